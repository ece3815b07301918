"""Issue 46 item 4: the what-if model runs the connector's load-or-recompute decision (``--policy on``).

Pure numpy models (kvctl.sim.policy, simulate, simulate_fleet) on seeded Poisson workloads: the numbers below are
the cost model's (paper §4), worked by hand where a test states one.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kvctl.core.errors import InvalidInput
from kvctl.sim.fleet import simulate_fleet
from kvctl.sim.policy import decided_hits
from kvctl.sim.simulate import SimConfig, parse_sweep, simulate
from kvctl.sim.workload import poisson_workload

S, R = 48437.5, 52200.0  # the paper's bytes per token and prefill rate: B* = s·R = 2.53 GB/s


def cfg(gbps: float, loading: str, policy: str, t0: float = 0.1) -> SimConfig:
    return SimConfig(S, R, t0, 1, gbps, loading, async_timeout_s=3.0, policy=policy)


def test_sync_loads_a_hit_only_where_it_wins_on_an_idle_tier():
    """16k tokens: recompute 0.3065 s. At 6 GB/s the load is 0.1 + 0.129 s: it wins; at 2 GB/s (below B*) the
    transfer alone is 0.387 s; with T0 = 0.25 at 6 GB/s, 0.379 s: above break-even but below n* = R·T0 = 13 050."""
    a, n, h = np.arange(3.0), np.full(3, 16000.0), np.array([16000.0, 16000.0, 0.0])
    for gbps, t0, want, why in ((6.0, 0.1, 16000.0, "load/wins"), (2.0, 0.1, 0.0, "recompute/below_breakeven"),
                                (6.0, 0.25, 0.0, "recompute/below_n_star")):
        loaded, dec = decided_hits(a, n, h, h * S / (gbps * 1e9), t0, R, "sync")
        assert loaded.tolist() == [want, want, 0.0] and dec == {why: 2}


def test_async_recomputes_what_waits_behind_the_tiers_queue_and_keeps_p99_near_recompute():
    """2.8 req/s of 16k prompts on one instance of 2.5 GB/s: each load is 0.31 s on the tier (ρ_tier 0.87) and a lone
    hit loses by a hair (0.1 + 0.31 > 0.3065); the engine alone is at ρ 0.86. Off: the async queue times loads out
    and p99 is several seconds; on: the decision loads what the tier and the engine's queue let win."""
    w = poisson_workload(2.8, 20000, 16000, seed=1)
    off, on = simulate(w, cfg(2.5, "async", "off"), 2.5), simulate(w, cfg(2.5, "async", "on"), 2.5)
    recompute = simulate(w, SimConfig(S, R, 0.1, 1, 2.5, "sync", hit_fraction=0.0), 2.5)
    assert on.p99_s < 0.5 * recompute.p99_s and on.p99_s < 0.5 * off.p99_s
    assert on.decisions["load/wins"] > 0 and on.decisions.get("recompute/tier_queue", 0) > 0
    assert sum(on.decisions.values()) == on.requests  # every request hits: each one judged once
    assert on.timeouts == 0 and on.tier_rho < off.tier_rho


def test_a_tier_that_keeps_up_is_left_alone():
    """At 8 GB/s (ρ_tier 0.27) the decision loads nearly every hit and p50 stays as it is; the few it recomputes, at a
    passing tier queue, delay the loaded hits queued behind them on the engine (head-of-line), which the per-request
    rule does not count: with 2,048-token steps p99 stays at or below the tier-only run's, with whole-prompt steps it
    grows (docs/connector.md, "What it cannot see")."""
    w = poisson_workload(2.8, 5000, 16000, seed=2)
    sync_off, sync_on = simulate(w, cfg(8.0, "sync", "off"), 8.0), simulate(w, cfg(8.0, "sync", "on"), 8.0)
    assert (sync_on.p50_s, sync_on.p99_s, sync_on.hits) == (sync_off.p50_s, sync_off.p99_s, sync_off.hits)
    assert sync_on.decisions == {"load/wins": 5000} and sync_off.decisions is None
    for steps, p99_grows in ((2048, False), (None, True)):
        kw = {"max_batch": 64, "max_batched_tokens": steps} if steps else {}
        off = simulate(w, replace(cfg(8.0, "async", "off"), **kw), 8.0)
        on = simulate(w, replace(cfg(8.0, "async", "on"), **kw), 8.0)
        assert on.decisions["load/wins"] >= 0.97 * 5000 and on.p50_s == pytest.approx(off.p50_s, rel=0.01)
        assert (on.p99_s > off.p99_s) is p99_grows, (steps, on.p99_s, off.p99_s)


def test_below_breakeven_an_async_hit_loads_the_prefix_the_engine_queue_hides():
    """At 0.6 GB/s a chunk loads in 0.0207 s and recomputes in 0.0049 s: no length wins alone, but a request that
    waits behind the engine's queue can load a prefix in that time (partial/below_breakeven)."""
    w = poisson_workload(2.8, 5000, 16000, seed=3)
    on = simulate(w, cfg(0.6, "async", "on"), 0.6)
    assert on.decisions.get("partial/below_breakeven", 0) > 0 and "load/wins" not in on.decisions


def test_one_engine_fleet_and_the_single_engine_model_decide_alike():
    w = poisson_workload(2.8, 3000, 16000, seed=4)
    c = cfg(2.5, "async", "on")
    one, fleet = simulate(w, c, 2.5), simulate_fleet(w, c, 2.5)
    assert one.decisions == fleet.decisions and one.p99_s == pytest.approx(fleet.p99_s)


def test_policy_values_are_checked_and_sweepable():
    with pytest.raises(InvalidInput, match="--policy must be on or off"):
        simulate(poisson_workload(1.0, 10, 1000), cfg(2.5, "sync", "maybe"), 2.5)
    assert parse_sweep(["policy=on,off"]) == {"policy": ["on", "off"]}
    with pytest.raises(InvalidInput, match="--sweep policy takes on,off"):
        parse_sweep(["policy=yes"])


PLAN = ["plan", "--arrival-rate", "2.8", "--prompt-tokens", "16000", "--bytes-per-token", str(S), "--prefill-rate", str(R),
        "--t0", "0.1", "--instance-gbps", "3", "--slo-p99", "1.2", "--max-instances", "4", "--requests", "4000", "--json"]


def test_plan_with_the_decision_needs_fewer_instances():
    """3 GB/s an instance: without the decision one instance carries ρ 0.72 > 0.5 and the plan needs 2; with it, the
    hits the tier cannot serve in time are recomputed and one instance meets the SLO."""
    import json  # noqa: PLC0415

    from click.testing import CliRunner  # noqa: PLC0415

    from kvctl.cli import cli  # noqa: PLC0415

    off = json.loads(CliRunner().invoke(cli, PLAN).stdout)
    on = json.loads(CliRunner().invoke(cli, [*PLAN, "--policy", "on"]).stdout)
    assert (off["instances"], off["policy"]) == (2, "off")
    assert (on["instances"], on["loading"], on["policy"]) == (1, "async", "on")
    assert "with the load-or-recompute decision" in on["verdict"]
    sim = json.loads(CliRunner().invoke(cli, ["simulate", *PLAN[1:11], "--instance-gbps", "2.5", "--loading", "async",
                                               "--policy", "on", "--requests", "2000", "--json"]).stdout)
    assert sim["decisions"]["load/wins"] > 0 and sum(sim["decisions"].values()) == 2000
