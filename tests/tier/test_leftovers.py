"""Issue 48 item 12: what the quick start and the sizing rehearsal leave behind.

* the quick start's files (`drill/`, `calib.jsonl`, `sweep.json`) showed in `git status`;
* `deploy-valkey down` kept `kv-tier/`, and a later `doctor` in the same directory failed on that stopped tier,
  which nobody had named;
* `down --purge` left `drill-engine/` (and so the directory);
* `down` before `drill engine --stop` left the drill engine running without a word;
* `down` did not say what it left.

Real tiers, a real drill engine, real kvctl processes where the working directory matters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.drill import standalone
from tests.tier.helpers import invoke

ROOT = Path(__file__).resolve().parents[2]


def test_the_quick_start_files_are_ignored_by_git():
    paths = ["drill/capture/capture.json", "calib.jsonl", "sweep.json", "kv-tier/kvctl-tier.json"]
    p = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=ROOT, capture_output=True, text=True)
    assert sorted(p.stdout.split()) == sorted(paths), p.stdout + p.stderr
    # anchored at the top: the tests' own drill/ and any calib.jsonl deeper down stay tracked
    p = subprocess.run(["git", "check-ignore", "--no-index", "tests/drill/test_engine.py", "kvctl/samples/calib-trace.jsonl"],
                       cwd=ROOT, capture_output=True, text=True)
    assert p.stdout == "", p.stdout


@pytest.fixture
def tier(tmp_path, monkeypatch):
    """A local tier in ./kv-tier of a fresh working directory (doctor's default), stopped and purged after."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KVCTL_TIER_DIR", raising=False)
    res = invoke("up", "--ranks", "1", "--maxmemory", "64mb", "--dir", "kv-tier", "--json")
    assert res.exit_code == 0, res.output
    yield tmp_path / "kv-tier"
    state = standalone.read_state(tmp_path / "kv-tier") if (tmp_path / "kv-tier").is_dir() else None
    if state is not None and psutil.pid_exists(state.pid):
        psutil.Process(state.pid).kill()
    if (tmp_path / "kv-tier" / "kvctl-tier.json").exists():
        invoke("down", "--dir", "kv-tier", "--purge")


def _doctor(*args: str):
    return CliRunner().invoke(cli, ["doctor", "--no-host-checks", "--json", *args])


def test_doctor_after_down_in_the_same_directory_does_not_fail_on_the_stopped_tier(tier, monkeypatch):
    # `make test` points doctor at LMCache 0.5.6 (KVCTL_LMCACHE_PYTHON), whose known bugs are a warning of their own
    monkeypatch.delenv("KVCTL_LMCACHE_PYTHON", raising=False)
    res = invoke("down", "--dir", "kv-tier")
    assert res.exit_code == 0, res.output
    assert (tier / "kvctl-tier.json").is_file()  # down keeps the configs
    res = _doctor()
    data = json.loads(res.stdout)
    assert res.exit_code == 6, res.output  # nothing of the deployment checked: no engine, no running tier
    up = [c for c in data["checks"] if c["name"] == "up"]
    assert up and all(c["status"] == "skipped" for c in up), up
    assert "stopped" in up[0]["message"] and "kv-tier" in up[0]["message"], up
    # named, the stopped tier is checked, and its failure says what doctor found
    res = _doctor("--dir", "kv-tier")
    assert res.exit_code in (4, 5), res.output
    assert "stopped by `kvctl deploy-valkey down`" in res.stdout, res.stdout


def test_down_stops_the_drill_engine_it_knows_of_and_purge_removes_its_files(tier):
    res = CliRunner().invoke(cli, ["drill", "engine", "--dir", "kv-tier"])
    assert res.exit_code == 0, res.output
    state = standalone.read_state(tier)
    assert state is not None and psutil.pid_exists(state.pid)
    res = invoke("down", "--dir", "kv-tier")
    assert res.exit_code == 0, res.output
    assert "drill engine" in res.output and str(state.pid) in res.output, res.output
    proc = standalone.our_process(state)
    assert proc is None, "the drill engine still runs after down"
    assert standalone.read_state(tier) is None
    assert (tier / "drill-engine").is_dir()  # its config and log stay with the tier's, until --purge
    res = invoke("down", "--dir", "kv-tier", "--purge")
    assert res.exit_code == 0, res.output
    assert not tier.exists(), sorted(p.name for p in tier.rglob("*"))


def test_purge_with_the_drill_engine_running(tier):
    res = CliRunner().invoke(cli, ["drill", "engine", "--dir", "kv-tier"])
    assert res.exit_code == 0, res.output
    pid = standalone.read_state(tier).pid
    res = invoke("down", "--dir", "kv-tier", "--purge", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["drill_engine"]["pid"] == pid and data["drill_engine"]["result"] == "stopped"
    assert data["left"] == [] and not tier.exists()


def test_down_says_what_it_leaves(tier):
    (tier / "notes.txt").write_text("mine\n")
    res = invoke("down", "--dir", "kv-tier", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert "kvctl-tier.json" in data["left"] and "valkey-0.conf" in data["left"], data
    assert data["drill_engine"] is None
    res = invoke("down", "--dir", "kv-tier", "--purge")
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "notes.txt" in text and "left" in text, text  # not kvctl's: kept, and said
    assert (tier / "notes.txt").is_file() and not (tier / "kvctl-tier.json").exists()


def test_down_in_a_real_process_stops_an_engine_it_did_not_start(tier):
    """The engine `kvctl drill engine` started in another process is found through drill-engine.json."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    p = subprocess.run(["kvctl", "drill", "engine", "--dir", "kv-tier"], cwd=tier.parent, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    pid = standalone.read_state(tier).pid
    p = subprocess.run(["kvctl", "deploy-valkey", "down", "--dir", "kv-tier"], cwd=tier.parent, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert f"drill engine (pid {pid}," in p.stdout + p.stderr, p.stdout + p.stderr
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
