"""The async loader's own time a load (``--fit-loads``, ``--async-load-s``): fitted from a connector trace and served
on the tier's FIFO (kvctl.sim.variability.fit_loads, kvctl.sim.fleet).

On an H100 (2026-12-06) each async load of 0.49 GB held the connector's loader 5 ms besides its GETs, and its GETs ran
3 % below the bench's: the bench alone put the tier's ρ at 1.13 where it ran at 1.24, and simulate's saturated-tier
waits came out at 0.62–0.65× the run's (benchmarks/README.md). Units here: 1000 tokens × 1e6 B/token = 1 GB a prompt.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.core.errors import InvalidInput
from kvctl.sim.fleet import simulate_fleet
from kvctl.sim.policy import decided_hits
from kvctl.sim.simulate import SimConfig
from kvctl.sim.variability import Variability, fit_loads
from kvctl.sim.workload import Workload


def load_event(t, rank=0, bytes_=1e9, get_s=0.5, total_s=0.55, given_up=False):
    return {"t": t, "ev": "load", "req": f"r{t}", "rank": rank, "bytes": bytes_, "get_s": get_s, "total_s": total_s,
            "given_up": given_up}


def write_trace(path, events, torn=False):
    text = "".join(json.dumps(e) + "\n" for e in events)
    path.write_text(text + ('{"t": 9, "ev": "lo' if torn else ""))
    return str(path)


def test_fit_takes_the_median_rate_and_the_loaders_own_time(tmp_path):
    # three loads of rank 0 at 2, 2.5 and 4 GB/s (medians 2.5 GB/s, 0.04 s besides the GETs); a load given up and
    # one that read nothing are left out, and so are the other events and a torn last line
    trace = write_trace(tmp_path / "t.jsonl", [
        load_event(1.0, get_s=0.5, total_s=0.53),
        load_event(2.0, get_s=0.4, total_s=0.44),
        load_event(3.0, get_s=0.25, total_s=0.30),
        load_event(4.0, get_s=0.1, total_s=5.0, given_up=True),
        load_event(5.0, bytes_=0, get_s=0.0, total_s=0.001),
        {"t": 6.0, "ev": "step", "s": 0.2},
    ], torn=True)
    fit = fit_loads(trace, instances=2)
    assert fit.loads == 3
    assert fit.instance_gbps == pytest.approx(2.5 / 2)  # one rank's loads spread over two instances
    assert fit.load_s == pytest.approx(0.04)
    assert "3 loads" in fit.note and "40.0 ms" in fit.note


def test_fit_counts_each_rank_on_its_own_instances(tmp_path):
    # two ranks, each loading its half at 1 GB/s from its own instance: 1 GB/s an instance
    trace = write_trace(tmp_path / "t.jsonl", [load_event(t, rank=r, bytes_=5e8) for t in (1.0, 2.0) for r in (0, 1)])
    assert fit_loads(trace, instances=2).instance_gbps == pytest.approx(1.0)


def test_fit_refuses_a_trace_without_a_load_that_read(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", [load_event(1.0, given_up=True), {"t": 2.0, "ev": "lookup"}])
    with pytest.raises(InvalidInput, match="--fit-loads .*no load that read something"):
        fit_loads(trace, instances=1)


def test_the_loaders_time_queues_loads_on_the_tier():
    # async, a load every second of 0.5 GB on 1 GB/s: 0.5 s of GETs + 0.6 s of the loader = 1.1 s on the tier,
    # so request i waits 0.1·i behind the ones before (0.5 s each without the loader's time: no wait at all).
    # R 1e9: the tail costs nothing; latency_i = 1.1 + 0.1·i
    n = 5
    w = Workload(np.arange(n, dtype=float), np.full(n, 500.0), 1.0, "hand")
    cfg = SimConfig(1e6, 1e9, 0.0, loading="async", async_timeout_s=86400.0)
    res = simulate_fleet(w, cfg, 1.0, var=Variability(async_load_s=0.6))
    assert res.max_s == pytest.approx(1.1 + 0.1 * (n - 1))
    assert res.tier_rho == pytest.approx(1.1)
    plain = simulate_fleet(w, cfg, 1.0, var=Variability())
    assert plain.max_s == pytest.approx(0.5) and plain.tier_rho == pytest.approx(0.5)
    # sync loads hold the engine; T0 covers the loader there, and the option does not apply
    sync = simulate_fleet(w, SimConfig(1e6, 1e9, 0.0, loading="sync"), 1.0, var=Variability(async_load_s=0.6))
    assert sync.max_s == pytest.approx(0.5)


def test_the_decision_counts_the_loaders_time_in_the_tiers_backlog():
    # two hits of 1000 tokens at t = 0 on an idle engine; each loads in 0.4 s and recomputes in 0.5 s (R 2000).
    # Without the loader's time the second sees 0.4 s ahead: 0.8 > 0.5, recomputed either way; at t = 0 and 0.3 the
    # second sees 0.1 s ahead (0.5 ≤ 0.5 + its engine backlog 0): loads. With 0.1 s a load it sees 0.2 s: recomputed.
    a, n = np.array([0.0, 0.3]), np.array([1000.0, 1000.0])
    args = (a, n, n, np.array([0.4, 0.4]), 0.0, 2000.0, "async")
    loaded, counts = decided_hits(*args)
    assert loaded.tolist() == [1000.0, 1000.0] and counts == {"load/wins": 2}
    loaded, counts = decided_hits(*args, load_s=0.1)
    assert loaded[0] == 1000.0 and loaded[1] < 1000.0
    assert counts["load/wins"] == 1 and sum(counts.values()) == 2


def test_cli_fits_loads_from_a_trace_and_a_given_value_wins(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", [load_event(float(t), get_s=1.0, total_s=1.25) for t in range(3)])
    base = ["simulate", "--arrival-rate", "0.5", "--prompt-tokens", "1000", "--bytes-per-token", "1e6", "--prefill-rate", "1e9",
            "--t0", "0", "--loading", "async", "--async-timeout", "86400", "--instance-gbps", "4", "--requests", "2000", "--json"]
    r = CliRunner().invoke(cli, [*base, "--fit-loads", trace])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    # 1 GB/s a load over one instance, 0.25 s of the loader: 0.5/s × 1.25 s = ρ 0.625 (the 4 GB/s given is the sync one)
    assert d["tier_rho"] == pytest.approx(0.625, rel=0.01)
    assert any("250.0 ms" in note for note in d["notes"])
    r = CliRunner().invoke(cli, [*base, "--fit-loads", trace, "--async-load-s", "0", "--async-instance-gbps", "2"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["tier_rho"] == pytest.approx(0.25, rel=0.01)  # 0.5/s × 0.5 s


@pytest.mark.parametrize("args,message", [
    (["--async-load-s", "-1"], "--async-load-s"),
    (["--fit-loads", "/nonexistent.jsonl"], "/nonexistent.jsonl"),
])
def test_cli_bad_loader_input_is_one_line(args, message):
    r = CliRunner().invoke(cli, ["simulate", "--arrival-rate", "0.1", "--prompt-tokens", "1000", "--bytes-per-token", "1e6",
                                 "--prefill-rate", "1e9", "--instance-gbps", "1", "--loading", "async", *args])
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output


def test_fit_splits_the_loads_beside_big_steps_from_the_others(tmp_path):
    """A load whose GETs ran at least half their time beside a step of 8192 prefill tokens or more counts as beside
    (on an H100 such loads were the slow ones, 2026-12-07); a small step beside a load does not count. Loads of 0.5 s
    ending at t: GETs over [t - 0.55, t - 0.05]."""
    steps = [{"t": 1.0, "ev": "step", "t_start": 0.6, "s": 0.4, "prefill_tokens": 16384},  # covers [0.45, 0.95] 0.35 s
             {"t": 3.0, "ev": "step", "t_start": 2.5, "s": 0.5, "prefill_tokens": 512},  # small: not beside
             {"t": 5.0, "ev": "step", "t_start": 4.5, "s": 0.1, "prefill_tokens": 8192}]  # 0.1 of 0.5 s: not half
    loads = [load_event(1.0, get_s=0.5), load_event(3.0, get_s=0.5), load_event(5.0, get_s=0.5),
             load_event(7.0, get_s=1.0, total_s=1.05)]
    fit = fit_loads(write_trace(tmp_path / "t.jsonl", steps + loads), 1)
    assert fit.spread == (1.0, 1.0, 1.0, 2.0)
    assert fit.spread_beside == (1.0,) and fit.spread_alone == (1.0, 1.0, 2.0)
