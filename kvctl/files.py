"""Whole-file writes that a crash or a signal can never leave half done.

A write goes to a uniquely named temp file in the target's directory, is
flushed to disk, given its final mode, and renamed over the target: a reader
(or the next kvctl run) sees the old file or the new one, never a prefix.
``kvctl loading`` has its own staged write because it must also keep an
existing file's owner, group, ACL and symlink; this is the plain case.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(path: Path | str, text: str, mode: int | None = None) -> Path:
    """Replace ``path`` with ``text`` in one rename.

    ``mode``: the file's permission bits (default: an existing file's, else 0666
    less the umask, as ``open()`` would give). A secret passes 0o600: the temp
    file is created owner-only, so the text is never readable by others.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if mode is None:
        try:
            mode = path.stat().st_mode & 0o7777
        except FileNotFoundError:
            mode = 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".kvctl-tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path
