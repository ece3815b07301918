"""Find the LMCache interpreter and run scenarios in it.

LMCache 0.5.6 is installed in a venv of its own (``make lmcache-venv``;
docs/engine.md, "The LMCache path", says why). Its interpreter is
``$KVCTL_LMCACHE_PYTHON`` when set (``make test`` sets it), else the running
interpreter when that one can import lmcache.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = "tests.lmcache.scenarios"


def lmcache_python() -> str:
    return os.environ.get("KVCTL_LMCACHE_PYTHON") or sys.executable


def lmcache_available(python: str | None = None) -> tuple[bool, str]:
    """(True, "") when ``python`` has LMCache 0.5.6, torch and kvctl; else (False, reason)."""
    python = python or lmcache_python()
    code = (
        "import importlib.metadata as m, importlib.util as u\n"
        "missing = [x for x in ('lmcache', 'torch', 'kvctl') if u.find_spec(x) is None]\n"
        "print(','.join(missing) if missing else m.version('lmcache'))\n"
    )
    try:
        r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"cannot run {python}: {exc}"
    out = r.stdout.strip()
    if r.returncode != 0 or out != "0.5.6":
        return False, (f"{python} has no LMCache 0.5.6 ({out or r.stderr.strip()[-200:]}): run `make lmcache-venv` "
                       "and set KVCTL_LMCACHE_PYTHON=.venv-lmcache/bin/python")
    return True, ""


def _env() -> dict[str, str]:
    return dict(os.environ, LMCACHE_DISABLE_BANNER="1", LMCACHE_LOG_LEVEL="WARNING", PYTHONHASHSEED="0",
                LMCACHE_USAGE_TRACK="false", DO_NOT_TRACK="1")


def _parse(lines: list[str], prefix: str) -> dict | None:
    for line in reversed(lines):
        if line.startswith(prefix):
            return json.loads(line[len(prefix):])
    return None


def run_scenario(name: str, args: dict, timeout_s: float = 240.0, python: str | None = None) -> dict:
    """Run scenario ``name`` in the LMCache interpreter and return its RESULT; raise with its output on failure."""
    r = subprocess.run([python or lmcache_python(), "-m", SCENARIOS, name], input=json.dumps(args), capture_output=True,
                       text=True, timeout=timeout_s, cwd=REPO, env=_env())
    result = _parse(r.stdout.splitlines(), "RESULT ")
    if r.returncode != 0 or result is None:
        raise AssertionError(f"scenario {name} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return result


def run_scenario_until_stalled(name: str, args: dict, ready_timeout_s: float, stall_s: float,
                               python: str | None = None) -> tuple[dict | None, dict | None, str]:
    """Run ``name`` until it prints a PROGRESS line, then give it ``stall_s`` more seconds.

    Returns (progress, result, output): ``result`` is None when the scenario
    was still running after ``stall_s`` -- it is then killed (this process
    started it; only its pid is signalled). Every wait is bounded.
    """
    proc = subprocess.Popen([python or lmcache_python(), "-m", SCENARIOS, name], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=_env())
    proc.stdin.write(json.dumps(args))
    proc.stdin.close()
    lines: list[str] = []
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + ready_timeout_s
    progress = None
    try:
        while time.monotonic() < deadline:
            if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                continue
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.rstrip("\n"))
            if progress is None and line.startswith("PROGRESS "):
                progress = json.loads(line[len("PROGRESS "):])
                deadline = time.monotonic() + stall_s
            if line.startswith("RESULT "):
                break
        return progress, _parse(lines, "RESULT "), "\n".join(lines[-80:])
    finally:
        sel.close()
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        proc.stdout.close()
