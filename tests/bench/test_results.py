"""summarize_* and the grid/key-count rules, on hand-made raw results (no servers)."""

import pytest

from kvctl.bench.info import ServerDelta, ServerInfo
from kvctl.bench.results import summarize_run, summarize_verdict, with_scaling
from kvctl.bench.spec import BenchSpec, auto_keys, grid
from kvctl.bench.worker import WorkerResult
from kvctl.core.errors import InvalidInput


def _w(wid, inst, nbytes, elapsed, lat, errors=0):
    return WorkerResult(wid, inst, True, True, len(lat), len(lat) * 2, 0, nbytes, errors, "boom" if errors else None, elapsed, lat)


def test_summarize_run_two_instances():
    workers = [_w(0, 0, 4_000_000_000, 2.0, [0.01, 0.02, 0.03]), _w(1, 1, 2_000_000_000, 1.0, [0.04])]
    deltas = [ServerDelta(2.0, 1000, 500_000, 4_000_100_000), "INFO failed: timeout"]
    r = summarize_run("get", [0, 1], ["a", "b"], 1, 1_000_000, 2, workers, deltas)
    assert r.aggregate_gbps == pytest.approx(3.0)  # 6 GB over the longest client window, 2 s
    assert r.per_instance_gbps == pytest.approx((2.0, 2.0))
    assert r.p50_batch_ms == pytest.approx(25.0) and r.p99_batch_ms == pytest.approx(39.7)
    assert r.server_usec_per_get == pytest.approx(500.0) and r.server_usec_per_set is None
    assert r.server_busy_frac == pytest.approx(0.25)
    assert r.errors == 1 and r.per_instance[1].first_error.startswith("INFO failed")
    assert r.per_instance[0].errors == 0 and r.per_instance[0].server_calls == 1000


def test_scaling_and_verdict():
    base = summarize_run("get", [0], ["a"], 1, 10, 1, [_w(0, 0, 1_000_000_000, 1.0, [0.1])], [ServerDelta(1, 1, 1, 1)])
    two = summarize_run("get", [0, 1], ["a", "b"], 1, 10, 1,
                        [_w(0, 0, 2_000_000_000, 1.0, [0.1]), _w(1, 1, 2_000_000_000, 1.0, [0.1])],
                        [ServerDelta(1, 1, 1, 1)] * 2)
    runs = with_scaling([base, two])
    assert [r.scaling_vs_1x1 for r in runs] == pytest.approx([1.0, 4.0])
    v = summarize_verdict(runs, 48437.5, 52200)
    assert v.breakeven_gbps == pytest.approx(2.528, abs=1e-3)
    assert v.ranks == 2 and v.tier_gbps == pytest.approx(4.0) and v.per_rank_gbps == pytest.approx(2.0)
    assert v.loading_wins
    assert not summarize_verdict(runs[:1], 48437.5, 52200).loading_wins


def test_grid():
    assert grid(4, BenchSpec(chunk_bytes=1, clients=3)) == [(4, 3)]
    assert grid(8, BenchSpec(chunk_bytes=1, clients=8, sweep=True)) == [(1, 1), (1, 2), (1, 4), (1, 8), (2, 1), (4, 1), (8, 1)]
    assert grid(3, BenchSpec(chunk_bytes=1, clients=1, sweep=True)) == [(1, 1), (2, 1), (3, 1)]


def test_auto_keys_within_maxmemory():
    spec = BenchSpec(chunk_bytes=12_400_000, batch=8, clients=1)
    fits = auto_keys(ServerInfo("8.1", 1_000_000_000, 1_000_000, 0), spec)
    assert 8 <= fits and fits * 12_400_000 <= 0.8 * 1_000_000_000
    assert auto_keys(ServerInfo("8.1", 100_000_000_000, 1_000_000, 0), spec) == 81  # ~1 GB of values
    with pytest.raises(InvalidInput, match="fewer than one batch"):
        auto_keys(ServerInfo("8.1", 50_000_000, 1_000_000, 0), spec)


def test_verdict_llama_tp8_on_8_instances_of_1_gbps_says_recompute():
    """Issue 13: the verdict compared the per-rank s (tp 8) with the whole tier's bandwidth and said "loading wins".

    Llama-3.1-8B, bf16: whole model 2 × 32 layers × 8 KV heads × 128 × 2 B = 131072 B/token; tp 8: 16384 per rank.
    8 instances, each 1e9 B in 1 s: 8 GB/s aggregate, 1 GB/s per instance. R = 100k tok/s.
      B* = 131072 × 1e5 = 13.1072 GB/s > 8 GB/s (per instance: 16384 × 1e5 = 1.6384 GB/s > 1 GB/s)
      loading 131072 B / 8e9 B/s = 16.384 µs per token, recomputing 1 / 1e5 s = 10 µs: recompute wins.
    """
    from pathlib import Path  # noqa: PLC0415

    from kvctl.core.kvsize import kv_size_from_file  # noqa: PLC0415

    size = kv_size_from_file(Path(__file__).resolve().parents[2] / "configs" / "models" / "llama-3.1-8b.json", tp=8)
    workers = [_w(i, i, 1_000_000_000, 1.0, [0.1]) for i in range(8)]
    run = summarize_run("get", list(range(8)), list("abcdefgh"), 1, 10, 1, workers, [ServerDelta(1, 1, 1, 1)] * 8)
    assert run.aggregate_gbps == pytest.approx(8.0)
    v = summarize_verdict([run], size.bytes_per_token, 100_000)
    assert v.bytes_per_token == 131072 and v.bytes_per_token_per_rank == 16384
    assert v.breakeven_gbps == pytest.approx(13.1072)
    assert v.per_rank_needed_gbps == pytest.approx(1.6384) and v.per_rank_gbps == pytest.approx(1.0)
    assert v.load_us_per_token == pytest.approx(16.384) and v.recompute_us_per_token == pytest.approx(10.0)
    assert v.loading_wins is False
    assert "recompute" in v.text and "16.4 µs" in v.text and "10.0 µs" in v.text
    # twice the instances (16 × 1 GB/s): 131072 / 16e9 = 8.192 µs < 10 µs, loading wins
    w16 = [_w(i, i, 1_000_000_000, 1.0, [0.1]) for i in range(16)]
    run16 = summarize_run("get", list(range(16)), [str(i) for i in range(16)], 1, 10, 1, w16, [ServerDelta(1, 1, 1, 1)] * 16)
    v16 = summarize_verdict([run16], size.bytes_per_token, 100_000)
    assert v16.loading_wins and v16.load_us_per_token == pytest.approx(8.192)
    assert v16.bytes_per_token_per_rank == 131072 / 16  # each of 16 instances serves 8192 B of every token
