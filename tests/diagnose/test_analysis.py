"""Observations and findings from two samples, every expected number worked out by hand.

Engine text comes from :mod:`tests.diagnose.engine_text` (written from the
documented vLLM/LMCache formats); Valkey INFO comes from real valkey-server
processes driven with redis-py between the two samples, or, where a number
must be exact, from INFO dicts written here. Expected values are literals or
arithmetic on the inputs written out in the test, never a call into kvctl.
"""

from __future__ import annotations

import math
import time

import pytest
import redis

from kvctl.records import prometheus as M
from kvctl.diagnose.analysis import Params, analyse
from kvctl.diagnose.capture import Capture, Sample, take_sample
from kvctl.diagnose.sources import GpuSample
from kvctl.core.errors import InvalidInput
from kvctl.tier.targets import resolve_targets
from tests.diagnose.engine_text import EngineState
from tests.diagnose.metrics_server import MetricsServer
from tests.tier.servers import valkey_8

S_PAPER = 48437.5  # bytes per token, GLM-5.3 FP8 MLA (paper §4)
BASE = EngineState(engines=2)
NO_LMCACHE = EngineState(engines=1, lmcache=False)  # no engine-side L2 counters: B and ρ come from Valkey


def healthy(**over) -> EngineState:
    """10 requests of 16k tokens in the window, 10 GETs of 10 ms moving 1 GB: B = 1e9 B / 0.1 s = 10 GB/s."""
    kw = dict(requests=10, prompt_lengths=[16000] * 10, external_hits=100000, external_queries=160000,
              remote_read_bytes=1e9, remote_get_ms=[10] * 10, lookup_s=[0.001] * 10, lmcache_hit_tokens=100000)
    kw.update(over)
    return BASE.advance(**kw)


def cap_of(a: EngineState, b: EngineState, window: float = 1.0, gpu: GpuSample | None = None, params: dict | None = None,
           valkey: list[tuple[dict, dict]] | None = None) -> Capture:
    g = gpu or GpuSample(note="no GPU visible (test)")
    va, vb = [v[0] for v in valkey or []], [v[1] for v in valkey or []]
    urls = [f"resp://valkey-{r}:6379" for r in range(len(va))]
    return Capture(["http://engine:8000"], urls, [Sample(100.0, [a.text()], va, g), Sample(100.0 + window, [b.text()], vb, g)], params or {})


def info(calls: float, usec: float, bytes_out: float, evicted: float = 0) -> dict:
    """The INFO fields the analysis reads, as redis-py parses them."""
    return {"cmdstat_get": {"calls": calls, "usec": usec}, "total_net_output_bytes": bytes_out, "evicted_keys": evicted}


def ids(diag) -> set[str]:
    return {f.id for f in diag.findings}


P = Params(bytes_per_token=S_PAPER, prefill_rate=52200, t0_s=0.1)
B_STAR_PAPER = 2.5284375  # s·R = 48437.5 B/token × 52200 tok/s = 2 528 437 500 B/s


def test_healthy_engine_observations_and_no_findings():
    d = analyse(cap_of(BASE, healthy()), P)
    assert d.requests == 10
    assert d.arrival_rate_per_s == pytest.approx(10.0)  # 10 finished + 0 queue growth in 1 s
    assert d.mean_prompt_tokens == pytest.approx(16000)  # 10 × 16000 / 10
    assert d.hit_token_fraction == pytest.approx(0.625)  # 100 000 hit / 160 000 prompt tokens
    assert d.bandwidth_gbps == pytest.approx(10.0)  # 1e9 B / (10 GETs × 10 ms = 0.1 s) = 1e10 B/s
    assert d.bandwidth_source == "lmcache_client" and d.rho_bound == "estimate"
    assert d.breakeven_gbps == pytest.approx(B_STAR_PAPER)
    assert d.min_hit_tokens == pytest.approx(5220)  # R·T0 = 52200 × 0.1
    assert d.l2_bytes_per_request == pytest.approx(1e8)  # 1e9 B/s over 10 completions/s
    assert d.rho == pytest.approx(0.1)  # 10 req/s × 1e8 B / 1e10 B/s
    assert d.load_busy_fraction == pytest.approx(0.1)  # 1e9 B/s served / 1e10 B/s
    assert d.l2_tokens_per_s == pytest.approx(20645.16129)  # 1e9 B/s / 48437.5 B/token
    assert d.findings == [] and d.worst_severity == "ok" and d.outcome == "ok"


def test_sums_over_engines_and_label_sets():
    one = analyse(cap_of(EngineState(engines=1), EngineState(engines=1).advance(requests=12, prompt_lengths=[100] * 12)), P)
    three = analyse(cap_of(EngineState(engines=3), EngineState(engines=3).advance(requests=12, prompt_lengths=[100] * 12)), P)
    # 12 requests split over 1 or 3 engine label sets (and 2 finished_reason each): 12 / 1 s either way
    assert one.arrival_rate_per_s == pytest.approx(12.0) and three.arrival_rate_per_s == pytest.approx(12.0)


def test_counter_reset_counts_from_zero():
    before = BASE.advance(requests=1000)
    after = BASE.advance(requests=5)  # the engine restarted inside the window
    d = analyse(cap_of(before, after), P)
    assert d.requests == pytest.approx(5)
    assert "engine_restarted" in ids(d)


def test_queue_growth_counts_in_the_offered_rate():
    # 10 finished and the waiting queue grew 0 → 30 in 2 s: λ = (10 + 30) / 2 = 20 req/s, completions 10 / 2 = 5
    d = analyse(cap_of(BASE, healthy(waiting=30), window=2.0), P)
    assert d.arrival_rate_per_s == pytest.approx(20.0) and d.completion_rate_per_s == pytest.approx(5.0)
    assert d.queue_growth == pytest.approx(30)
    # L2 bytes per request: 1e9 B / 2 s = 5e8 B/s over 5 completions/s = 1e8 B; ρ = 20 × 1e8 / 1e10 = 0.2
    assert d.rho == pytest.approx(0.2)
    assert d.load_busy_fraction == pytest.approx(0.05)  # 5e8 B/s / 1e10 B/s: served, not offered


def test_rho_unstable_fires_with_instances_for_half():
    d = analyse(cap_of(BASE, healthy(remote_get_ms=[300] * 10)), P)  # 10 × 300 ms = 3 s of GETs for 1e9 B
    f = {f.id: f for f in d.findings}["rho_unstable"]
    assert d.bandwidth_gbps == pytest.approx(1 / 3)  # 1e9 B / 3 s
    assert d.rho == pytest.approx(3.0)  # 10 req/s × 1e8 B / (1e9 / 3 B/s)
    assert f.severity == "critical" and d.worst_severity == "critical"
    assert f.evidence["instances_for_rho_target"] == 6  # ceil(3.0 × 1 instance / 0.5)
    assert "6 Valkey instance" in f.recommendation and "async" in f.recommendation


def test_rho_high_is_a_warning_below_one():
    d = analyse(cap_of(BASE, healthy(remote_get_ms=[80] * 10)), Params(bytes_per_token=S_PAPER, prefill_rate=10000, t0_s=0.1))
    assert d.bandwidth_gbps == pytest.approx(1.25)  # 1e9 B / 0.8 s
    assert d.rho == pytest.approx(0.8)  # 1e9 B/s offered / 1.25e9 B/s
    assert d.breakeven_gbps == pytest.approx(0.484375)  # 48437.5 × 10000 = 484 375 000 B/s < B: no below-B* finding
    assert ids(d) == {"rho_high"} and d.worst_severity == "warning"


@pytest.mark.parametrize("get_ms, bw, fires", [([300] * 10, 1 / 3, True), ([10] * 10, 10.0, False)])
def test_bandwidth_below_breakeven(get_ms, bw, fires):
    d = analyse(cap_of(BASE, healthy(remote_get_ms=get_ms)), P)
    assert d.bandwidth_gbps == pytest.approx(bw)  # 1e9 B / Σ GET ms; B* = 2.528 GB/s
    assert ("bandwidth_below_breakeven" in ids(d)) is fires


@pytest.mark.parametrize("t0, fires", [(0.33, True), (0.1, False)])
def test_typical_prompt_below_min_hit(t0, fires):
    d = analyse(cap_of(BASE, healthy()), Params(bytes_per_token=S_PAPER, prefill_rate=52200, t0_s=t0))
    assert ("prompt_below_min_hit" in ids(d)) is fires
    if fires:  # 16k prompts, n* = 52200 × 0.33 = 17226: the paper's case; info only
        assert d.min_hit_tokens == pytest.approx(17226)
        assert d.worst_severity == "info"
    else:  # n* = 52200 × 0.1 = 5220 < 16000
        assert d.min_hit_tokens == pytest.approx(5220)


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
    assert d.breakeven_gbps == pytest.approx(2.421875)  # 48437.5 × 50000 = 2 421 875 000 B/s
    assert d.min_hit_tokens == pytest.approx(16500)  # 50000 tok/s × the paper's T0 0.33 s


def test_prefill_rate_overlapping_prefills_capped_at_the_window():
    # 4 × 25000 = 100000 tokens whose prefill times sum to 20 s in a 10 s window: the engine was busy
    # at most 10 s, so R ≥ 100000 / 10 = 10000 tok/s (said to be a lower bound)
    b = BASE.advance(requests=4, prompt_lengths=[25000] * 4, prefill_time_s=20.0)
    d = analyse(cap_of(BASE, b, window=10.0), Params(bytes_per_token=S_PAPER))
    assert d.prefill_rate_tok_s == pytest.approx(10000)
    assert "lower bound" in d.prefill_rate_source


def test_prefill_rate_implausibly_low_is_a_finding_not_a_rate():
    # 4 × 100 = 400 tokens in 10 s of prefill: 40 tok/s, below the 100 tok/s floor
    b = BASE.advance(requests=4, prompt_lengths=[100] * 4, prefill_time_s=10.0)
    d = analyse(cap_of(BASE, b, window=20.0), Params(bytes_per_token=S_PAPER))
    assert d.prefill_rate_tok_s is None and d.breakeven_gbps is None
    (f,) = [f for f in d.findings if f.id == "prefill_rate_implausible"]
    assert f.evidence["derived_prefill_rate_tok_s"] == pytest.approx(40)


def test_missing_inputs_are_notes_not_crashes():
    d = analyse(cap_of(BASE, BASE), Params())
    assert d.rho is None and d.breakeven_gbps is None
    assert "bytes per token" in d.null_reasons["breakeven_gbps"] and "prefill" in d.null_reasons["prefill_rate_tok_s"]
    assert d.outcome == "insufficient_data" and any("no request" in r for r in d.insufficient_data)


def test_capture_parameters_used_when_no_flags():
    d = analyse(cap_of(BASE, healthy(), params={"bytes_per_token": S_PAPER, "prefill_rate": 52200, "t0_s": 0.1}), Params())
    assert d.breakeven_gbps == pytest.approx(B_STAR_PAPER) and d.t0_s == 0.1


def test_samples_out_of_order_refused():
    with pytest.raises(InvalidInput):
        analyse(cap_of(BASE, healthy(), window=-1.0), P)


def test_kvctl_connector_bandwidth_is_w_times_summed_bytes_over_summed_seconds():
    """4 ranks each read 2e9 B in 4 s of GETs (in parallel): Σbytes 8e9, Σseconds 16 s.
    B = 4 × 8e9 / 16 = 2e9 B/s = 2 GB/s (not 8e9 / 16 = 0.5 GB/s, one rank's view).
    10 requests in 10 s: 1 req/s × 8e8 B/s ÷ 1 req/s = 8e8 B per request; ρ = 1 × 8e8 / 2e9 = 0.4."""
    a = EngineState(engines=1, lmcache=False, kvctl_get_bytes=0, extra={"kvctl:ranks": 4})
    b = a.advance(requests=10, prompt_lengths=[1000] * 10, kvctl_get_bytes=8e9, kvctl_get_s=16.0)
    d = analyse(cap_of(a, b, window=10.0), P)
    assert d.bandwidth_source == "kvctl_connector" and d.engine_ranks == 4
    assert d.bandwidth_gbps == pytest.approx(2.0)
    assert d.l2_bytes_per_request == pytest.approx(8e8)
    assert d.rho == pytest.approx(0.4) and d.rho_bound == "estimate"
    assert d.bandwidth_gbps < B_STAR_PAPER and "bandwidth_below_breakeven" in ids(d)


def test_implausible_bandwidth_is_refused_not_used():
    # 1e15 B in 1 s of engine-side GETs: 1e6 GB/s, beyond the 1000 GB/s plausibility cap
    b = healthy(remote_read_bytes=1e15, remote_get_ms=[100] * 10)
    d = analyse(cap_of(BASE, b), P)
    assert d.bandwidth_gbps is None and d.rho is None
    (f,) = [f for f in d.findings if f.id == "bandwidth_implausible"]
    assert f.evidence["bandwidth_gbps"] == pytest.approx(1e6)  # 1e15 B / (10 × 100 ms) / 1e9


def test_an_unreachable_component_is_named_and_sets_the_exit_status():
    g = GpuSample(note="no GPU visible (test)")
    # the engine answered; Valkey rank 0 did not answer the second read
    a = Sample(100.0, [BASE.text()], [info(0, 0, 0)], g)
    b = Sample(101.0, [healthy().text()], [None], g, valkey_errors=["Valkey rank 0 at h:1 unreachable: timed out"])
    d = analyse(Capture(["http://engine:8000"], ["resp://h:1"], [a, b]), P)
    assert d.unreachable == ["Valkey rank 0 (resp://h:1): second sample: Valkey rank 0 at h:1 unreachable: timed out"]
    assert d.exit_status == 5 and d.worst_severity == "ok"
    assert d.rho == pytest.approx(0.1)  # the engine side still answers: 10 req/s × 1e8 B / 10 GB/s
    # a critical finding outranks the unreachable component (exit 4 before 5)
    b_crit = Sample(101.0, [healthy(remote_get_ms=[300] * 10).text()], [None], g)
    assert analyse(Capture(["http://engine:8000"], ["resp://h:1"], [a, b_crit]), P).exit_status == 4
    # an engine that did not answer the first read: no λ, so insufficient data as well
    c = analyse(Capture(["http://engine:8000"], [], [Sample(100.0, [None], [], g, engine_errors=["refused"]), Sample(101.0, [healthy().text()], [], g)]), P)
    assert c.unreachable == ["engine http://engine:8000: first sample: refused"] and c.exit_status == 5 and c.rho is None


# --- server side: B and ρ from Valkey's INFO -------------------------------------


@pytest.mark.parametrize("growth, rho, finding", [(0, 0.25, None), (6, 0.4, None), (22, 0.8, "rho_high"), (110, 3.0, "rho_unstable")])
def test_server_side_rho_is_a_lower_bound_from_get_time(growth, rho, finding):
    """One instance over a 2 s window: 1000 GETs of 1 MB, 0.5 s of GET time inside Valkey.

    Bytes out: 1000 × (1 000 000 + len("$1000000\\r\\n") 10 + len("\\r\\n") 2) = 1 000 012 000 B.
    B = 1 000 012 000 B / 0.5 s = 2 000 024 000 B/s = 2.000024 GB/s (an upper bound on what the engine sees).
    Served: 1 000 012 000 B / 2 s = 500 006 000 B/s over 10 req / 2 s = 5 req/s: 100 001 200 B per request.
    λ = (10 + growth) / 2 s; ρ = λ × 100 001 200 / 2 000 024 000 = λ / 20 = (10 + growth) / 40:
    growth 0 → 0.25, 6 → 0.4, 22 → 0.8, 110 → 3.0 (instances for ρ ≤ 0.5: ceil(3.0 / 0.5) = 6).
    """
    per_get = 1_000_000 + 10 + 2
    b = NO_LMCACHE.advance(requests=10, prompt_lengths=[16000] * 10, waiting=growth)
    d = analyse(cap_of(NO_LMCACHE, b, window=2.0, valkey=[(info(0, 0, 0), info(1000, 500_000, 1000 * per_get))]), P)
    (inst,) = d.instances
    assert inst.get_calls == 1000 and inst.bytes_out == 1_000_012_000
    assert inst.usec_per_get == pytest.approx(500)  # 500 000 µs / 1000 GETs
    assert inst.get_busy_fraction == pytest.approx(0.25)  # 0.5 s of 2 s
    assert d.bandwidth_source == "valkey_server_upper_bound" and d.rho_bound == "lower_bound"
    assert d.bandwidth_gbps == pytest.approx(2.000024)
    assert d.l2_bytes_per_request == pytest.approx(100_001_200)
    assert d.arrival_rate_per_s == pytest.approx((10 + growth) / 2)
    assert d.rho == pytest.approx(rho)
    assert any("lower bound" in n for n in d.notes)
    rho_findings = [f for f in d.findings if f.id.startswith("rho_")]
    if finding is None:
        assert rho_findings == []
    else:
        (f,) = rho_findings
        assert f.id == finding and "lower bound" in f.message and f.evidence["rho_bound"] == "lower_bound"
    if finding == "rho_unstable":
        assert f.evidence["instances_for_rho_target"] == 6
    assert "bandwidth_below_breakeven" in ids(d)  # 2.000024 < B* 2.5284375 GB/s


def test_server_side_bandwidth_sums_instances():
    """Two instances, 2 s: rank 0 sends 4e8 B in 0.2 s of GETs (2 GB/s), rank 1 6e8 B in 0.2 s (3 GB/s).
    B = 2 + 3 = 5 GB/s; served 1e9 B / 2 s = 5e8 B/s over 5 req/s = 1e8 B per request;
    ρ = 5 req/s × 1e8 B / 5e9 B/s = 0.1."""
    b = NO_LMCACHE.advance(requests=10, prompt_lengths=[16000] * 10)
    v = [(info(0, 0, 0), info(400, 200_000, 4e8)), (info(0, 0, 0), info(600, 200_000, 6e8))]
    d = analyse(cap_of(NO_LMCACHE, b, window=2.0, valkey=v), P)
    assert [i.bandwidth_gbps for i in d.instances] == [pytest.approx(2.0), pytest.approx(3.0)]
    assert d.bandwidth_gbps == pytest.approx(5.0)
    assert d.rho == pytest.approx(0.1)


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


def _get_usec(r: redis.Redis) -> int:
    """Valkey's own total GET time (µs), read by the test itself: INFO does not count as a GET."""
    return int(r.info("commandstats").get("cmdstat_get", {}).get("usec", 0))


def _live(srv_texts, valkeys, load):
    """Two real samples around ``load``, with wall-time brackets of each sample's reads."""
    targets = resolve_targets([v.url for v in valkeys])
    with MetricsServer(srv_texts) as srv:
        t0 = time.time()
        first = take_sample([srv.url], targets)
        t1 = time.time()
        load()
        t2 = time.time()
        second = take_sample([srv.url], targets)
        t3 = time.time()
    return analyse(Capture([srv.url], [t.url for t in targets], [first, second]), P), (t0, t1, t2, t3)


# GET bytes are the bytes out less the INFO replies (the first sample's own reply is written after its
# counters were read), whose size is estimated from the parsed INFO (within ~50 B of ~7 KB on Valkey 8.1),
# plus the second sample's connection handshake (a few "+OK" replies)
INFO_SLACK_BYTES = 1024


@pytest.fixture
def valkey_8_server(valkey_factory):
    """The server-side bound needs a server whose GET time holds the copy of the value: Valkey 8.1 (9.x writes the
    reply from the value after the command: test_valkey_9_gets_bound_no_bandwidth)."""
    return valkey_factory(binary=valkey_8())


def test_real_gets_server_side_bandwidth_and_rho(valkey_8_server):
    """300 real GETs of 100 000 B between two samples; the engine finished 1 request while its queue grew by 999.

    Bytes out: 300 × (100 000 + len("$100000\\r\\n") 9 + 2) = 300 × 100 011 = 30 003 300 B, plus one INFO reply.
    With ΔG the GET µs Valkey counted (read here independently) and w the window between the two INFO reads:
    B = bytes / ΔG; served bytes/request = bytes / w ÷ (1 / w_e); λ = (1 + 999) / w_e, so
    ρ = λ × bytes·w_e / w / (bytes / ΔG) = 1000 × ΔG / w, and w lies between the samples' wall-clock brackets.
    300 GETs of 100 kB cost Valkey at least ~1 ms (a copy each; ~16 ms measured), so with w < 1 s ρ ≥ 1.
    """
    n, size, growth = 300, 100_000, 999
    valkey_server = valkey_8_server
    r = redis.Redis(port=valkey_server.port)
    _fill(r, 20, size)
    before = NO_LMCACHE
    after = before.advance(requests=1, prompt_lengths=[16000], waiting=growth)
    usec0 = _get_usec(r)
    d, (t0, t1, t2, t3) = _live([before.text(), after.text()], [valkey_server], lambda: _gets(r, n, 20))
    g_s = (_get_usec(r) - usec0) / 1e6
    assert g_s > 0
    (inst,) = d.instances
    assert inst.get_calls == 300
    assert inst.bytes_out == pytest.approx(30_003_300, abs=INFO_SLACK_BYTES)
    w_min, w_max = t2 - t1, t3 - t0  # the first read lies in [t0, t1], the second in [t2, t3]
    assert w_min <= inst.window_s <= w_max
    assert g_s / w_max <= inst.get_busy_fraction <= g_s / w_min
    assert d.bandwidth_source == "valkey_server_upper_bound" and d.rho_bound == "lower_bound"
    assert (30_003_300 - INFO_SLACK_BYTES) / g_s / 1e9 <= d.bandwidth_gbps <= (30_003_300 + INFO_SLACK_BYTES) / g_s / 1e9
    assert d.arrival_rate_per_s and d.completion_rate_per_s  # engine window: the MetricsServer's reads
    assert d.arrival_rate_per_s / d.completion_rate_per_s == pytest.approx(1000)  # (1 + 999) / 1
    assert 1000 * g_s / w_max <= d.rho <= 1000 * g_s / w_min
    assert d.rho == pytest.approx(1000 * inst.get_busy_fraction)  # the same ρ, by the algebra above
    assert w_max < 1 and d.rho >= 1
    (f,) = [f for f in d.findings if f.id.startswith("rho_")]
    assert f.id == "rho_unstable" and "lower bound" in f.message
    # instances for ρ ≤ 0.5: ceil(ρ / 0.5), bracketed by the bounds on ρ
    assert math.ceil(2000 * g_s / w_max - 1e-9) <= f.evidence["instances_for_rho_target"] <= math.ceil(2000 * g_s / w_min)


def test_real_gets_counted_exactly_with_no_queue_rho_is_the_busy_fraction(valkey_8_server):
    """No queue growth: λ = completions, so ρ = ΔG / w ≤ 1: the busy fraction of Valkey's GET time."""
    valkey_server = valkey_8_server
    r = redis.Redis(port=valkey_server.port)
    _fill(r, 20, 100_000)
    usec0 = _get_usec(r)
    after = NO_LMCACHE.advance(requests=4, prompt_lengths=[16000] * 4)
    d, (t0, t1, t2, t3) = _live([NO_LMCACHE.text(), after.text()], [valkey_server], lambda: _gets(r, 200, 20))
    g_s = (_get_usec(r) - usec0) / 1e6
    (inst,) = d.instances
    assert inst.get_calls == 200
    assert inst.bytes_out == pytest.approx(200 * 100_011, abs=INFO_SLACK_BYTES)
    assert g_s / (t3 - t0) <= d.rho <= g_s / (t2 - t1) and d.rho <= 1
    assert d.rho == pytest.approx(inst.get_busy_fraction)


def test_valkey_9_gets_bound_no_bandwidth(valkey_server):
    """Valkey 9.1 counts a GET's time without the copy of its value (copy avoidance: 300 GETs of 100 kB cost it well
    under 1 ms here, 8.1 ~3 ms): its bytes / GET time is no bound on B, so no B and no ρ come from it. The engine was
    given and answered without a connector's series: the reason says why that is (no Prometheus multiprocess
    collection for LMCache's series) and --tier-gbps, never "give an engine's --engine-url" (issue 47 item 2)."""
    r = redis.Redis(port=valkey_server.port)
    assert r.info("server")["valkey_version"].startswith("9.")
    _fill(r, 20, 100_000)
    after = NO_LMCACHE.advance(requests=1, prompt_lengths=[16000], waiting=999)
    d, _ = _live([NO_LMCACHE.text(), after.text()], [valkey_server], lambda: _gets(r, 300, 20))
    (inst,) = d.instances
    assert inst.get_calls == 300 and inst.server_version.startswith("9.") and inst.io_threads == 1
    assert d.bandwidth_gbps is None and d.rho is None and not [f for f in d.findings if f.id.startswith("rho_")]
    why = d.null_reasons["bandwidth_gbps"]
    assert "Valkey 9.x" in why and "PROMETHEUS_MULTIPROC_DIR" in why and "--tier-gbps" in why and "--engine-url" not in why


def test_no_gets_serve_no_l2_bytes_whatever_else_the_instance_replied(valkey_server):
    """Issue 22's phantom L2 traffic: with 0 GETs, the samplers' own INFO replies (total_net_output_bytes)
    were counted as served KV ("L2-served tokens/s 0.296"). Here the window holds SETs, EXISTS and another
    monitor's INFO calls, but no GET: nothing was served."""
    r = redis.Redis(port=valkey_server.port)

    def other_traffic():
        _fill(r, 5, 1000)
        for _ in range(3):
            r.exists("k0")
            r.info("all")

    after = NO_LMCACHE.advance(requests=2, prompt_lengths=[16000] * 2)
    d, _ = _live([NO_LMCACHE.text(), after.text()], [valkey_server], other_traffic)
    (inst,) = d.instances
    assert inst.get_calls == 0 and inst.bytes_out == 0 and inst.bytes_out_per_s == 0
    assert d.l2_tokens_per_s == 0 and inst.bandwidth_gbps is None


def test_gets_bytes_leave_out_other_monitors_info_replies(valkey_server):
    """200 GETs of 100 000 B: 200 × 100 011 B served, whatever INFO replies (~7 KB each) went out beside
    them; before, each of these 5 INFO replies and the sampler's own was counted as GET bytes."""
    r = redis.Redis(port=valkey_server.port)
    _fill(r, 20, 100_000)

    def load():
        _gets(r, 200, 20)
        for _ in range(5):
            r.info("all")

    d, _ = _live([NO_LMCACHE.text(), NO_LMCACHE.advance(requests=1, prompt_lengths=[16000]).text()], [valkey_server], load)
    (inst,) = d.instances
    assert inst.get_calls == 200
    assert inst.bytes_out == pytest.approx(200 * 100_011, abs=INFO_SLACK_BYTES)  # INFO's size: estimated from its fields


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

    d, _ = _live([BASE.text()], [v0, v1], load)
    # 400 GETs × (50 000 + len("$50000\r\n") 8 + 2) = 20 004 000 B out of rank 0
    assert d.instances[0].bytes_out == pytest.approx(20_004_000, abs=INFO_SLACK_BYTES)
    assert d.instances[1].get_calls == (400 if balanced else 0)
    hot = [f for f in d.findings if f.id == "hot_instance"]
    if balanced:
        assert not hot
    else:
        assert hot and hot[0].evidence["rank"] == 0 and hot[0].severity == "warning"
        assert hot[0].evidence["get_calls"] == 400


@pytest.mark.parametrize("maxmemory, fires", [("2mb", True), ("256mb", False)])
def test_evictions_under_load(valkey_factory, maxmemory, fires):
    v = valkey_factory(settings={"maxmemory": maxmemory})
    r = redis.Redis(port=v.port)
    _fill(r, 5, 50_000)

    def load():
        for i in range(120):  # 6 MB one SET at a time: over a 2 MB maxmemory, LRU evicts
            r.set(f"big{i}", b"y" * 50_000)
        _gets(r, 50, 5)

    d, _ = _live([BASE.text()], [v], load)
    assert ("evictions_under_load" in ids(d)) is fires
    if fires:
        # 120 SETs of 50 000 B = 6 MB into 2 MB: at least (6 MB - 2 MB) / 50 000 B = 80 keys had to go
        assert d.instances[0].evicted_keys >= 80
    else:
        assert d.instances[0].evicted_keys == 0


def test_metric_parse_error_names_the_source():
    with pytest.raises(InvalidInput, match="engine 0 metrics"):
        analyse(Capture(["x"], [], [Sample(0, ["vllm:x{ 1"], []), Sample(1, ["vllm:x 1"], [])]))


def test_quantile_and_count_above():
    buckets = {10.0: 2.0, 20.0: 6.0, float("inf"): 8.0}
    # median: rank 4 of 8 falls in (10, 20] holding ranks 3..6: 10 + (4 - 2) / (6 - 2) × 10 = 15
    assert M.quantile(buckets, 0.5) == pytest.approx(15.0)
    assert M.count_above(buckets, 10.0) == 6.0  # 8 - 2 at or below 10
    assert M.count_above(buckets, 25.0) == 2.0  # only the +Inf bucket's 8 - 6


# --- several engines sharing instances (kvctl/diagnose/fleet.py) ------------------------------------------


def fleet_capture(b_bytes: float, b_secs: float = 8.0) -> Capture:
    """Engine A: 4 ranks, 10 requests in 10 s, 8e9 B in Σ16 s of GETs. Engine B: 2 ranks, 20 requests, ``b_bytes``
    in Σ``b_secs`` s. Four Valkey instances; A uses ranks 0-3, B ranks 0-1."""
    g = GpuSample(note="no GPU visible (test)")
    a0 = EngineState(engines=1, lmcache=False, kvctl_get_bytes=0, extra={"kvctl:ranks": 4})
    b0 = EngineState(engines=1, lmcache=False, kvctl_get_bytes=0, extra={"kvctl:ranks": 2})
    a1 = a0.advance(requests=10, prompt_lengths=[1000] * 10, kvctl_get_bytes=8e9, kvctl_get_s=16.0)
    b1 = b0.advance(requests=20, prompt_lengths=[1000] * 20, kvctl_get_bytes=b_bytes, kvctl_get_s=b_secs)
    urls = [f"resp://valkey-{r}:6379" for r in range(4)]
    va, vb = [info(0, 0, 0)] * 4, [info(100, 1e5, 1e9)] * 4
    return Capture(["http://engine-a:8000", "http://engine-b:8000"], urls,
                   [Sample(100.0, [a0.text(), b0.text()], va, g), Sample(110.0, [a1.text(), b1.text()], vb, g)], {})


def test_instance_rho_sums_the_engines_that_use_it():
    """A: B_A = 4 × 8e9 / 16 = 2 GB/s, 8e8 B/request, λ 1/s: ρ_A = 1 × 8e8 / 2e9 = 0.4.
    B: B_B = 2 × 4e9 / 8 = 1 GB/s, 2e8 B/request, λ 2/s: ρ_B = 2 × 2e8 / 1e9 = 0.4.
    Per rank both see 0.5 GB/s, so B_i = 0.5 GB/s. Instance 0 (A and B): A's 1 × 8e8 / 4 = 2e8 B/s + B's 2 × 2e8 / 2
    = 2e8 B/s = 4e8 B/s → ρ_0 = 0.8 (each engine alone: 0.4). Instance 2 (A only): 2e8 / 5e8 = 0.4."""
    d = analyse(fleet_capture(4e9), P)
    eng = {e.url: e for e in d.engine_loads}
    assert eng["http://engine-a:8000"].rho == pytest.approx(0.4) and eng["http://engine-a:8000"].instances == (0, 1, 2, 3)
    assert eng["http://engine-b:8000"].rho == pytest.approx(0.4) and eng["http://engine-b:8000"].instances == (0, 1)
    inst = {i.rank: i for i in d.instance_loads}
    assert inst[0].rho == pytest.approx(0.8) and inst[1].rho == pytest.approx(0.8)
    assert inst[2].rho == pytest.approx(0.4) and inst[3].rho == pytest.approx(0.4)
    assert inst[0].engines == (0, 1) and inst[2].engines == (0,)
    assert inst[0].bandwidth_gbps == pytest.approx(0.5) and inst[0].rho_bound == "estimate"
    assert dict(inst[0].shares) == pytest.approx({0: 0.4, 1: 0.4})
    f = next(f for f in d.findings if f.id == "instance_saturated")
    assert f.severity == "warning" and f.evidence["rank"] == 0 and "2 engines" in f.message


def test_below_the_warning_threshold_no_finding():
    """B moves 8e9 B in Σ8 s: B_B = 2 × 8e9 / 8 = 2 GB/s, 1 GB/s per rank, so B_i = max(0.5, 1) = 1 GB/s; 4e8 B/request.
    Instance 0 carries A's 2e8 + B's 2 × 4e8 / 2 = 4e8 → 6e8 B/s over 1e9 B/s: ρ_0 = 0.6 < 0.7, no finding."""
    d = analyse(fleet_capture(8e9), P)
    inst = {i.rank: i for i in d.instance_loads}
    assert inst[0].rho == pytest.approx(0.6) and inst[0].bandwidth_gbps == pytest.approx(1.0)
    assert "instance_saturated" not in ids(d)


def test_other_engines_saturate_a_shared_instance_critical():
    """B moves 1.2e10 B in Σ24 s: B_B = 2 × 1.2e10 / 24 = 1 GB/s (0.5 per rank, B_i = 0.5 GB/s), 6e8 B/request.
    Instance 0: A's 2e8 + B's 2 × 6e8 / 2 = 6e8 → 8e8 B/s over 5e8 B/s: ρ_0 = 1.6, critical, though A alone is at
    ρ_A = 0.4 (B's own ρ_B = 2 × 6e8 / 1e9 = 1.2)."""
    d = analyse(fleet_capture(1.2e10, 24.0), P)
    inst = {i.rank: i for i in d.instance_loads}
    assert inst[0].rho == pytest.approx(1.6) and inst[2].rho == pytest.approx(0.4)
    f = next(f for f in d.findings if f.id == "instance_saturated")
    assert f.severity == "critical" and f.evidence["rho"] == pytest.approx(1.6)
    assert f.evidence["shares"] == pytest.approx({"0": 0.4, "1": 1.2})
    assert "engine 1 (http://engine-b:8000) ρ 1.20" in f.message


def test_one_engine_has_no_fleet_loads():
    d = analyse(cap_of(BASE, healthy()), P)
    assert d.engine_loads == [] and d.instance_loads == []


def test_diagnose_prints_the_shared_instances(tmp_path):
    from click.testing import CliRunner  # noqa: PLC0415

    from kvctl.cli import cli  # noqa: PLC0415
    from kvctl.diagnose.capture import save_capture  # noqa: PLC0415

    save_capture(fleet_capture(1.2e10, 24.0), tmp_path / "cap")
    r = CliRunner().invoke(cli, ["diagnose", "--from", str(tmp_path / "cap"), "--bytes-per-token", str(S_PAPER), "--prefill-rate", "52200"])
    assert r.exit_code == 4, r.output  # critical: instance 0 at ρ 1.6
    assert "Instances shared by engines" in r.output and "instance_saturated" in r.output
    assert "runbook: kvctl runbook instance_saturated" in r.output


# --- issue 31, item 5: a median from a histogram never lies outside what was observed, and says it is an estimate


def test_median_of_prompts_all_in_one_bucket_is_their_sum_over_count():
    """Every prompt 4,160 tokens, all in the bucket (2000, 5000]: interpolating inside it gave 3,500, below every
    prompt (the drill engine's (4096, 8192] gave 6,144, above every one). One bucket holds them all, so the
    histogram's sum/count is their mean, 4,160, and the output says that is where it came from."""
    d = analyse(cap_of(BASE, healthy(prompt_lengths=[4160] * 10)), P)
    assert d.typical_prompt_tokens == pytest.approx(4160)
    assert d.typical_prompt_tokens_basis == "one_bucket_mean"
    q = next(q for q in d.explain if q.name.startswith("typical (median) prompt tokens"))
    assert "sum/count" in q.formula and "one bucket" in q.formula


def test_median_inside_a_bucket_is_clamped_by_the_buckets_sum_and_called_an_estimate():
    """99 prompts of 4,160 in (4096, 8192] and one of 100 in (64, 128]: interpolation puts the median at
    4096 + 4096 × 49/99 = 6,123, above every prompt. The sum bounds the bucket's 49th value: its 51 values
    from the 49th up are at least that value and the 48 below it more than 4096, so it is at most
    (Σ_bucket − 48 × 4096) / 51 ≤ (411 940 − 64 − 196 608) / 51 = 4,221."""
    buckets = {64.0: 0.0, 128.0: 1.0, 4096.0: 1.0, 8192.0: 100.0, float("inf"): 100.0}
    est = M.quantile_estimate(buckets, 0.5, total_sum=99 * 4160 + 100)
    assert 4096 <= est.value <= 4221.1 and est.basis == "bucket_estimate"
    assert est.lo == 4096 and est.hi == pytest.approx(215268 / 51)  # (411 940 − 64 − 48 × 4096) / 51 = 4,220.9
    one = M.quantile_estimate({4096.0: 0.0, 8192.0: 10.0, float("inf"): 10.0}, 0.5, total_sum=41600)
    assert one.value == 4160 and one.basis == "one_bucket_mean"
    assert M.quantile_estimate(buckets, 0.5).basis == "bucket_interpolation"  # no sum: interpolated, and said so
