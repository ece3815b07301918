"""`kvctl diagnose` over a tier of K instances per rank: every instance read and named on its own, W from the
tier's ranks (not its instances), and ρ per instance with a rank's load and bandwidth spread over its K
instances. Expected numbers are worked out by hand in each docstring."""

from __future__ import annotations

import json
import threading
import time

import pytest
import redis
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.diagnose.analysis import Params, analyse
from kvctl.diagnose.capture import Capture, Sample, load_capture, save_capture
from kvctl.diagnose.sources import GpuSample
from kvctl.core.errors import InvalidInput
from tests.diagnose.engine_text import EngineState
from tests.diagnose.metrics_server import MetricsServer

G = GpuSample(note="no GPU visible (test)")
P = Params(bytes_per_token=40_000, prefill_rate=50_000, t0_s=0.1)


def info(calls: float, usec: float, bytes_out: float) -> dict:
    return {"cmdstat_get": {"calls": calls, "usec": usec}, "total_net_output_bytes": bytes_out, "evicted_keys": 0}


def one_engine(k: int) -> Capture:
    """One TP=1 engine (no kvctl:ranks gauge) on 4 instances: 10 requests in 10 s, 4e9 B read in Σ2 s of GET wall time."""
    a = EngineState(engines=1, lmcache=False, kvctl_get_bytes=0)
    b = a.advance(requests=10, prompt_lengths=[10_000] * 10, kvctl_get_bytes=4e9, kvctl_get_s=2.0)
    urls = [f"resp://valkey-0-{i}:6379" for i in range(4)]
    va, vb = [info(0, 0, 0)] * 4, [info(250, 5e5, 1e9)] * 4
    return Capture(["http://engine:8000"], urls, [Sample(100.0, [a.text()], va, G), Sample(110.0, [b.text()], vb, G)], {},
                   instances_per_rank=k)


def test_w_is_the_tiers_ranks_not_its_instances():
    """K = 4 instances of one rank: W = 4 / 4 = 1, so B = W × Σbytes / Σseconds = 1 × 4e9 / 2 = 2 GB/s, and each
    instance is rank 0's. Read as one instance per rank (K = 1) the same capture says W = 4 and B = 8 GB/s."""
    d = analyse(one_engine(4), P)
    assert d.engine_ranks == 1 and d.bandwidth_gbps == pytest.approx(2.0)
    assert d.bytes_per_token_per_rank == pytest.approx(40_000)  # s / W, W = 1
    assert [(i.rank, i.instance, i.name) for i in d.instances] == [(0, i, f"rank 0 instance {i}") for i in range(4)]
    assert any(q.name == "rank 0 instance 3 GET busy fraction" for q in d.explain)
    old = analyse(one_engine(1), P)
    assert old.engine_ranks == 4 and old.bandwidth_gbps == pytest.approx(8.0)
    assert [i.name for i in old.instances] == ["rank 0", "rank 1", "rank 2", "rank 3"]


def test_more_instances_for_the_target_said_as_ranks_times_instances():
    """λ = 1 req/s and 4e8 B per request. With Σ2 s of GETs B = 2 GB/s and ρ = 4e8 / 2e9 = 0.2: no more instances
    needed, no note. With Σ20 s B = 0.2 GB/s, ρ = 4e8 / 2e8 = 2, and ⌈2 × 4 / 0.5⌉ = 16 instances of this bandwidth
    for ρ ≤ 0.5: said as 1 rank × 16 instances per rank (one instance per rank could never get there)."""
    assert not any("instances per rank" in n for n in analyse(one_engine(4), P).notes)
    a = EngineState(engines=1, lmcache=False, kvctl_get_bytes=0)
    b = a.advance(requests=10, prompt_lengths=[10_000] * 10, kvctl_get_bytes=4e9, kvctl_get_s=20.0)
    c = Capture(["http://engine:8000"], [f"resp://v{i}:1" for i in range(4)],
                [Sample(100.0, [a.text()], [info(0, 0, 0)] * 4, G), Sample(110.0, [b.text()], [info(1, 1, 1)] * 4, G)], {},
                instances_per_rank=4)
    d = analyse(c, P)
    assert d.rho == pytest.approx(2.0) and d.instances_for_rho_target == 16
    assert any("1 rank(s) × 16 instances per rank = 16 instances" in n and "--instances-per-rank 16" in n for n in d.notes), d.notes


def shared_tier(k: int) -> Capture:
    """Engines A and B, both TP=1 (kvctl:ranks 1), on one rank of K = 2 instances. A: 10 requests in 10 s, 4e9 B in
    Σ4 s (B_A = 1 GB/s, 4e8 B/request, λ 1/s); B: 20 requests, 4e9 B in Σ4 s (B_B = 1 GB/s, 2e8 B/request, λ 2/s)."""
    a0 = EngineState(engines=1, lmcache=False, kvctl_get_bytes=0, extra={"kvctl:ranks": 1})
    a1 = a0.advance(requests=10, prompt_lengths=[1000] * 10, kvctl_get_bytes=4e9, kvctl_get_s=4.0)
    b1 = a0.advance(requests=20, prompt_lengths=[1000] * 20, kvctl_get_bytes=4e9, kvctl_get_s=4.0)
    va, vb = [info(0, 0, 0)] * 2, [info(100, 1e5, 1e9)] * 2
    return Capture(["http://engine-a:8000", "http://engine-b:8000"], ["resp://v-0-0:1", "resp://v-0-1:1"],
                   [Sample(100.0, [a0.text(), a0.text()], va, G), Sample(110.0, [a1.text(), b1.text()], vb, G)], {}, instances_per_rank=k)


def test_rho_per_instance_spreads_a_ranks_load_over_its_instances():
    """Rank 0 is offered 1 × 4e8 + 2 × 2e8 = 8e8 B/s, 4e8 B/s on each of its 2 instances; its bandwidth, the best
    B_e / W_e = 1 GB/s, is the sum over them: 0.5 GB/s each. ρ_i = 4e8 / 5e8 = 0.8 on both (rank 0 as a whole:
    8e8 / 1e9 = 0.8), a warning naming the instance. Read as 2 ranks of one instance, instance 1 would look unused."""
    d = analyse(shared_tier(2), P)
    loads = [(i.rank, i.instance, i.engines) for i in d.instance_loads]
    assert loads == [(0, 0, (0, 1)), (0, 1, (0, 1))]
    for il in d.instance_loads:
        assert il.offered_bytes_per_s == pytest.approx(4e8) and il.bandwidth_gbps == pytest.approx(0.5)
        assert il.rho == pytest.approx(0.8) and dict(il.shares) == pytest.approx({0: 0.4, 1: 0.4})
    f = next(f for f in d.findings if f.id == "instance_saturated")
    assert f.message.startswith("Valkey rank 0 instance 0 (resp://v-0-0:1) is at ρ = 0.80")
    old = {i.rank: i for i in analyse(shared_tier(1), P).instance_loads}
    assert old[0].rho == pytest.approx(0.8) and old[1].rho is None and old[1].engines == ()


def test_capture_keeps_instances_per_rank(tmp_path):
    save_capture(shared_tier(2), tmp_path / "k2")
    assert json.loads((tmp_path / "k2" / "capture.json").read_text())["instances_per_rank"] == 2
    assert load_capture(tmp_path / "k2").instances_per_rank == 2
    save_capture(shared_tier(1), tmp_path / "k1")
    assert "instances_per_rank" not in json.loads((tmp_path / "k1" / "capture.json").read_text())  # K = 1: as before
    assert load_capture(tmp_path / "k1").instances_per_rank == 1
    meta = json.loads((tmp_path / "k2" / "capture.json").read_text())
    meta["instances_per_rank"] = 3  # does not divide its 2 instances
    (tmp_path / "k2" / "capture.json").write_text(json.dumps(meta))
    with pytest.raises(InvalidInput, match="instances_per_rank is 3"):
        load_capture(tmp_path / "k2")


def test_live_diagnose_reads_every_instance_of_a_rank(valkey_factory):
    """Two real servers as rank 0's instances 0 and 1; a reader GETs from instance 1 only, all through the window."""
    v0, v1 = valkey_factory(), valkey_factory()
    base = EngineState(engines=1, lmcache=False, kvctl_get_bytes=0)
    after = base.advance(requests=4, prompt_lengths=[1000] * 4, kvctl_get_bytes=4e5, kvctl_get_s=0.01)
    stop = threading.Event()

    def reader() -> None:
        with redis.Redis(port=v1.port) as r:
            r.set("c", b"x" * 100_000)
            deadline = time.monotonic() + 10
            while not stop.is_set() and time.monotonic() < deadline:
                r.get("c")
                time.sleep(0.01)

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    try:
        with MetricsServer([base.text(), after.text()]) as srv:
            res = CliRunner().invoke(cli, ["diagnose", "--engine-url", srv.url, "--valkey", v0.url, "--valkey", v1.url, "--instances-per-rank", "2",
                                           "--window", "0.3", "--bytes-per-token", "1000", "--prefill-rate", "1e6", "--json"])
    finally:
        stop.set()
        t.join(5)
    assert res.exit_code in (0, 3, 6), res.output
    d = json.loads(res.stdout)
    assert [(i["rank"], i["instance"], i["status"]) for i in d["instances"]] == [(0, 0, "ok"), (0, 1, "ok")]
    assert d["instances"][0]["get_calls"] == 0 and d["instances"][1]["get_calls"] > 0
    assert d["engine_ranks"] == 1  # W from the tier: 2 instances, 2 per rank
    bad = CliRunner().invoke(cli, ["diagnose", "--engine-url", "http://127.0.0.1:1", "--valkey", v0.url, "--instances-per-rank", "2"])
    assert bad.exit_code == 2 and "give K URLs per rank" in bad.output
