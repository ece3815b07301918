"""Two samples → observations → findings (paper §4 and §6).

Pure: :func:`analyse` takes a :class:`~kvctl.diagnose.capture.Capture` (scrapes)
and returns a :class:`Diagnosis` (a dataclass); no I/O, no click, no rich, so
an exporter can call it on its own scrapes. Every derived quantity carries the
formula it came from and its source (``--explain`` prints them); every value
that stays unknown is None with a reason in ``null_reasons``.

* Each engine's counters are differenced on their own, over that engine's own
  window (each read has its own timestamp); a counter that went backwards is
  an engine restart, reported, never summed away.
* λ is the OFFERED arrival rate: finished requests (every finished_reason)
  plus the growth of waiting + running, per engine. When the tier is the
  bottleneck, completions are capped by it and cannot show ρ > 1.
* B is the bandwidth the engine sees: the kvctl connector's ``kvctl:l2_get_*``
  counters, else LMCache's ``remote_time_to_get`` with ``num_remote_read_bytes``,
  else Valkey's bytes out / time in GETs — server side, an UPPER bound on B
  (socket writes done by io-threads are outside the GET's time), so ρ is then
  a LOWER bound and said so (``rho_bound``).
* ρ = λ_offered · (L2 bytes per request) / B, never the served rate over B.
* B* = s·R, n* = R·T0 (R from --prefill-rate, else derived, sanity-checked).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvctl import cost
from kvctl.diagnose import metrics as M
from kvctl.diagnose.capture import Capture
from kvctl.diagnose.findings import Finding, Params, worst_severity  # noqa: F401 - Params/Finding are part of this API
from kvctl.diagnose.fleet import fleet_loads
from kvctl.diagnose.rules import findings_for
from kvctl.diagnose.observations import (  # noqa: F401 - EngineObs/InstanceObs/GET_COMMANDS are part of this API
    GET_COMMANDS,
    EngineObs,
    InstanceObs,
    _Deltas,
    _div,
    _Engine,
    _engine_obs,
    _engines,
    _instances,
)
from kvctl.errors import ExitStatus, InvalidInput
from kvctl.connector import metric_names as N
DEFAULT_T0_S = cost.PAPER_PAIRING["t0_s"]

#: where B came from (``Diagnosis.bandwidth_source``)
BW_KVCTL = "kvctl_connector"
BW_LMCACHE = "lmcache_client"
BW_VALKEY = "valkey_server_upper_bound"
BANDWIDTH_SOURCES = {
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
    typical_prompt_tokens: float | None
    hit_token_fraction: float | None
    hit_tokens_per_request: float | None
    l2_bytes_per_request: float | None
    l2_tokens_per_s: float | None
    bandwidth_gbps: float | None
    bandwidth_source: str | None  # BW_KVCTL, BW_LMCACHE or BW_VALKEY
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
    instances_for_target_rho: int | None
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


def _g(x: float | None) -> str:
    """A number for a formula string: 4 significant digits, "?" when unknown."""
    return "?" if x is None else f"{x:.4g}"


# --- the analysis ----------------------------------------------------------------------


def analyse(capture: Capture, params: Params | None = None) -> Diagnosis:
    """Observations and findings from the first and last sample of ``capture``."""

    params = params or Params()
    if len(capture.samples) < 2:
        raise InvalidInput("a diagnosis needs two samples")
    a, b = capture.samples[0], capture.samples[-1]
    window = b.t_s - a.t_s
    if not window > 0:
        raise InvalidInput(f"the samples are not in time order (Δt = {window:.3f} s)")
    given = capture.parameters or {}
    s_bpt = params.bytes_per_token if params.bytes_per_token is not None else given.get("bytes_per_token")
    r_flag = params.prefill_rate if params.prefill_rate is not None else given.get("prefill_rate")
    t0 = params.t0_s if params.t0_s is not None else float(given.get("t0_s") or DEFAULT_T0_S)
    ex: list[Quantity] = []
    notes: list[str] = []
    why: dict[str, str] = {}
    insufficient: list[str] = []

    # --- engines -----------------------------------------------------------------------
    engine_obs, ok_engines = _engines(a, b, list(capture.engine_urls), notes)
    D = _Deltas(ok_engines)
    per_engine = {e.index: _engine_obs(e) for e in ok_engines}
    engine_obs = sorted([o for o in engine_obs] + list(per_engine.values()), key=lambda o: o.index)
    unreachable = [f"engine {o.url}: {o.error}" for o in engine_obs if o.status == "unreachable"]
    for o in engine_obs:
        if o.status == "no_vllm_metrics":
            insufficient.append(f"engine {o.url} served no vllm: metrics ({o.error}): point --engine-url at the vLLM API server (the port serving /v1/completions)")
    if not ok_engines and not insufficient and not unreachable:
        insufficient.append("no engine could be read in both samples: nothing to analyse; check --engine-url and that the engines are up")

    finished_list = [o.finished for o in per_engine.values() if o.finished is not None]
    requests = sum(finished_list) if finished_list else None
    completion = sum(o.completion_rate_per_s for o in per_engine.values() if o.completion_rate_per_s is not None) if finished_list else None
    offered_list = [o.offered_rate_per_s for o in per_engine.values() if o.offered_rate_per_s is not None]
    lam = sum(offered_list) if offered_list else None
    growths = [o.queue_end - o.queue_start for o in per_engine.values() if o.queue_start is not None and o.queue_end is not None]
    growth = sum(growths) if growths else None
    if ok_engines and requests is None:
        why["arrival_rate_per_s"] = "no vllm:request_success or vllm:request_prompt_tokens in the engine metrics"
    elif ok_engines and not growths:
        notes.append("no vllm:num_requests_waiting/_running gauges: λ is the completion rate, a lower bound on the offered rate")
    ex.append(Quantity(
        "offered arrival rate λ (req/s)", lam,
        "Σ_engines (Δvllm:request_success + Δ(waiting + running)) / Δt_engine = "
        + " + ".join(f"({_g(o.finished)} + {_g(None if o.queue_start is None else o.queue_end - o.queue_start)}) / {o.window_s:.2f} s" for o in per_engine.values()),
        "vllm:request_success (all finished_reason), vllm:num_requests_waiting/_running",
    ))
    ex.append(Quantity("completions (req/s)", completion, "Σ_engines Δvllm:request_success / Δt_engine", "vllm:request_success"))
    resets = [f"{o.url}: {', '.join(o.counter_resets)}" for o in per_engine.values() if o.counter_resets]

    if ok_engines and requests == 0 and not growth:
        insufficient.append(f"no request finished or queued on the engines in the {window:.1f} s window: send traffic or lengthen --window")

    p_sum, p_cnt = D.total("vllm:request_prompt_tokens", "sum"), D.total("vllm:request_prompt_tokens", "count")
    prompt_tokens = D.total("vllm:prompt_tokens")
    if p_cnt:
        mean_prompt, mp_src = _div(p_sum, p_cnt), f"Δvllm:request_prompt_tokens_sum / Δ_count = {_g(p_sum)} / {p_cnt:g}"
    else:
        mean_prompt, mp_src = _div(prompt_tokens, requests), f"Δvllm:prompt_tokens / Δrequests = {_g(prompt_tokens)} / {_g(requests)}"
    if prompt_tokens is None:
        prompt_tokens = p_sum
    ex.append(Quantity("mean prompt tokens", mean_prompt, mp_src, "vllm:request_prompt_tokens"))
    typical = M.quantile(D.buckets("vllm:request_prompt_tokens"), 0.5) or mean_prompt
    ex.append(Quantity("typical (median) prompt tokens", typical, "p50 of the Δ request_prompt_tokens buckets (mean if none)", "vllm:request_prompt_tokens_bucket"))

    hit_tokens, hit_src = D.total("vllm:external_prefix_cache_hits"), "vllm:external_prefix_cache_hits"
    if hit_tokens is None:
        hit_tokens, hit_src = D.total("lmcache:num_hit_tokens"), "lmcache:num_hit_tokens"
    hit_frac = _div(hit_tokens, prompt_tokens)
    ex.append(Quantity("hit-token fraction", hit_frac, f"Δ{hit_src} / Δvllm:prompt_tokens = {_g(hit_tokens)} / {_g(prompt_tokens)}", hit_src))
    hits_per_req = _div(hit_tokens, requests)

    # --- Valkey side --------------------------------------------------------------------
    instances = _instances(a, b, list(capture.valkey_urls))
    unreachable += [f"Valkey rank {i.rank} ({i.url}): {i.error}" for i in instances if i.status == "unreachable"]
    resets_valkey = [f"Valkey rank {i.rank} ({i.url})" for i in instances if i.restarted]
    if resets_valkey:
        notes.append(f"restarted inside the window (INFO counters went backwards), counted from the restart: {', '.join(resets_valkey)}")
    ok_inst = [i for i in instances if i.status == "ok"]
    for inst in ok_inst:
        ex.append(Quantity(
            f"rank {inst.rank} GET busy fraction", inst.get_busy_fraction,
            f"Δcmdstat_get usec / Δt = {inst.get_busy_fraction * inst.window_s * 1e6:.0f} µs / {inst.window_s:.2f} s",
            "valkey INFO commandstats",
        ))

    # --- L2 bytes and bandwidth B ---------------------------------------------------------
    k_bytes_rate, k_secs = D.rate(N.L2_GET_BYTES), D.total(N.L2_GET_SECONDS)
    k_bytes = D.total(N.L2_GET_BYTES)
    lm_bytes_rate, lm_bytes = D.rate("lmcache:num_remote_read_bytes"), D.total("lmcache:num_remote_read_bytes")
    lm_get_ms = D.total("lmcache:remote_time_to_get", "sum")
    valkey_rate = sum(i.bytes_out_per_s for i in ok_inst) if ok_inst else None
    if k_bytes_rate is not None:
        l2_rate, l2_src = k_bytes_rate, f"{N.L2_GET_BYTES}_total (engine side)"
    elif lm_bytes_rate is not None:
        l2_rate, l2_src = lm_bytes_rate, "lmcache:num_remote_read_bytes (engine side)"
    elif valkey_rate is not None:
        l2_rate, l2_src = valkey_rate, "valkey INFO: bytes out to GETs (server side)"
    else:
        l2_rate, l2_src = None, None
        why["l2_bytes_per_request"] = "no L2 byte counter: neither kvctl:l2_get_bytes_total, lmcache:num_remote_read_bytes nor a --valkey instance"
    l2_tokens_per_s = _div(l2_rate, s_bpt)
    ex.append(Quantity("L2-served tokens/s", l2_tokens_per_s, f"Σ Δ{l2_src or 'L2 bytes'} / Δt / s = {_g(l2_rate)} B/s / {_g(s_bpt)} B/token", l2_src or "—"))

    bw = bw_src = None
    ranks, ranks_src = None, None
    if k_bytes and k_secs:
        # the connector sums bytes and GET seconds over the engine's ranks, which load in parallel
        # (each its own chunks from its own instance): B = W × Σbytes / Σseconds
        ranks, ranks_src = _engine_ranks(ok_engines, capture)
        if ranks_src is None:
            notes.append(
                "kvctl:l2_get_seconds_total is summed over the engine's ranks: with W ranks loading in parallel B is W× "
                "what is shown and ρ W× smaller; give the tier (--valkey per rank, --ranks or --dir) so W is known"
            )
        bw, bw_src = ranks * k_bytes / k_secs / cost.GB, BW_KVCTL
        ex.append(Quantity(
            "bandwidth the engine sees B (GB/s)", bw, f"W × Σbytes / Σseconds = {ranks} × {k_bytes:g} B / {k_secs:.4g} s (W: {ranks_src or 'unknown, 1 assumed'})",
            BANDWIDTH_SOURCES[BW_KVCTL],
        ))
    elif lm_bytes and lm_get_ms:
        bw, bw_src = lm_bytes / (lm_get_ms / 1e3) / cost.GB, BW_LMCACHE
        ex.append(Quantity("bandwidth the engine sees B (GB/s)", bw, f"{lm_bytes:g} B / {lm_get_ms / 1e3:.4g} s", BANDWIDTH_SOURCES[BW_LMCACHE]))
    elif any(i.bandwidth_gbps for i in ok_inst):
        busy = [i for i in ok_inst if i.bandwidth_gbps]
        bw, bw_src = sum(i.bandwidth_gbps for i in busy), BW_VALKEY
        ex.append(Quantity("B, upper bound (GB/s)", bw, f"Σ_i GET bytes out_i / Δcmdstat_get usec_i over {len(busy)} instance(s)", BANDWIDTH_SOURCES[BW_VALKEY]))
    else:
        why["bandwidth_gbps"] = "no GET timing in the window: no kvctl:l2_get_seconds_total, lmcache:remote_time_to_get, or Valkey GETs"
    bw_implausible = None
    if bw is not None and not (math.isfinite(bw) and bw <= params.max_bandwidth_gbps):
        bw_implausible, bw, bw_src = bw, None, None
        why["bandwidth_gbps"] = (
            f"B = {bw_implausible:.3g} GB/s from these counters is implausible (> {params.max_bandwidth_gbps:g} GB/s): "
            "bytes and GET time do not belong together; not used for ρ"
        )
    if ok_inst and not any(i.get_calls for i in ok_inst) and not (k_bytes or lm_bytes):
        insufficient.append(
            f"0 GETs on these {len(ok_inst)} Valkey instance(s) in the window and no engine-side L2 bytes: "
            "check that the engines' remote URL (LMCache remote_url, --kv-transfer-config) points at these instances"
        )

    # --- prefill rate, B*, n* -------------------------------------------------------------
    r, r_src, r_implausible = r_flag, ("--prefill-rate" if r_flag is not None else None), None
    if r is None:
        r, r_src, r_implausible = _derived_prefill_rate(ok_engines, D, prompt_tokens, params, ex, why)
    else:
        ex.append(Quantity("prefill rate R (tok/s)", r, "given", r_src))
    if s_bpt is None:
        why["breakeven_gbps"] = "bytes per token unknown: give --bytes-per-token or --model-config"
    b_star = cost.breakeven_gbps(s_bpt, r) if s_bpt and r else None  # s: the whole model's, B: the whole tier's
    w_ranks, w_src = _engine_ranks(ok_engines, capture)
    s_rank = s_bpt / w_ranks if s_bpt and w_src else None
    if s_bpt and not w_src:
        why["bytes_per_token_per_rank"] = "W unknown: give the tier (--valkey per rank, --ranks or --dir)"
    ex.append(Quantity("bytes per token per rank s/W", s_rank, f"{_g(s_bpt)} B/token / W = {w_ranks if w_src else '?'}", w_src or "—"))
    n_star = cost.min_hit_tokens(r, t0) if r else None
    if r is None and "breakeven_gbps" not in why:
        why["breakeven_gbps"] = why.get("prefill_rate_tok_s", "prefill rate unknown: give --prefill-rate")
    if r is None:
        why["min_hit_tokens"] = why.get("prefill_rate_tok_s", "prefill rate unknown: give --prefill-rate")
    ex.append(Quantity("break-even bandwidth B* (GB/s)", b_star, f"s·R = {_g(s_bpt)} B/token × {_g(r)} tok/s", "cost model §4"))
    ex.append(Quantity("min hit tokens n*", n_star, f"R·T0 = {_g(r)} tok/s × {t0:g} s", "cost model §4 (T0: --t0)"))

    # --- ρ ------------------------------------------------------------------------------
    l2_per_req = _div(l2_rate, completion)
    if l2_per_req is None and hits_per_req is not None and s_bpt:
        l2_per_req = hits_per_req * s_bpt
    engine_side_zero = (k_bytes == 0 and k_bytes_rate is not None) or (k_bytes is None and lm_bytes == 0)
    rho = rho_bound = None
    if lam is not None and l2_per_req == 0 and engine_side_zero:
        rho, rho_bound = 0.0, "estimate"
        notes.append("no L2 bytes loaded by the engines in the window: no load queue (ρ = 0)")
    elif lam is not None and l2_per_req is not None and bw:
        rho = _div(lam * l2_per_req, bw * cost.GB)
        rho_bound = "lower_bound" if bw_src == BW_VALKEY else "estimate"
    else:
        why["rho"] = (
            "λ unknown" if lam is None else why.get("l2_bytes_per_request") or why.get("bandwidth_gbps") or "L2 bytes per request unknown"
        )
    if rho is None and "rho" not in why:
        why["rho"] = "λ·(L2 bytes/request)/B is not a finite number with these counters"
        rho_bound = None
    busy_frac = _div(l2_rate, bw * cost.GB) if bw else None
    n_inst = max(1, len(ok_inst))
    k = cost.instances_for_rho(rho, params.target_rho, n_inst) if rho else None
    ex.append(Quantity(
        "ρ = λ·(L2 bytes/request) / B" + (" (lower bound)" if rho_bound == "lower_bound" else ""), rho,
        f"{_g(lam)} req/s × {_g(l2_per_req)} B / {_g(bw)} GB/s", "synchronous-load queue §4; λ offered, not completed",
    ))
    ex.append(Quantity("load-path busy fraction (served bytes/s over B; ≤ 1, not ρ)", busy_frac, f"{_g(l2_rate)} B/s / {_g(bw)} GB/s", l2_src or "—"))
    if rho is None and not insufficient and ok_engines:
        insufficient.append(f"ρ unknown: {why['rho']}")
    if rho_bound == "lower_bound":
        notes.append(f"B is Valkey's server-side time per GET, an upper bound: ρ ≥ {rho:.2f} (a lower bound). Engine-side metrics (kvctl connector or LMCache) give ρ itself.")

    waiting_a = sum(v for e in ok_engines if (v := e.a.gauge("vllm:num_requests_waiting")) is not None) if ok_engines else None
    waiting_b = sum(v for e in ok_engines if (v := e.b.gauge("vllm:num_requests_waiting")) is not None) if ok_engines else None
    if ok_engines and all(e.a.gauge("vllm:num_requests_waiting") is None for e in ok_engines):
        waiting_a = waiting_b = None
    gpu_utils = a.gpu.utilization_pct + b.gpu.utilization_pct
    gpu_note = b.gpu.note or a.gpu.note
    mean_prefill_s = _div(D.total("vllm:request_prefill_time_seconds", "sum"), D.total("vllm:request_prefill_time_seconds", "count"))
    obs = dict(
        lam=lam, completion=completion, typical=typical, bw=bw, bw_src=bw_src, b_star=b_star, n_star=n_star, rho=rho,
        rho_bound=rho_bound, k=k, n_inst=n_inst, waiting=(waiting_a, waiting_b), gpu_utils=gpu_utils, gpu_note=gpu_note,
        instances=ok_inst, l2_per_req=l2_per_req, resets=resets, r=r, r_implausible=r_implausible,
        blocking=D.total("lmcache:get_blocking_failed_count"),
        slow_lookups=M.count_above(D.buckets("lmcache:time_to_lookup"), params.slow_lookup_s),
        kvctl_timeouts=D.total(N.LOOKUP_TIMEOUTS), kvctl_load_errors=D.total(N.LOAD_ERRORS),
        kvctl_shortfall=D.total(N.AGREED_PREFIX_SHORTFALL_CHUNKS),
        chunks_hit=D.total(N.CHUNKS_HIT), chunks_missed=D.total(N.CHUNKS_MISSED),
        ext_queries=D.total("vllm:external_prefix_cache_queries"), ext_hits=D.total("vllm:external_prefix_cache_hits"),
        lm_requested=D.total("lmcache:num_requested_tokens"), lm_hits=D.total("lmcache:num_hit_tokens"),
        mean_prefill_s=mean_prefill_s, bw_implausible=bw_implausible,
        engine_errors=[(o.url, o.error) for o in engine_obs if o.error],
    )
    engine_loads, instance_loads = fleet_loads(ok_engines, per_engine, instances, s_bpt)
    obs["instance_loads"] = instance_loads
    obs["engine_loads"] = engine_loads
    findings = findings_for(obs, params)
    if rho is None or not math.isfinite(rho):
        findings = [f for f in findings if not f.id.startswith("rho_")]
    worst_found = worst_severity(f.severity for f in findings)
    worst = worst_found.value if worst_found else "ok"
    # the same order as exit_status: the JSON's outcome never says "ok" while the exit code says otherwise
    if worst == "critical":
        outcome = "findings"
    elif unreachable:
        outcome = "unreachable"
    elif insufficient:
        outcome = "insufficient_data"
    else:
        outcome = "findings" if findings else "ok"
    for name, value in (("arrival_rate_per_s", lam), ("bandwidth_gbps", bw), ("rho", rho), ("prefill_rate_tok_s", r)):
        if value is None and name not in why:
            why[name] = "not measurable from these samples"
    return Diagnosis(
        created_at=capture.created_at, window_s=window, engine_urls=list(capture.engine_urls), outcome=outcome,
        requests=requests, arrival_rate_per_s=lam, completion_rate_per_s=completion, queue_growth=growth,
        mean_prompt_tokens=mean_prompt, typical_prompt_tokens=typical, hit_token_fraction=hit_frac,
        hit_tokens_per_request=hits_per_req, l2_bytes_per_request=l2_per_req, l2_tokens_per_s=l2_tokens_per_s,
        bandwidth_gbps=bw, bandwidth_source=bw_src, bandwidth_source_detail=BANDWIDTH_SOURCES.get(bw_src or ""), engine_ranks=ranks if bw_src == BW_KVCTL else None,
        bytes_per_token=s_bpt, prefill_rate_tok_s=r, prefill_rate_source=r_src, t0_s=t0, breakeven_gbps=b_star,
        min_hit_tokens=n_star, rho=rho, rho_bound=rho_bound, load_busy_fraction=busy_frac, instances_for_target_rho=k,
        requests_waiting_start=waiting_a, requests_waiting_end=waiting_b, gpu_utilization_pct=list(b.gpu.utilization_pct),
        gpu_note=gpu_note, engines=engine_obs, instances=instances, unreachable=unreachable,
        insufficient_data=insufficient, findings=findings, worst_severity=worst, notes=notes + ([f"engine restarted in the window (counters went backwards): {'; '.join(resets)}"] if resets else []),
        null_reasons=why, explain=ex, bytes_per_token_per_rank=s_rank, engine_loads=engine_loads, instance_loads=instance_loads,
    )


def _engine_ranks(engines: list[_Engine], capture: Capture) -> tuple[int, str | None]:
    """W, the ranks whose GET seconds the connector sums: its ``kvctl:ranks`` gauge, else one per Valkey instance."""
    exported = [v for e in engines if (v := e.b.gauge(N.RANKS)) is not None and v >= 1]
    if exported:
        return int(max(exported)), N.RANKS
    if capture.valkey_urls:
        return len(capture.valkey_urls), f"{len(capture.valkey_urls)} Valkey instance(s), one per rank"
    return 1, None


def _derived_prefill_rate(
    engines: list[_Engine], D: _Deltas, prompt_tokens: float | None, params: Params, ex: list[Quantity], why: dict[str, str]
) -> tuple[float | None, str | None, float | None]:
    """R from the engines' prefill time, batched prefills counted once: (R, source, implausible R).

    A batch of k requests prefilled together reports its time in each of the k
    requests' ``request_prefill_time_seconds``; the engine cannot have spent more
    than its window prefilling, so per engine the busy time is min(Σ prefill time,
    window). The result is a lower bound on R whenever prefills overlapped.
    """
    computed_total, busy_total, overlapped = 0.0, 0.0, False
    for e in engines:
        one = _Deltas([e])
        pf = one.total("vllm:request_prefill_time_seconds", "sum")
        pt = one.total("vllm:prompt_tokens")
        if pt is None:
            pt = one.total("vllm:request_prompt_tokens", "sum")
        if not pf or pt is None:
            continue
        cached = (one.total("vllm:prefix_cache_hits") or 0.0) + (one.total("vllm:external_prefix_cache_hits") or 0.0)
        computed_total += max(0.0, pt - cached)
        busy = min(pf, e.window_s)
        overlapped = overlapped or pf > e.window_s
        busy_total += busy
    if not busy_total or not computed_total:
        why["prefill_rate_tok_s"] = "no prefill time or computed tokens in the window: give --prefill-rate for B* and n*"
        return None, None, None
    r = computed_total / busy_total
    src = "derived: computed prompt tokens / min(Σ request_prefill_time, window) per engine" + (
        " (prefills overlapped: a lower bound on R)" if overlapped else ""
    )
    ex.append(Quantity("prefill rate R (tok/s)", r, f"{computed_total:g} tok / {busy_total:.3f} s busy", src))
    if r < params.min_prefill_rate:
        why["prefill_rate_tok_s"] = (
            f"derived R = {r:.3g} tok/s is implausibly low (< {params.min_prefill_rate:g}): prefill time is spent waiting, "
            "not computing; give --prefill-rate"
        )
        return None, None, r
    return r, src, None
