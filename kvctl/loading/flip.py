"""``kvctl loading sync|async`` as one workflow: check → plan → apply → restart.

Every file and the sync-safety verdict are checked before anything is written, so all
files change or none (:func:`kvctl.loading.edit.apply_all`). The restart command runs only
after a real change; a stop signal during it stops it and all it started
(:class:`RestartInterrupted`), and the files stay written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from kvctl.core.errors import KvctlError
from kvctl.core.signals import Signalled, signals_raise
from kvctl.diagnose import saved as saved_diagnoses
from kvctl.loading import edit as loading
from kvctl.loading import restart as loading_restart
from kvctl.loading import safety as loading_safety
from kvctl.loading import tier_of
from kvctl.loading.edit import Change
from kvctl.loading.restart import RestartResult
from kvctl.loading.safety import SafetyCheck


class RestartInterrupted(Signalled):
    """A stop signal came during the restart command: it and what it started were stopped; the files stay written."""

    def __init__(self, signum: int, written: list[str]) -> None:
        super().__init__(signum)
        self.written = written

    def __str__(self) -> str:
        return (f"interrupted by {self.signal.name} during the restart command: stopped it and everything it "
                f"started; the change to {', '.join(self.written)} stays written, restart the engines yourself")


@dataclass(frozen=True)
class FlipResult:
    value: bool  # True: asynchronous loading
    dry_run: bool
    changes: list[Change]  # one per file, applied unless dry_run
    safety: SafetyCheck | None  # the sync-safety verdict (switching to sync only)
    restart_cmd: str | None
    restart: RestartResult | None  # None: not run (nothing changed, a dry run, or no command)

    @property
    def mode(self) -> str:
        return "async" if self.value else "sync"

    def raise_if_restart_failed(self) -> None:
        """KvctlError when the restart command ran and failed (the config is written all the same)."""
        r = self.restart
        if r is not None and not r.ok:
            raise KvctlError(f"the config was written but the restart command failed ({'timed out' if r.timed_out else f'exit {r.returncode}'})")


def flip(
    value: bool,
    sources: list[tuple[str, str]],
    *,
    dry_run: bool = False,
    force: bool = False,
    diagnosis: str | None = None,
    max_age_s: float = loading_safety.DEFAULT_MAX_AGE_S,
    backup: bool = True,
    restart_cmd: str | None = None,
    restart_timeout_s: float = 300.0,
    diagnosis_default: Path | None = None,
    engine_urls: Sequence[str] = (),
) -> FlipResult:
    """Set async loading to ``value`` in every (path, kind) of ``sources``, then run ``restart_cmd``.

    Switching to sync first asks the diagnosis (``diagnosis``, else ``diagnosis_default``, else the one saved for the
    tier the files name, or for ``engine_urls``: :func:`kvctl.diagnose.saved.find`, never another tier's) and raises
    :class:`kvctl.loading.edit.Refused` unless ``force`` when ρ is too high or cannot be told.
    """
    safety = None
    if not value:
        default = diagnosis_default
        if not diagnosis and default is None:
            tier = tier_of.of_sources(sources)
            default = saved_diagnoses.find(tier[0], engine_urls, tier[1])
            if default is None:
                safety = loading_safety.check_sync(None, tier_of.no_saved(tier, [p for p, _ in sources], engine_urls), force, max_age_s=max_age_s)
        if safety is None:
            diag, src = loading_safety.load_diagnosis(diagnosis, default or Path(saved_diagnoses.kvctl_home(), "none"))
            safety = loading_safety.check_sync(diag, src, force, max_age_s=max_age_s)
    changes = [loading.plan(p, kind, value, force=force) for p, kind in sources]
    if not dry_run:
        changes = loading.apply_all(changes, backup=backup, force=force)
    restart = None
    if restart_cmd and not dry_run and any(c.changed for c in changes):
        restart = _restart(restart_cmd, restart_timeout_s, changes)
    return FlipResult(value=value, dry_run=dry_run, changes=changes, safety=safety, restart_cmd=restart_cmd, restart=restart)


def _restart(command: str, timeout_s: float, changes: list[Change]) -> RestartResult:
    """The restart command, stoppable: it runs in its own process group, so a signal to kvctl must stop it too."""
    try:
        with signals_raise():
            return loading_restart.run_restart(command, timeout_s)
    except Signalled as e:
        written = [str(loading.real_path(c.path)) for c in changes if c.changed]
        raise RestartInterrupted(int(e.signal), written) from None
