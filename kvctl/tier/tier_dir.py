"""A local tier's directory: its lock, the valkey-servers working in it, and the files ``up`` writes there.

Everything here is derived from the directory itself, never from what a file inside it says:

* its servers are the live ``valkey-server`` processes whose working directory it is (``up`` starts each
  server in it, and Valkey's ``dir`` is it), recorded in the state file or not: an ``up`` killed between
  spawning a server and recording it leaves nothing ``down`` cannot find, and a copy of the directory
  (``cp -a``) has no server of the original's;
* its files are the names ``up`` gives them (:data:`INSTANCE_FILE`, the state file, the engine password,
  their temp files), listed in the directory and removed there;
* its lock is the file ``.kvctl-tier.lock`` at that path, held (flock) by ``up`` and ``down``; only a holder
  removes it, and a lock taken on a file no longer at the path does not count.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import psutil

from kvctl.core.errors import KvctlError
from kvctl.core.files import TMP_MARK, read_regular
from kvctl.tier.state_file import ENGINE_PASSWORD_FILE, LOCK_FILE, STATE_FILE, InstanceState

#: The files ``up`` writes for instance i of rank r: ``valkey-<r>[-<i>].conf|log|pid``.
INSTANCE_FILE = re.compile(r"^valkey-(\d{1,5})(?:-(\d{1,2}))?\.(conf|log|pid)$")
#: Times ``tier_lock`` opens the lock file again when the one it locked was removed from the path meanwhile.
LOCK_TRIES = 5
_OWN_NAMES = (STATE_FILE, ENGINE_PASSWORD_FILE)


class TierBusy(KvctlError):
    """Another kvctl process holds the tier directory's lock."""


@dataclass
class TierLock:
    """The directory's lock, held: :meth:`remove` takes the lock file away while it is still held (a directory
    that is being removed), so no later kvctl can hold a lock on a file that is gone."""

    path: Path
    fd: int

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            now, held = os.lstat(self.path), os.fstat(self.fd)
            if (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
                os.unlink(self.path)


@contextlib.contextmanager
def tier_lock(tier_dir: Path, what: str) -> Iterator[TierLock]:
    """Hold the directory's exclusive lock (non-blocking): TierBusy naming the holder's pid if taken.

    The lock is the file at ``tier_dir/.kvctl-tier.lock``: a flock that succeeds on a file another kvctl
    removed from the path meanwhile (its holder finished with the directory) is dropped and the path opened
    again, so two processes never both think they hold the directory."""
    tier_dir.mkdir(parents=True, exist_ok=True)
    path = tier_dir / LOCK_FILE
    for _ in range(LOCK_TRIES):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as e:
            raise KvctlError(f"cannot open the tier's lock file {path}: {e.strerror or e}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip().replace(" ", ", ", 1) or "?"
            os.close(fd)
            raise TierBusy(
                f"another kvctl (pid {holder}) is working on the tier in {tier_dir} right now; "
                f"wait for it to finish, or use another --dir for a second tier"
            ) from None
        try:
            now, held = os.lstat(path), os.fstat(fd)
            at_path = (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)
        except FileNotFoundError:
            at_path = False
        if at_path:
            break
        os.close(fd)  # locked a file its holder removed: open the one at the path now
    else:
        raise TierBusy(f"the lock file of the tier in {tier_dir} kept being replaced ({LOCK_TRIES} tries): another kvctl is working on it")
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {what}\n".encode(), 0)
        yield TierLock(path, fd)
    finally:
        os.close(fd)  # releases the lock


def make_dir(tier_dir: Path) -> bool:
    """Create ``tier_dir`` (and its parents); True only when this call created it (False when it was there)."""
    tier_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        tier_dir.mkdir()
    except FileExistsError:
        return False
    return True


# ----------------------------------------------------------------------------- the directory's servers


def is_valkey(proc: psutil.Process) -> bool:
    """Whether ``proc`` runs a valkey-server binary (its name; or its command line, which Valkey retitles)."""
    try:
        if "valkey-server" in proc.name():
            return True
        cmdline = proc.cmdline()
    except psutil.Error:
        return False
    return bool(cmdline) and "valkey-server" in cmdline[0]


def works_in(proc: psutil.Process, tier_dir: Path | str) -> bool:
    """Whether ``proc``'s working directory is ``tier_dir`` (False when it cannot be read: another user's)."""
    try:
        return proc.cwd() == os.path.realpath(tier_dir)
    except psutil.Error:
        return False


def working_dir(proc: psutil.Process) -> str:
    try:
        return proc.cwd()
    except psutil.Error:
        return "?"


def servers_of(tier_dir: Path | str) -> list[psutil.Process]:
    """The live valkey-servers working in ``tier_dir``: what runs there, recorded in the state file or not."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and is_valkey(proc) and works_in(proc, tier_dir):
                found.append(proc)
        except psutil.Error:
            continue
    return sorted(found, key=lambda p: p.pid)


def is_our_server(inst: InstanceState, tier_dir: Path | str | None = None) -> psutil.Process | None:
    """The live process of ``inst`` when it is a valkey-server started when the state file says (and, given
    ``tier_dir``, working in it); else None."""
    if inst.pid <= 0:
        return None
    try:
        proc = psutil.Process(inst.pid)
        if proc.status() == psutil.STATUS_ZOMBIE or not is_valkey(proc):
            return None
        if inst.create_time and abs(round(proc.create_time(), 2) - inst.create_time) > 0.05:
            return None
    except psutil.Error:
        return None
    if tier_dir is not None and not works_in(proc, tier_dir):
        return None
    return proc


def listening_port(proc: psutil.Process) -> int:
    """The lowest TCP port ``proc`` listens on, 0 when none (yet) or unreadable."""
    try:
        conns = (getattr(proc, "net_connections", None) or proc.connections)(kind="tcp")
    except psutil.Error:
        return 0
    ports = [c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN and c.laddr]
    return min(ports, default=0)


def pidfile_names(tier_dir: Path) -> dict[int, tuple[int, int]]:
    """pid -> (rank, instance) from the pidfiles the servers wrote in ``tier_dir`` (names ``valkey-<r>[-<i>].pid``)."""
    out: dict[int, tuple[int, int]] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir(tier_dir):
            m = INSTANCE_FILE.match(name)
            if not m or m.group(3) != "pid":
                continue
            try:
                text = read_regular(tier_dir / name, "pidfile", 32, kind="a pidfile").strip()
            except KvctlError:
                continue
            if text.isdigit():
                out[int(text)] = (int(m.group(1)), int(m.group(2) or 0))
    return out


# ----------------------------------------------------------------------------- the directory's files


def purge_files(tier_dir: Path, lock: TierLock) -> list[str]:
    """Remove what ``up`` wrote in ``tier_dir`` (instance files, the state file, the engine password, their temp
    files, the lock), then the directory when nothing else is left; the names removed. Links are removed, never
    followed; a directory or another odd file of such a name is left."""
    removed = []
    for name in sorted(os.listdir(tier_dir)):
        ours = INSTANCE_FILE.match(name) or name in _OWN_NAMES or name.startswith(tuple(f".{n}{TMP_MARK}" for n in _OWN_NAMES))
        if not ours:
            continue
        path = tier_dir / name
        try:
            mode = os.lstat(path).st_mode
            if stat.S_ISREG(mode) or stat.S_ISLNK(mode):
                os.unlink(path)
                removed.append(name)
        except FileNotFoundError:
            pass
    lock.remove()
    with contextlib.suppress(OSError):
        tier_dir.rmdir()  # only when nothing else lives there
    return removed
