"""benchmarks/gpu_paper_set.sh (``gpu_host.sh paper-set``): several paper_gpu.py runs in one device call, an archive
each. Run here dry (``PAPER_SET_DRY=1``: each run's command and timeout printed, nothing started): the caps and
the time left, a run skipped with under 60 s left, and a malformed set refused whole before any run starts."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def dry(tmp_path: Path, runs: str, set_s: str = "585") -> subprocess.CompletedProcess:
    env = {**os.environ, "PAPER_SET": runs, "PAPER_SET_S": set_s, "PAPER_SET_DRY": "1"}
    return subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_paper_set.sh"), str(tmp_path / "out")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=30)


def test_each_run_gets_its_cap_or_what_is_left(tmp_path):
    r = dry(tmp_path, "s39-on|R5|--compiled --rate 3.9 --load-policy on|240;s39-off|R5|--load-policy off", "400")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == '== s39-on: PAPER_WORK=s39-on PAPER_STEPS=R5 BENCH_ARGS="--compiled --rate 3.9 --load-policy on" BENCH_TIMEOUT_S=240'
    left = int(lines[1].rsplit("=", 1)[1])
    assert lines[1].startswith('== s39-off: PAPER_WORK=s39-off PAPER_STEPS=R5 BENCH_ARGS="--load-policy off"') and 390 <= left <= 395


def test_a_run_with_under_a_minute_left_is_skipped(tmp_path):
    r = dry(tmp_path, "a|R5|--x", "50")
    assert r.returncode == 0 and r.stdout.startswith("== a: skipped")


def test_a_malformed_set_is_refused_before_any_run(tmp_path):
    for runs, why in (("ok|R5|--x;../up|R5|--x", "plain name"), ("ok|R5|--x;b|R5|--x|1m", "whole seconds"),
                      ("ok|R5|--x;b||--x", "no steps")):
        r = dry(tmp_path, runs)
        assert r.returncode == 2 and why in r.stderr and r.stdout == "", (runs, r.stdout, r.stderr)
    r = dry(tmp_path, "a|R5|--x", "ten")
    assert r.returncode == 2 and "whole seconds" in r.stderr
