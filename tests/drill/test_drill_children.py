"""The drill's children (issue 30, items 3 and 7): what they import, how long they live, who reaps them.

Real processes throughout: the drill's own valkey-servers, engine and replay, a SIGKILLed drill, a
planted ``./kvctl`` package. Drills that run end to end are short (--duration 8); the rest drive
:class:`kvctl.drill.run.Drill` in this process, so only the part under test runs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from kvctl.drill import scenarios as S
from kvctl.drill.run import Drill, DrillOptions
from kvctl.core.errors import ExitStatus
from kvctl.tier import local


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = [p for p in pids if not _gone(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if not _gone(p)]


def _kill(pids: list[int]) -> None:
    for pid in pids:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)


def _drill_cli(args: list[str], cwd: Path) -> subprocess.Popen:
    """``kvctl drill ...`` as an installed console script starts it: the working directory not on sys.path."""
    return subprocess.Popen([sys.executable, "-P", "-m", "kvctl.cli", "drill", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def dr_workload(dr: Drill):
    """A light trace for the drill's replay (ρ 0.3)."""
    from kvctl.drill.run import _workload  # noqa: PLC0415

    return _workload(dr.sc, 0.3, dr.opts)


# ----------------------------------------------------------------------------- item 3: what the children import


def test_a_kvctl_package_planted_in_the_cwd_never_runs_in_the_drill_children(tmp_path, monkeypatch):
    """A ``./kvctl/__init__.py`` in the working directory: the drill engine and replay import the installed
    kvctl, never the planted one (before: the planted code ran in the engine, which then died)."""
    marker = tmp_path / "planted-code-ran"
    plant = tmp_path / "cwd" / "kvctl"
    plant.mkdir(parents=True)
    (plant / "__init__.py").write_text(f"open({str(marker)!r}, 'a').write('ran\\n')\n")
    monkeypatch.chdir(plant.parent)
    dr = Drill(S.SCENARIOS["overload"], DrillOptions(duration_s=8), lambda line: None)
    try:
        targets = dr.start_tier(1)
        dr.start_engine(dr.engine_settings(targets))
        dr.start_replay(dr_workload(dr))
        run = dr.work / "run.jsonl"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and dr.replay.poll() is None and not (run.exists() and run.read_text().strip()):
            time.sleep(0.1)
        assert dr.replay.poll() is None, (dr.work / "replay.log").read_text()[-2000:]
        assert run.read_text().startswith('{"metadata"')
    finally:
        dr.cleanup()
    assert not marker.exists(), "the planted ./kvctl/__init__.py ran in a drill child"


@pytest.mark.long  # a whole drill: the long lane
def test_an_unrelated_kvctl_folder_in_the_cwd_does_not_fail_the_drill(tmp_path):
    """The issue's repro: run from the parent of a checkout (a ``kvctl/`` folder without ``__init__.py``).
    Replay used to die at import and the drill said exit 7, "diagnose missed"; now the drill runs and
    passes. ``--keep`` into an existing empty directory keeps that very directory (item 1)."""
    (tmp_path / "kvctl" / "docs").mkdir(parents=True)
    kept = tmp_path / "kept"
    kept.mkdir()
    inode = kept.stat().st_ino
    p = _drill_cli(["overload", "--duration", "8", "--keep", "kept", "--json"], tmp_path)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, (p.returncode, out[-2000:], err[-2000:])
    assert json.loads(out)["passed"] is True
    assert kept.stat().st_ino == inode
    assert (kept / "run.jsonl").is_file() and (kept / "capture" / "capture.json").is_file()


@pytest.mark.long  # a whole drill: the long lane
def test_a_child_that_dies_mid_drill_is_could_not_run_not_missed(tmp_path):
    """Replay SIGKILLed (the OOM killer, say) right after it starts: the drill stops at its next look and
    exits 8 ("could not run", naming replay), not 7 ("diagnose missed")."""
    p = _drill_cli(["overload", "--duration", "20"], tmp_path)
    killed = None
    deadline = time.monotonic() + 60
    for line in p.stdout:
        if "replay:" in line or time.monotonic() > deadline:
            break
    while killed is None and time.monotonic() < deadline:
        for c in psutil.Process(p.pid).children(recursive=True):
            if "replay" in c.cmdline():
                killed = c.pid
                c.kill()
        time.sleep(0.05)
    out, err = p.communicate(timeout=90)
    assert killed, out
    assert p.returncode == ExitStatus.DRILL_NOT_RUN, (p.returncode, out[-2000:], err[-2000:])
    assert "replay" in err and "could not run" in err, err
    assert "Traceback" not in err
# ----------------------------------------------------------------------------- item 7: lifetimes, reaping, stale dirs


def test_a_sigkilled_drill_leaves_no_process_and_the_next_drill_removes_its_work_dir(tmp_path):
    """SIGKILL cannot be caught: the valkey-server, engine and replay die with the drill (PR_SET_PDEATHSIG),
    and the next drill reports the dead drill's work directory and removes it."""
    p = _drill_cli(["overload", "--duration", "30"], tmp_path)
    deadline = time.monotonic() + 60
    for line in p.stdout:
        if "replay:" in line or time.monotonic() > deadline:
            break
    children = psutil.Process(p.pid).children(recursive=True)
    pids = [c.pid for c in children]
    work = {m.group(1) for c in children for a in c.cmdline() if (m := re.search(r"(.*/kvctl-drill-overload-[^/]+)/", a))}
    assert len(pids) >= 3 and len(work) == 1, ([c.cmdline() for c in children], work)
    p.kill()
    p.communicate(timeout=10)
    try:
        left = _wait_gone(pids, 10)
        assert not left, [psutil.Process(x).cmdline() for x in left]
    finally:
        _kill(pids)
    stale = Path(work.pop())
    assert stale.is_dir()
    said: list[str] = []
    dr = Drill(S.SCENARIOS["overload"], DrillOptions(duration_s=8), said.append)
    dr.cleanup()
    assert not stale.exists()
    assert any(str(stale) in s and "removed" in s for s in said), said


def test_the_drill_reaps_the_valkey_servers_it_stops(tmp_path):
    """After the drill stops its tier (as on SIGINT/SIGTERM), no valkey-server of it is left a zombie."""
    dr = Drill(S.SCENARIOS["dead-instance"], DrillOptions(duration_s=8), lambda line: None)
    try:
        dr.start_tier(2)
        pids = [i.pid for i in local.load_tier(dr.tier_dir).instances]
    finally:
        dr.cleanup()
    try:
        mine = {c.pid: c.status() for c in psutil.Process().children()}
        assert not [pid for pid in pids if pid in mine], mine
    finally:
        _kill(pids)


def test_a_work_dir_deleted_under_the_drill_still_has_its_servers_stopped(tmp_path):
    """Another process deletes the drill's work dir (its tier state file with it): the drill stops the
    valkey-servers it started through the handles it holds, not through the state file."""
    dr = Drill(S.SCENARIOS["overload"], DrillOptions(duration_s=8), lambda line: None)
    try:
        dr.start_tier(1)
        pids = [i.pid for i in local.load_tier(dr.tier_dir).instances]
        shutil.rmtree(dr.work)
    finally:
        dr.cleanup()
    try:
        assert _wait_gone(pids, 5) == [], "a valkey-server of the drill is still running"
    finally:
        _kill(pids)
