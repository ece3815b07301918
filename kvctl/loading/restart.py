"""Run the user's restart command after a loading flip, in a process group of its own."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass

from kvctl.core.procs import kill_group


@dataclass(frozen=True)
class RestartResult:
    command: str
    returncode: int | None
    duration_s: float
    output_tail: str
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def run_restart(command: str, timeout_s: float = 300.0) -> RestartResult:
    """Run the user's restart command through ``/bin/sh -c`` and report how it went.

    The shell runs in a process group of its own, so a timeout (or Ctrl-C)
    stops everything the command started, not only the shell: a restart
    reported as timed out does not go on in the background.
    """
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(
            ["/bin/sh", "-c", command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
    except OSError as e:
        return RestartResult(command, None, time.monotonic() - t0, str(e))
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        kill_group(proc)
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return RestartResult(command, None, time.monotonic() - t0, out[-2000:], timed_out=True)
    except BaseException:
        kill_group(proc)
        raise
    return RestartResult(command, proc.returncode, time.monotonic() - t0, (stdout + stderr)[-2000:])
