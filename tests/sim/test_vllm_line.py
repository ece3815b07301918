"""Issue 46, the model: ``kvctl simulate --scheduler vllm`` (kvctl.sim.vllm_line), the engine as vLLM's scheduler runs
it. A hit is decided, and its async load starts, only when the scheduler reaches it in the waiting line; its rest runs
in a step after the load; a load past its budget is given up there. ``--fit-load-spread`` draws each load's GET time
from a connector trace's own loads. Expected numbers are worked out by hand in each test."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.core.errors import InvalidInput
from kvctl.sim.steps import StepCost
from kvctl.sim.variability import fit_loads
from kvctl.sim.vllm_line import LineConfig, run_line

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
EIGHTH_ON = RESULTS / "paper_gpu-h100-2026-12-06h-sat-800-on"

# 1 000 B a token: a 256-token chunk is 256 kB, 0.1 s at 2.56 MB/s; R 1 000 tokens/s; T0 10 ms
CFG = LineConfig(prefill_rate=1000.0, tier_bps=2.56e6, t0_s=0.01, budget=1000, chunk_tokens=256, bytes_per_token=1000.0,
                 rule="off")


def test_a_lone_hit_loads_then_its_rest_takes_a_step():
    """Idle engine, no lag: 3 chunks load in 0.01 + 0.3 s, then the 256-token rest in a step of 0.02 + 0.256 s."""
    cfg = LineConfig(**{**CFG.__dict__, "cost": StepCost(step_s=0.02)})
    out = run_line(np.array([0.0]), np.array([1024]), np.array([768]), cfg)
    assert out.done[0] == pytest.approx(0.31 + 0.276) and out.loaded[0] == 768 and not out.given_up[0]
    assert out.busy_s == pytest.approx(0.276) and out.loaded_bytes == 768_000


def test_the_load_starts_only_when_the_scheduler_reaches_the_hit():
    """Two 1 000-token misses and a hit arrive at 0 with a budget of 1 000 tokens a step: each miss fills a step
    (1 s), so vLLM asks about the hit at 2 s; its load ends at 2.31 s and its rest at 2.566 s. Started on arrival (the
    fifo model) the load would have ended at 0.31 s."""
    out = run_line(np.zeros(3), np.array([1000, 1000, 1024]), np.array([0, 0, 768]), CFG)
    assert out.done.tolist() == pytest.approx([1.0, 2.0, 2.566])
    assert out.compute_s.sum() == pytest.approx(out.busy_s) == pytest.approx(2.256)


def test_a_load_past_its_budget_is_given_up_and_its_prompt_recomputed():
    """The decision on (rule credit): the hit loads (0.31 s predicted against a 0.768 s recompute). Ten times slower
    than predicted, no chunk comes by the budget: the load is given up there and the whole prompt recomputed."""
    cfg = LineConfig(**{**CFG.__dict__, "rule": "credit"})
    fast = run_line(np.array([0.0]), np.array([1024]), np.array([768]), cfg)
    assert fast.loaded[0] == 768 and fast.done[0] == pytest.approx(0.566) and fast.decisions == {"load/wins": 1}
    slow = run_line(np.array([0.0]), np.array([1024]), np.array([768]), cfg, mult=np.array([10.0]))
    assert slow.given_up[0] and slow.loaded[0] == 0 and slow.loaded_bytes == 0
    assert 0.5 < slow.done[0] - 1.024 < 1.0  # its budget (about its recompute time), then the whole prompt


def test_a_slow_tier_recomputes_and_a_fast_one_loads():
    """At 25.6 kB/s a chunk takes 10 s: every hit is recomputed (``recompute/below_breakeven``)."""
    slow = LineConfig(**{**CFG.__dict__, "rule": "credit", "tier_bps": 2.56e4})
    out = run_line(np.array([0.0, 5.0]), np.array([1024, 1024]), np.array([768, 768]), slow)
    assert out.loaded.tolist() == [0, 0] and out.decisions == {"recompute/below_breakeven": 2}
    assert out.done.tolist() == pytest.approx([1.024, 6.024])


def test_the_loaders_spread_comes_from_the_traces_own_loads():
    """The eighth H100 run's 64 loads: most within 2 % of the median's seconds a byte, the slowest about twice."""
    fit = fit_loads(str(EIGHTH_ON / "R5.connector-trace.jsonl"), 4)
    s = np.array(fit.spread)
    assert len(s) == fit.loads == 64 and np.median(s) == pytest.approx(1.0)
    assert np.percentile(s, 90) < 1.03 and 1.8 < s.max() < 2.5 and list(s) == sorted(s)


def simulate(*args: str):
    return CliRunner().invoke(cli, ["simulate", "--arrival-rate", "2", "--prompt-tokens", "16384", "--bytes-per-token",
                                    "31104", "--prefill-rate", "91000", "--t0", "0.005", "--instance-gbps", "1.5",
                                    "--instances", "4", "--requests", "200", "--max-batched-tokens", "16384", "--json", *args])


def test_simulate_runs_vllms_scheduler_and_counts_the_decisions():
    res = simulate("--loading", "async", "--policy", "on", "--scheduler", "vllm", "--step-s", "0.023")
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)
    assert r["solver"] == "vLLM's scheduler, step by step" and sum(r["decisions"].values()) == 200, r
    assert r["hits"] == r["decisions"].get("load/wins", 0) + r["decisions"].get("partial/tier_queue", 0) > 150, r
    off = json.loads(simulate("--loading", "async", "--scheduler", "vllm").stdout)
    assert off["decisions"] is None and off["hits"] == 200


@pytest.mark.parametrize("args, says", [
    (["--loading", "sync", "--scheduler", "vllm"], "--scheduler vllm models async loading"),
    (["--loading", "async", "--scheduler", "vllm", "--engines", "2"], "--scheduler vllm models one engine"),
    (["--loading", "async", "--fit-load-spread"], "--fit-load-spread draws from --fit-loads' trace"),
    (["--loading", "async", "--scheduler", "vllm", "--fit-load-beside"], "--fit-load-beside splits --fit-load-spread's draws"),
    (["--loading", "async", "--fit-load-spread", "--fit-load-beside"], "--fit-load-beside draws by the engine's prefill"),
])
def test_what_the_model_cannot_run_is_one_line(args, says):
    res = simulate(*args)
    assert res.exit_code == 2 and says in res.output and "Traceback" not in res.output, res.output


def test_the_scheduler_is_a_simulate_option_only():
    with pytest.raises(InvalidInput, match="--sched-lag must be 0 or 1"):
        from kvctl.sim.simulate import SimConfig, check_config
        check_config(SimConfig(31104, 91000, loading="async", scheduler="vllm", sched_lag=2), 3.0)
    assert "--scheduler" not in CliRunner().invoke(cli, ["plan", "--help"]).output


def test_a_fitted_t0_distribution_is_said_unused_by_vllms_scheduler():
    """--fit-from's T0 samples are hits' whole fixed latency; the line's T0 is a load's fixed seconds on the tier."""
    from kvctl.sim.fleet import simulate_fleet
    from kvctl.sim.simulate import SimConfig
    from kvctl.sim.variability import Variability
    from kvctl.sim.workload import Workload

    w = Workload(np.array([0.0, 1.0, 2.0]), np.array([1024.0] * 3), 1.0, "three")
    cfg = SimConfig(1000.0, 1000.0, 0.01, loading="async", scheduler="vllm", max_batched_tokens=1000)
    res = simulate_fleet(w, cfg, 0.00256, var=Variability(t0_samples_s=(0.2, 0.3)))
    assert any("--fit-from's T0 distribution is not used" in n for n in res.notes), res.notes
    assert res.p50_s == pytest.approx(0.31 + 0.256)  # each alone: its load, then its 256-token rest


def test_a_load_that_starts_beside_a_big_prefill_takes_the_beside_draw():
    """``mult_beside`` (``--fit-load-beside``): a hit that reaches the scheduler while 8192 or more tokens of prefill
    are scheduled or waiting takes that draw, a lone hit its own. R 100 000 tokens/s: a 10 000-token miss and a hit
    arrive together, the miss's step takes 0.1 s, the hit's 3 chunks 0.01 + 0.3 s alone or 0.01 + 0.6 s at 2x, then
    its 256-token rest (2.56 ms). A lone hit at 20 s, and a hit beside a 512-token miss, keep 1x."""
    cfg = LineConfig(**{**CFG.__dict__, "budget": 20000, "prefill_rate": 100_000.0})
    arrival, tokens, hits = np.array([0.0, 0.0, 20.0]), np.array([10000, 1024, 1024]), np.array([0, 768, 768])
    plain = run_line(arrival, tokens, hits, cfg, mult=np.ones(3))
    beside = run_line(arrival, tokens, hits, cfg, mult=np.ones(3), mult_beside=np.full(3, 2.0))
    assert plain.done.tolist() == pytest.approx([0.1, 0.31256, 20.31256])
    assert beside.done.tolist() == pytest.approx([0.1, 0.61256, 20.31256])
    small = (np.array([0.0, 0.0]), np.array([512, 1024]), np.array([0, 768]))
    assert run_line(*small, cfg, mult=np.ones(2), mult_beside=np.full(2, 2.0)).done[1] == pytest.approx(0.31256)
