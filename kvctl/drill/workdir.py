"""The drill's directories: its work dir (created under the temp dir, held by a lock for the drill's life,
cleared by the next drill when the drill that made it died) and the ``--keep`` copy of it.

A work dir is ``$TMPDIR/kvctl-drill-<scenario>-<random>/`` holding ``.kvctl-drill.lock``, which its
drill holds (``flock``) as long as it lives; the kernel lets go of the lock when the drill dies, even by
SIGKILL. The lock file appears under its name only once locked (it is locked under a temp name, then
renamed), so a lock that can be taken belongs to a drill that is gone. :func:`remove_stale` stops what
such a drill's tier left (through its state file; its children die with it anyway, PR_SET_PDEATHSIG) and
removes the directory. Only directories of this user, named so, holding that lock file are touched: never
anything kvctl did not create.

``--keep DIR`` (:func:`check_keep`, before anything starts): DIR is new, or an empty directory that is
not a link, and a file can really be created there; the copy (:func:`kvctl.core.files.copy_tree_new`) never
overwrites or removes anything. Library code: no click.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Callable

from kvctl.core import files
from kvctl.core.errors import InvalidInput, KvctlError
from kvctl.tier.local import LOCK_FILE as TIER_LOCK

PREFIX = "kvctl-drill-"
LOCK = ".kvctl-drill.lock"
#: what a kept copy of the work dir leaves out (locks of the drill and of its tier)
NOT_KEPT = (LOCK, TIER_LOCK)
#: how much of a child's log an error quotes
LOG_TAIL_LINES = 6
LOG_TAIL_CHARS = 800


class WorkDir:
    """A new locked work directory; :meth:`remove` deletes it and lets go of the lock."""

    def __init__(self, scenario: str) -> None:
        self.path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{scenario}-"))
        tmp = self.path / f"{LOCK}.new"
        self._fd = files.create_private(tmp)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        os.write(self._fd, f"{os.getpid()}\n".encode())
        os.rename(tmp, self.path / LOCK)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def remove_stale(say: Callable[[str], None], stop_tier: Callable[[Path], int]) -> list[Path]:
    """Remove the work dirs of drills that died (their lock is free); ``say`` one line for each.

    ``stop_tier(tier_dir)`` stops what a dead drill's tier left running and returns how many it stopped.
    """
    removed = []
    for d in sorted(Path(tempfile.gettempdir()).glob(f"{PREFIX}*")):
        try:
            st = os.lstat(d)
            fd = os.open(d / LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue  # gone, or not a drill work dir of this kvctl: not ours to touch
        try:
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # its drill is alive
            pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            stopped = 0
            with contextlib.suppress(KvctlError, OSError):
                stopped = stop_tier(d / "tier")
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
            left = f"; stopped {stopped} valkey-server(s) it had left running" if stopped else ""
            say(f"removed {d}, the work dir of a drill that died (pid {pid}){left}")
        finally:
            os.close(fd)
    return removed


def check_keep(path: str) -> None:
    """InvalidInput unless ``--keep PATH`` can take the drill's files without losing anything: PATH is
    new (under a directory where it can be created) or an empty directory, not a link, and writable."""
    p = Path(path)
    try:
        st: os.stat_result | None = os.lstat(p)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise InvalidInput(f"--keep {path}: {e.strerror or e}; nothing was started") from e
    if st is None:
        where = next(a for a in p.absolute().parents if os.path.lexists(a))
        if not where.is_dir():
            raise InvalidInput(f"--keep {path} cannot be created: {where} is not a directory; nothing was started")
    elif stat.S_ISLNK(st.st_mode):
        raise InvalidInput(f"--keep {path} is a symbolic link: refused (give the directory itself, or a new one); nothing was started")
    elif not stat.S_ISDIR(st.st_mode):
        raise InvalidInput(f"--keep {path} exists and is not a directory: refused; nothing was started")
    else:
        where = p
        try:
            full = bool(os.listdir(p))
        except OSError as e:
            raise InvalidInput(f"--keep {path} cannot be read ({e.strerror}): refused; nothing was started") from e
        if full:
            raise InvalidInput(f"--keep {path} is not empty: refused, nothing was started (kvctl never deletes what it did not "
                               "create: give a new or an empty directory)")
    try:
        files.probe_writable(where)
    except OSError as e:
        what = f"{path} cannot be written" if st is not None else f"{path} cannot be created ({where} cannot be written)"
        raise InvalidInput(f"--keep {what}: {e.strerror or e}; nothing was started") from e


def keep(work: Path, dest: str) -> str | None:
    """Copy the work dir ``work`` to ``--keep dest``; the one-line reason when that failed, else None."""
    try:
        files.copy_tree_new(work, dest, skip=NOT_KEPT)
    except OSError as e:
        where = f" at {e.filename}" if e.filename and str(e.filename) != dest else ""
        return f"--keep {dest}: the drill's files could not be copied there ({e.strerror or e}{where}); its work dir was removed"
    return None


def quote_log(log: Path, kept_as: Path | None = None) -> str:
    """The last lines of a child's log in one line (it goes into an error; the log itself is removed with
    the work dir), and where the kept copy is, if any."""
    lines = [ln.strip() for ln in files.read_tail(log).splitlines() if ln.strip()][-LOG_TAIL_LINES:]
    text = " | ".join(lines)
    text = text if len(text) <= LOG_TAIL_CHARS else "..." + text[-LOG_TAIL_CHARS:]
    where = f" (kept as {kept_as})" if kept_as is not None else ""
    return f"its log{where} ends: {text}" if text else f"its log{where} is empty"
