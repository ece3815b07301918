"""``--t0-engine-share``: the share θ of T0 that holds the engine, by hand, by queueing theory, and fitted.

Units as in test_fleet: 1000 tokens × 1e6 B/token = 1 GB per prompt, 1 s on 1 GB/s.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from kvctl.sim.calibrate import fit_engine_share, measured_percentiles
from kvctl.cli import cli
from kvctl.core.errors import InvalidInput
from kvctl.sim.fleet import simulate_fleet
from kvctl.sim.simulate import SimConfig, simulate
from kvctl.sim.workload import Workload, poisson_workload
from kvctl.sim.variability import Variability, t0_from_run


def two_hits() -> Workload:
    return Workload(np.array([0.0, 0.1]), np.full(2, 1000.0), None, "hand")


@pytest.mark.parametrize("theta,latencies", [
    # hit 1: engine held 1 s (+θ·0.5), hit 2 waits for it, then the same; the rest of T0 is latency only
    (0.0, [1.5, 2.4]),  # hold 1.0: 0–1 (+0.5 late) | 1–2 (+0.5) − 0.1
    (0.5, [1.5, 2.65]),  # hold 1.25: 0–1.25 (+0.25) | 1.25–2.5 (+0.25) − 0.1
    (1.0, [1.5, 2.9]),  # hold 1.5: 0–1.5 | 1.5–3.0 − 0.1
])
def test_engine_share_by_hand_closed_form_and_fleet_agree(theta, latencies):
    cfg = SimConfig(1e6, 1e9, 0.5, t0_engine_share=theta)
    plain = simulate(two_hits(), cfg, 1.0)
    fleet = simulate_fleet(two_hits(), cfg, 1.0)
    assert plain.max_s == pytest.approx(latencies[1]) and plain.mean_s == pytest.approx(sum(latencies) / 2)
    assert fleet.max_s == pytest.approx(latencies[1]) and fleet.mean_s == pytest.approx(sum(latencies) / 2)
    assert fleet.gpu_utilization_pct == pytest.approx(0.0, abs=1e-4)  # T0 on the engine is not compute


def test_engine_share_md1_wait():
    # M/D/1 with S = 1 s transfer + θ·T0 = 0.5 s: ρ = 0.4 × 1.5 = 0.6, Wq = ρ·S / (2(1 − ρ)) = 0.9 / 0.8 = 1.125 s
    w = poisson_workload(0.4, 200_000, 1000.0, "fixed", 7)
    res = simulate_fleet(w, SimConfig(1e6, 1e9, 0.5, t0_engine_share=1.0), 1.0)
    assert res.rho == pytest.approx(0.6, rel=0.02)
    assert res.mean_wait_s == pytest.approx(1.125, rel=0.05)
    paper = simulate_fleet(w, SimConfig(1e6, 1e9, 0.5), 1.0)  # θ = 0: ρ = 0.4, Wq = 0.4 / 1.2 = 0.333 s
    assert paper.mean_wait_s == pytest.approx(1 / 3, rel=0.05)


def test_engine_share_async_holds_the_engine_after_the_load():
    # async, one hit: loaded at 1.0, then the engine is held θ·T0 = 0.5 (tail 0): done 1.5 either way;
    # a miss arriving at 1.2 waits for that 0.5 only when θ = 1: 1.5 + 1000/1000 → latency 1.3 against 1.0
    w = Workload(np.array([0.0, 1.2]), np.full(2, 1000.0), None, "hand", hit_tokens=np.array([1000.0, 0.0]))
    for theta, miss_latency in ((0.0, 1.0), (1.0, 1.3)):
        cfg = SimConfig(1e6, 1000.0, 0.5, loading="async", async_timeout_s=10.0, hits_from_trace=True, t0_engine_share=theta)
        res = simulate_fleet(w, cfg, 1.0)
        assert res.max_s == pytest.approx(max(1.5, miss_latency))
        assert res.mean_s == pytest.approx((1.5 + miss_latency) / 2)


def test_engine_share_out_of_range_is_refused():
    with pytest.raises(InvalidInput, match="t0-engine-share"):
        simulate(two_hits(), SimConfig(1e6, 1e9, 0.5, t0_engine_share=1.5), 1.0)


# --- fitted on a run file ----------------------------------------------------------------------------------------


def run_file(path, theta: float, t0: float = 0.5, alone: int = 0, burst: int = 14, gap: float = 0.1,
             metadata: dict | None = None, first_extra_s: float = 0.0):
    """A run of 1 GB hits on 1 GB/s with a constant T0, latencies worked out by hand for ``theta``:
    ``alone`` hits 10 s apart, then a burst of ``burst`` hits ``gap`` s apart. The engine is held
    1 + θ·T0 per hit (FIFO), the rest of T0 is latency; the first hit takes ``first_extra_s`` more (latency only)."""
    hold = 1.0 + theta * t0
    arrivals = [10.0 * i for i in range(alone)] + [10.0 * alone + gap * i for i in range(burst)]
    rows, free, finished = [], 0.0, []
    for i, arrival in enumerate(arrivals):
        start = max(free, arrival)
        free = start + hold
        latency = free + (1 - theta) * t0 - arrival + (first_extra_s if i == 0 else 0.0)
        in_flight = 1 + sum(1 for f in finished if f > arrival)
        finished.append(arrival + latency)
        rows.append({"index": i, "scheduled_s": arrival, "sent_s": arrival, "first_token_s": arrival + latency,
                     "finished_s": arrival + latency, "latency_s": latency, "prompt_tokens": 1000, "cached_tokens": 1000,
                     "status": "ok", "in_flight": in_flight,
                     "request": {"timestamp": arrival * 1000, "input_length": 1000, "output_length": 1, "hash_ids": [i]}})
    path.write_text("\n".join(json.dumps(x) for x in [{"metadata": metadata or {}}, *rows, {"summary": {}}]) + "\n")
    return str(path)


@pytest.mark.parametrize("theta", [0.0, 0.5, 1.0])
def test_fit_recovers_the_share_a_burst_shows(tmp_path, theta):
    path = run_file(tmp_path / "run.jsonl", theta)
    fit = fit_engine_share(path, SimConfig(1e6, 1e9, 0.5), 1.0, Variability(t0_samples_s=(0.5,)))
    assert fit.theta == pytest.approx(theta)
    assert fit.error == pytest.approx(0.0, abs=1e-6)
    assert len(fit.tried) == 11 and "barely queued" not in fit.note


def test_fit_on_a_run_without_queueing_says_so(tmp_path):
    path = run_file(tmp_path / "run.jsonl", 1.0, alone=12, burst=0)  # each hit alone: every θ gives the same latencies
    fit = fit_engine_share(path, SimConfig(1e6, 1e9, 0.5), 1.0, Variability(t0_samples_s=(0.5,)))
    assert "barely queued" in fit.note


def test_fit_on_too_few_requests_is_refused(tmp_path):
    path = run_file(tmp_path / "run.jsonl", 1.0, burst=5)
    with pytest.raises(InvalidInput, match="5 successful requests; fitting --t0-engine-share needs at least 10"):
        fit_engine_share(path, SimConfig(1e6, 1e9, 0.5), 1.0, Variability(t0_samples_s=(0.5,)))


def test_cli_fit_and_refusals(tmp_path):
    # 12 hits alone (T0 = 0.5 is fitted on these; the burst's first was sent alone but the second came 0.1 s
    # later, before its first token), then the burst that shows θ
    run = run_file(tmp_path / "run.jsonl", 1.0, alone=12)
    model = ["simulate", "--trace", run, "--hits-from-trace", "--bytes-per-token", "1e6", "--prefill-rate", "1e9", "--instance-gbps", "1"]
    base = [*model, "--t0", "0.5"]
    r = CliRunner().invoke(cli, [*model, "--fit-from", run, "--t0-engine-share", "fit", "--json"])  # T0 from the run (no --t0)
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert any("T0 from 12 hits" in n and "alone in flight" in n and "p50 0.500 s" in n for n in d["notes"])
    assert any("T0 engine share θ = 1 fitted on 26 requests" in n for n in d["notes"])
    assert d["max_s"] == pytest.approx(14 * 1.5 - 13 * 0.1)  # the burst reproduced: the last hit's latency
    r = CliRunner().invoke(cli, [*base, "--t0-engine-share", "fit"])
    assert r.exit_code == 2 and "needs --fit-from" in r.output
    r = CliRunner().invoke(cli, [*base, "--t0-engine-share", "1.5"])
    assert r.exit_code == 2 and "--t0-engine-share" in r.output
    r = CliRunner().invoke(cli, [*base, "--t0-engine-share", "1", "--json"])  # given, not fitted: the same burst
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["max_s"] == pytest.approx(14 * 1.5 - 13 * 0.1)


def test_a_hit_sent_alone_but_overtaken_is_not_a_t0_sample(tmp_path):
    """A hit sent with nobody in flight (in_flight 1) that a later request then overlapped waited for it: T0 is fitted
    on hits nobody overlapped between their sending and their first token (the H200's calibration of 2026-12-02
    had one such hit at 1.1 s among 0.32-0.38 s ones)."""
    run = run_file(tmp_path / "run.jsonl", 1.0, alone=12, burst=3)
    t0, note = t0_from_run(run, 1e6, 1.0, 1e9)
    assert t0 == pytest.approx((0.5,) * 12) and "12 hits" in note and "alone in flight" in note
    rows = [json.loads(x) for x in open(run)][1:-1]
    burst_first = rows[12]
    assert burst_first["in_flight"] == 1 and burst_first["latency_s"] == pytest.approx(1.5)  # sent alone, yet left out
    few = run_file(tmp_path / "few.jsonl", 1.0, alone=3, burst=14)  # 3 alone < 10: every hit, and the note says so
    t0, note = t0_from_run(few, 1e6, 1.0, 1e9)
    assert len(t0) == 17 and "fewer than 10 alone in flight" in note


@pytest.mark.parametrize("before,left_out", [(0, True), (4096, False), (None, False)])
def test_the_engines_first_external_hit_is_left_out(tmp_path, before, left_out):
    """A run that holds its engine's first external-cache hit (vllm:external_prefix_cache_hits 0 before it): that hit's
    one-time setup (1 s extra here; 0.4-1 s on the H200) is neither a T0 sample nor in the percentiles θ is fitted to.
    An engine that had served hits before (or a run file without the counter) keeps every row."""
    meta = {} if before is None else {"metrics_before": {"vllm:external_prefix_cache_hits_total": before}}
    run = run_file(tmp_path / "run.jsonl", 1.0, alone=13, burst=14, metadata=meta, first_extra_s=1.0)
    t0, note = t0_from_run(run, 1e6, 1.0, 1e9)
    if left_out:
        assert t0 == pytest.approx((0.5,) * 12) and "left out its first hit" in note and "2.500 s" in note
    else:
        assert sorted(t0) == pytest.approx([0.5] * 12 + [1.5]) and "left out" not in note
    measured, rows = measured_percentiles(run)
    assert rows == (26 if left_out else 27)
    fit = fit_engine_share(run, SimConfig(1e6, 1e9, 0.5), 1.0, Variability(t0_samples_s=t0))
    # the run was made at θ = 1: found when the first hit is left out; kept, its 1.5 s T0 sample pulls θ off it
    assert (fit.theta == pytest.approx(1.0)) is left_out


def test_fit_loading_fits_theta_as_the_run_loaded(tmp_path):
    """--fit-loading: θ is fitted by replaying the --fit-from run as it ran (here sync, θ = 1), whatever --loading the
    prediction is for; fitted at --loading async instead, the same run gives another θ."""
    run = run_file(tmp_path / "run.jsonl", 1.0, alone=12)
    base = ["simulate", "--trace", run, "--hits-from-trace", "--bytes-per-token", "1e6", "--prefill-rate", "1e9", "--t0", "0.5",
            "--instance-gbps", "1", "--loading", "async", "--async-timeout", "1000", "--json"]
    r = CliRunner().invoke(cli, [*base, "--fit-from", run, "--fit-loading", "sync", "--t0-engine-share", "fit"])
    assert r.exit_code == 0, r.output
    fitted = json.loads(r.output)
    assert fitted["loading"] == "async" and any("θ = 1 fitted" in n for n in fitted["notes"])
    r = CliRunner().invoke(cli, [*base, "--fit-from", run, "--t0-engine-share", "1"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["p99_s"] == pytest.approx(fitted["p99_s"])  # the same model as θ = 1 given
    r = CliRunner().invoke(cli, [*base, "--fit-from", run, "--t0-engine-share", "fit"])  # fitted as async
    assert r.exit_code == 0, r.output
    assert not any("θ = 1 fitted" in n for n in json.loads(r.output)["notes"])
    r = CliRunner().invoke(cli, [*base, "--fit-loading", "sync"])
    assert r.exit_code == 2 and "--fit-loading says how the --fit-from run loaded" in r.output


# --- --max-batch: an engine admits several waiting requests into one step ------------------------------------


def test_batch_fifo_by_hand():
    from kvctl.sim.simulate import batch_fifo, fifo

    # holds 1 s; arrivals 0, 0.1, 0.2, 0.3, 5. M = 2: step 1 is request 0 alone (0–1: nothing else had
    # arrived at 0); at 1, requests 1 and 2 wait: one step 1–3; request 3 then alone 3–4; request 4 at 5–6.
    a, h = np.array([0.0, 0.1, 0.2, 0.3, 5.0]), np.ones(5)
    start, finish = batch_fifo(a, h, 2)
    assert start.tolist() == [0.0, 1.0, 1.0, 3.0, 5.0]
    assert finish.tolist() == [1.0, 3.0, 3.0, 4.0, 6.0]
    # M = 4: 1, 2, 3 in one step 1–4
    assert batch_fifo(a, h, 4)[1].tolist() == [1.0, 4.0, 4.0, 4.0, 6.0]
    # M = 1 is the FIFO queue
    rng = np.random.default_rng(3)
    a = np.cumsum(rng.exponential(1.0, 500))
    h = rng.exponential(0.8, 500)
    for x, y in zip(batch_fifo(a, h, 1), fifo(a, h)):
        assert np.allclose(x, y)


def test_batches_in_the_fleet_solver_match_the_one_engine_queue_and_a_hand_worked_pair():
    # one engine: the event loop (readers curve on, so the fleet path is taken) and batch_fifo agree
    w = poisson_workload(0.8, 3000, 1000.0, "exponential", 5)
    cfg = SimConfig(1e6, 2000.0, 0.3, hit_fraction=0.7, t0_engine_share=0.5, max_batch=4)
    plain = simulate(w, cfg, 1.0)
    flat_gain = Variability(readers_gain={1: 1.0, 2: 1.0})  # g(k) = 1: the same tier, solved by the event loop
    fleet = simulate_fleet(w, cfg, 1.0, var=flat_gain)
    assert fleet.solver == "event loop"
    assert fleet.mean_s == pytest.approx(plain.mean_s) and fleet.p99_s == pytest.approx(plain.p99_s)
    assert fleet.max_queue == plain.max_queue
    # two engines share the tier, M = 2, 1 GB hits on 1 GB/s, T0 0: e0 gets requests at 0 and 0.1, e1 at 0.05.
    # e0 step 0: request 0 alone, tier 0–1, done 1. e1 step at 0.05: its load waits for the tier, 1–2, done 2.
    # e0 step at 1: request 1 (arrived 0.1), tier 2–3, done 3: latency 2.9
    w2 = Workload(np.array([0.0, 0.05, 0.1]), np.full(3, 1000.0), None, "hand")
    res = simulate_fleet(w2, SimConfig(1e6, 1e9, 0.0, max_batch=2), 1.0, engines=2, engine_of=np.array([0, 1, 0]))
    assert [e.max_s for e in res.per_engine] == pytest.approx([2.9, 1.95])
    # e0's two requests arriving together: one step, loads 0–1 and 1–2, both done at 2; e1's load waits, 2–3
    w3 = Workload(np.array([0.0, 0.0, 0.05]), np.full(3, 1000.0), None, "hand")
    res = simulate_fleet(w3, SimConfig(1e6, 1e9, 0.0, max_batch=2), 1.0, engines=2, engine_of=np.array([0, 0, 1]))
    assert [e.max_s for e in res.per_engine] == pytest.approx([2.0, 2.95])
    assert [e.mean_s for e in res.per_engine] == pytest.approx([2.0, 2.95])  # both of e0's finish at its step's end


def test_cli_max_batch():
    args = ["simulate", "--arrival-rate", "0.9", "--prompt-tokens", "1000", "--bytes-per-token", "1e6", "--prefill-rate", "1e9", "--t0", "0",
            "--instance-gbps", "1", "--requests", "5000", "--json"]
    one = json.loads(CliRunner().invoke(cli, args).output)
    four = CliRunner().invoke(cli, [*args, "--max-batch", "4"])
    assert four.exit_code == 0, four.output
    four = json.loads(four.output)
    # ρ 0.9: queues form; steps of several requests finish together, so the mean latency grows
    assert four["mean_s"] > one["mean_s"] and four["rho"] == pytest.approx(one["rho"])
    bad = CliRunner().invoke(cli, [*args, "--max-batch", "0"])
    assert bad.exit_code == 2 and "--max-batch" in bad.output


def test_fit_instances_takes_the_calibration_runs_transfers_out_at_its_own_tier(tmp_path):
    """A calibration run on 1 instance (1 GB hits at 1 GB/s, T0 0.5 s: 1.5 s each), predicting 4 instances. With
    --fit-instances 1 the fit sees the run's own B (T0 = 1.5 − 1.0) and a lone hit at 4 GB/s takes 0.5 + 0.25 s;
    fitted at the predicted tier instead, T0 swallows 0.75 s of the calibration's transfer (1.25 + 0.25 s)."""
    run = run_file(tmp_path / "run.jsonl", 0.0, alone=12, burst=0)
    base = ["simulate", "--trace", run, "--hits-from-trace", "--bytes-per-token", "1e6", "--prefill-rate", "1e9",
            "--instance-gbps", "1", "--instances", "4", "--fit-from", run, "--json"]
    own = CliRunner().invoke(cli, [*base, "--fit-instances", "1"])
    assert own.exit_code == 0, own.output
    assert json.loads(own.output)["p50_s"] == pytest.approx(0.75)
    assert any("p50 0.500 s" in n for n in json.loads(own.output)["notes"])
    same = CliRunner().invoke(cli, base)
    assert same.exit_code == 0, same.output
    assert json.loads(same.output)["p50_s"] == pytest.approx(1.5)
    r = CliRunner().invoke(cli, [*base[:-3], "--fit-instances", "1"])  # without --fit-from
    assert r.exit_code == 2 and "--fit-instances says what tier the --fit-from run had" in r.output
