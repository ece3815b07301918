"""Observations and findings from two samples.

Engine text comes from :mod:`tests.diagnose.engine_text` (written from the
documented vLLM/LMCache formats); Valkey INFO comes from real valkey-server
processes driven with redis-py between the two samples.
"""

from __future__ import annotations

import pytest
import redis

from kvctl.diagnose import metrics as M
from kvctl.diagnose.analysis import Params, analyse
from kvctl.diagnose.capture import Capture, Sample, take_sample
from kvctl.diagnose.sources import GpuSample
from kvctl.errors import InvalidInput
from kvctl.tier.targets import resolve_targets
from tests.diagnose.engine_text import EngineState
from tests.diagnose.metrics_server import MetricsServer

S_PAPER = 48437.5  # bytes per token, GLM-5.3 FP8 MLA (paper §4)
BASE = EngineState(engines=2)


def healthy(**over) -> EngineState:
    """10 requests of 16k tokens in the window, 0.1 s of remote GETs for 1 GB: B = 10 GB/s."""
    kw = dict(requests=10, prompt_lengths=[16000] * 10, external_hits=100000, external_queries=160000,
              remote_read_bytes=1e9, remote_get_ms=[10] * 10, lookup_s=[0.001] * 10, lmcache_hit_tokens=100000)
    kw.update(over)
    return BASE.advance(**kw)


def cap_of(a: EngineState, b: EngineState, window: float = 1.0, gpu: GpuSample | None = None, params: dict | None = None) -> Capture:
    g = gpu or GpuSample(note="no GPU visible (test)")
    return Capture(["http://engine:8000"], [], [Sample(100.0, [a.text()], [], g), Sample(100.0 + window, [b.text()], [], g)], params or {})


def ids(diag) -> set[str]:
    return {f.id for f in diag.findings}


P = Params(bytes_per_token=S_PAPER, prefill_rate=52200, t0_s=0.1)


def test_healthy_engine_observations_and_no_findings():
    d = analyse(cap_of(BASE, healthy()), P)
    assert d.arrival_rate_per_s == pytest.approx(10.0)
    assert d.mean_prompt_tokens == pytest.approx(16000)
    assert d.hit_token_fraction == pytest.approx(100000 / 160000)
    assert d.bandwidth_gbps == pytest.approx(10.0)
    assert d.bandwidth_source == "lmcache_client"
    assert d.breakeven_gbps == pytest.approx(S_PAPER * 52200 / 1e9)
    assert d.rho == pytest.approx(0.1)
    assert d.l2_tokens_per_s == pytest.approx(1e9 / S_PAPER)
    assert d.findings == [] and d.worst_severity == "ok"


def test_sums_over_engines_and_label_sets():
    one = analyse(cap_of(EngineState(engines=1), EngineState(engines=1).advance(requests=12, prompt_lengths=[100] * 12)), P)
    three = analyse(cap_of(EngineState(engines=3), EngineState(engines=3).advance(requests=12, prompt_lengths=[100] * 12)), P)
    assert one.arrival_rate_per_s == three.arrival_rate_per_s == pytest.approx(12.0)


def test_counter_reset_counts_from_zero():
    before = BASE.advance(requests=1000)
    after = BASE.advance(requests=5)  # the engine restarted inside the window
    assert analyse(cap_of(before, after), P).requests == pytest.approx(5)


def test_rho_unstable_fires_with_instances_for_half():
    d = analyse(cap_of(BASE, healthy(remote_get_ms=[300] * 10)), P)  # 3 s of GETs in 1 s: ρ = 3
    f = {f.id: f for f in d.findings}["rho_unstable"]
    assert d.rho == pytest.approx(3.0)
    assert f.severity == "critical" and d.worst_severity == "critical"
    assert f.evidence["instances_for_target_rho"] == 6  # ceil(3 / 0.5)
    assert "6 Valkey instance" in f.recommendation and "async" in f.recommendation


def test_rho_high_is_a_warning_below_one():
    d = analyse(cap_of(BASE, healthy(remote_get_ms=[80] * 10)), Params(bytes_per_token=S_PAPER, prefill_rate=10000, t0_s=0.1))
    assert d.rho == pytest.approx(0.8)
    assert ids(d) == {"rho_high"} and d.worst_severity == "warning"


@pytest.mark.parametrize("get_ms, fires", [([300] * 10, True), ([10] * 10, False)])
def test_bandwidth_below_breakeven(get_ms, fires):
    d = analyse(cap_of(BASE, healthy(remote_get_ms=get_ms)), P)
    assert ("bandwidth_below_breakeven" in ids(d)) is fires


@pytest.mark.parametrize("t0, fires", [(0.33, True), (0.1, False)])
def test_typical_prompt_below_min_hit(t0, fires):
    d = analyse(cap_of(BASE, healthy()), Params(bytes_per_token=S_PAPER, prefill_rate=52200, t0_s=t0))
    assert ("prompt_below_min_hit" in ids(d)) is fires
    if fires:  # 16k prompts, n* = 52200 × 0.33 ≈ 17226: the paper's case; info only
        assert d.min_hit_tokens == pytest.approx(17226)
        assert d.worst_severity == "info"


@pytest.mark.parametrize(
    "gpu, waiting, expected",
    [
        (None, 5, ("queue_growing", "warning")),
        (GpuSample([5.0, 3.0], ["H200", "H200"]), 5, ("queue_growing_gpu_idle", "critical")),
        (GpuSample([97.0], ["H200"]), 5, ("queue_growing", "warning")),
        (GpuSample([5.0], ["H200"]), 0, None),
    ],
)
def test_queue_growing(gpu, waiting, expected):
    a = BASE.advance(waiting=1)
    d = analyse(cap_of(a, healthy(waiting=waiting).advance(waiting=waiting), gpu=gpu), P)
    found = [(f.id, f.severity) for f in d.findings if f.id.startswith("queue")]
    assert found == ([expected] if expected else [])


@pytest.mark.parametrize(
    "change, fires",
    [({"blocking_failed": 3}, True), ({"lookup_s": [2.0]}, True), ({"lookup_s": [0.01]}, False)],
)
def test_timeouts_rising(change, fires):
    d = analyse(cap_of(BASE, healthy().advance(**change)), P)
    assert ("timeouts_rising" in ids(d)) is fires


def test_prefill_rate_derived_from_engine_prefill_time():
    b = BASE.advance(requests=4, prompt_lengths=[25000] * 4, prefill_time_s=2.0)
    d = analyse(cap_of(BASE, b, window=10.0), Params(bytes_per_token=S_PAPER))
    # 4 × 25000 = 100000 computed tokens in 2.0 s of prefill (inside the 10 s window): 50000 tok/s
    assert d.prefill_rate_tok_s == pytest.approx(50000)
    assert d.prefill_rate_source.startswith("derived")
    assert d.breakeven_gbps == pytest.approx(S_PAPER * 50000 / 1e9)


def test_missing_inputs_are_notes_not_crashes():
    d = analyse(cap_of(BASE, BASE), Params())
    assert d.rho is None and d.breakeven_gbps is None
    assert "bytes per token" in d.null_reasons["breakeven_gbps"] and "prefill" in d.null_reasons["prefill_rate_tok_s"]
    assert d.outcome == "insufficient_data" and any("no request" in r for r in d.insufficient_data)


def test_capture_parameters_used_when_no_flags():
    d = analyse(cap_of(BASE, healthy(), params={"bytes_per_token": S_PAPER, "prefill_rate": 52200, "t0_s": 0.1}), Params())
    assert d.breakeven_gbps == pytest.approx(S_PAPER * 52200 / 1e9) and d.t0_s == 0.1


def test_samples_out_of_order_refused():
    with pytest.raises(InvalidInput):
        analyse(cap_of(BASE, healthy(), window=-1.0), P)


# --- real Valkey -------------------------------------------------------------


def _fill(r: redis.Redis, n: int, size: int, prefix: str = "k") -> None:
    pipe = r.pipeline()
    for i in range(n):
        pipe.set(f"{prefix}{i}", b"x" * size)
    pipe.execute()


def _gets(r: redis.Redis, n: int, keys: int, prefix: str = "k") -> None:
    pipe = r.pipeline(transaction=False)
    for i in range(n):
        pipe.get(f"{prefix}{i % keys}")
    pipe.execute()


def _live(srv_texts, valkeys, load):
    targets = resolve_targets([v.url for v in valkeys])
    with MetricsServer(srv_texts) as srv:
        first = take_sample([srv.url], targets)
        load()
        second = take_sample([srv.url], targets)
    return analyse(Capture([srv.url], [t.url for t in targets], [first, second]), P)


def test_valkey_get_counters_bandwidth_and_busy(valkey_server):
    r = redis.Redis(port=valkey_server.port)
    _fill(r, 20, 100_000)
    d = _live([BASE.text(), BASE.text()], [valkey_server], lambda: _gets(r, 200, 20))
    (inst,) = d.instances
    assert inst.get_calls == 200
    assert inst.bytes_out >= 200 * 100_000
    assert inst.usec_per_get and inst.usec_per_get > 0 and 0 < inst.get_busy_fraction < 1
    assert d.bandwidth_source == "valkey_server_upper_bound" and d.rho_bound in (None, "lower_bound")
    assert d.bandwidth_gbps == pytest.approx(inst.bandwidth_gbps)


@pytest.mark.parametrize("balanced", [False, True])
def test_hot_instance(valkey_factory, balanced):
    v0, v1 = valkey_factory(), valkey_factory()
    r0, r1 = redis.Redis(port=v0.port), redis.Redis(port=v1.port)
    for r in (r0, r1):
        _fill(r, 10, 50_000)

    def load():
        _gets(r0, 400, 10)
        if balanced:
            _gets(r1, 400, 10)

    d = _live([BASE.text()], [v0, v1], load)
    hot = [f for f in d.findings if f.id == "hot_instance"]
    if balanced:
        assert not hot
    else:
        assert hot and hot[0].evidence["rank"] == 0 and hot[0].severity == "warning"


@pytest.mark.parametrize("maxmemory, fires", [("2mb", True), ("256mb", False)])
def test_evictions_under_load(valkey_factory, maxmemory, fires):
    v = valkey_factory(settings={"maxmemory": maxmemory})
    r = redis.Redis(port=v.port)
    _fill(r, 5, 50_000)

    def load():
        for i in range(120):  # 6 MB one SET at a time: over a 2 MB maxmemory, LRU evicts
            r.set(f"big{i}", b"y" * 50_000)
        _gets(r, 50, 5)

    d = _live([BASE.text()], [v], load)
    assert ("evictions_under_load" in ids(d)) is fires
    if fires:
        assert d.instances[0].evicted_keys > 0


def test_metric_parse_error_names_the_source():
    with pytest.raises(InvalidInput, match="engine 0 metrics"):
        analyse(Capture(["x"], [], [Sample(0, ["vllm:x{ 1"], []), Sample(1, ["vllm:x 1"], [])]))


def test_quantile_and_count_above():
    buckets = {10.0: 2.0, 20.0: 6.0, float("inf"): 8.0}
    assert M.quantile(buckets, 0.5) == pytest.approx(15.0)
    assert M.count_above(buckets, 10.0) == 6.0
    assert M.count_above(buckets, 25.0) == 2.0
