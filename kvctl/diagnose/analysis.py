"""Two samples → observations → findings (paper §4 and §6).

Pure: :func:`analyse` takes a :class:`~kvctl.diagnose.capture.Capture` (scrapes)
and returns a :class:`Diagnosis` (a dataclass); no I/O, no click, no rich, so
an exporter can call it on its own scrapes. Every derived quantity carries the
formula it came from and its source (``--explain`` prints them); every value
that stays unknown is None with a reason in ``null_reasons``.

* Each engine's counters are differenced on their own, over that engine's own
  window (each read has its own timestamp); a counter that went backwards is
  an engine restart, reported, never summed away.
* λ is the OFFERED arrival rate: the growth of finished (every finished_reason)
  + waiting + running between two states an engine published, each as of its
  step's start (:mod:`kvctl.diagnose.arrivals`: the engines are read between
  the samples), else finished + the growth of waiting + running between the
  samples, per engine. When the tier is the bottleneck, completions are capped
  by it and cannot show ρ > 1; λ's estimators give ρ a range (how sure).
* B is the bandwidth the engine sees: ``--tier-gbps`` when given (measured with
  ``kvctl bench``), else the kvctl connector's ``kvctl:l2_get_*``
  counters, else LMCache's ``remote_time_to_get`` with ``num_remote_read_bytes``,
  else Valkey's bytes out / time in GETs — server side, an UPPER bound on B
  (socket writes done by io-threads are outside the GET's time), so ρ is then
  a LOWER bound and said so (``rho_bound``).
* ρ = λ_offered · (L2 bytes per offered request) / B, never the served rate over B
  (:mod:`kvctl.diagnose.rho`: bytes per hit token × hit tokens per admitted request).
* B* = s·R, n* = R·T0 (R from --prefill-rate, else derived, sanity-checked).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvctl.core import cost
from kvctl.diagnose.capture import Capture, Sample
from kvctl.diagnose.findings import Finding, Params, worst_severity  # noqa: F401 - Params/Finding are part of this API
from kvctl.diagnose.fleet import fleet_loads
from kvctl.diagnose.rules import findings_for, tier_recomputed
from kvctl.records import prometheus as M
from kvctl.diagnose import quantities as Q
from kvctl.diagnose import rho as P
from kvctl.diagnose.observations import GET_COMMANDS, EngineObs, InstanceObs, ratio, EnginePair  # noqa: F401 - EngineObs/InstanceObs/GET_COMMANDS are part of this API
from kvctl.diagnose.quantities import BANDWIDTH_SOURCES, BW_GIVEN, BW_KVCTL, BW_LMCACHE, BW_VALKEY, Quantity  # noqa: F401 - part of this API
from kvctl.core.errors import ExitStatus, InvalidInput
from kvctl.connector import metric_names as N
from kvctl.connector.policy import GIVEN_UP, LOAD, PARTIAL, RECOMPUTE, REASONS
DEFAULT_T0_S = cost.PAPER_PAIRING["t0_s"]


@dataclass(frozen=True)
class Diagnosis:
    created_at: str
    window_s: float
    engine_urls: list[str]
    outcome: str  # "ok", "findings", "unreachable" or "insufficient_data": the word for exit_status
    requests: float | None
    arrival_rate_per_s: float | None  # OFFERED λ
    completion_rate_per_s: float | None
    queue_growth: float | None
    mean_prompt_tokens: float | None
    typical_prompt_tokens: float | None  # the median prompt, as typical_prompt_tokens_basis says it was found
    typical_prompt_tokens_basis: str  # one_bucket_mean (exact: sum/count), bucket_estimate, bucket_interpolation, mean
    hit_token_fraction: float | None
    hit_tokens_per_request: float | None
    l2_bytes_per_request: float | None
    l2_tokens_per_s: float | None
    bandwidth_gbps: float | None
    bandwidth_source: str | None  # BW_GIVEN, BW_KVCTL, BW_LMCACHE or BW_VALKEY
    bandwidth_source_detail: str | None
    engine_ranks: int | None  # W for the kvctl connector's per-rank-summed GET seconds
    bytes_per_token: float | None
    prefill_rate_tok_s: float | None
    prefill_rate_source: str | None
    t0_s: float
    breakeven_gbps: float | None
    min_hit_tokens: float | None
    rho: float | None
    rho_bound: str | None  # "estimate", "lower_bound" (B from Valkey server side) or None
    load_busy_fraction: float | None  # served L2 bytes/s over B: capped at 1, NOT ρ
    instances_for_rho_target: int | None
    requests_waiting_start: float | None
    requests_waiting_end: float | None
    gpu_utilization_pct: list[float]
    gpu_note: str
    engines: list[EngineObs]
    instances: list[InstanceObs]
    unreachable: list[str]
    insufficient_data: list[str]
    findings: list[Finding]
    worst_severity: str
    notes: list[str]
    null_reasons: dict[str, str]
    explain: list[Quantity]
    # s / W: one rank's share of every token, what each instance (one per rank) serves; s itself is the whole model's
    bytes_per_token_per_rank: float | None = None
    # several engines (kvctl.diagnose.fleet): each engine's load against what it gets, each instance's summed over engines
    engine_loads: list[Any] = field(default_factory=list)
    instance_loads: list[Any] = field(default_factory=list)
    # how sure (kvctl.diagnose.rho): λ's basis and the range of its estimators, the arrivals it counted, ρ's range
    arrival_rate_basis: str | None = None
    arrival_rate_range_per_s: list[float] | None = None
    arrivals_counted: float | None = None
    engine_states: int = 0  # states the engines published in the window (the reads between the samples saw them)
    rho_range: list[float] | None = None
    rho_relative_error: float | None = None  # 1/√(arrivals counted): λ is a Poisson count
    l2_bytes_per_request_basis: str | None = None
    # the kvctl connector's load-or-recompute decisions in the window: {decision: {reason: hits}} (issue 46)
    load_decisions: dict[str, dict[str, float]] = field(default_factory=dict)
    # of the hits it judged, the share the decision recomputed because of the tier (None: no hit judged)
    hits_recomputed_share: float | None = None

    @property
    def exit_status(self) -> ExitStatus:
        """4 critical finding, 5 a component unreachable, 6 insufficient data, 3 warning, 0 ok."""
        if self.worst_severity == "critical":
            return ExitStatus.FINDING_CRITICAL
        if self.unreachable:
            return ExitStatus.UNREACHABLE
        if self.insufficient_data:
            return ExitStatus.INSUFFICIENT_DATA
        if self.worst_severity == "warning":
            return ExitStatus.FINDING_WARNING
        return ExitStatus.OK


# --- the analysis ----------------------------------------------------------------------


def analyse(capture: Capture, params: Params | None = None) -> Diagnosis:
    """Observations and findings from the first and last sample of ``capture``: the steps of kvctl.diagnose.quantities."""
    params = params or Params()
    a, b, window = _window(capture)
    s_bpt, r_flag, t0 = _given(capture, params)
    nb = Q.Notebook()
    b_flag = _given_bandwidth(capture, params, nb)
    engines = Q.read_engines(a, b, capture.engine_urls, nb, capture.samples, capture.engine_states)
    rates = Q.gather_rates(engines, window, nb)
    prompts = Q.prompts_and_hits(engines.deltas, rates.requests, nb)
    instances = Q.read_instances(a, b, capture.valkey_urls, nb, capture.instances_per_rank)
    ok_inst = [i for i in instances if i.status == "ok"]
    l2 = Q.l2_load(engines.deltas, ok_inst, s_bpt, nb, window)
    bw = Q.tier_bandwidth(l2, engines.ok, ok_inst, capture, params, nb, b_flag)
    Q.check_gets_reached_tier(l2, ok_inst, nb)
    be = Q.break_even(engines, prompts.prompt_tokens, s_bpt, r_flag, t0, capture, params, nb)
    w_ranks, w_src = Q.engine_ranks(engines.ok, capture)
    rho = P.rho_of(rates, prompts, l2, bw, s_bpt, len(ok_inst), bool(engines.ok), params, nb, w_ranks if w_src else None)
    waiting = _requests_waiting(engines.ok)
    engine_loads, instance_loads = fleet_loads(engines.ok, engines.per_engine, instances, s_bpt, capture.instances_per_rank)
    obs = _rule_inputs(a, b, engines, rates, prompts, ok_inst, bw, be, rho, waiting, params)
    obs.update(ranks=w_ranks if w_src else None, instances_per_rank=capture.instances_per_rank)  # the deployment the fixes are said for
    findings = _findings(obs, engine_loads, instance_loads, rho.rho, params)
    worst_found = worst_severity(f.severity for f in findings)
    worst = worst_found.value if worst_found else "ok"
    why = nb.why
    for name, value in (("arrival_rate_per_s", rates.offered), ("bandwidth_gbps", bw.gbps), ("rho", rho.rho), ("prefill_rate_tok_s", be.prefill_rate)):
        if value is None and name not in why:
            why[name] = "not measurable from these samples"
    resets_note = [f"engine restarted in the window (counters went backwards): {'; '.join(rates.resets)}"] if rates.resets else []
    resets_note = list(capture.notes) + resets_note
    return Diagnosis(
        created_at=capture.created_at, window_s=window, engine_urls=list(capture.engine_urls),
        outcome=_outcome(worst, findings, nb), requests=rates.requests, arrival_rate_per_s=rates.offered,
        completion_rate_per_s=rates.completion, queue_growth=rates.queue_growth, mean_prompt_tokens=prompts.mean_tokens,
        typical_prompt_tokens=prompts.typical_tokens, typical_prompt_tokens_basis=prompts.typical_basis,
        hit_token_fraction=prompts.hit_fraction,
        hit_tokens_per_request=prompts.hits_per_request, l2_bytes_per_request=rho.l2_bytes_per_request, l2_tokens_per_s=l2.tokens_per_s,
        bandwidth_gbps=bw.gbps, bandwidth_source=bw.source, bandwidth_source_detail=BANDWIDTH_SOURCES.get(bw.source or ""),
        engine_ranks=bw.ranks if bw.source == BW_KVCTL else None, bytes_per_token=s_bpt, prefill_rate_tok_s=be.prefill_rate,
        prefill_rate_source=be.prefill_rate_source, t0_s=t0, breakeven_gbps=be.breakeven_gbps, min_hit_tokens=be.min_hit_tokens,
        rho=rho.rho, rho_bound=rho.bound, load_busy_fraction=rho.busy_fraction, instances_for_rho_target=rho.instances_for_target,
        requests_waiting_start=waiting[0], requests_waiting_end=waiting[1], gpu_utilization_pct=list(b.gpu.utilization_pct),
        gpu_note=b.gpu.note or a.gpu.note, engines=engines.obs, instances=instances, unreachable=nb.unreachable,
        insufficient_data=nb.insufficient, findings=findings, worst_severity=worst, notes=nb.notes + resets_note,
        null_reasons=why, explain=nb.explain, bytes_per_token_per_rank=be.bytes_per_token_per_rank,
        engine_loads=engine_loads, instance_loads=instance_loads,
        arrival_rate_basis=rates.basis if rates.offered is not None else None,
        arrival_rate_range_per_s=None if rho.arrival_rate_range_per_s is None else list(rho.arrival_rate_range_per_s),
        arrivals_counted=rates.arrivals_counted, engine_states=rates.states,
        rho_range=None if rho.rho_range is None else list(rho.rho_range), rho_relative_error=rho.relative_error,
        l2_bytes_per_request_basis=rho.l2_basis, load_decisions=_nested(obs["decisions"]),
        hits_recomputed_share=_recomputed_share(obs["decisions"]),
    )


def _recomputed_share(decisions: dict[tuple[str, ...], float]) -> float | None:
    judged, *turned = tier_recomputed(decisions)
    return sum(turned) / judged if judged > 0 else None


#: the connector's decisions (connector/policy.py): any other value an engine labels one with is counted as "other", so
#: the series diagnose and the exporter make of them stay a known, bounded set whatever an engine exports
DECISIONS = (LOAD, PARTIAL, RECOMPUTE, GIVEN_UP)


def _known_decisions(pairs: dict[tuple[str, ...], float]) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    for (decision, reason), n in pairs.items():
        key = (decision if decision in DECISIONS else "other", reason if reason in REASONS else "other")
        out[key] = out.get(key, 0.0) + n
    return out


def _nested(pairs: dict[tuple[str, ...], float]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for (decision, reason), n in sorted(pairs.items()):
        out.setdefault(decision, {})[reason] = n
    return out


def _window(capture: Capture) -> tuple[Sample, Sample, float]:
    """The first and last sample and the seconds between them; refused unless there are two, in time order."""
    if len(capture.samples) < 2:
        raise InvalidInput("a diagnosis needs two samples")
    a, b = capture.samples[0], capture.samples[-1]
    window = b.t_s - a.t_s
    if not window > 0:
        raise InvalidInput(f"the samples are not in time order (Δt = {window:.3f} s)")
    return a, b, window


def _given(capture: Capture, params: Params) -> tuple[float | None, float | None, float]:
    """s, R and T0: the flags (``params``) first, then what the capture was taken with, then T0's default."""
    given = capture.parameters or {}
    s_bpt = params.bytes_per_token if params.bytes_per_token is not None else given.get("bytes_per_token")
    r_flag = params.prefill_rate if params.prefill_rate is not None else given.get("prefill_rate")
    t0 = params.t0_s if params.t0_s is not None else float(given.get("t0_s") or DEFAULT_T0_S)
    return s_bpt, r_flag, t0


def _given_bandwidth(capture: Capture, params: Params, nb: Q.Notebook) -> float | None:
    """B given: ``--tier-gbps``, else what the capture was taken with (a number in (0, max_bandwidth_gbps], or a note)."""
    if params.bandwidth_gbps is not None:
        return params.bandwidth_gbps
    b = (capture.parameters or {}).get("bandwidth_gbps")
    if b is None:
        return None
    if isinstance(b, (int, float)) and not isinstance(b, bool) and math.isfinite(b) and 0 < b <= params.max_bandwidth_gbps:
        return float(b)
    nb.notes.append(f"the capture's bandwidth_gbps {str(b)[:40]!r} is not a bandwidth in (0, {params.max_bandwidth_gbps:g}] GB/s: not used")
    return None


def _requests_waiting(ok_engines: list[EnginePair]) -> tuple[float | None, float | None]:
    """Σ vllm:num_requests_waiting at the first and the last sample; None when no engine exports it."""
    if not ok_engines:
        return None, None
    if all(e.a.gauge(N.VLLM_NUM_REQUESTS_WAITING) is None for e in ok_engines):
        return None, None
    return (
        sum(v for e in ok_engines if (v := e.a.gauge(N.VLLM_NUM_REQUESTS_WAITING)) is not None),
        sum(v for e in ok_engines if (v := e.b.gauge(N.VLLM_NUM_REQUESTS_WAITING)) is not None),
    )


def _rule_inputs(
    a: Sample, b: Sample, engines: Q.Engines, rates: Q.Rates, prompts: Q.Prompts, ok_inst: list[InstanceObs],
    bw: Q.Bandwidth, be: Q.BreakEven, rho: P.Rho, waiting: tuple[float | None, float | None], params: Params,
) -> dict[str, Any]:
    """What the rules (kvctl.diagnose.rules) read, under the names they read it by."""
    D = engines.deltas
    return dict(
        lam=rates.offered, completion=rates.completion, typical=prompts.typical_tokens, bw=bw.gbps, bw_src=bw.source,
        b_star=be.breakeven_gbps, n_star=be.min_hit_tokens, rho=rho.rho, rho_bound=rho.bound, k=rho.instances_for_target,
        n_inst=rho.n_instances, waiting=waiting, gpu_utils=a.gpu.utilization_pct + b.gpu.utilization_pct,
        gpu_note=b.gpu.note or a.gpu.note, instances=ok_inst, l2_per_req=rho.l2_bytes_per_request, resets=rates.resets,
        r=be.prefill_rate, r_implausible=be.implausible_prefill_rate,
        blocking=D.total(N.LMCACHE_GET_BLOCKING_FAILED_COUNT),
        slow_lookups=M.count_above(D.buckets(N.LMCACHE_TIME_TO_LOOKUP), params.slow_lookup_s),
        lookups_timed=bool(D.buckets(N.LMCACHE_TIME_TO_LOOKUP)),
        kvctl_timeouts=D.total(N.LOOKUP_TIMEOUTS), kvctl_load_errors=D.total(N.LOAD_ERRORS),
        kvctl_shortfall=D.total(N.AGREED_PREFIX_SHORTFALL_CHUNKS), kvctl_saves_dropped=D.total(N.SAVES_DROPPED),
        chunks_hit=D.total(N.CHUNKS_HIT), chunks_missed=D.total(N.CHUNKS_MISSED),
        ext_queries=D.total(N.VLLM_EXTERNAL_PREFIX_CACHE_QUERIES), ext_hits=D.total(N.VLLM_EXTERNAL_PREFIX_CACHE_HITS),
        lm_requested=D.total(N.LMCACHE_NUM_REQUESTED_TOKENS), lm_hits=D.total(N.LMCACHE_NUM_HIT_TOKENS),
        mean_prefill_s=ratio(D.total(N.VLLM_REQUEST_PREFILL_TIME_SECONDS, "sum"), D.total(N.VLLM_REQUEST_PREFILL_TIME_SECONDS, "count")),
        bw_implausible=bw.implausible_gbps, engine_errors=[(o.url, o.error) for o in engines.obs if o.error],
        decisions=_known_decisions(D.by_labels(N.LOAD_DECISIONS)),
    )


def _findings(obs: dict[str, Any], engine_loads: list[Any], instance_loads: list[Any], rho: float | None, params: Params) -> list[Finding]:
    """The rules' findings; the ρ ones only when ρ is a finite number."""
    obs["instance_loads"] = instance_loads
    obs["engine_loads"] = engine_loads
    findings = findings_for(obs, params)
    if rho is None or not math.isfinite(rho):
        findings = [f for f in findings if not f.id.startswith("rho_")]
    return findings


def _outcome(worst: str, findings: list[Finding], nb: Q.Notebook) -> str:
    """The word for exit_status, in its order: the JSON's outcome never says "ok" while the exit code says otherwise."""
    if worst == "critical":
        return "findings"
    if nb.unreachable:
        return "unreachable"
    if nb.insufficient:
        return "insufficient_data"
    return "findings" if findings else "ok"
