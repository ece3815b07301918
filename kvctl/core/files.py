"""Every file kvctl writes or reads as a whole: atomic replaces, private backups, bounded reads.

Writes: the new text goes to a uniquely named, locked temp file in the target's directory
(created ``O_CREAT|O_EXCL|O_NOFOLLOW``, mode 0600), is flushed to disk, given its final owner
and mode, and renamed over the target; the directory is fsynced. A reader (or the next kvctl
run) sees the old file or the new one, never a prefix. A run killed between the two leaves a
temp file that the next run removes (its lock is gone with the process).

``write_atomic`` is the plain case; ``kvctl loading`` stages several files with
:func:`stage` (the same temp files, the old file's owner, group, mode, ACL and xattrs
copied) and renames them together. Backups (:func:`write_backup`) are created 0600 under
a name nobody can guess, so a link planted beside the file is never followed.

Reads: :func:`read_regular` opens without blocking, refuses anything but a regular file
(FIFOs, devices such as ``/dev/zero``, directories) and anything over a size cap;
:func:`read_password_file`, the one reader of password files, is read_regular with the mode
checked on the same open file.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import fcntl
import json
import logging
import os
import re
import secrets
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from kvctl.core.errors import InvalidInput, KvctlError
from kvctl.core.thresholds import CONFIG_MAX_BYTES, JSON_MAX_DEPTH, PASSWORD_FILE_MAX_BYTES

log = logging.getLogger(__name__)

TMP_MARK = ".kvctl-tmp-"
#: The largest config file kvctl reads (LMCache YAML, vLLM config/unit, env file, kv-transfer-config JSON):
#: real ones are a few KB; a bigger one is a mistake or an attack (``/dev/zero``-like growth).
MAX_CONFIG_BYTES = CONFIG_MAX_BYTES
_PRIVATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# --- reading ----------------------------------------------------------------------------


def read_regular(path: Path | str, what: str, max_bytes: int = MAX_CONFIG_BYTES, *, newline: str | None = "",
                 kind: str = "a config file", private: bool = False, errors: str = "strict") -> str:
    """The UTF-8 text of ``path``, refused (InvalidInput naming ``what``, never quoting the file) unless it
    is a regular file of at most ``max_bytes`` (the cap for ``kind`` of file, as the message says).

    Opened ``O_NONBLOCK`` so a FIFO cannot hang the open; the type and size come from ``fstat`` of that
    open file (no race with a swap of the name); at most ``max_bytes + 1`` bytes are ever read.
    ``newline=""`` keeps CRLF as it is (kvctl edits line by line); None translates it like ``open()``.
    ``private``: refused too when every user may read or write it (a secret), naming the ``chmod`` that fixes it.
    ``errors``: how bytes that are not UTF-8 decode (``"strict"``: refused).
    """
    unchanged = "; the file was not changed" if kind == "a config file" else ""  # kvctl edits config files
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise InvalidInput(f"cannot read {what} {path}: {e.strerror or e}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidInput(f"{what} {path} is not a regular file (a FIFO, device or directory): refused{unchanged}")
        mode = stat.S_IMODE(st.st_mode)
        if private and mode & 0o007:
            raise InvalidInput(f"{what} {path} is open to every user (mode {mode:04o}): run `chmod 600 {path}` (0600 or 0640)")
        if st.st_size > max_bytes:
            raise InvalidInput(f"{what} {path} is {st.st_size:,} bytes, over the {max_bytes:,}-byte cap for {kind}: refused")
        os.set_blocking(fd, True)
        chunks, total = [], 0
        while total <= max_bytes:
            block = os.read(fd, min(1 << 16, max_bytes + 1 - total))
            if not block:
                break
            chunks.append(block)
            total += len(block)
        if total > max_bytes:
            raise InvalidInput(f"{what} {path} grew past the {max_bytes:,}-byte cap for {kind} while read: refused")
    except OSError as e:
        raise InvalidInput(f"cannot read {what} {path}: {e.strerror or e}") from e
    finally:
        os.close(fd)
    data = b"".join(chunks)
    try:
        text = data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        raise InvalidInput(f"{what} {path} is not UTF-8 text ({e.reason} at byte {e.start}){unchanged}") from e
    return text if newline == "" else text.replace("\r\n", "\n").replace("\r", "\n")


def read_password_file(path: Path | str, what: str = "password file") -> str:
    """The password in ``path``: the one reader of every password file kvctl takes (:func:`read_regular`).

    A regular file (symlinks followed: Kubernetes mounts secrets through them) of at most
    PASSWORD_FILE_MAX_BYTES, not empty, and not readable or writable by every user: mode 0600 or 0400, or
    group-readable (0640/0440, what a Kubernetes secret mounted with an ``fsGroup`` gets). Anything else is
    InvalidInput naming the file (and the ``chmod`` that fixes a mode); the password itself is never quoted.
    """
    text = read_regular(path, what, PASSWORD_FILE_MAX_BYTES, kind="a password file", private=True, errors="replace").strip()
    if not text:
        raise InvalidInput(f"{what} {path} is empty")
    return text


_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string, escapes included (linear: no nested repeats)
_JSON_BRACKET = re.compile(r"[\[\]{}]")


def json_too_deep(text: str, max_depth: int = JSON_MAX_DEPTH) -> bool:
    """Whether the JSON ``text`` nests arrays/objects deeper than ``max_depth`` (checked before parsing: the
    parser's own limit is a RecursionError, and a deep enough document can take the stack)."""
    if text.count("[") + text.count("{") <= max_depth:
        return False
    depth = 0
    for m in _JSON_BRACKET.finditer(_JSON_STRING.sub('""', text)):
        if m.group() in "[{":
            depth += 1
            if depth > max_depth:
                return True
        else:
            depth -= 1
    return False


def read_json(path: Path | str, what: str, max_bytes: int, kind: str) -> Any:
    """The JSON value in ``path``: read by :func:`read_regular` (``max_bytes``, named ``kind``), nested at most
    JSON_MAX_DEPTH levels; InvalidInput, one line, otherwise."""
    text = read_regular(path, what, max_bytes, kind=kind)
    if json_too_deep(text):
        raise InvalidInput(f"{what} {path} is nested too deeply (more than {JSON_MAX_DEPTH} levels): refused, not {kind}")
    try:
        return json.loads(text)
    except ValueError as e:  # a JSONDecodeError, or an integer past Python's digit limit
        raise InvalidInput(f"{what} {path} is not {kind}: {str(e).split(';')[0]}") from e


def read_tail(path: Path | str, max_bytes: int = 4096) -> str:
    """The last ``max_bytes`` of a regular file kvctl wrote (a child's log), as text; "" when unreadable.

    Never follows a link, never blocks on a FIFO; a partial first line is dropped."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return ""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return ""
        start = max(0, st.st_size - max_bytes)
        data = os.pread(fd, max_bytes, start)
    except OSError:
        return ""
    finally:
        os.close(fd)
    text = data.decode("utf-8", errors="replace")
    return text.split("\n", 1)[-1] if start and "\n" in text else text


# --- creating ---------------------------------------------------------------------------


def probe_writable(directory: Path | str) -> None:
    """OSError unless a file can be created in ``directory`` (tried, then removed: the mode bits do not
    tell, for root or on a read-only mount)."""
    fd, name = tempfile.mkstemp(prefix=TMP_MARK, dir=directory)
    os.close(fd)
    os.unlink(name)


def copy_file_new(src: Path | str, dest: Path | str) -> None:
    """Copy the regular file ``src`` to the new file ``dest`` (never an existing one, never through a link:
    :func:`create_private`), with ``src``'s permission bits, fsynced. A failed copy leaves no ``dest``."""
    with open(src, "rb") as inp, _filling(dest, create_private(dest)) as fd:
        while block := inp.read(1 << 20):
            write_all(fd, block)
        os.fchmod(fd, stat.S_IMODE(os.fstat(inp.fileno()).st_mode))
        os.fsync(fd)


def copy_tree_new(src: Path | str, dest: Path | str, skip: tuple[str, ...] = ()) -> None:
    """Copy the tree ``src`` into ``dest``, which must be missing (it is created, parents too) or an empty
    directory (not a link): nothing that exists is ever overwritten or removed. Links and special files in
    ``src`` and names in ``skip`` are left out. OSError when something is in the way."""
    dest = Path(dest)
    try:
        os.makedirs(dest)
    except FileExistsError:
        st = os.lstat(dest)
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory (or a symbolic link)", str(dest)) from None
        if os.listdir(dest):
            raise OSError(errno.ENOTEMPTY, "not empty", str(dest)) from None
    for root, dirs, names in os.walk(src):
        out = dest / os.path.relpath(root, src)
        for d in list(dirs):
            st = os.lstat(Path(root) / d)
            if stat.S_ISDIR(st.st_mode):
                os.mkdir(out / d, stat.S_IMODE(st.st_mode) | 0o700)
            else:  # a link to a directory: left out, not descended into
                dirs.remove(d)
        for n in names:
            path = Path(root) / n
            if n in skip or not stat.S_ISREG(os.lstat(path).st_mode):
                continue
            copy_file_new(path, out / n)


def create_private(path: Path | str) -> int:
    """A new file at ``path``, mode 0600 from the start, opened for writing: never an existing file, never
    through a symlink (``O_CREAT|O_EXCL|O_NOFOLLOW``). FileExistsError when the name is taken."""
    return os.open(path, _PRIVATE_FLAGS, 0o600)


@contextlib.contextmanager
def _filling(path: Path | str, fd: int) -> Iterator[int]:
    """``fd``, a file just created at ``path``, closed at the end; ``path`` removed when the body fails."""
    try:
        yield fd
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def copy_owner_and_mode(fd: int, st: os.stat_result, like: Path) -> None:
    """Give an open file the owner, group, mode, ACL and extended attributes of ``like`` (whose stat is ``st``).

    chown first (it may clear set-id bits), then the mode, then the xattrs: a POSIX ACL
    (``system.posix_acl_access``, e.g. ``setfacl -m u:vllm:r``) or an SELinux label would
    otherwise be lost with the old inode. An attribute that cannot be copied is an error:
    the engine might no longer be allowed to read the file.
    """
    if (st.st_uid, st.st_gid) != (os.geteuid(), os.getegid()):
        os.fchown(fd, st.st_uid, st.st_gid)
    os.fchmod(fd, stat.S_IMODE(st.st_mode))
    try:
        names = os.listxattr(like)
    except OSError as e:
        if e.errno in (errno.ENOTSUP, errno.ENODATA):
            return
        raise
    for name in names:
        try:
            value = os.getxattr(like, name)
        except OSError as e:
            if e.errno == errno.ENODATA:  # gone meanwhile
                continue
            raise
        try:
            if os.getxattr(fd, name) == value:
                continue
        except OSError:
            pass
        try:
            os.setxattr(fd, name, value)
        except OSError as e:
            raise OSError(e.errno, f"cannot copy the extended attribute {name} ({e.strerror})") from e


def write_backup(real: Path, attempts: int = 5) -> Path:
    """A copy of ``real`` next to it, ``NAME.<YYYYmmddTHHMMSS>-<random>.bak``, as private as the file.

    Created 0600 with ``O_CREAT|O_EXCL|O_NOFOLLOW`` under a name with 64 random bits, so a link planted
    at a guessable name is never followed and the text is never readable by others while written;
    then given the file's owner, group and mode. Nothing is left behind when it fails.
    """
    st = os.stat(real)
    data = read_regular(real, "the file to back up", max(MAX_CONFIG_BYTES, st.st_size)).encode("utf-8")
    stamp = _dt.datetime.now().strftime("%Y%m%dT%H%M%S")
    for _ in range(attempts):
        bak = real.with_name(f"{real.name}.{stamp}-{secrets.token_hex(8)}.bak")
        try:
            fd = create_private(bak)
        except FileExistsError:
            continue
        with _filling(bak, fd):
            write_all(fd, data)
            copy_owner_and_mode(fd, st, real)
            os.fsync(fd)
        return bak
    raise KvctlError(f"cannot create a backup next to {real}: {attempts} random names were taken")


# --- atomic replace -----------------------------------------------------------------------


def _stale_temps(real: Path) -> None:
    """Remove temp files that killed kvctl runs left next to ``real``.

    A temp file is locked (``flock``) by the run that writes it for as long as that run lives,
    so one that can be locked belongs to a dead run, whatever its PID was (PID 1 in a container
    is every run's PID). Only regular files named like kvctl's temp files of this very file are
    considered; a file still being written by a live run is left alone.
    """
    prefix = f".{real.name}{TMP_MARK}"
    try:
        names = [n for n in os.listdir(real.parent) if n.startswith(prefix)]
    except OSError:
        return
    for name in names:
        cand = real.parent / name
        try:
            fd = os.open(cand, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live run holds it
            now = os.lstat(cand)
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                os.unlink(cand)
                log.info("removed %s, a temp file left by a kvctl run that died (%d bytes)", cand, st.st_size)
        except OSError:
            pass
        finally:
            os.close(fd)


@dataclass
class TempFile:
    """A locked temp file next to the file it will replace; ``commit`` renames it over that file."""

    path: Path
    target: Path
    fd: int

    def discard(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            os.close(self.fd)
            self.fd = -1

    def commit(self) -> None:
        os.replace(self.path, self.target)
        os.close(self.fd)  # the lock goes with it, after the rename
        self.fd = -1
        with contextlib.suppress(OSError):  # the rename itself durable
            dfd = os.open(self.target.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)


def open_temp(target: Path | str, attempts: int = 5) -> TempFile:
    """A new, unique, locked temp file (0600, ``O_EXCL|O_NOFOLLOW``: mkstemp's flags) in ``target``'s
    directory; stale ones of dead runs are removed first."""
    target = Path(target)
    _stale_temps(target)
    for _ in range(attempts):
        fd, name = tempfile.mkstemp(prefix=f".{target.name}{TMP_MARK}{os.getpid()}-", dir=target.parent)
        fcntl.flock(fd, fcntl.LOCK_EX)
        log.debug("writing %s through %s", target, name)
        try:  # another run's cleanup may have taken it between mkstemp and flock: start again
            now = os.lstat(name)
            mine = os.fstat(fd)
            if (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
                return TempFile(Path(name), target, fd)
        except FileNotFoundError:
            pass
        os.close(fd)
    raise KvctlError(f"cannot create a temp file next to {target}: it kept disappearing ({attempts} tries); no file was changed")


def stage(real: Path, text: str) -> TempFile:
    """``text`` written and fsynced in a locked temp file next to ``real``, with its owner, group, mode and xattrs."""
    st = os.stat(real)
    tmp = open_temp(real)
    try:
        write_all(tmp.fd, text.encode("utf-8"))
        copy_owner_and_mode(tmp.fd, st, real)
        os.fsync(tmp.fd)
    except BaseException:
        tmp.discard()
        raise
    return tmp


def write_atomic(path: Path | str, text: str | bytes, mode: int | None = None) -> Path:
    """Replace ``path`` with ``text`` (str, written as UTF-8, or bytes) in one rename.

    ``mode``: the file's permission bits (default: an existing file's, else 0666
    less the umask, as ``open()`` would give). A secret passes 0o600: the temp
    file is created owner-only, so the text is never readable by others. A link
    at ``path`` is replaced, never written through (nor its target's mode taken).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if mode is None:
        try:
            st = os.lstat(path)
            mode = st.st_mode & 0o7777 if not stat.S_ISLNK(st.st_mode) else None
        except FileNotFoundError:
            pass
    if mode is None:
        mode = 0o666 & ~_umask()
    tmp = open_temp(path)
    try:
        write_all(tmp.fd, text.encode("utf-8") if isinstance(text, str) else text)
        os.fsync(tmp.fd)
        os.fchmod(tmp.fd, mode)
        tmp.commit()
    except BaseException:
        tmp.discard()
        raise
    return path
