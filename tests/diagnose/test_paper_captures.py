"""Captures authored from the paper's numbers (§4, §6), analysed through `kvctl diagnose --from`.

Engine text is written from the documented vLLM / kvctl-connector formats
(:mod:`tests.diagnose.engine_text`); Valkey INFO as the real server reports it
(``cmdstat_get`` calls/usec, ``total_net_output_bytes``). The expected values
are worked out by hand in each test from the paper's figures, not with the
analysis code.
"""

from __future__ import annotations

import math

import pytest
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.diagnose.analysis import analyse
from kvctl.diagnose.capture import load_capture
from tests.diagnose.captures import from_dir, info, write_capture
from tests.diagnose.engine_text import EngineState

CHUNK = 12.4e6  # one 256-token GLM-5.3 FP8 MLA chunk (paper §4)


def test_h1b_overload_offered_rho_is_1_13_critical_and_3_instances(tmp_path):
    """Paper §4 H1b: λ = 1.21 req/s offered, 0.79 GB per prompt, one instance at ~0.845 GB/s (0.78-0.89).

    The tier caps completions at 1.06 req/s and the waiting queue grows. Over 100 s:
    106 requests finish and waiting + running grows by 15 (121 arrived = 1.21 req/s).
    Bytes loaded: 106 × 0.79e9 = 83.74e9 B in 83.74e9 / 0.845e9 = 99.10 s of engine-side GET time.
    ρ = 1.21 × 0.79 / 0.845 = 0.9559 / 0.845 = 1.1312 → unstable; instances for ρ ≤ 0.5 at
    this per-instance bandwidth: ceil(1.1312 × 1 / 0.5) = ceil(2.262) = 3.
    The served rate over B is only 0.8374 / 0.845 = 0.991: what the old analysis called ρ
    (a `rho_high` warning with "run 2 instances").
    """
    bytes_total = 106 * 0.79e9
    get_s = bytes_total / 0.845e9
    before = EngineState(waiting=2, running=1, kvctl_get_bytes=0, lmcache=False)
    after = before.advance(requests=106, prompt_lengths=[16300] * 106, kvctl_get_bytes=bytes_total, kvctl_get_s=get_s,
                           chunks_hit=106 * 64, waiting=16, running=2)
    # the one Valkey instance's own view (8.9 ms per 12.4 MB GET): present, but engine-side B wins
    gets = 106 * 64
    inst = (info(0, 0, 0), info(gets, gets * 8900, gets * CHUNK))
    d = from_dir(write_capture(tmp_path / "h1b", [(before.text(), after.text())], [inst], 100.0), code=4)
    assert d["arrival_rate_per_s"] == pytest.approx(1.21)
    assert d["completion_rate_per_s"] == pytest.approx(1.06)
    assert d["queue_growth"] == pytest.approx(15)
    assert d["bandwidth_source"] == "kvctl_connector" and d["rho_bound"] == "estimate"
    assert d["bandwidth_gbps"] == pytest.approx(0.845)
    assert d["l2_bytes_per_request"] == pytest.approx(0.79e9)
    assert d["rho"] == pytest.approx(1.1312, abs=1e-3)
    assert d["load_busy_fraction"] == pytest.approx(0.991, abs=1e-3)
    (f,) = [f for f in d["findings"] if f["id"].startswith("rho_")]
    assert f["id"] == "rho_unstable" and f["severity"] == "critical"
    assert f["evidence"]["instances_for_rho_target"] == 3 and "run 3 Valkey instance" in f["recommendation"]
    assert d["outcome"] == "findings" and d["worst_severity"] == "critical"


def test_eight_instances_at_8_9_ms_per_get_rho_0_09_no_rho_finding(tmp_path):
    """Paper §4/§6: eight instances, 8.9 ms server time per 12.4 MB GET, λ = 1.21 req/s.

    Over 100 s, 121 requests of 64 chunks (64 × 12.4e6 = 0.7936 GB each): 7744 GETs,
    968 per instance, each 968 × 8900 µs = 8.6152 s of GET time and 968 × 12.4e6 B out.
    B per instance = 12.4e6 B / 8.9e-3 s = 1.3933 GB/s; eight: 11.146 GB/s.
    ρ = 1.21 × 0.7936e9 / 11.146e9 = 0.0861 ≈ 0.09 — a lower bound, B being server side.
    """
    before = EngineState(running=1, lmcache=False)
    after = before.advance(requests=121, prompt_lengths=[16384] * 121, external_hits=121 * 16384, external_queries=121 * 16384, running=1)
    per = 968
    insts = [(info(0, 0, 0), info(per, per * 8900, per * CHUNK)) for _ in range(8)]
    d = from_dir(write_capture(tmp_path / "eight", [(before.text(), after.text())], insts, 100.0), code=0)
    assert d["arrival_rate_per_s"] == pytest.approx(1.21)
    assert d["bandwidth_source"] == "valkey_server_upper_bound" and d["rho_bound"] == "lower_bound"
    assert d["bandwidth_gbps"] == pytest.approx(8 * 12.4e6 / 8.9e-3 / 1e9)
    assert d["l2_bytes_per_request"] == pytest.approx(0.7936e9)
    assert d["rho"] == pytest.approx(0.0861, abs=5e-4) and round(d["rho"], 2) == 0.09
    assert not [f for f in d["findings"] if f["id"].startswith("rho_")]
    assert all(i["get_busy_fraction"] == pytest.approx(0.086152) for i in d["instances"])
    assert any("lower bound" in n for n in d["notes"])
    # said in --explain too
    assert any("upper bound" in q["name"] or "UPPER bound" in q["source"] for q in d["explain"])
    # and in the table
    res = CliRunner().invoke(cli, ["diagnose", "--from", str(tmp_path / "eight")], env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    assert "lower bound" in res.stdout and "upper bound" in res.stdout and "keeps up" not in res.stdout


def test_served_rate_can_never_show_rho_above_one_but_offered_does(tmp_path):
    """The same overload seen through completions only (no queue gauges would hide it): with the
    gauges, the offered λ exceeds completions by the queue growth; ρ follows the offered rate."""
    cap_dir = tmp_path / "h1b"
    bytes_total = 106 * 0.79e9
    before = EngineState(waiting=2, running=1, kvctl_get_bytes=0, lmcache=False)
    after = before.advance(requests=106, prompt_lengths=[16300] * 106, kvctl_get_bytes=bytes_total,
                           kvctl_get_s=bytes_total / 0.845e9, waiting=16, running=2)
    write_capture(cap_dir, [(before.text(), after.text())], [], 100.0)
    d = analyse(load_capture(cap_dir))
    assert d.rho > 1 > d.load_busy_fraction
    assert math.isclose(d.rho / d.load_busy_fraction, 1.21 / 1.06, rel_tol=1e-9)  # offered / completed


def test_eight_ranks_engine_side_seconds_summed_over_ranks(tmp_path):
    """The kvctl connector sums GET bytes and seconds over the engine's ranks, which load in parallel.

    Eight ranks, each reading its 1/8 of a 0.7936 GB prompt (0.0992 GB) at 1.3933 GB/s (12.4 MB per
    8.9 ms): 71.2 ms per rank per request, Σ over ranks 0.5696 s per request; 121 requests in 100 s.
    With W = 8 (one instance per rank, or the connector's kvctl:ranks gauge):
    B = 8 × 96.03e9 B / 68.92 s = 11.15 GB/s and ρ = 1.21 × 0.7936e9 / 11.146e9 = 0.0861.
    Without W the same counters read as one rank: ρ = 8 × 0.0861 = 0.689, with a note saying so.
    """
    per_rank_s = 0.0992e9 / (12.4e6 / 8.9e-3)
    bytes_total, secs_total = 121 * 0.7936e9, 121 * 8 * per_rank_s
    before = EngineState(running=1, kvctl_get_bytes=0, lmcache=False)
    after = before.advance(requests=121, prompt_lengths=[16384] * 121, kvctl_get_bytes=bytes_total, kvctl_get_s=secs_total, running=1)
    with_gauge = after.advance(extra={"kvctl:ranks": 8})
    insts = [(info(0, 0, 0), info(968, 968 * 8900, 968 * CHUNK)) for _ in range(8)]
    for name, eng, valkey in (("instances", after, insts), ("gauge", with_gauge, [])):
        d = from_dir(write_capture(tmp_path / name, [(before.text(), eng.text())], valkey, 100.0), code=0)
        assert d["bandwidth_source"] == "kvctl_connector" and d["engine_ranks"] == 8
        assert d["rho"] == pytest.approx(0.0861, abs=5e-4)
    d = from_dir(write_capture(tmp_path / "alone", [(before.text(), after.text())], [], 100.0), code=0)
    assert d["engine_ranks"] == 1 and d["rho"] == pytest.approx(8 * 0.0861, abs=4e-3)
    assert any("summed over the engine's ranks" in n for n in d["notes"])
