"""benchmarks/saturated_oracle.py: the oracle that asks whether issue 46's saturated-tier p99 target can be met at all.

Hand-built cases whose answers are worked out here (a lone load against a recompute, a second request behind it, a
job split across the GPU's gaps), then the kept H100 runs of 2026-12-07, sixth, read back as benchmarks/README.md
quotes them: at the runs' own send times the oracle's p99 is 5.26x the unshaped run's (the target 2x), and with the
unshaped tier's speed it lands under that run's measured p99 (the oracle is optimistic, not pessimistic).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks import saturated_oracle as so  # noqa: E402
from kvctl.sim.steps import StepCost  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
CALIB = RESULTS / "paper_gpu-h100-2026-12-07f-s39-calib2"
UNSHAPED = RESULTS / "paper_gpu-h100-2026-12-07-s39-unshaped"
RUN = RESULTS / "paper_gpu-h100-2026-12-07f-s39fix-sw05"

# 4 chunks of 100 tokens in the tier, 1 byte a token: a chunk is 100 bytes; at 1000 B/s a chunk loads in 0.1 s.
# R 1000 tokens/s, no step cost, no budget limit beyond one step: a 500-token recompute takes 0.5 s.
F = so.Figures(prefill_rate=1000.0, cost=StepCost(0.0, 0, 0.0), budget=10_000, t0_s=0.0, load_bps=1000.0, api_s=0.0,
               chunk_tokens=100, bytes_per_token=1.0)


def test_a_lone_hit_loads_whole_and_the_one_behind_it_splits_between_tier_and_gpu():
    # alone: load all 4 chunks (0.4 s) then compute the last 100 tokens (0.1 s): 0.5 s; recomputing would be 0.5 s
    # too, and a tie goes to the longer load
    one = so.oracle([0.0], 500, 400, F)
    assert one["p50_s"] == pytest.approx(0.5) and one["loaded_share"] == 1.0
    # the second, at the same instant: the tier is busy until 0.4. Loading k chunks ends at 0.4 + 0.1k, then
    # 500 - 100k tokens on a GPU busy 0.4-0.5 with the first's rest: k = 0 runs 0-0.4 and 0.5-0.6 (split) -> 0.6;
    # k = 1: ready 0.5, 0.4 s of compute -> 0.9. So it recomputes, and its latency is 0.6 s.
    two = so.oracle([0.0, 0.0], 500, 400, F)
    assert two["loaded_share"] == pytest.approx(0.5)
    assert (two["p50_s"], two["p99_s"]) == pytest.approx((0.55, 0.599))  # latencies 0.5 and 0.6, interpolated
    assert two["gpu_s"] == pytest.approx(0.1 + 0.5)


def test_the_gpu_fills_gaps_in_order_and_splits_a_job_that_does_not_fit_one():
    g = so._Gpu()
    assert g.take(1.0, 0.5) == pytest.approx(1.5)
    assert g.take(2.0, 0.5) == pytest.approx(2.5)
    assert g.finish(0.0, 0.8) == pytest.approx(0.8)  # the first gap holds it
    assert g.finish(0.5, 0.8) == pytest.approx(1.5 + 0.3)  # 0.5 before 1.0, 0.3 after 1.5
    assert g.take(1.2, 0.6) == pytest.approx(2.6)  # 1.5-2.0, then 2.5-2.6
    assert len(g.busy) == 1 and g.busy[0] == pytest.approx([1.0, 2.6])  # the pieces merged with both jobs
    assert g.finish(3.0, 0.0) == 3.0


def test_the_kept_runs_read_back_as_the_readme_quotes_them(tmp_path):
    out = tmp_path / "o.json"
    assert so.main([str(RUN), "--calib", str(CALIB), "--unshaped", str(UNSHAPED), "--rates", "1", "--seeds", "1,3",
                    "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert round(res["unshaped_p99_s"], 3) == 0.343 and round(res["figures"]["load_gbps"], 2) == 3.04
    row = res["runs"][RUN.name]
    assert round(row["measured_p99_s"], 3) == 3.055
    assert round(row["oracle"]["p99_s"], 3) == 1.804 and row["oracle"]["p99_s"] / res["unshaped_p99_s"] > 5
    assert row["oracle"]["p99_s"] < row["measured_p99_s"]  # the decision is slower than the oracle, as it must be
    # a tier a third busy (1 request/s) still misses 2x: a lone load and the API server take 0.475 s of the 0.687
    assert all(r["p99_s"] / res["unshaped_p99_s"] > 2 for r in res["rates"]["1"])
    kept = json.loads((RESULTS / "saturated_oracle-h100-2026-12-07f-s39.json").read_text())
    assert kept["runs"][RUN.name]["oracle"]["p99_s"] == pytest.approx(row["oracle"]["p99_s"])


def test_with_the_unshaped_tiers_speed_the_oracle_beats_the_unshaped_run(tmp_path):
    out = tmp_path / "o.json"
    assert so.main([str(UNSHAPED), "--calib", str(CALIB), "--unshaped", str(UNSHAPED), "--load-gbps", "17.1",
                    "--json", str(out)]) == 0
    row = json.loads(out.read_text())["runs"][UNSHAPED.name]
    assert row["oracle"]["p99_s"] <= row["measured_p99_s"]
    assert row["oracle"]["p99_s"] > 0.8 * row["measured_p99_s"]  # and not by much: the model is not free


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    assert so.main([str(tmp_path), "--calib", str(CALIB), "--unshaped", str(UNSHAPED)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("saturated_oracle: ") and len(err.splitlines()) == 1
    assert so.main([str(RUN), "--calib", str(tmp_path), "--unshaped", str(UNSHAPED)]) == 2
    err = capsys.readouterr().err.strip()
    assert "calibration trace" in err and len(err.splitlines()) == 1
    with pytest.raises(SystemExit) as exc:
        so.main([str(RUN), "--calib", str(CALIB), "--unshaped", str(UNSHAPED), "--rates", "0"])
    assert exc.value.code == 2
