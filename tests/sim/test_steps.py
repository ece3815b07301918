"""Issue 46, the model: what an engine step costs besides its tokens (``--step-s``, ``--graph-tokens``,
``--graph-jump-s``, ``--fit-steps``; kvctl.sim.steps). The engine's model pays each step's cost, the decision of
``--policy on`` prices a recompute in steps as the connector does, and ``--fit-steps`` fits the costs from a
connector trace with the connector's own fit. Expected numbers are worked out by hand in each test."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.connector.policy import Estimates, prefill_s
from kvctl.core.errors import InvalidInput
from kvctl.sim.fleet import simulate_fleet
from kvctl.sim.policy import decided_hits
from kvctl.sim.simulate import SimConfig, engine_steps, simulate
from kvctl.sim.steps import StepCost, fit_steps
from kvctl.sim.workload import Workload

R = 90_000.0
H100 = StepCost(step_s=0.025, graph_tokens=512, graph_jump_s=0.030)  # about an H100's, compiled (2026-12-06)


def test_a_prompts_steps_cost_what_the_connector_prices():
    """StepCost.prefill is the connector's prefill_s without its tokens / R: one step of 16 384 tokens above the
    graphs costs a + J, 20 000 in 16 384-token steps two such steps, 512 tokens one step at a, nothing none."""
    assert H100.prefill(16384, 16384) == pytest.approx(0.055)
    assert H100.prefill(20000, 16384) == pytest.approx(0.110)
    assert H100.prefill(512, 16384) == pytest.approx(0.025)
    assert H100.prefill(1024, None) == pytest.approx(0.055)  # no budget: one step
    assert H100.prefill(0, 16384) == 0.0
    est = Estimates(R, 0.0, (1e9,), graph_tokens=512, graph_jump_s=0.030, step_s=0.025, step_budget=16384)
    for tokens in (1, 256, 512, 513, 8192, 16384, 16385, 40000):
        assert tokens / R + H100.prefill(tokens, 16384) == pytest.approx(prefill_s(tokens, R, est))


def test_the_engine_pays_each_step_once_and_a_batch_shares_it():
    """One 16 384-token miss alone: 16384/R + a + J. Two 256-token misses arriving together, M = 4: one step of 512
    tokens (at the graphs: no jump), both done at 512/R + a. One at a time (M = 1): each pays its own step."""
    one = engine_steps(np.array([0.0]), np.zeros(1), np.array([16384.0]), R, 4, 16384, H100)[1]
    assert one.tolist() == pytest.approx([16384 / R + 0.055])
    pair = engine_steps(np.zeros(2), np.zeros(2), np.full(2, 256.0), R, 4, 16384, H100)[1]
    assert pair.tolist() == pytest.approx([512 / R + 0.025] * 2)
    alone = engine_steps(np.zeros(2), np.zeros(2), np.full(2, 256.0), R, 1, 16384, H100)[1]
    assert alone.tolist() == pytest.approx([256 / R + 0.025, 2 * (256 / R + 0.025)])
    # no cost: as before
    assert engine_steps(np.zeros(2), np.zeros(2), np.full(2, 256.0), R, 4, 16384)[1].tolist() == pytest.approx([512 / R] * 2)


@pytest.mark.parametrize("loading", ["sync", "async"])
@pytest.mark.parametrize("max_batch", [1, 4])
def test_one_engine_and_the_fleet_model_agree_with_step_costs(loading, max_batch):
    """The single-engine model and the fleet's (one engine) give the same latencies with the steps' costs, which
    make every request slower than tokens / R alone."""
    rng = np.random.default_rng(7)
    n = 60
    w = Workload(np.cumsum(rng.exponential(0.25, n)), rng.choice([512.0, 4096.0, 16384.0], n), 4.0, "test",
                 hit_tokens=rng.choice([0.0, 256.0, 3840.0], n))
    base = SimConfig(31104.0, R, t0_s=0.005, instance_gbps=3.0, loading=loading, async_timeout_s=86400, hits_from_trace=True,
                     max_batch=max_batch, max_batched_tokens=16384)
    cfg = SimConfig(**{**base.__dict__, "step_cost": H100})
    one, fleet, none = simulate(w, cfg, 3.0), simulate_fleet(w, cfg, 3.0), simulate(w, base, 3.0)
    for k in ("p50_s", "p90_s", "p99_s", "max_s"):
        assert getattr(one, k) == pytest.approx(getattr(fleet, k), rel=1e-9)
        assert getattr(one, k) > getattr(none, k)


def test_the_decision_prices_the_steps_as_the_connector():
    """A lone async hit (R 90k, a 25 ms, J 30 ms above 512 tokens, T0 0): 256 of a 512-token prompt from the tier in
    1 ms saves 256/R = 2.8 ms of compute, but as a hit vLLM receives it waits one more step (25 ms): recomputed. 768
    of a 1024-token prompt in 5 ms saves 768/R + J = 38.5 ms (the rest, 256 tokens, fits a graph): loaded for 30 ms.
    Without the step cost both load (1 and 5 ms against 2.8 and 8.5)."""
    def decide(tokens, hit, transfer, steps):
        return decided_hits(np.array([0.0]), np.array([tokens]), np.array([hit]), np.array([transfer]), 0.0, R, "async",
                            steps=steps)

    assert decide(512.0, 256.0, 0.001, (H100, 16384)) == (np.array([0.0]), {"recompute/below_n_star": 1})
    loaded, counts = decide(1024.0, 768.0, 0.005, (H100, 16384))
    assert loaded.tolist() == [768.0] and counts == {"load/wins": 1}
    for tokens, hit, x in ((512.0, 256.0, 0.001), (1024.0, 768.0, 0.005)):
        assert decide(tokens, hit, x, None)[0].tolist() == [hit]


def _trace(tmp_path, steps):
    lines = [json.dumps({"t": 10.0 + i, "ev": "step", "pid": 1, "step": i, "prefill_tokens": tok, "s": s, "above_graphs": above})
             for i, (tok, s, above) in enumerate(steps)]
    lines.append(json.dumps({"t": 99.0, "ev": "lookup", "req": "x", "tokens": 512}))
    p = tmp_path / "trace.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return str(p)


def test_fit_steps_finds_the_steps_a_trace_timed(tmp_path):
    """Steps timed as a + J·[above 512] + tokens/R (a 23 ms, J 30 ms, R 91k, as the eighth H100 session's engine
    fitted) give those back, the graph size from the largest step that ran as a graph."""
    a, j, r = 0.023, 0.030, 91_000.0
    sizes = [512, 256, 512, 1024, 1536, 16384, 16384, 8192, 512, 13056, 16384, 384]
    path = _trace(tmp_path, [(t, a + (j if t > 512 else 0.0) + t / r, t > 512) for t in sizes])
    fit = fit_steps(path)
    assert fit.steps == len(sizes) and fit.cost.graph_tokens == 512
    assert fit.cost.step_s == pytest.approx(a, rel=1e-6) and fit.cost.graph_jump_s == pytest.approx(j, rel=1e-6)
    assert fit.prefill_rate == pytest.approx(r, rel=1e-6)
    with pytest.raises(InvalidInput, match="no timed step"):
        fit_steps(_trace(tmp_path, []))


def test_simulate_takes_the_step_cost_given_or_fitted(tmp_path):
    """The CLI: --step-s/--graph-tokens/--graph-jump-s as given, --fit-steps' fit (its note says so), values given
    win over the fit; a negative step is a usage error naming the option."""
    base = ["simulate", "--arrival-rate", "2", "--prompt-tokens", "16384", "--bytes-per-token", "31104", "--prefill-rate", "90000",
            "--instance-gbps", "3", "--hit-fraction", "0", "--requests", "200", "--max-batched-tokens", "16384", "--json"]

    def p50(*extra):
        r = CliRunner().invoke(cli, [*base, *extra])
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)

    plain = p50()["p50_s"]
    assert plain == pytest.approx(16384 / 90000, rel=0.05)  # at ρ 0.36 most misses find the engine free
    given = p50("--step-s", "0.025", "--graph-tokens", "512", "--graph-jump-s", "0.030")
    assert given["p50_s"] == pytest.approx(16384 / 90000 + 0.055, rel=0.05)
    path = _trace(tmp_path, [(t, 0.025 + (0.03 if t > 512 else 0.0) + t / 90000, t > 512) for t in (256, 512, 16384, 8192, 1024)])
    fitted = p50("--fit-steps", path)
    assert fitted["p50_s"] == pytest.approx(given["p50_s"], rel=1e-6)
    assert any(n.startswith(f"--fit-steps {path}: 5 steps: a step costs 25.0 ms") for n in fitted["notes"])
    assert p50("--fit-steps", path, "--step-s", "0")["p50_s"] == pytest.approx(16384 / 90000 + 0.030, rel=0.05)
    r = CliRunner().invoke(cli, [*base, "--step-s", "-1"])
    assert r.exit_code == 2 and "--step-s" in r.output


def test_fit_steps_leaves_out_a_step_it_cannot_read_and_says_so_when_none_is_left(tmp_path):
    """A trace written by hand or cut short: a step whose tokens or seconds are not numbers (a string, a bool, NaN)
    is left out, never a traceback; with none left, one line names the file."""
    good = [(t, 0.025 + (0.03 if t > 512 else 0.0) + t / 90000, t > 512) for t in (256, 512, 16384, 8192, 1024)]
    path = _trace(tmp_path, [*good, ("16384", 0.2, True), (True, 0.2, True), (512, "fast", False), (512, float("nan"), False)])
    fit = fit_steps(path)
    assert fit.steps == len(good) and fit.cost.step_s == pytest.approx(0.025, rel=1e-6)
    with pytest.raises(InvalidInput, match="no timed step") as e:
        fit_steps(_trace(tmp_path, [("16384", 0.2, True), (512, None, False)]))
    assert "\n" not in str(e.value)
    r = CliRunner().invoke(cli, ["simulate", "--arrival-rate", "2", "--prompt-tokens", "512", "--bytes-per-token", "31104",
                                 "--prefill-rate", "90000", "--instance-gbps", "3", "--requests", "10",
                                 "--fit-steps", str(tmp_path / "missing.jsonl")])
    assert r.exit_code != 0 and "missing.jsonl" in r.output and "Traceback" not in r.output


def test_the_vectorised_step_costs_are_the_scalar_ones():
    """prefill_many (the model's per-request costs) gives prefill's figure, float for float, budget or none."""
    tokens = np.array([0.0, 1.0, 255.0, 512.0, 513.0, 8192.0, 16384.0, 16385.0, 30720.0, 0.1 * 3 * 10240, 40000.0])
    for cost in (H100, StepCost(0.02), StepCost(0.0, 512, 0.03), StepCost()):
        for budget in (16384, 8192, None, 0):
            assert cost.prefill_many(tokens, budget).tolist() == [cost.prefill(t, budget) for t in tokens.tolist()]
