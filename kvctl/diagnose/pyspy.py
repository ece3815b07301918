"""Thread stacks of a live Python process, from ``py-spy dump --json``.

One small function, :func:`dump_threads`, runs py-spy with a timeout and
returns typed stacks. Failures become ``KvctlError`` subclasses that say what
to do: install py-spy, or let it attach (ptrace).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kvctl.core.errors import BinaryNotFound, KvctlError

#: ``py-spy dump --help``: a local binary printing its usage; not a read of the engine, so not a --timeout.
HELP_TIMEOUT_S = 10.0
#: one ``py-spy dump`` of a process (``diagnose stalls`` has no --timeout: a dump of a big engine takes seconds).
DUMP_TIMEOUT_S = 10.0

INSTALL_HINT = "install it with `pip install py-spy` (kvctl depends on it; reinstall kvctl into this environment)"

PTRACE_HINT = (
    "run kvctl as root (e.g. `sudo env \"PATH=$PATH\" kvctl diagnose stalls ...`) or as the engine's user; "
    "in a container add the SYS_PTRACE capability (`docker run --cap-add SYS_PTRACE`, "
    "Kubernetes `securityContext.capabilities.add: [\"SYS_PTRACE\"]`); "
    "on a host with Yama, allow tracing with `sysctl kernel.yama.ptrace_scope=0` (or 1 when kvctl runs as the engine's parent)"
)


class PtraceNotPermitted(KvctlError):
    """py-spy may not read the target's memory (ptrace denied)."""


class NotAPythonProcess(KvctlError):
    """The pid is not a Python interpreter py-spy understands."""


class ProcessGone(KvctlError):
    """The pid does not exist (any more)."""


@dataclass(frozen=True)
class Frame:
    """One Python frame; ``name`` is py-spy's (``Class.method`` where known), ``filename`` its short form."""

    name: str
    filename: str
    line: int

    @property
    def function(self) -> str:
        """The bare function name: ``Future.result`` → ``result``."""
        return self.name.rsplit(".", 1)[-1]

    def __str__(self) -> str:
        return f"{self.name} ({self.filename}:{self.line})"


@dataclass(frozen=True)
class ThreadStack:
    """One thread of one process at one instant; ``frames[0]`` is the innermost."""

    pid: int
    thread_id: int
    os_thread_id: int | None
    thread_name: str | None
    active: bool
    owns_gil: bool
    frames: tuple[Frame, ...]

    @property
    def label(self) -> str:
        return self.thread_name or f"thread {self.os_thread_id or self.thread_id}"


def find_py_spy() -> str:
    """Path of py-spy: $KVCTL_PY_SPY, PATH, then the bin dir of this interpreter's venv."""
    env = os.environ.get("KVCTL_PY_SPY")
    if env:
        if os.path.isfile(env) and os.access(env, os.X_OK):
            return env
        raise BinaryNotFound(f"KVCTL_PY_SPY={env} is not an executable file; {INSTALL_HINT}")
    found = shutil.which("py-spy")
    if found:
        return found
    cand = Path(sys.executable).parent / "py-spy"
    if cand.is_file() and os.access(cand, os.X_OK):
        return str(cand)
    raise BinaryNotFound(f"py-spy not found on PATH or next to {sys.executable}; {INSTALL_HINT}")


@functools.lru_cache(maxsize=8)
def supports_nonblocking(binary: str) -> bool:
    """True when this py-spy's ``dump`` takes ``--nonblocking`` (reads without pausing the target)."""
    try:
        out = subprocess.run([binary, "dump", "--help"], capture_output=True, text=True, timeout=HELP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "--nonblocking" in (out.stdout + out.stderr)


def dump_threads(pid: int, *, binary: str | None = None, timeout_s: float = DUMP_TIMEOUT_S, nonblocking: bool = True) -> list[ThreadStack]:
    """Every Python thread's stack in ``pid`` (``py-spy dump --json``)."""
    exe = binary or find_py_spy()
    cmd = [exe, "dump", "--json", "--pid", str(pid)]
    if nonblocking and supports_nonblocking(exe):
        cmd.append("--nonblocking")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise KvctlError(f"py-spy did not dump pid {pid} within {timeout_s:g}s") from e
    except OSError as e:
        raise BinaryNotFound(f"cannot run {exe}: {e}; {INSTALL_HINT}") from e
    if proc.returncode != 0:
        raise _dump_error(pid, proc.stderr or proc.stdout)
    try:
        raw = json.loads(proc.stdout)
    except json.JSONDecodeError as e:
        raise KvctlError(f"py-spy printed no JSON for pid {pid}: {proc.stdout[:200]!r}") from e
    return [_thread(pid, t) for t in raw]


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return "no output"


def _dump_error(pid: int, text: str) -> KvctlError:
    """Map py-spy's stderr to an error that says what to do."""
    low = text.lower()
    why = _first_line(text)
    if not _pid_exists(pid):
        return ProcessGone(f"no process with pid {pid}")
    if "permission denied" in low or "operation not permitted" in low or "os error 1)" in low or "os error 13" in low:
        return PtraceNotPermitted(f"py-spy may not attach to pid {pid} (ptrace not permitted: {why}); {PTRACE_HINT}")
    if "python version" in low or "python interpreter" in low or "not a python" in low:
        return NotAPythonProcess(f"pid {pid} is not a Python process py-spy can read, or it is still starting ({why})")
    return KvctlError(f"py-spy failed on pid {pid}: {why}")


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _thread(pid: int, t: dict) -> ThreadStack:
    frames = tuple(
        Frame(
            name=str(f.get("name") or "?"),
            filename=str(f.get("short_filename") or f.get("filename") or "?"),
            line=int(f.get("line") or 0),
        )
        for f in t.get("frames") or ()
    )
    return ThreadStack(
        pid=int(t.get("pid") or pid),
        thread_id=int(t.get("thread_id") or 0),
        os_thread_id=t.get("os_thread_id"),
        thread_name=t.get("thread_name"),
        active=bool(t.get("active")),
        owns_gil=bool(t.get("owns_gil")),
        frames=frames,
    )
