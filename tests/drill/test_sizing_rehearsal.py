"""Issue 31, item 3: README's "Sizing a shared tier" runs word for word on this machine, with what ships: a tier,
the drill engine as the replay target (`kvctl drill engine`), the bundled calibration trace, a bench that sizes
itself to the tier, and plan. The block runs as one bash script (its ENGINE variable spans lines)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.drill.samples import loader_gbps, sample_paths
from kvctl.drill.workload import calibration_text
from tests.held_ports import held_ports

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def sizing_block() -> str:
    section = README.split("## Sizing a shared tier", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def test_the_section_is_a_rehearsal_with_what_ships():
    block = sizing_block()
    for step in ("kvctl deploy-valkey up", "kvctl drill engine --dir", "kvctl drill samples --path calib", "kvctl replay",
                 "kvctl bench --dir", "kvctl plan", "--fit-from calib.jsonl", "kvctl drill engine --stop", "kvctl deploy-valkey down"):
        assert step in block, step
    # the bandwidth plan is given is the drill engine's own loader, not the raw Valkey the bench measures
    assert f"--instance-gbps {loader_gbps()[0]:.1g}" in block
    assert sample_paths()["calib"].read_text() == calibration_text()  # the shipped trace is the one the code describes


@pytest.mark.long
def test_readme_sizing_runs_word_for_word(tmp_path):
    """Word for word on a busy host (issue 48 item 7): another tier holds 17400.. (real listening sockets), and no
    KVCTL_BASE_PORT points the block elsewhere."""
    env = {k: v for k, v in os.environ.items() if k != "KVCTL_BASE_PORT"}
    env.update({"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "KVCTL_HOME": str(tmp_path / "home")})
    t = time.monotonic()
    with held_ports():
        p = subprocess.run(["bash", "-euo", "pipefail", "-c", sizing_block()], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    took = time.monotonic() - t
    out = p.stdout[-6000:] + p.stderr[-3000:]
    try:
        assert p.returncode == 0, out
        text = " ".join(p.stdout.split())
        assert "PLAN:" in text and "recompute" in text, out  # a plan, recompute among the points tried
        assert "kvctl replay: 25/25 finished" in p.stderr and "values of 0.070272 MB" in p.stderr, out
        assert took < 90, took
    finally:  # whatever failed, nothing the block started keeps running
        state = tmp_path / "kv-tier" / "drill-engine.json"
        if state.exists():
            pid = json.loads(state.read_text())["pid"]
            if psutil.pid_exists(pid):
                psutil.Process(pid).kill()
            CliRunner().invoke(cli, ["deploy-valkey", "down", "--dir", str(tmp_path / "kv-tier")])
    assert not (tmp_path / "kv-tier" / "drill-engine.json").exists()  # --stop cleared it


def test_drill_engine_needs_a_tier_and_stopping_none_is_said(tmp_path):
    r = CliRunner().invoke(cli, ["drill", "engine"])
    assert r.exit_code == 2 and "--dir" in r.output
    r = CliRunner().invoke(cli, ["drill", "engine", "--dir", str(tmp_path / "none")])
    assert r.exit_code != 0 and "kvctl-tier.json" in r.output
    r = CliRunner().invoke(cli, ["drill", "engine", "--stop", "--dir", str(tmp_path)])
    assert r.exit_code == 0 and "no drill engine recorded" in r.output
    r = CliRunner().invoke(cli, ["drill", "overload", "--stop"])
    assert r.exit_code == 2 and "--stop with `kvctl drill engine`" in r.output
