"""The drill's work directory: created private under the temp dir, held by a lock for the drill's life,
and cleared by the next drill when the drill that made it died.

A work dir is ``$TMPDIR/kvctl-drill-<scenario>-<random>/`` holding ``.kvctl-drill.lock``, which its
drill holds (``flock``) as long as it lives; the kernel lets go of the lock when the drill dies, even by
SIGKILL. The lock file appears under its name only once locked (it is locked under a temp name, then
renamed), so a lock that can be taken belongs to a drill that is gone. :func:`remove_stale` stops what
such a drill's tier left (through its state file; its children die with it anyway, PR_SET_PDEATHSIG) and
removes the directory. Only directories of this user, named so, holding that lock file are touched: never
anything kvctl did not create. Library code: no click.
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

from kvctl import files
from kvctl.errors import KvctlError

PREFIX = "kvctl-drill-"
LOCK = ".kvctl-drill.lock"
#: what a kept copy of the work dir leaves out (locks of the drill and of its tier)
NOT_KEPT = (LOCK, ".kvctl-tier.lock")


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
