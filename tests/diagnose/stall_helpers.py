"""Helpers the stall tests share: start a stall program (``stall_programs/``), wait for it, run the command.

Each program reproduces one signature of paper §5.4 and exits by itself after ``--lifetime``
seconds; :func:`spawn` also kills it, by pid, when the test is done.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import time
from pathlib import Path

from click.testing import CliRunner

from kvctl.diagnose import stalls

PROGRAMS = Path(__file__).resolve().parent / "stall_programs"
LIFETIME_S = 60
INTERVAL_S = 0.4


@contextlib.contextmanager
def spawn(program: str, *args: str):
    """Start a stall program and wait for its READY line; always kill it (by pid) afterwards."""
    cmd = [sys.executable, str(PROGRAMS / program), "--lifetime", str(LIFETIME_S), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, 9)
        proc.wait(timeout=10)
        proc.stdout.close()
        proc.stderr.close()


def wait_ready(*procs: subprocess.Popen, timeout_s: float = 45.0) -> None:
    deadline = time.monotonic() + timeout_s
    for p in procs:
        left = deadline - time.monotonic()
        ready, _, _ = select.select([p.stdout], [], [], max(left, 0))
        line = p.stdout.readline() if ready else ""
        if not line.startswith("READY"):
            err = p.stderr.read() if p.poll() is not None else "(still running)"
            raise AssertionError(f"{p.args[1]} did not get ready: {line!r} {err[-2000:]}")


def run_stalls(*args: str):
    from kvctl.commands.diagnose_stalls import stalls_cmd  # noqa: PLC0415 - imports kvctl.cli

    return CliRunner().invoke(stalls_cmd, [*args, "--interval", str(INTERVAL_S)], env={"COLUMNS": "400"})


def by_id(report: stalls.StallReport) -> dict[str, list[stalls.StallFinding]]:
    out: dict[str, list[stalls.StallFinding]] = {}
    for f in report.findings:
        out.setdefault(f.id, []).append(f)
    return out
