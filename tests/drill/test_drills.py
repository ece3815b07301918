"""`kvctl drill`: each scenario end to end (real valkey-servers, the drill engine, replay, diagnose), the
plant-nothing failure, and cleanup on SIGTERM. Short --duration; every one is in the long lane."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.core.errors import ExitStatus

DURATION = "10"
# every drill runs a real tier, the drill engine, replay and diagnose for --duration: the long lane (README, Tests)
pytestmark = pytest.mark.long


def _drill(*args: str, timeout: float = 120) -> tuple[int, dict]:
    p = subprocess.run([sys.executable, "-m", "kvctl.cli", "drill", *args, "--json"], capture_output=True, text=True, timeout=timeout)
    assert p.stdout.strip(), p.stderr
    return p.returncode, json.loads(p.stdout)


def _no_leftovers() -> list[str]:
    """Processes of drills still running (engine, replay, valkey-servers in a drill's work dir)."""
    out = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if "kvctl-drill-" in cmd or "kvctl.drill.engine" in cmd:
            out.append(f"{proc.pid}: {cmd[:120]}")
    return out


@pytest.mark.parametrize("scenario, finding", [("overload", "rho_unstable"), ("missing-key-stall", "missing-key-get"), ("dead-instance", "instance_down"),
                                               ("saturated-tier", "hits_recomputed")])
def test_scenario_finds_what_it_planted(scenario, finding):
    code, data = _drill(scenario, "--duration", DURATION)
    assert code == 0, data
    assert data["passed"] is True and data["exit_code"] == 0
    assert finding in data["found"]
    assert data["runbook"] == f"kvctl runbook {finding}"
    verdict = [s for s in data["steps"] if s["kind"] == "verdict"][0]["text"]
    assert verdict.startswith("PASS") and f"Fix: {data['fix']}; runbook: kvctl runbook {finding}" in verdict
    # the fix is the finding's own line for the drill's tier (issue 48 item 3), never a command form of its own
    forms = {"overload": "`kvctl deploy-valkey up --ranks 1 --instances-per-rank ", "missing-key-stall": "Missing-key GET hang",
             "dead-instance": "`kvctl deploy-valkey up --ranks 2 --instances-per-rank 1 --dir ./kv-tier`",
             "saturated-tier": "`kvctl plan --ranks 1 --policy on`"}
    assert forms[scenario] in data["fix"], data["fix"]


def test_healthy_has_no_findings():
    code, data = _drill("healthy", "--duration", DURATION)
    assert code == 0, data
    last = data["diagnoses"][-1]
    assert last["rho"] < 0.7 and not [f for f in last["findings"] if f.startswith("rho_")]
    assert last["exit_code"] in (0, 3)  # no critical finding, nothing unreachable


@pytest.mark.parametrize("scenario", ["overload", "dead-instance", "saturated-tier"])
def test_planting_nothing_fails_the_drill(scenario):
    """Without the fault diagnose has nothing to find: the drill must say so and exit 7."""
    code, data = _drill(scenario, "--duration", DURATION, "--plant-nothing")
    assert code == ExitStatus.DRILL_MISSED, data
    assert data["passed"] is False and data["planted"] is False


def test_async_fix_recovers():
    code, data = _drill("async-fix", "--duration", "20")
    assert code == 0, data
    before, after = data["diagnoses"][2], data["diagnoses"][-1]
    assert "rho_unstable" in before["findings"] and before["rho"] >= 1.0
    assert "rho_unstable" not in after["findings"] and after["rho"] < 1.0


def test_sigterm_stops_everything_it_started(tmp_path):
    p = subprocess.Popen([sys.executable, "-m", "kvctl.cli", "drill", "dead-instance", "--duration", "30"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    pids, ports = [], []
    deadline = time.monotonic() + 60
    for line in p.stdout:
        if m := re.search(r"on 127\.0\.0\.1:(\d+)\.\.(\d+)", line):
            ports += list(range(int(m.group(1)), int(m.group(2)) + 1))
        if m := re.search(r"drill engine pid (\d+) on http://127\.0\.0\.1:(\d+)", line):
            pids.append(int(m.group(1)))
            ports.append(int(m.group(2)))
        if "SIGSTOP rank" in line or time.monotonic() > deadline:
            break
    children = [c.pid for c in psutil.Process(p.pid).children(recursive=True)]
    valkeys = [c.pid for c in psutil.process_iter(["cmdline"]) if "kvctl-drill-dead-instance" in " ".join(c.info["cmdline"] or [])]
    assert pids and ports and valkeys
    p.send_signal(signal.SIGTERM)
    rest = p.communicate(timeout=60)[0]
    assert p.returncode == 128 + signal.SIGTERM, rest
    assert "interrupted by SIGTERM" in rest
    for pid in pids + children + valkeys:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid
    listening = {c.laddr.port for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    assert not listening & set(ports)
    assert not _no_leftovers()


def test_list_samples_and_usage_errors():
    r = CliRunner().invoke(cli, ["drill", "--json"])
    assert r.exit_code == 0, r.output
    assert [s["name"] for s in json.loads(r.output)["scenarios"]] == ["healthy", "overload", "async-fix", "missing-key-stall", "saturated-tier",
                                                                    "dead-instance"]
    r = CliRunner().invoke(cli, ["drill", "samples", "--json"])
    assert r.exit_code == 0, r.output
    assert all(os.path.exists(v["path"]) for v in json.loads(r.output).values())
    for bad in (["drill", "overload", "--all"], ["drill", "overload", "--duration", "2"], ["drill", "nope"]):
        r = CliRunner().invoke(cli, bad)
        assert r.exit_code == 2, (bad, r.output)
