"""``kvctl simulate --engines`` with variability: queueing theory, hand-worked fleets, fitted inputs.

Units used throughout: 1000 tokens × 1e6 B/token = 1 GB per prompt, so a prompt takes 1 s on 1 GB/s.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from kvctl.sim import fleet
from kvctl.cli import cli
from kvctl.sim.fleet import simulate_fleet
from kvctl.sim.simulate import SimConfig, simulate
from kvctl.sim.workload import Workload, poisson_workload
from kvctl.sim.variability import Variability, Z99, build, readers_gain_from_bench, t0_from_run

GB_PROMPT = ["--prompt-tokens", "1000", "--bytes-per-token", "1e6", "--prefill-rate", "1e9", "--t0", "0"]


def bench_file(path, runs):
    path.write_text(json.dumps({"metadata": {}, "runs": [{"op": "get", **r} for r in runs]}))
    return str(path)


# --- queueing theory: the tier as an M/G/1 queue fed by every engine ----------------------------------------


@pytest.mark.parametrize("dist,sigma,expected", [
    # service S = 1 s per prompt on 2 instances × 0.5 GB/s; ρ = Σλ·E[S] = 4 engines × 0.125/s × 1 s = 0.5
    ("fixed", 0.0, 0.5),  # M/D/1: Wq = ρ·S / (2(1 − ρ)) = 0.5 / 1 = 0.5 s
    ("exponential", 0.0, 1.0),  # M/M/1: Wq = ρ·S / (1 − ρ) = 1.0 s
    # M/G/1, lognormal multiplier X (mean 1, σ 0.5): E[S²] = e^{σ²} = 1.2840; Pollaczek–Khinchine
    # Wq = λ·E[S²] / (2(1 − ρ)) = 0.5 × 1.2840 / 1 = 0.6420 s
    ("fixed", 0.5, 0.5 * math.exp(0.25)),
])
def test_fleet_tier_waits_match_queueing_theory(dist, sigma, expected):
    """Async loading with no timeout: prefetches are issued on arrival, so the tier is exactly an M/G/1
    queue whatever the engines do, and the engines never wait (a full hit has no tail to compute).

    400 000 requests with seed 7: the batch-means standard error of the mean wait is under 1 % at
    ρ = 0.5 for these three queues, so 4 % is a tolerance of more than four standard errors.
    """
    w = poisson_workload(4 * 0.125, 400_000, 1000, dist, seed=7)
    cfg = SimConfig(bytes_per_token=1e6, prefill_rate=1e9, t0_s=0.0, instances=2, loading="async", async_timeout_s=1e9)
    res = simulate_fleet(w, cfg, bandwidth_gbps=2 * 0.5, engines=4, var=Variability(get_sigma=sigma))
    assert res.mean_wait_s == pytest.approx(expected, rel=0.04)
    assert res.tier_rho == pytest.approx(0.5, rel=0.02)  # per instance: the four engines' loads summed
    assert res.timeouts == 0
    assert len(res.per_engine) == 4
    for e in res.per_engine:  # each engine sees about a quarter of the requests and the same tier
        assert e.requests == pytest.approx(100_000, rel=0.02)
        assert e.mean_s == pytest.approx(expected + 1.0, rel=0.05)


def test_rho_per_instance_is_summed_over_engines():
    # 3 engines at λ = 0.2/s each, 1 GB prompts on 4 instances × 1 GB/s: each instance carries 0.25 GB per
    # request at 1 GB/s = 0.25 s, from all 3 × 0.2 = 0.6 req/s → ρ = 0.6 × 0.25 = 0.15 per instance.
    # One engine alone: λ·n·s/B = 0.2 × 1 GB / 4 GB/s = 0.05 (the engine's own, sync: transfer holds it).
    w = poisson_workload(3 * 0.2, 60_000, 1000, seed=3)
    res = simulate_fleet(w, SimConfig(1e6, 1e9, 0.0, instances=4), 4.0, engines=3)
    assert res.tier_rho == pytest.approx(0.15, rel=0.02)
    for e in res.per_engine:
        assert e.rho == pytest.approx(0.05, rel=0.03)


def test_one_engine_no_variability_is_simulate():
    w = poisson_workload(0.6, 20_000, 1000, "exponential", seed=2)
    for loading in ("sync", "async"):
        cfg = SimConfig(1e6, 2000.0, 0.3, 1, 1.5, loading, hit_fraction=0.7, async_timeout_s=2.0)
        a, b = simulate(w, cfg, 1.5), simulate_fleet(w, cfg, 1.5)
        assert (a.p50_s, a.p99_s, a.max_s, a.mean_wait_s, a.rho, a.timeouts) == (b.p50_s, b.p99_s, b.max_s, b.mean_wait_s, b.rho, b.timeouts)
        assert a.by_class == b.by_class and a.by_class["hit"]["requests"] == a.hits


# --- hand-worked fleets ------------------------------------------------------------------------------------


def hand(arrivals, engines_of, tokens=1000.0):
    a = np.array(arrivals, dtype=float)
    return Workload(a, np.full(len(a), tokens), None, "hand"), np.array(engines_of)


def test_sync_engines_queue_on_the_shared_tier_by_hand():
    # 1 GB prompts, 1 GB/s, all hits, T0 0. e0: t=0 issues at 0, tier 0–1, done 1.
    # e1: t=0.1 issues at 0.1, waits for the tier until 1, 1–2: latency 1.9.
    # e0: t=0.2 waits for its engine (busy to 1), issues at 1, tier busy to 2, 2–3: latency 2.8.
    w, eng = hand([0.0, 0.1, 0.2], [0, 1, 0])
    res = simulate_fleet(w, SimConfig(1e6, 1e9, 0.0), 1.0, engines=2, engine_of=eng)
    assert res.max_s == pytest.approx(2.8)
    assert [e.max_s for e in res.per_engine] == pytest.approx([2.8, 1.9])
    assert res.mean_s == pytest.approx((1 + 1.9 + 2.8) / 3)
    assert res.mean_wait_s == pytest.approx((0 + 0.9 + (0.8 + 1.0)) / 3)  # e0's second: 0.8 engine + 1.0 tier


def test_throughput_grows_with_concurrent_readers_by_hand():
    # two engines, both arrive at 0; g(1) = 1, g(2) = 2: the first load is alone (1 s, done at 1); the second
    # finds one load in the tier, k = 2, is served at 2 GB/s once the first is done: 1–1.5.
    w, eng = hand([0.0, 0.0], [0, 1])
    res = simulate_fleet(w, SimConfig(1e6, 1e9, 0.0), 1.0, engines=2, var=Variability(readers_gain={1: 1.0, 2: 2.0}), engine_of=eng)
    assert sorted(e.max_s for e in res.per_engine) == pytest.approx([1.0, 1.5])
    assert res.extrapolated == ()
    # a third engine: k = 3 is past the 2 readers measured: held at 2×, and said
    w, eng = hand([0.0, 0.0, 0.0], [0, 1, 2])
    res = simulate_fleet(w, SimConfig(1e6, 1e9, 0.0), 1.0, engines=3, var=Variability(readers_gain={1: 1.0, 2: 2.0}), engine_of=eng)
    assert sorted(e.max_s for e in res.per_engine) == pytest.approx([1.0, 1.5, 2.0])
    assert "beyond the 2 measured" in res.extrapolated[0]


def test_abandoned_load_keeps_the_tier_busy_and_recomputes_on_its_engine():
    # async, timeout 1 s, R = 2000 tok/s (a 1000-token recompute is 0.5 s), overhead 0.05 s.
    # r0 (t=0, 1 GB): tier 0–1, loaded at 1 ≤ 1 → served, latency 1 + 0.05.
    # r1 (t=0, 1 GB): tier 1–2, past the timeout at 1 → recomputed on engine 0 from 1: 1–1.5, latency 1.55;
    #   its load still runs to 2.
    # r2 (t=1.2, 0.1 GB on engine 1): the tier is busy with r1's abandoned load until 2 → 2–2.1, 0.9 ≤ 1 →
    #   served, latency 0.9 + 0.05 (0.1 + 0.05 if the abandoned load had freed the tier).
    a = np.array([0.0, 0.0, 1.2])
    w = Workload(a, np.array([1000.0, 1000.0, 100.0]), None, "hand")
    var = Variability(async_overhead_s=0.05)
    res = simulate_fleet(w, SimConfig(1e6, 2000.0, 0.0, loading="async", async_timeout_s=1.0), 1.0, engines=2, var=var,
                         engine_of=np.array([0, 0, 1]))
    assert res.timeouts == 1
    assert res.per_engine[0].max_s == pytest.approx(1.55)
    assert res.per_engine[1].max_s == pytest.approx(0.95)
    # GPU busy: engine 0 computed r1's 0.5 s over the run's span 0 → 2.1 s (r2 finishes at 2.1)
    assert res.per_engine[0].gpu_utilization_pct == pytest.approx(100 * 0.5 / 2.1)
    assert res.per_engine[1].gpu_utilization_pct == 0.0


def test_sync_load_holds_the_engine_but_not_its_gpu():
    # one engine, misses only: 4 requests at 0, 10, 20, 30 of 1000 tokens at R = 1000 tok/s → 1 s of compute
    # each; span 0 → 31 s: GPU busy 4/31. Hits at 1 GB/s: the engine is held 1 s each, the GPU 0.
    w = Workload(np.array([0.0, 10, 20, 30]), np.full(4, 1000.0), 0.1, "hand")
    miss = simulate_fleet(w, SimConfig(1e6, 1000.0, 0.0, hit_fraction=0.0), 1.0, var=Variability(async_overhead_s=0.0))
    assert miss.gpu_utilization_pct == pytest.approx(100 * 4 / 31)
    hit = simulate_fleet(w, SimConfig(1e6, 1000.0, 0.0, hit_fraction=1.0), 1.0, engines=2)
    assert hit.gpu_utilization_pct == 0.0


@pytest.mark.parametrize("gain", [None, {1: 1.0, 2: 1.1, 4: 1.15}])
def test_blocked_fixed_point_equals_the_event_loop(gain, monkeypatch):
    """The vectorised sync solver against the one-request-at-a-time loop, across many blocks."""
    monkeypatch.setattr(fleet, "BLOCK", 256)
    w = poisson_workload(8 * 1.2, 6000, 1000, "exponential", seed=5)
    n = len(w.arrival_s)
    rng = np.random.default_rng(1)
    hit = rng.random(n) < 0.8
    eng = rng.integers(0, 8, n)
    transfer = w.tokens * 1e6 / 12e9 * np.exp(0.4 * rng.standard_normal(n))
    tail, prefill = np.where(hit, 0.01, 0.0), w.tokens / 50_000
    gtab = fleet._gain_table(gain, 8) if gain else None
    a = fleet._sync(w.arrival_s, eng, hit, transfer, tail, prefill, gtab, 8)
    b = fleet._sync_event_loop(w.arrival_s, hit, transfer, tail, prefill, gtab, [np.flatnonzero(eng == e) for e in range(8)])
    assert a[4].startswith("fixed point")
    for x, y in zip(a[:3], b[:3]):
        assert np.abs(x - y).max() < 1e-9
    assert (a[3] is None and b[3] is None) or np.array_equal(a[3], b[3])


# --- fitted inputs -----------------------------------------------------------------------------------------


def test_get_spread_from_bench_p50_p99(tmp_path):
    # p99/p50 = 3 → σ = ln 3 / z99 = 1.0986 / 2.3263 = 0.4723
    path = bench_file(tmp_path / "b.json", [{"instances": 1, "clients": 1, "aggregate_gbps": 1.0, "p50_batch_ms": 10.0, "p99_batch_ms": 30.0}])
    var = build(get_times_from=path)
    assert var.get_sigma == pytest.approx(math.log(3) / Z99)
    assert var.get_sigma == pytest.approx(0.4723, abs=1e-4)


def test_readers_curve_from_a_sweep(tmp_path):
    path = bench_file(tmp_path / "s.json", [
        {"instances": 1, "clients": 1, "aggregate_gbps": 1.0}, {"instances": 1, "clients": 2, "aggregate_gbps": 1.1},
        {"instances": 1, "clients": 4, "aggregate_gbps": 1.13}, {"instances": 2, "clients": 1, "aggregate_gbps": 2.0}])
    gain, _ = readers_gain_from_bench(path)
    assert gain == pytest.approx({1: 1.0, 2: 1.1, 4: 1.13})


def test_t0_fitted_from_a_run_file(tmp_path):
    # every hit: TTFT 1.4 s (sent 0.1 → first token 1.5), 1000 cached of 1000 tokens at 1 GB/s = 1 s of
    # transfer → T0 = 0.4; one with 500 cached: TTFT 1.2 = 0.5 s transfer + 500/1000 s recompute + T0 0.2.
    rows = [{"scheduled_s": 0, "sent_s": 0.1, "first_token_s": 1.5, "finished_s": 1.5, "latency_s": 1.5, "prompt_tokens": 1000,
             "cached_tokens": 1000, "status": "ok", "in_flight": 1}] * 12
    rows.append({"scheduled_s": 0, "sent_s": 0.0, "first_token_s": 1.2, "finished_s": 1.2, "latency_s": 1.2, "prompt_tokens": 1000,
                 "cached_tokens": 500, "status": "ok", "in_flight": 1})
    rows.append({"scheduled_s": 0, "sent_s": 0.0, "first_token_s": 0.5, "finished_s": 0.5, "latency_s": 0.5, "prompt_tokens": 1000,
                 "cached_tokens": 0, "status": "ok", "in_flight": 1})  # a miss: not a T0 sample
    rows = [{"index": i, **r} for i, r in enumerate(rows)]  # each row names its request, once (issue 44)
    p = tmp_path / "run.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in [{"metadata": {}}, *rows, {"summary": {}}]) + "\n")
    t0, note = t0_from_run(str(p), 1e6, 1.0, 1000.0)
    assert sorted(t0) == pytest.approx([0.2] + [0.4] * 12)
    assert "13 hits" in note
    # simulated hits of prompts of 800 and 2000 tokens lie outside the prompts of 1000 T0 was fitted on: said (prompts on
    # both sides, issue 48: a run's hits cache whole chunks, 4,096 of 4,160 tokens, where the model loads the prompt)
    var = build(fit_from=str(p), bytes_per_token=1e6, prefill_rate=1000.0, fit_gbps=1.0)
    assert var.t0_fit_hit_tokens == (1000.0, 1000.0)
    w = Workload(np.array([0.0, 10.0]), np.array([2000.0, 800.0]), 0.1, "hand")
    res = simulate_fleet(w, SimConfig(1e6, 1000.0, 0.0), 1.0, var=var)
    assert any("fitted on hits of prompts of 1,000–1,000 tokens; simulated hits' prompts span 800–2,000" in x for x in res.extrapolated)
    inside = simulate_fleet(Workload(np.array([0.0]), np.array([1000.0]), 0.1, "hand"), SimConfig(1e6, 1000.0, 0.0), 1.0, var=var)
    assert inside.extrapolated == ()


# --- CLI ---------------------------------------------------------------------------------------------------


def test_cli_engines_json_has_fleet_and_engines(tmp_path):
    b = bench_file(tmp_path / "b.json", [{"instances": 1, "clients": 1, "aggregate_gbps": 1.0, "p50_batch_ms": 10.0, "p99_batch_ms": 20.0},
                                          {"instances": 1, "clients": 2, "aggregate_gbps": 1.2}])
    r = CliRunner().invoke(cli, ["simulate", "--arrival-rate", "0.1", *GB_PROMPT, "--instances", "2", "--instance-gbps", "1", "--engines", "3",
                                 "--requests", "3000", "--bench", b, "--json"])  # B from --instance-gbps, the spread and readers from b
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert len(d["per_engine"]) == 3 and d["engines"] == 3
    # λ 0.1/s per engine × 3 engines × 0.5 GB per instance / 1 GB/s = 0.15 per instance
    assert d["tier_rho"] == pytest.approx(0.15, rel=0.05)
    assert "gpu_utilization_pct" in d and d["stable"] is True
    assert any("lognormal" in n for n in d["notes"])
    assert d["extrapolated"]  # three engines read at once, two readers measured


def test_cli_engines_table():
    r = CliRunner().invoke(cli, ["simulate", "--arrival-rate", "0.1", *GB_PROMPT, "--instance-gbps", "1", "--engines", "2", "--requests", "500"])
    assert r.exit_code == 0, r.output
    heading = next(ln for ln in r.output.splitlines() if ln.startswith("┃"))
    assert "fleet" in r.output and "engine ρ" in heading and "tier ρ" in heading  # issue 48: each ρ a column of its own


@pytest.mark.parametrize("args,message", [
    (["--engines", "0"], "--engines"),
    (["--bench", "/nonexistent.json"], "--bench /nonexistent.json"),
    (["--async-overhead", "-1"], "--async-overhead"),
])
def test_cli_fleet_bad_input(args, message):
    r = CliRunner().invoke(cli, ["simulate", "--arrival-rate", "0.1", *GB_PROMPT, "--instance-gbps", "1", *args])
    assert r.exit_code == 2, r.output
    assert message in r.output


def test_a_fleet_result_is_a_sim_result_with_the_fleets_fields():
    """Issue 32 item 5: FleetResult reuses SimResult's fields (one definition of p50_s … gpu_utilization_pct)."""
    import dataclasses  # noqa: PLC0415

    from kvctl.sim.fleet import FleetResult  # noqa: PLC0415
    from kvctl.sim.simulate import SimResult  # noqa: PLC0415

    assert issubclass(FleetResult, SimResult)
    own = [f.name for f in dataclasses.fields(FleetResult)][len(dataclasses.fields(SimResult)):]
    assert own == ["engines", "per_engine", "extrapolated", "notes", "solver"]
    assert FleetResult.__dataclass_params__.frozen
