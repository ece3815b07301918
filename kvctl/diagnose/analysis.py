"""Two samples → observations → findings (paper §4 and §6).

Pure: takes a :class:`~kvctl.diagnose.capture.Capture`, returns a
:class:`Diagnosis`. Every derived quantity carries the formula it came from
and its source (``--explain`` prints them).

* λ = Δ vllm:request_success / Δt
* mean prompt = Δ vllm:request_prompt_tokens_sum / Δ _count
* hit-token fraction = Δ vllm:external_prefix_cache_hits / Δ vllm:prompt_tokens
* L2 bytes = Δ lmcache:num_remote_read_bytes (else Valkey bytes out); L2 tokens = L2 bytes / s
* B = bytes out / time spent in GETs (Valkey commandstats, server side; else
  LMCache's remote_time_to_get, client side)
* ρ = λ·n_L2·s / B (synchronous loading is a single-server queue)
* B* = s·R, n* = R·T0
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from kvctl import cost
from kvctl.diagnose import metrics as M
from kvctl.diagnose.capture import Capture, Sample
from kvctl.diagnose.findings import worst_severity
from kvctl.errors import InvalidInput

GET_COMMANDS = ("cmdstat_get", "cmdstat_mget", "cmdstat_getex")
DEFAULT_T0_S = cost.PAPER_PAIRING["t0_s"]


@dataclass(frozen=True)
class Params:
    """What the user told us (flags), plus thresholds for the findings."""

    bytes_per_token: float | None = None
    prefill_rate: float | None = None
    t0_s: float | None = None  # None: the capture's, else the paper's 0.33 s
    target_rho: float = 0.5
    warn_rho: float = 0.7
    slow_lookup_s: float = 1.0
    gpu_idle_pct: float = 30.0
    hot_ratio: float = 2.0
    hot_min_gets: int = 100


@dataclass(frozen=True)
class Quantity:
    """One derived number with how it was computed (for ``--explain``)."""

    name: str
    value: float | None
    formula: str
    source: str


@dataclass(frozen=True)
class Finding:
    id: str
    severity: str  # "info", "warning" or "critical"
    message: str
    recommendation: str
    evidence: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class InstanceObs:
    rank: int
    url: str
    get_calls: float
    get_rate_per_s: float
    bytes_out: float
    bytes_out_per_s: float
    usec_per_get: float | None
    get_busy_fraction: float
    bandwidth_gbps: float | None
    evicted_keys: float


@dataclass(frozen=True)
class Diagnosis:
    created_at: str
    window_s: float
    engine_urls: list[str]
    requests: float | None
    arrival_rate_per_s: float | None
    mean_prompt_tokens: float | None
    typical_prompt_tokens: float | None
    hit_token_fraction: float | None
    hit_tokens_per_request: float | None
    l2_bytes_per_request: float | None
    l2_tokens_per_s: float | None
    bandwidth_gbps: float | None
    bandwidth_source: str | None
    bytes_per_token: float | None
    prefill_rate_tok_s: float | None
    prefill_rate_source: str | None
    t0_s: float
    breakeven_gbps: float | None
    min_hit_tokens: float | None
    rho: float | None
    instances_for_target_rho: int | None
    requests_waiting_start: float | None
    requests_waiting_end: float | None
    gpu_utilization_pct: list[float]
    gpu_note: str
    instances: list[InstanceObs]
    findings: list[Finding]
    worst_severity: str
    notes: list[str]
    explain: list[Quantity]


def _g(x: float | None) -> str:
    """A number for a formula string: 4 significant digits, "?" when unknown."""
    return "?" if x is None else f"{x:.4g}"


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _engine_scrapes(s: Sample) -> M.Scrape:
    return M.merge([M.parse(text, f"engine {i} metrics") for i, text in enumerate(s.engines)])


def _cmd(info: dict[str, Any], field_name: str) -> float:
    return float(sum(float((info.get(c) or {}).get(field_name, 0)) for c in GET_COMMANDS))


def _instances(a: Sample, b: Sample, urls: list[str], window_s: float) -> list[InstanceObs]:
    if len(a.valkey) != len(b.valkey):
        raise InvalidInput(f"the samples hold {len(a.valkey)} and {len(b.valkey)} Valkey instances; they must match")
    out = []
    for rank, (ia, ib) in enumerate(zip(a.valkey, b.valkey)):
        calls = M.delta(_cmd(ia, "calls"), _cmd(ib, "calls")) or 0.0
        usec = M.delta(_cmd(ia, "usec"), _cmd(ib, "usec")) or 0.0
        out_bytes = M.delta(float(ia.get("total_net_output_bytes", 0)), float(ib.get("total_net_output_bytes", 0))) or 0.0
        evicted = M.delta(float(ia.get("evicted_keys", 0)), float(ib.get("evicted_keys", 0))) or 0.0
        out.append(
            InstanceObs(
                rank=rank,
                url=urls[rank] if rank < len(urls) else f"rank {rank}",
                get_calls=calls,
                get_rate_per_s=calls / window_s,
                bytes_out=out_bytes,
                bytes_out_per_s=out_bytes / window_s,
                usec_per_get=_div(usec, calls),
                get_busy_fraction=usec / (window_s * 1e6),
                bandwidth_gbps=(out_bytes / (usec / 1e6) / cost.GB) if usec > 0 and out_bytes > 0 else None,
                evicted_keys=evicted,
            )
        )
    return out


def analyse(capture: Capture, params: Params | None = None) -> Diagnosis:
    """Observations and findings from the first and last sample of ``capture``."""
    params = params or Params()
    if len(capture.samples) < 2:
        raise InvalidInput("a diagnosis needs two samples")
    a, b = capture.samples[0], capture.samples[-1]
    window = b.t_s - a.t_s
    if window <= 0:
        raise InvalidInput(f"the samples are not in time order (Δt = {window:.3f} s)")
    given = capture.parameters or {}
    s_bpt = params.bytes_per_token if params.bytes_per_token is not None else given.get("bytes_per_token")
    r_flag = params.prefill_rate if params.prefill_rate is not None else given.get("prefill_rate")
    t0 = params.t0_s if params.t0_s is not None else float(given.get("t0_s") or DEFAULT_T0_S)
    ea, eb = _engine_scrapes(a), _engine_scrapes(b)
    ex: list[Quantity] = []
    notes: list[str] = []

    def d_counter(name: str) -> float | None:
        return M.delta(ea.counter(name), eb.counter(name))

    # --- engine side -------------------------------------------------------
    requests = d_counter("vllm:request_success")
    req_src = "vllm:request_success"
    if requests is None:
        requests = M.delta(ea.hist_count("vllm:request_prompt_tokens"), eb.hist_count("vllm:request_prompt_tokens"))
        req_src = "vllm:request_prompt_tokens_count"
    if requests is None:
        notes.append("no vllm:request_success or vllm:request_prompt_tokens in the engine metrics: λ unknown")
    lam = _div(requests, window)
    ex.append(Quantity("arrival rate λ (req/s)", lam, f"Δ{req_src} / Δt = {_g(requests)} / {window:.2f} s", req_src))

    p_sum = M.delta(ea.hist_sum("vllm:request_prompt_tokens"), eb.hist_sum("vllm:request_prompt_tokens"))
    p_cnt = M.delta(ea.hist_count("vllm:request_prompt_tokens"), eb.hist_count("vllm:request_prompt_tokens"))
    prompt_tokens = d_counter("vllm:prompt_tokens")
    if p_cnt:
        mean_prompt, mp_src = _div(p_sum, p_cnt), f"Δvllm:request_prompt_tokens_sum / Δ_count = {p_sum:g} / {p_cnt:g}"
    else:
        mean_prompt, mp_src = _div(prompt_tokens, requests), f"Δvllm:prompt_tokens / Δrequests = {_g(prompt_tokens)} / {_g(requests)}"
    if prompt_tokens is None:
        prompt_tokens = p_sum
    ex.append(Quantity("mean prompt tokens", mean_prompt, mp_src, "vllm:request_prompt_tokens"))
    typical = M.quantile(M.bucket_delta(ea, eb, "vllm:request_prompt_tokens"), 0.5) or mean_prompt
    ex.append(Quantity("typical (median) prompt tokens", typical, "p50 of the Δ request_prompt_tokens buckets (mean if none)", "vllm:request_prompt_tokens_bucket"))

    hit_tokens, hit_src = d_counter("vllm:external_prefix_cache_hits"), "vllm:external_prefix_cache_hits"
    if hit_tokens is None:
        hit_tokens, hit_src = d_counter("lmcache:num_hit_tokens"), "lmcache:num_hit_tokens"
    hit_frac = _div(hit_tokens, prompt_tokens)
    ex.append(Quantity("hit-token fraction", hit_frac, f"Δ{hit_src} / Δvllm:prompt_tokens = {_g(hit_tokens)} / {_g(prompt_tokens)}", hit_src))
    hits_per_req = _div(hit_tokens, requests)

    # --- Valkey side ---------------------------------------------------------
    instances = _instances(a, b, capture.valkey_urls, window)
    for inst in instances:
        ex.append(
            Quantity(
                f"rank {inst.rank} GET busy fraction",
                inst.get_busy_fraction,
                f"Δcmdstat_get usec / Δt = {inst.get_busy_fraction * window * 1e6:.0f} µs / {window:.2f} s",
                "valkey INFO commandstats",
            )
        )

    # --- L2 bytes and bandwidth ------------------------------------------------
    l2_bytes, l2_src = d_counter("lmcache:num_remote_read_bytes"), "lmcache:num_remote_read_bytes"
    if l2_bytes is None and instances:
        l2_bytes, l2_src = sum(i.bytes_out for i in instances), "valkey INFO total_net_output_bytes"
    l2_tokens_per_s = _div(_div(l2_bytes, s_bpt), window)
    ex.append(Quantity("L2-served tokens/s", l2_tokens_per_s, f"Δ{l2_src} / s / Δt = {_g(l2_bytes)} B / {_g(s_bpt)} B/token / {window:.2f} s", l2_src))

    bw, bw_src = None, None
    busy_instances = [i for i in instances if i.bandwidth_gbps]
    if busy_instances:
        bw = sum(i.bandwidth_gbps for i in busy_instances)
        bw_src = f"valkey server side: Σ bytes out / time in GETs over {len(busy_instances)} instance(s)"
        ex.append(Quantity("delivered bandwidth B (GB/s)", bw, "Σ_i Δtotal_net_output_bytes_i / Δcmdstat_get usec_i", bw_src))
    else:
        get_ms = M.delta(ea.hist_sum("lmcache:remote_time_to_get"), eb.hist_sum("lmcache:remote_time_to_get"))
        rb = d_counter("lmcache:num_remote_read_bytes")
        if get_ms and rb:
            bw = rb / (get_ms / 1e3) / cost.GB
            bw_src = "lmcache client side: Δnum_remote_read_bytes / Δremote_time_to_get_sum (ms)"
            ex.append(Quantity("delivered bandwidth B (GB/s)", bw, f"{rb:g} B / {get_ms / 1e3:.3f} s", bw_src))
        else:
            notes.append("no GET traffic in the window: delivered bandwidth B unknown")

    # --- prefill rate, B*, n* --------------------------------------------------
    r, r_src = r_flag, "--prefill-rate" if r_flag is not None else None
    if r is None:
        pf_s = M.delta(ea.hist_sum("vllm:request_prefill_time_seconds"), eb.hist_sum("vllm:request_prefill_time_seconds"))
        cached = (d_counter("vllm:prefix_cache_hits") or 0.0) + (d_counter("vllm:external_prefix_cache_hits") or 0.0)
        computed = None if prompt_tokens is None else max(0.0, prompt_tokens - cached)
        if pf_s and computed:
            r, r_src = computed / pf_s, "derived: (Δvllm:prompt_tokens − cached) / Δvllm:request_prefill_time_seconds_sum"
            ex.append(Quantity("prefill rate R (tok/s)", r, f"{computed:g} tok / {pf_s:.3f} s", r_src))
        else:
            notes.append("prefill rate unknown (no prefill time in the window): give --prefill-rate for B* and n*")
    else:
        ex.append(Quantity("prefill rate R (tok/s)", r, "given", r_src))
    if s_bpt is None:
        notes.append("bytes per token unknown: give --bytes-per-token or --model-config for B*, n* and L2 tokens")
    b_star = cost.breakeven_gbps(s_bpt, r) if s_bpt and r else None
    n_star = cost.min_hit_tokens(r, t0) if r else None
    ex.append(Quantity("break-even bandwidth B* (GB/s)", b_star, f"s·R = {_g(s_bpt)} B/token × {_g(r)} tok/s", "cost model §4"))
    ex.append(Quantity("min hit tokens n*", n_star, f"R·T0 = {_g(r)} tok/s × {t0:g} s", "cost model §4 (T0: --t0)"))

    # --- ρ -----------------------------------------------------------------------
    l2_per_req = _div(l2_bytes, requests)
    if l2_per_req is None and hits_per_req is not None and s_bpt:
        l2_per_req = hits_per_req * s_bpt
    load_rate = _div(l2_bytes, window)
    if load_rate is None and lam is not None and l2_per_req is not None:
        load_rate = lam * l2_per_req
    rho = _div(load_rate, bw * cost.GB) if bw else None
    n_inst = max(1, len(instances))
    k = cost.instances_for_rho(rho, params.target_rho, n_inst) if rho else None
    ex.append(Quantity("ρ = λ·n_L2·s / B", rho, f"λ·(L2 bytes/request) / B = {_g(load_rate)} B/s / {_g(bw)} GB/s", "synchronous-load queue §4"))

    waiting_a, waiting_b = ea.gauge("vllm:num_requests_waiting"), eb.gauge("vllm:num_requests_waiting")
    gpu_utils = a.gpu.utilization_pct + b.gpu.utilization_pct
    gpu_note = b.gpu.note or a.gpu.note
    obs = dict(
        lam=lam, typical=typical, bw=bw, bw_src=bw_src, b_star=b_star, n_star=n_star, rho=rho, k=k, n_inst=n_inst,
        waiting=(waiting_a, waiting_b), gpu_utils=gpu_utils, gpu_note=gpu_note, instances=instances, l2_per_req=l2_per_req,
        blocking=d_counter("lmcache:get_blocking_failed_count"),
        slow_lookups=M.count_above(M.bucket_delta(ea, eb, "lmcache:time_to_lookup"), params.slow_lookup_s),
    )
    findings = _findings(obs, params)
    worst_found = worst_severity(f.severity for f in findings)
    worst = worst_found.value if worst_found else "ok"
    return Diagnosis(
        created_at=capture.created_at,
        window_s=window,
        engine_urls=list(capture.engine_urls),
        requests=requests,
        arrival_rate_per_s=lam,
        mean_prompt_tokens=mean_prompt,
        typical_prompt_tokens=typical,
        hit_token_fraction=hit_frac,
        hit_tokens_per_request=hits_per_req,
        l2_bytes_per_request=l2_per_req,
        l2_tokens_per_s=l2_tokens_per_s,
        bandwidth_gbps=bw,
        bandwidth_source=bw_src,
        bytes_per_token=s_bpt,
        prefill_rate_tok_s=r,
        prefill_rate_source=r_src,
        t0_s=t0,
        breakeven_gbps=b_star,
        min_hit_tokens=n_star,
        rho=rho,
        instances_for_target_rho=k,
        requests_waiting_start=waiting_a,
        requests_waiting_end=waiting_b,
        gpu_utilization_pct=list(b.gpu.utilization_pct),
        gpu_note=gpu_note,
        instances=instances,
        findings=findings,
        worst_severity=worst,
        notes=notes,
        explain=ex,
    )


def _findings(o: dict[str, Any], p: Params) -> list[Finding]:
    out: list[Finding] = []
    rho, k, bw = o["rho"], o["k"], o["bw"]
    if rho is not None and rho >= p.warn_rho:
        sev, fid = ("critical", "rho_unstable") if rho >= 1 else ("warning", "rho_high")
        what = "the synchronous-load queue is unstable and grows without bound" if rho >= 1 else "the synchronous-load queue is close to saturation"
        out.append(
            Finding(
                fid,
                sev,
                f"ρ = {rho:.2f}: {what}",
                f"run {k} Valkey instance(s) of this bandwidth (one per rank, `kvctl deploy-valkey`) to bring ρ to ≤ {p.target_rho:g}, "
                "or switch to asynchronous loading (`kvctl loading async`)",
                {"rho": rho, "bandwidth_gbps": bw, "instances_now": o["n_inst"], "instances_for_target_rho": k, "target_rho": p.target_rho, "l2_bytes_per_request": o["l2_per_req"], "arrival_rate_per_s": o["lam"]},
            )
        )
    if bw is not None and o["b_star"] is not None and bw < o["b_star"]:
        out.append(
            Finding(
                "bandwidth_below_breakeven",
                "warning",
                f"delivered bandwidth B = {bw:.3f} GB/s is below the break-even B* = {o['b_star']:.3f} GB/s: every L2 hit is slower than recomputing",
                "raise the tier's bandwidth: one Valkey instance per rank scales GETs (6.3× at 8 instances in the paper); until B > B*, hits only save GPU compute",
                {"bandwidth_gbps": bw, "breakeven_gbps": o["b_star"], "bandwidth_source": o["bw_src"]},
            )
        )
    if o["typical"] is not None and o["n_star"] is not None and o["typical"] < o["n_star"]:
        out.append(
            Finding(
                "prompt_below_min_hit",
                "info",
                f"the typical prompt ({o['typical']:,.0f} tokens) is shorter than n* = R·T0 = {o['n_star']:,.0f}: a hit cannot beat recompute on latency at any bandwidth",
                "keep the tier for capacity (hits use no GPU compute); to win on latency, shrink T0 (engine-side per-hit cost) — see `kvctl cost report`",
                {"typical_prompt_tokens": o["typical"], "min_hit_tokens": o["n_star"]},
            )
        )
    wa, wb = o["waiting"]
    if wa is not None and wb is not None and wb > wa and wb >= 1:
        utils = o["gpu_utils"]
        mean_util = statistics.fmean(utils) if utils else None
        ev = {"requests_waiting_start": wa, "requests_waiting_end": wb, "gpu_utilization_pct": mean_util}
        if mean_util is not None and mean_util < p.gpu_idle_pct:
            out.append(
                Finding(
                    "queue_growing_gpu_idle",
                    "critical",
                    f"requests waiting grew {wa:g} → {wb:g} while the GPUs were {mean_util:.0f}% busy: the engine is waiting on something other than compute",
                    "the remote tier or a stalled lookup is holding the engine step: check ρ above, run `kvctl diagnose stalls --match vllm`, consider `kvctl loading async`",
                    ev,
                )
            )
        elif mean_util is None:
            ev["gpu_note"] = o["gpu_note"]
            out.append(
                Finding(
                    "queue_growing",
                    "warning",
                    f"requests waiting grew {wa:g} → {wb:g} ({o['gpu_note'] or 'GPU utilisation unknown'})",
                    "run kvctl where NVML sees the engine's GPUs to tell a compute-bound engine from one waiting on the tier; check ρ and `kvctl diagnose stalls`",
                    ev,
                )
            )
        else:
            out.append(
                Finding(
                    "queue_growing",
                    "warning",
                    f"requests waiting grew {wa:g} → {wb:g} with the GPUs {mean_util:.0f}% busy: prefill is compute-bound",
                    "add prefill capacity, or raise the hit fraction so fewer tokens are recomputed",
                    ev,
                )
            )
    insts = o["instances"]
    if len(insts) >= 2:
        # hot = receives much more GET traffic (bytes out) AND spends much more time in GETs than the others
        hot = max(insts, key=lambda i: i.get_busy_fraction)
        others = [i for i in insts if i is not hot]
        med_busy = statistics.median(i.get_busy_fraction for i in others)
        med_bytes = statistics.median(i.bytes_out for i in others)

        def ratio(x: float, med: float) -> float:
            return float("inf") if med == 0 else x / med

        r_busy, r_bytes = ratio(hot.get_busy_fraction, med_busy), ratio(hot.bytes_out, med_bytes)
        if hot.get_calls >= p.hot_min_gets and hot.get_busy_fraction > 0 and min(r_busy, r_bytes) >= p.hot_ratio:
            out.append(
                Finding(
                    "hot_instance",
                    "warning",
                    f"Valkey rank {hot.rank} ({hot.url}) spends {hot.get_busy_fraction:.1%} of the window in GETs, "
                    f"{'∞' if r_busy == float('inf') else f'{r_busy:.1f}'}× the median of the others, "
                    f"and sends {'∞' if r_bytes == float('inf') else f'{r_bytes:.1f}'}× their bytes",
                    "keys are not spread by rank: use the {rank} URL so each rank's chunks live on its own instance (sharded store, paper §5.2)",
                    {
                        "rank": hot.rank,
                        "get_busy_fraction": hot.get_busy_fraction,
                        "others_median_busy_fraction": med_busy,
                        "bytes_out": hot.bytes_out,
                        "others_median_bytes_out": med_bytes,
                        "get_calls": hot.get_calls,
                        "busy_fractions": [i.get_busy_fraction for i in insts],
                    },
                )
            )
    evicted = sum(i.evicted_keys for i in insts)
    gets = sum(i.get_calls for i in insts)
    if evicted > 0 and (gets > 0 or (o["lam"] or 0) > 0):
        out.append(
            Finding(
                "evictions_under_load",
                "warning",
                f"{evicted:,.0f} key(s) evicted during the window while serving {gets:,.0f} GET(s): evicted chunks come back as recompute",
                "raise maxmemory or add instances (`kvctl deploy-valkey`); check that maxmemory-policy is an LRU policy",
                {"evicted_keys": evicted, "per_rank": {i.rank: i.evicted_keys for i in insts if i.evicted_keys}, "get_calls": gets},
            )
        )
    blocking, slow = o["blocking"], o["slow_lookups"]
    if (blocking or 0) > 0 or slow > 0:
        out.append(
            Finding(
                "timeouts_rising",
                "warning",
                f"{blocking or 0:g} blocking GET failure(s) and {slow:g} lookup(s) slower than {p.slow_lookup_s:g} s in the window",
                "lookups or blocking GETs are timing out: check the remote tier's latency (kvctl bench), run `kvctl diagnose stalls` for the lost-completion and missing-key signatures",
                {"get_blocking_failed": blocking or 0, "slow_lookups": slow, "slow_lookup_s": p.slow_lookup_s},
            )
        )
    return out
