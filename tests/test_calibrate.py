"""``--t0-engine-share``: the share θ of T0 that holds the engine, by hand, by queueing theory, and fitted.

Units as in test_fleet: 1000 tokens × 1e6 B/token = 1 GB per prompt, 1 s on 1 GB/s.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from kvctl.calibrate import fit_engine_share
from kvctl.cli import cli
from kvctl.errors import InvalidInput
from kvctl.fleet import simulate_fleet
from kvctl.simulate import SimConfig, Workload, poisson_workload, simulate
from kvctl.variability import Variability


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
    assert fleet.gpu_busy_frac == pytest.approx(0.0, abs=1e-6)  # T0 on the engine is not compute


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


def run_file(path, theta: float, t0: float = 0.5, alone: int = 0, burst: int = 14, gap: float = 0.1):
    """A run of 1 GB hits on 1 GB/s with a constant T0, latencies worked out by hand for ``theta``:
    ``alone`` hits 10 s apart, then a burst of ``burst`` hits ``gap`` s apart. The engine is held
    1 + θ·T0 per hit (FIFO), the rest of T0 is latency."""
    hold = 1.0 + theta * t0
    arrivals = [10.0 * i for i in range(alone)] + [10.0 * alone + gap * i for i in range(burst)]
    rows, free, finished = [], 0.0, []
    for i, arrival in enumerate(arrivals):
        start = max(free, arrival)
        free = start + hold
        latency = free + (1 - theta) * t0 - arrival
        in_flight = 1 + sum(1 for f in finished if f > arrival)
        finished.append(arrival + latency)
        rows.append({"index": i, "scheduled_s": arrival, "sent_s": arrival, "first_token_s": arrival + latency,
                     "finished_s": arrival + latency, "latency_s": latency, "prompt_tokens": 1000, "cached_tokens": 1000,
                     "status": "ok", "in_flight": in_flight,
                     "request": {"timestamp": arrival * 1000, "input_length": 1000, "output_length": 1, "hash_ids": [i]}})
    path.write_text("\n".join(json.dumps(x) for x in [{"metadata": {}}, *rows, {"summary": {}}]) + "\n")
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


def test_cli_fit_and_refusals(tmp_path):
    # 12 hits alone and the burst's first (T0 = 0.5 is fitted on these 13), then the burst that shows θ
    run = run_file(tmp_path / "run.jsonl", 1.0, alone=12)
    base = ["simulate", "--trace", run, "--hits-from-trace", "--bytes-per-token", "1e6", "--prefill-rate", "1e9", "--t0", "0.5",
            "--instance-gbps", "1"]
    r = CliRunner().invoke(cli, [*base, "--fit-from", run, "--t0-engine-share", "fit", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert any("T0 from 13 hits" in n and "p50 0.500 s" in n for n in d["notes"])
    assert any("T0 engine share θ = 1 fitted on 26 requests" in n for n in d["notes"])
    assert d["max_s"] == pytest.approx(14 * 1.5 - 13 * 0.1)  # the burst reproduced: the last hit's latency
    r = CliRunner().invoke(cli, [*base, "--t0-engine-share", "fit"])
    assert r.exit_code == 2 and "needs --fit-from" in r.output
    r = CliRunner().invoke(cli, [*base, "--t0-engine-share", "1.5"])
    assert r.exit_code == 2 and "--t0-engine-share" in r.output
    r = CliRunner().invoke(cli, [*base, "--t0-engine-share", "1", "--json"])  # given, not fitted: the same burst
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["max_s"] == pytest.approx(14 * 1.5 - 13 * 0.1)
