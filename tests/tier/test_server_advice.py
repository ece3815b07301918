"""Issue 45 item 3: the advice says "move to 9.x / raise io-threads" before "add instances" when an instance gives less
than a newer server or more threads would (the measured table, kvctl.core.thresholds.INSTANCE_GBPS_BY_SERVER): kvctl
diagnose's rho_unstable, bandwidth_below_breakeven and instance_saturated, and kvctl plan on a bench of an 8.1 tier.
(doctor's lines: tests/ops/test_doctor.py; bench's: tests/bench/test_bench_server.py.)"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.core.thresholds import INSTANCE_GBPS_BY_SERVER
from kvctl.diagnose.analysis import Params, analyse
from kvctl.diagnose.capture import Capture, Sample
from kvctl.diagnose.sources import GpuSample
from kvctl.tier import sizing
from tests.diagnose.engine_text import EngineState

V8 = {"valkey_version": "8.1.8", "redis_version": "7.2.4"}  # INFO server of an 8.1 instance: no per-thread times
V9_ONE = {"valkey_version": "9.1.2", "used_active_time_main_thread": 0.1}  # 9.1 at io-threads 1
V9_EIGHT = {**V9_ONE, **{f"used_active_time_io_thread_{n}": 0.0 for n in range(1, 8)}}  # 9.1 at io-threads 8
P = Params(bytes_per_token=48437.5, prefill_rate=52200, t0_s=0.1)  # B* = s·R = 2.53 GB/s
GPU = GpuSample(note="no GPU visible (test)")


def info(calls: float, usec: float, bytes_out: float, server: dict) -> dict:
    """The INFO fields the analysis reads, as redis-py parses them, and the instance's server fields."""
    return {"cmdstat_get": {"calls": calls, "usec": usec}, "total_net_output_bytes": bytes_out, "evicted_keys": 0, **server}


def slow_tier(server: dict) -> Capture:
    """One engine (2 label sets), 10 requests of 16k tokens in 1 s, 10 remote GETs of 300 ms moving 1e9 B: B = 1/3 GB/s
    (below B*), 1e8 B a request, ρ = 10 × 1e8 / (1e9 / 3) = 3 (unstable: 6 instances for ρ 0.5); one instance of ``server``."""
    a = EngineState(engines=2)
    b = a.advance(requests=10, prompt_lengths=[16000] * 10, external_hits=100000, external_queries=160000, remote_read_bytes=1e9,
                  remote_get_ms=[300] * 10, lookup_s=[0.001] * 10, lmcache_hit_tokens=100000)
    return Capture(["http://engine:8000"], ["resp://valkey-0:6379"],
                   [Sample(100.0, [a.text()], [info(0, 0, 0, server)], GPU), Sample(101.0, [b.text()], [info(10, 3e6, 1e9, server)], GPU)], {})


def shared_tier(server: dict) -> Capture:
    """Engine A (4 ranks, 10 requests, 8e9 B in Σ16 s of GETs) and engine B (2 ranks, 20 requests, 1.2e10 B in Σ24 s) over
    four instances: instance 0 carries both at ρ 1.6 (the numbers of tests/diagnose/test_analysis.py's fleet capture)."""
    a0 = EngineState(engines=1, lmcache=False, kvctl_get_bytes=0, extra={"kvctl:ranks": 4})
    b0 = EngineState(engines=1, lmcache=False, kvctl_get_bytes=0, extra={"kvctl:ranks": 2})
    a1 = a0.advance(requests=10, prompt_lengths=[1000] * 10, kvctl_get_bytes=8e9, kvctl_get_s=16.0)
    b1 = b0.advance(requests=20, prompt_lengths=[1000] * 20, kvctl_get_bytes=1.2e10, kvctl_get_s=24.0)
    va, vb = [info(0, 0, 0, server)] * 4, [info(100, 1e5, 1e9, server)] * 4
    return Capture(["http://engine-a:8000", "http://engine-b:8000"], [f"resp://valkey-{r}:6379" for r in range(4)],
                   [Sample(100.0, [a0.text(), b0.text()], va, GPU), Sample(110.0, [a1.text(), b1.text()], vb, GPU)], {})


@pytest.mark.parametrize("server, step", [
    (V8, "Valkey 8.1.8: move to 9.1, with io-threads 8"),  # valkey-0 is another host: a 16-core one assumed, said so
    (V9_ONE, "io-threads 1 on a 16-core host (assumed: its cores are not known here): set io-threads 8"),
    (V9_EIGHT, None),
])  # fmt: skip
def test_rho_unstable_says_the_server_change_before_more_instances(server, step):
    d = analyse(slow_tier(server), P)
    assert d.rho == pytest.approx(3.0)
    f = {f.id: f for f in d.findings}["rho_unstable"]
    assert "6 Valkey instance" in f.recommendation
    if step is None:
        assert "first_step" not in f.evidence and not f.recommendation.startswith("first")
    else:
        assert f.recommendation.startswith(f"first, before adding instances: {step}"), f.recommendation
        assert f.recommendation.index(step) < f.recommendation.index("6 Valkey instance")
        assert f.evidence["first_step"].startswith(step)


def test_bandwidth_below_breakeven_and_a_shared_instance_say_it_too():
    d = analyse(slow_tier(V8), P)
    f = {f.id: f for f in d.findings}["bandwidth_below_breakeven"]
    assert f.recommendation.startswith("first, before adding instances: Valkey 8.1.8: move to 9.1")
    assert f.recommendation.index("move to 9.1") < f.recommendation.index("one Valkey instance per rank")
    d = analyse(shared_tier(V8), P)
    f = next(f for f in d.findings if f.id == "instance_saturated")
    assert f.evidence["rho"] == pytest.approx(1.6)
    assert f.recommendation.startswith("first, before adding instances: Valkey 8.1.8: move to 9.1"), f.recommendation
    assert f.recommendation.index("move to 9.1") < f.recommendation.index("add instances")


def test_the_table_is_the_measured_one_and_the_step_follows_it():
    """The figures of issue 45 (kvctl bench, 8 MB values, one instance, 16-core H200 host), and the gains they imply."""
    assert INSTANCE_GBPS_BY_SERVER == {(8, 1): 2.57, (8, 4): 2.60, (8, 8): 3.11, (9, 1): 4.80, (9, 4): 12.0, (9, 8): 13.5}
    assert sizing.expected_gbps("8.1.8", 2) == 2.57 and sizing.expected_gbps("9.1.2", 6) == 12.0 and sizing.expected_gbps("10.0", 64) == 13.5
    assert sizing.first_step("9.1.2", 4, cores=16) is None  # 13.5 / 12.0 < 1.5: more threads would not pay
    assert sizing.first_step("9.1.2", 1, cores=2) is None  # one thread is all a 2-core host gives it
    up = sizing.first_step("8.1.8", 8, cores=16)
    assert up.upgrade and up.target_io_threads == 8 and up.then_gbps / up.now_gbps == pytest.approx(13.5 / 3.11)
    assert sizing.first_step("8.1.8", 1, cores=2, measured_gbps=4.0) is None  # measured at 4.0: 9.1 at one thread is 4.8


def _bench_file(tmp_path, versions: list[str], threads: list[int]) -> str:
    p = tmp_path / "bench.json"
    p.write_text(json.dumps({"metadata": {"server_versions": versions, "server_io_threads": threads, "host_cores": 16}, "runs": [
        {"op": "get", "instances": 1, "clients": 1, "aggregate_gbps": 2.5, "p50_batch_ms": 30.0, "p99_batch_ms": 40.0}]}))
    return str(p)


PLAN = ["plan", "--arrival-rate", "3", "--prompt-tokens", "16310", "--bytes-per-token", "48437.5", "--prefill-rate", "52200",
        "--t0", "0.33", "--requests", "2000", "--loading", "sync", "--slo-p99", "1.0", "--max-instances", "4", "--json"]


def test_plan_on_a_bench_of_valkey_8_says_move_to_9_before_more_instances(tmp_path):
    """λ 3/s of 0.79 GB prompts need ρ ≤ 0.5 at 2.5 GB/s an instance: 2 or more instances. Measured on 8.1.8 at one
    thread, the plan says first move to 9.1 (4.80-13.5 GB/s an instance), then plan again; on 9.1 at 8 threads, it
    plans instances from the measured figure alone."""
    r = CliRunner().invoke(cli, [*PLAN, "--bench", _bench_file(tmp_path, ["8.1.8"], [1])])
    d = json.loads(r.stdout)
    assert d["instances"] is None or d["instances"] > 1, d["verdict"]
    assert d["verdict"].startswith("first, before adding instances: Valkey 8.1.8: move to 9.1, with io-threads 8"), d["verdict"]
    r = CliRunner().invoke(cli, [*PLAN, "--bench", _bench_file(tmp_path, ["9.1.2"], [8])])
    d = json.loads(r.stdout)
    assert "move to" not in d["verdict"] and "first" not in d["verdict"]
