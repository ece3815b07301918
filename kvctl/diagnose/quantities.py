"""The named steps of :func:`kvctl.diagnose.analysis.analyse`: from counter deltas to λ, B, B*, n* and ρ.

Pure (no I/O). Each step derives a few quantities and writes into one :class:`Notebook`
how it computed them (a :class:`Quantity` each, for ``--explain``), why a value stayed
unknown (``why``, the Diagnosis' ``null_reasons``), what it noticed (``notes``) and what
kept it from a verdict (``insufficient``, ``unreachable``). analyse calls the steps in
one order, so these lists keep the order in which the quantities depend on each other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Sequence

from kvctl.core import cost
from kvctl.connector import metric_names as N
from kvctl.core.errors import KvctlError
from kvctl.core.thresholds import DIAGNOSIS_WINDOW_S, LMCACHE_PUBLISH_S
from kvctl.diagnose import arrivals as A
from kvctl.records import prometheus as M
from kvctl.diagnose.capture import Capture, Sample
from kvctl.diagnose.findings import Params
from kvctl.diagnose.observations import EngineObs, InstanceObs, Deltas, ratio, EnginePair, engine_obs, engine_pairs, instance_obs
from kvctl.tier.sizing import ZERO_COPY_MAJOR, parse_version

#: where B came from (``Diagnosis.bandwidth_source``)
BW_GIVEN = "given"
BW_KVCTL = "kvctl_connector"
BW_LMCACHE = "lmcache_client"
BW_VALKEY = "valkey_server_upper_bound"
BANDWIDTH_SOURCES = {
    BW_GIVEN: "--tier-gbps as given: the tier's GET bandwidth `kvctl bench` measured, not measured in this window",
    BW_KVCTL: "engine side, kvctl connector: W × Δkvctl:l2_get_bytes_total / Δkvctl:l2_get_seconds_total (both summed over W ranks loading in parallel)",
    BW_LMCACHE: "engine side, LMCache: Δlmcache:num_remote_read_bytes / Δlmcache:remote_time_to_get_sum (ms)",
    BW_VALKEY: (
        "Valkey server side: Σ bytes out / time in GETs — an UPPER bound on the bandwidth the engine sees "
        "(socket writes done by io-threads fall outside the GET's time), so ρ is a LOWER bound"
    ),
}


@dataclass(frozen=True)
class Quantity:
    """One derived number with how it was computed (for ``--explain``)."""

    name: str
    value: float | None
    formula: str
    source: str


@dataclass
class Notebook:
    """What the steps write down, in the order they find it."""

    explain: list[Quantity] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    why: dict[str, str] = field(default_factory=dict)  # field name -> why it is None
    insufficient: list[str] = field(default_factory=list)
    unreachable: list[str] = field(default_factory=list)


def _g(x: float | None) -> str:
    """A number for a formula string: 4 significant digits, "?" when unknown."""
    return "?" if x is None else f"{x:.4g}"


# --- engines: λ, prompts, hits ------------------------------------------------------------


@dataclass(frozen=True)
class Engines:
    obs: list[EngineObs]  # every engine URL, in --engine-url order
    ok: list[EnginePair]  # those read in both samples
    deltas: Deltas  # their counters, each over its own window
    per_engine: dict[int, EngineObs]  # the ok ones' observations by index


def read_engines(a: Sample, b: Sample, urls: list[str], nb: Notebook, samples: Sequence[Sample] = (), states_seen: Sequence[int] | None = None) -> Engines:
    """Each engine's deltas over its own window, and its λ from the states it published (``samples``: every sample of the
    window, the engine reads between the first and last included); the ones that could not be read go to unreachable/insufficient."""
    failed, ok = engine_pairs(a, b, list(urls), nb.notes)
    per_engine = {e.index: _with_states(engine_obs(e), e, samples or (a, b), states_seen) for e in ok}
    obs = sorted(list(failed) + list(per_engine.values()), key=lambda o: o.index)
    nb.unreachable += [f"engine {o.url}: {o.error}" for o in obs if o.status == "unreachable"]
    for o in obs:
        if o.status == "no_vllm_metrics":
            nb.insufficient.append(f"engine {o.url} served no vllm: metrics ({o.error}): point --engine-url at the vLLM API server (the port serving /v1/completions)")
    if not ok and not nb.insufficient and not nb.unreachable:
        nb.insufficient.append("no engine could be read in both samples: nothing to analyse; check --engine-url and that the engines are up")
    return Engines(obs=obs, ok=ok, deltas=Deltas(ok), per_engine=per_engine)


def _with_states(obs: EngineObs, e: EnginePair, samples: Sequence[Sample], states_seen: Sequence[int] | None) -> EngineObs:
    """``obs`` with λ from the engine's published states (kvctl.diagnose.arrivals) when the window has them."""
    marks = []
    for s in samples:
        try:
            scrape = s.scrape(e.index) if e.index < len(s.engines) else None
        except KvctlError:  # an odd read between the samples: left out
            scrape = None
        marks.append((s.engine_time(e.index), None if scrape is None else A.mark(scrape)))
    seq = A.states(marks)
    seen = states_seen[e.index] if states_seen is not None and e.index < len(states_seen) else len(seq)
    r = A.states_rate(seq, e.window_s)
    if r is None:
        return replace(obs, states=seen)
    return replace(obs, arrival_rate_per_s=r.rate_per_s, arrivals_basis=A.BASIS_STATES, arrivals_counted=r.arrivals, states=seen)


@dataclass(frozen=True)
class Rates:
    requests: float | None  # finished in the window, all engines
    completion: float | None  # req/s
    offered: float | None  # λ, req/s: from the engines' states where they have them, else completions plus queue growth
    queue_growth: float | None
    resets: list[str]  # "url: counter, ..." per engine whose counters went backwards
    offered_queue: float | None = None  # λ from completions plus queue growth at the sample times, every engine
    arrivals_counted: float | None = None  # the requests λ counted, all engines
    basis: str = A.BASIS_QUEUE  # A.BASIS_STATES when any engine's λ came from its states
    states: int = 0  # states the engines published in the window


def gather_rates(engines: Engines, window_s: float, nb: Notebook) -> Rates:
    """The offered arrival rate λ and the completion rate, summed over the engines."""
    per = list(engines.per_engine.values())
    finished_list = [o.finished for o in per if o.finished is not None]
    requests = sum(finished_list) if finished_list else None
    completion = sum(o.completion_rate_per_s for o in per if o.completion_rate_per_s is not None) if finished_list else None
    offered_list = [o.arrival_rate_per_s for o in per if o.arrival_rate_per_s is not None]
    lam = sum(offered_list) if offered_list else None
    growths = [o.queue_end - o.queue_start for o in per if o.queue_start is not None and o.queue_end is not None]
    growth = sum(growths) if growths else None
    if engines.ok and requests is None:
        nb.why["arrival_rate_per_s"] = "no vllm:request_success or vllm:request_prompt_tokens in the engine metrics"
    elif engines.ok and not growths:
        nb.notes.append("no vllm:num_requests_waiting/_running gauges: λ is the completion rate, a lower bound on the offered rate")
    queue_list = [o.arrival_rate_queue_per_s for o in per if o.arrival_rate_queue_per_s is not None]
    lam_queue = sum(queue_list) if queue_list else None
    counted = [o.arrivals_counted for o in per if o.arrivals_counted is not None]
    by_states = [o for o in per if o.arrivals_basis == A.BASIS_STATES]
    nb.explain.append(Quantity(
        "offered arrival rate λ, finished + queue growth (req/s)", lam_queue,
        "Σ_engines (Δvllm:request_success + Δ(waiting + running)) / Δt_engine = "
        + " + ".join(f"({_g(o.finished)} + {_g(None if o.queue_start is None else o.queue_end - o.queue_start)}) / {o.window_s:.2f} s" for o in per),
        "vllm:request_success (all finished_reason), vllm:num_requests_waiting/_running at the two samples: low while a step is long "
        "(what arrived during it waits in the engine core's input queue, outside waiting and running)",
    ))
    if by_states:
        nb.explain.append(Quantity(
            "offered arrival rate λ, engine states (req/s)", lam,
            "Σ_engines Δ(finished + waiting + running) between two published states / the time between them = "
            + " + ".join(f"{_g(o.arrivals_counted)} over {o.states} state(s)" for o in by_states),
            "vLLM publishes at each step's end the state as of its start; the engines read between the samples tell when (kvctl.diagnose.arrivals)",
        ))
    nb.explain.append(Quantity("completions (req/s)", completion, "Σ_engines Δvllm:request_success / Δt_engine", N.VLLM_REQUEST_SUCCESS))
    resets = [f"{o.url}: {', '.join(o.counter_resets)}" for o in per if o.counter_resets]
    if engines.ok and requests == 0 and not growth:
        nb.insufficient.append(f"no request finished or queued on the engines in the {window_s:.1f} s window: send traffic or lengthen --window")
    return Rates(requests=requests, completion=completion, offered=lam, queue_growth=growth, resets=resets, offered_queue=lam_queue,
                 arrivals_counted=sum(counted) if counted else None, basis=A.BASIS_STATES if by_states else A.BASIS_QUEUE,
                 states=sum(o.states for o in per))


@dataclass(frozen=True)
class Prompts:
    mean_tokens: float | None
    typical_tokens: float | None  # median, else the mean
    prompt_tokens: float | None  # Δ prompt tokens in the window
    hit_fraction: float | None
    hits_per_request: float | None
    typical_basis: str = "mean"  # MEDIAN_BASIS key
    hit_tokens: float | None = None  # Δ L2 hit tokens
    admitted: bool = False  # hit fraction and hits per request from counters vLLM counts as a request is admitted


def prompts_and_hits(D: Deltas, requests: float | None, nb: Notebook) -> Prompts:
    """Prompt lengths, and the share of prompt tokens the external cache (L2) served."""
    p_sum, p_cnt = D.total(N.VLLM_REQUEST_PROMPT_TOKENS, "sum"), D.total(N.VLLM_REQUEST_PROMPT_TOKENS, "count")
    prompt_tokens = D.total(N.VLLM_PROMPT_TOKENS)
    if p_cnt:
        mean_prompt, mp_src = ratio(p_sum, p_cnt), f"Δvllm:request_prompt_tokens_sum / Δ_count = {_g(p_sum)} / {p_cnt:g}"
    else:
        mean_prompt, mp_src = ratio(prompt_tokens, requests), f"Δvllm:prompt_tokens / Δrequests = {_g(prompt_tokens)} / {_g(requests)}"
    if prompt_tokens is None:
        prompt_tokens = p_sum
    nb.explain.append(Quantity("mean prompt tokens", mean_prompt, mp_src, N.VLLM_REQUEST_PROMPT_TOKENS))
    est = M.quantile_estimate(D.buckets(N.VLLM_REQUEST_PROMPT_TOKENS), 0.5, p_sum)
    typical, basis = (est.value, est.basis) if est is not None and est.value else (mean_prompt, "mean")
    nb.explain.append(Quantity(f"typical (median) prompt tokens, {MEDIAN_BASIS[basis]}", typical, _median_source(est, basis),
                               f"{N.VLLM_REQUEST_PROMPT_TOKENS}_bucket"))
    hit_tokens, hit_src = D.total(N.VLLM_EXTERNAL_PREFIX_CACHE_HITS), N.VLLM_EXTERNAL_PREFIX_CACHE_HITS
    if hit_tokens is None:
        hit_tokens, hit_src = D.total(N.LMCACHE_NUM_HIT_TOKENS), N.LMCACHE_NUM_HIT_TOKENS
    # hits are counted as a request is admitted, prompt tokens as its prefill ends: under a growing queue (requests
    # admitted, loading, not finished) hits/prompt tokens read 152 % (paper_gpu R2). vLLM's prefix-cache queries count
    # the prompt tokens of the same admitted requests: the fraction and the hits per request from the same population
    queried = D.total(N.VLLM_PREFIX_CACHE_QUERIES) if hit_src == N.VLLM_EXTERNAL_PREFIX_CACHE_HITS else None
    if queried and mean_prompt and hit_tokens is not None:
        hit_frac = hit_tokens / queried
        nb.explain.append(Quantity("hit-token fraction", hit_frac, f"Δ{hit_src} / Δ{N.VLLM_PREFIX_CACHE_QUERIES} = {_g(hit_tokens)} / {_g(queried)}",
                                   f"{hit_src}, {N.VLLM_PREFIX_CACHE_QUERIES}: both counted as a request is admitted"))
        return Prompts(mean_prompt, typical, prompt_tokens, hit_frac, hit_frac * mean_prompt, basis, hit_tokens, True)
    hit_frac = ratio(hit_tokens, prompt_tokens)
    nb.explain.append(Quantity("hit-token fraction", hit_frac, f"Δ{hit_src} / Δvllm:prompt_tokens = {_g(hit_tokens)} / {_g(prompt_tokens)}", hit_src))
    return Prompts(mean_prompt, typical, prompt_tokens, hit_frac, ratio(hit_tokens, requests), basis, hit_tokens)


#: How the typical (median) prompt was found, as the output says it (JSON ``typical_prompt_tokens_basis``).
MEDIAN_BASIS = {
    "one_bucket_mean": "exact mean: every prompt in one histogram bucket (sum/count)",
    "bucket_estimate": "estimate inside one histogram bucket",
    "bucket_interpolation": "estimate inside one histogram bucket",
    "mean": "the mean (no prompt histogram)",
}


def _median_source(est: M.QuantileEstimate | None, basis: str) -> str:
    if est is None or basis == "mean":
        return "no Δ request_prompt_tokens buckets: the mean prompt instead"
    if basis == "one_bucket_mean":
        return f"every prompt in one bucket ({est.lo:g}, {est.hi:g}]: Δ request_prompt_tokens sum/count"
    return (f"p50 of the Δ request_prompt_tokens buckets, interpolated in its bucket and kept within [{est.lo:,.0f}, {est.hi:,.0f}], "
            "what the bucket's bounds and the histogram's sum allow")


# --- the tier: L2 bytes and the bandwidth B -----------------------------------------------


def read_instances(a: Sample, b: Sample, urls: list[str], nb: Notebook, instances_per_rank: int = 1) -> list[InstanceObs]:
    """Each Valkey instance's GET traffic (instance n mod K of rank n // K); the unreachable and the restarted are written down."""
    instances = instance_obs(a, b, list(urls), instances_per_rank)
    nb.unreachable += [f"Valkey {i.name} ({i.url}): {i.error}" for i in instances if i.status == "unreachable"]
    restarted = [f"Valkey {i.name} ({i.url})" for i in instances if i.restarted]
    if restarted:
        nb.notes.append(f"restarted inside the window (INFO counters went backwards), counted from the restart: {', '.join(restarted)}")
    for inst in instances:
        if inst.status == "ok":
            nb.explain.append(Quantity(
                f"{inst.name} GET busy fraction", inst.get_busy_fraction,
                f"Δcmdstat_get usec / Δt = {inst.get_busy_fraction * inst.window_s * 1e6:.0f} µs / {inst.window_s:.2f} s",
                "valkey INFO commandstats",
            ))
    return instances


@dataclass(frozen=True)
class L2Load:
    bytes_per_s: float | None  # served by L2, from the best source below
    source: str | None
    tokens_per_s: float | None
    kvctl_bytes: float | None  # the kvctl connector's counters
    kvctl_bytes_per_s: float | None
    kvctl_seconds: float | None
    lmcache_bytes: float | None  # LMCache's
    lmcache_get_ms: float | None


def l2_load(D: Deltas, ok_inst: list[InstanceObs], s_bpt: float | None, nb: Notebook, window_s: float | None = None) -> L2Load:
    """The bytes L2 served per second: the kvctl connector's count, else LMCache's, else Valkey's GET replies."""
    k_bytes_rate, k_secs, k_bytes = D.rate(N.L2_GET_BYTES), D.total(N.L2_GET_SECONDS), D.total(N.L2_GET_BYTES)
    lm_bytes_rate, lm_bytes = D.rate(N.LMCACHE_NUM_REMOTE_READ_BYTES), D.total(N.LMCACHE_NUM_REMOTE_READ_BYTES)
    valkey_rate = sum(i.bytes_out_per_s for i in ok_inst) if ok_inst else None
    if k_bytes_rate is not None:
        l2_rate, l2_src = k_bytes_rate, f"{N.L2_GET_BYTES}_total (engine side)"
    elif lm_bytes_rate is not None:
        l2_rate, l2_src = lm_bytes_rate, "lmcache:num_remote_read_bytes (engine side)"
        if window_s is not None and window_s < DIAGNOSIS_WINDOW_S:
            nb.notes.append(
                f"L2 bytes from LMCache's counters over a {window_s:.3g} s window: LMCache publishes them every {LMCACHE_PUBLISH_S:g} s "
                f"(vLLM its own every engine step), so a short window's L2 bytes per request may be off by up to one publish "
                f"interval's traffic; a --window of {DIAGNOSIS_WINDOW_S:g} s (the default) or more keeps that small"
            )
    elif valkey_rate is not None:
        l2_rate, l2_src = valkey_rate, "valkey INFO: bytes out to GETs (server side)"
    else:
        l2_rate, l2_src = None, None
        nb.why["l2_bytes_per_request"] = "no L2 byte counter: neither kvctl:l2_get_bytes_total, lmcache:num_remote_read_bytes nor a --valkey instance" + (
            f"; {NO_ENGINE_SERIES}; or give the tier (--valkey, --dir: its GET bytes)" if D.engines and not engine_side_series(D.engines) else "")
    tokens_per_s = ratio(l2_rate, s_bpt)
    nb.explain.append(Quantity("L2-served tokens/s", tokens_per_s, f"Σ Δ{l2_src or 'L2 bytes'} / Δt / s = {_g(l2_rate)} B/s / {_g(s_bpt)} B/token", l2_src or "—"))
    return L2Load(
        bytes_per_s=l2_rate, source=l2_src, tokens_per_s=tokens_per_s, kvctl_bytes=k_bytes, kvctl_bytes_per_s=k_bytes_rate,
        kvctl_seconds=k_secs, lmcache_bytes=lm_bytes, lmcache_get_ms=D.total(N.LMCACHE_REMOTE_TIME_TO_GET, "sum"),
    )


@dataclass(frozen=True)
class Bandwidth:
    gbps: float | None  # B, None when unknown or implausible
    source: str | None  # BW_GIVEN, BW_KVCTL, BW_LMCACHE or BW_VALKEY
    ranks: int | None  # W, when B came from the kvctl connector
    implausible_gbps: float | None  # a B the counters gave that cannot be


def tier_bandwidth(
    l2: L2Load, ok_engines: list[EnginePair], ok_inst: list[InstanceObs], capture: Capture, params: Params, nb: Notebook,
    given_gbps: float | None = None,
) -> Bandwidth:
    """B, the bandwidth the engine sees: given (--tier-gbps), else the kvctl connector's, else LMCache's, else Valkey's
    (an upper bound)."""
    k_bytes, k_secs, lm_bytes, lm_get_ms = l2.kvctl_bytes, l2.kvctl_seconds, l2.lmcache_bytes, l2.lmcache_get_ms
    bw = bw_src = None
    ranks = None
    if given_gbps is not None:  # as --prefill-rate for R: what the operator measured wins over the counters
        bw, bw_src = given_gbps, BW_GIVEN
        nb.explain.append(Quantity("bandwidth the engine sees B (GB/s)", bw, "given", BANDWIDTH_SOURCES[BW_GIVEN]))
    elif k_bytes and k_secs:
        # the connector sums bytes and GET seconds over the engine's ranks, which load in parallel
        # (each its own chunks from its own instance): B = W × Σbytes / Σseconds
        ranks, ranks_src = engine_ranks(ok_engines, capture)
        if ranks_src is None:
            nb.notes.append(
                "kvctl:l2_get_seconds_total is summed over the engine's ranks: with W ranks loading in parallel B is W× "
                "what is shown and ρ W× smaller; give the tier (--valkey per rank, --ranks or --dir) so W is known"
            )
        bw, bw_src = ranks * k_bytes / k_secs / cost.GB, BW_KVCTL
        nb.explain.append(Quantity(
            "bandwidth the engine sees B (GB/s)", bw, f"W × Σbytes / Σseconds = {ranks} × {k_bytes:g} B / {k_secs:.4g} s (W: {ranks_src or 'unknown, 1 assumed'})",
            BANDWIDTH_SOURCES[BW_KVCTL],
        ))
    elif lm_bytes and lm_get_ms:
        bw, bw_src = lm_bytes / (lm_get_ms / 1e3) / cost.GB, BW_LMCACHE
        nb.explain.append(Quantity("bandwidth the engine sees B (GB/s)", bw, f"{lm_bytes:g} B / {lm_get_ms / 1e3:.4g} s", BANDWIDTH_SOURCES[BW_LMCACHE]))
    elif any(i.bandwidth_gbps for i in ok_inst if not _copy_free(i)):
        busy = [i for i in ok_inst if i.bandwidth_gbps and not _copy_free(i)]
        bw, bw_src = sum(i.bandwidth_gbps for i in busy), BW_VALKEY
        nb.explain.append(Quantity("B, upper bound (GB/s)", bw, f"Σ_i GET bytes out_i / Δcmdstat_get usec_i over {len(busy)} instance(s)", BANDWIDTH_SOURCES[BW_VALKEY]))
        if lm_bytes and not lm_get_ms:
            nb.notes.append(f"{LMCACHE_UNTIMED}: B is Valkey's server side; {GIVE_TIER_GBPS} for ρ itself")
    else:
        nb.why["bandwidth_gbps"] = no_bandwidth_why(l2, ok_engines, any(i.bandwidth_gbps for i in ok_inst))
    bw_implausible = None
    if bw is not None and not (math.isfinite(bw) and bw <= params.max_bandwidth_gbps):
        bw_implausible, bw, bw_src = bw, None, None
        nb.why["bandwidth_gbps"] = (
            f"B = {bw_implausible:.3g} GB/s from these counters is implausible (> {params.max_bandwidth_gbps:g} GB/s): "
            "bytes and GET time do not belong together; not used for ρ"
        )
    return Bandwidth(gbps=bw, source=bw_src, ranks=ranks, implausible_gbps=bw_implausible)


#: why B stays unknown, and the way out (kvctl.diagnose.quantities.no_bandwidth_why)
GIVE_TIER_GBPS = "give --tier-gbps, the tier's GET bandwidth measured with `kvctl bench` (its aggregate_gbps)"
LMCACHE_UNTIMED = (
    "LMCache counted the bytes it read from the remote tier (lmcache:num_remote_read_bytes) but recorded no read time "
    "(no lmcache:remote_time_to_get samples): async loading in LMCache 0.5.6, whose batched_get_non_blocking counts bytes "
    "and times nothing (lmcache/v1/storage_backend/connector/instrumented_connector.py; only the blocking batched_get is timed)"
)
VALKEY_9_NO_BOUND = (
    "the instances run Valkey 9.x, which writes a GET's reply from the value after the command (copy avoidance, "
    "and on io-threads): its GET µs hold no copy of the bytes and bound no bandwidth"
)
NO_ENGINE_SERIES = (
    "the engines answered but no /metrics of theirs has kvctl: or lmcache: series (no KV connector, or LMCache's unseen): "
    "LMCache registers its metrics in vLLM's "
    "engine-core process, which reach the API server's /metrics only under Prometheus multiprocess collection, and vLLM "
    "sets that up itself only with --api-server-count > 1; start the vLLM server with PROMETHEUS_MULTIPROC_DIR pointing "
    "at an empty directory it can write (kvctl's connector exports its kvctl: series without it)"
)


def engine_side_series(engines: Sequence[EnginePair]) -> bool:
    """Whether any engine's last read holds a kvctl: or lmcache: series (a KV connector's counters reach its /metrics)."""
    return any(n.startswith((N.PREFIX, N.LMCACHE_PREFIX)) for e in engines for n in (*e.b.values, *e.b.buckets))


def no_bandwidth_why(l2: L2Load, ok_engines: list[EnginePair], valkey_9: bool) -> str:
    """Why neither the engines' counters nor the instances give B (``valkey_9``: the instances' GET times bound none)."""
    if l2.lmcache_bytes and not l2.lmcache_get_ms:
        return f"{LMCACHE_UNTIMED}; {GIVE_TIER_GBPS}"
    if ok_engines and not engine_side_series(ok_engines):
        return (f"{VALKEY_9_NO_BOUND}, and " if valkey_9 else "") + f"{NO_ENGINE_SERIES}; or {GIVE_TIER_GBPS}"
    if valkey_9:
        engines = ("the engines' counters timed no L2 read in the window (no kvctl:l2_get_seconds_total, no lmcache:remote_time_to_get)"
                   if ok_engines else "give an engine's --engine-url (kvctl's connector or LMCache export the bandwidth the engine sees)")
        return f"{VALKEY_9_NO_BOUND}; {engines}; or {GIVE_TIER_GBPS}"
    return f"no GET timing in the window: no kvctl:l2_get_seconds_total, lmcache:remote_time_to_get, or Valkey GETs; {GIVE_TIER_GBPS}"


def _copy_free(i: InstanceObs) -> bool:
    """An instance whose GET time leaves the copy of the value out (Valkey 9.x): its server-side B is no bound."""
    v = parse_version(i.server_version)
    return v is not None and v[0] >= ZERO_COPY_MAJOR


def check_gets_reached_tier(l2: L2Load, ok_inst: list[InstanceObs], nb: Notebook) -> None:
    """Instances given but no GET reached them and no engine loaded from L2: the engines point elsewhere."""
    if ok_inst and not any(i.get_calls for i in ok_inst) and not (l2.kvctl_bytes or l2.lmcache_bytes):
        nb.insufficient.append(
            f"0 GETs on these {len(ok_inst)} Valkey instance(s) in the window and no engine-side L2 bytes: "
            "check that the engines' remote URL (LMCache remote_url, --kv-transfer-config) points at these instances"
        )


# --- the cost model: R, B*, n* --------------------------------------------------------------


@dataclass(frozen=True)
class BreakEven:
    prefill_rate: float | None  # R, tok/s
    prefill_rate_source: str | None
    implausible_prefill_rate: float | None  # a derived R too low to be a compute rate
    breakeven_gbps: float | None  # B* = s·R
    min_hit_tokens: float | None  # n* = R·T0
    bytes_per_token_per_rank: float | None  # s / W


def break_even(
    engines: Engines, prompt_tokens: float | None, s_bpt: float | None, r_flag: float | None, t0: float,
    capture: Capture, params: Params, nb: Notebook,
) -> BreakEven:
    """R (given, else derived from the engines' prefill time), B* = s·R and n* = R·T0 (paper §4)."""
    why = nb.why
    r, r_src, r_implausible = r_flag, ("--prefill-rate" if r_flag is not None else None), None
    if r is None:
        r, r_src, r_implausible = derived_prefill_rate(engines.ok, prompt_tokens, params, nb)
    else:
        nb.explain.append(Quantity("prefill rate R (tok/s)", r, "given", r_src))
    if s_bpt is None:
        why["breakeven_gbps"] = "bytes per token unknown: give --bytes-per-token or --model-config"
    b_star = cost.breakeven_gbps(s_bpt, r) if s_bpt and r else None  # s: the whole model's, B: the whole tier's
    w_ranks, w_src = engine_ranks(engines.ok, capture)
    s_rank = s_bpt / w_ranks if s_bpt and w_src else None
    if s_bpt and not w_src:
        why["bytes_per_token_per_rank"] = "W unknown: give the tier (--valkey per rank, --ranks or --dir)"
    nb.explain.append(Quantity("bytes per token per rank s/W", s_rank, f"{_g(s_bpt)} B/token / W = {w_ranks if w_src else '?'}", w_src or "—"))
    n_star = cost.min_hit_tokens(r, t0) if r else None
    if r is None and "breakeven_gbps" not in why:
        why["breakeven_gbps"] = why.get("prefill_rate_tok_s", "prefill rate unknown: give --prefill-rate")
    if r is None:
        why["min_hit_tokens"] = why.get("prefill_rate_tok_s", "prefill rate unknown: give --prefill-rate")
    nb.explain.append(Quantity("break-even bandwidth B* (GB/s)", b_star, f"s·R = {_g(s_bpt)} B/token × {_g(r)} tok/s", "cost model §4"))
    nb.explain.append(Quantity("min hit tokens n*", n_star, f"R·T0 = {_g(r)} tok/s × {t0:g} s", "cost model §4 (T0: --t0)"))
    return BreakEven(r, r_src, r_implausible, b_star, n_star, s_rank)


def engine_ranks(engines: list[EnginePair], capture: Capture) -> tuple[int, str | None]:
    """W, the ranks whose GET seconds the connector sums: its ``kvctl:ranks`` gauge, else the tier's ranks
    (one per Valkey instance, or one per K of them with K instances per rank: a rank's GET seconds are its
    own wall time, its K instances loading at once)."""
    exported = [v for e in engines if (v := e.b.gauge(N.RANKS)) is not None and v >= 1]
    if exported:
        return int(max(exported)), N.RANKS
    n, k = len(capture.valkey_urls), capture.instances_per_rank
    if n and k > 1:
        return max(1, n // k), f"{n} Valkey instances, {k} per rank: {max(1, n // k)} rank(s)"
    if n:
        return n, f"{n} Valkey instance(s), one per rank"
    return 1, None


def derived_prefill_rate(
    engines: list[EnginePair], prompt_tokens: float | None, params: Params, nb: Notebook
) -> tuple[float | None, str | None, float | None]:
    """R from the engines' prefill time, batched prefills counted once: (R, source, implausible R).

    A batch of k requests prefilled together reports its time in each of the k
    requests' ``request_prefill_time_seconds``; the engine cannot have spent more
    than its window prefilling, so per engine the busy time is min(Σ prefill time,
    window). The result is a lower bound on R whenever prefills overlapped.
    """
    computed_total, busy_total, overlapped = 0.0, 0.0, False
    for e in engines:
        one = Deltas([e])
        pf = one.total(N.VLLM_REQUEST_PREFILL_TIME_SECONDS, "sum")
        pt = one.total(N.VLLM_PROMPT_TOKENS)
        if pt is None:
            pt = one.total(N.VLLM_REQUEST_PROMPT_TOKENS, "sum")
        if not pf or pt is None:
            continue
        cached = (one.total(N.VLLM_PREFIX_CACHE_HITS) or 0.0) + (one.total(N.VLLM_EXTERNAL_PREFIX_CACHE_HITS) or 0.0)
        computed_total += max(0.0, pt - cached)
        busy = min(pf, e.window_s)
        overlapped = overlapped or pf > e.window_s
        busy_total += busy
    if not busy_total or not computed_total:
        nb.why["prefill_rate_tok_s"] = "no prefill time or computed tokens in the window: give --prefill-rate for B* and n*"
        return None, None, None
    r = computed_total / busy_total
    src = "derived: computed prompt tokens / min(Σ request_prefill_time, window) per engine" + (
        " (prefills overlapped: a lower bound on R)" if overlapped else ""
    )
    nb.explain.append(Quantity("prefill rate R (tok/s)", r, f"{computed_total:g} tok / {busy_total:.3f} s busy", src))
    if r < params.min_prefill_rate:
        nb.why["prefill_rate_tok_s"] = (
            f"derived R = {r:.3g} tok/s is implausibly low (< {params.min_prefill_rate:g}): prefill time is spent waiting, "
            "not computing; give --prefill-rate"
        )
        return None, None, r
    return r, src, None
