"""Findings of the live diagnosis: observations in, :class:`Finding` list out (pure).

Called by :func:`kvctl.diagnose.analysis.analyse`; each rule reads the
``obs`` mapping built there and the thresholds in ``Params``.
"""

from __future__ import annotations

import statistics
from typing import Any

from kvctl.connector.policy import DEADLINE, GIVEN_UP, PARTIAL, RECOMPUTE, TIER_QUEUE
from kvctl.diagnose.findings import Finding, Params
from kvctl.diagnose.fixes import Deployment, Server, fix_line
from kvctl.core.engine_http import TOO_LARGE
from kvctl.core.thresholds import RHO_UNSTABLE
from kvctl.tier.checks import is_local
from kvctl.tier.sizing import FirstStep, host_cores


def findings_for(o: dict[str, Any], p: Params) -> list[Finding]:
    out: list[Finding] = []
    _rho(o, p, out)
    _tier_health(o, p, out)
    _shared_instances(o, p, out)
    _metrics_too_large(o, out)
    _hits_recomputed(o, p, out)
    _saves_dropped(o, out)
    bw = o["bw"]
    if bw is not None and o["b_star"] is not None and bw < o["b_star"]:
        out.append(
            Finding(
                "bandwidth_below_breakeven",
                "warning",
                f"bandwidth B = {bw:.3f} GB/s{' (an upper bound)' if o['rho_bound'] == 'lower_bound' else ''} is below the break-even B* = {o['b_star']:.3f} GB/s: every L2 hit is slower than recomputing",
                fix_line("bandwidth_below_breakeven", o, _deployment(o)),
                {"bandwidth_gbps": bw, "breakeven_gbps": o["b_star"], "bandwidth_source": o["bw_src"], **_step_evidence(o)},
            )
        )
    if o["typical"] is not None and o["n_star"] is not None and o["typical"] < o["n_star"]:
        out.append(
            Finding(
                "prompt_below_min_hit",
                "info",
                f"the typical prompt ({o['typical']:,.0f} tokens) is shorter than n* = R·T0 = {o['n_star']:,.0f}: a hit cannot beat recompute on latency at any bandwidth",
                fix_line("prompt_below_min_hit", o),
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
                    f"requests waiting grew {wa:g} → {wb:g} while the GPUs averaged {mean_util:.0f}% busy, below the {p.gpu_idle_pct:g}% "
                    "of a compute-bound prefill: the engine is not compute-bound, it waits on something else",
                    fix_line("queue_growing_gpu_idle", o),
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
                    fix_line("queue_growing", o, variant="gpu_unknown"),
                    ev,
                )
            )
        else:
            out.append(
                Finding(
                    "queue_growing",
                    "warning",
                    f"requests waiting grew {wa:g} → {wb:g} while the GPUs averaged {mean_util:.0f}% busy: prefill is compute-bound",
                    fix_line("queue_growing", o, variant="compute_bound"),
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
                    f"Valkey {hot.name or f'rank {hot.rank}'} ({hot.url}) spends {hot.get_busy_fraction:.1%} of the window in GETs, "
                    f"{'∞' if r_busy == float('inf') else f'{r_busy:.1f}'}× the median of the others, "
                    f"and sends {'∞' if r_bytes == float('inf') else f'{r_bytes:.1f}'}× their bytes",
                    fix_line("hot_instance", o),
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
                fix_line("evictions_under_load", o),
                {"evicted_keys": evicted, "per_rank": {i.rank: i.evicted_keys for i in insts if i.evicted_keys}, "get_calls": gets},
            )
        )
    blocking, slow, kv_to = o["blocking"], o["slow_lookups"], o["kvctl_timeouts"] or 0
    if (blocking or 0) > 0 or slow > 0 or kv_to > 0:
        # only what the engines export: LMCache 0.5.6's blocking-failure gauge never reaches vLLM's /metrics (a callback
        # gauge, under multiprocess collection) and async loading times no lookup; "0" for a count nobody exports is false
        said = [f"{blocking:g} blocking GET failure(s)" if blocking is not None else "",
                f"{kv_to:g} kvctl lookup timeout(s)" if o["kvctl_timeouts"] is not None else "",
                f"{slow:g} lookup(s) slower than {p.slow_lookup_s:g} s" if o.get("lookups_timed", True) else ""]
        out.append(
            Finding(
                "timeouts_rising",
                "warning",
                f"{', '.join(x for x in said if x)} in the window",
                fix_line("timeouts_rising", o),
                {"get_blocking_failed": blocking, "kvctl_lookup_timeouts": kv_to, "slow_lookups": slow, "slow_lookup_s": p.slow_lookup_s},
            )
        )
    return out


def tier_recomputed(dec: dict[tuple[str, ...], float]) -> tuple[float, float, float, float]:
    """(hits judged, recomputed whole behind the tier's queue, in part, async loads given up at their deadline) of
    the connector's decisions ``{(decision, reason): hits}``; a given-up load was judged once already."""
    judged = sum(v for (d, *_), v in dec.items() if d != GIVEN_UP)
    return (judged, dec.get((RECOMPUTE, TIER_QUEUE), 0.0), dec.get((PARTIAL, TIER_QUEUE), 0.0),
            dec.get((GIVEN_UP, DEADLINE), 0.0))


def _hits_recomputed(o: dict[str, Any], p: Params, out: list[Finding]) -> None:
    """The kvctl connector's decision turning hits into recompute because of the tier (issue 46): its queue
    (``tier_queue``: the hit would win on an idle tier) or an async load stopped at its deadline (``given_up``)."""
    dec = o.get("decisions") or {}
    judged, whole, part, given_up = tier_recomputed(dec)
    turned = whole + part + given_up
    if turned < p.recomputed_min or turned < p.recomputed_share * max(judged, 1.0):
        return
    share = turned / judged if judged else None
    out.append(
        Finding(
            "hits_recomputed",
            "warning",
            f"the kvctl connector recomputed {turned:g} of the {judged:g} hit(s) it judged because the tier is saturated "
            f"({whole:g} whole and {part:g} in part behind the tier's queue, {given_up:g} async load(s) given up at their "
            "deadline): those prompts run at recompute speed, and the GPUs redo work the tier holds",
            fix_line("hits_recomputed", o, _deployment(o)),
            {**_step_evidence(o), "hits_judged": judged, "hits_recomputed": turned, "recomputed_share": share,
             "recomputed_whole": whole, "recomputed_in_part": part, "given_up_at_deadline": given_up,
             "decisions": {f"{d}/{r}": v for (d, r), v in sorted(dec.items())}},
        )
    )


def _metrics_too_large(o: dict[str, Any], out: list[Finding]) -> None:
    """An engine whose /metrics answer passed the size cap: refused (kvctl.core.engine_http), so it is not analysed."""
    big = [url for url, err in o.get("engine_errors", ()) if TOO_LARGE in err]
    if big:
        out.append(
            Finding(
                "metrics_too_large",
                "warning",
                f"the /metrics answer of {', '.join(big)} is over the size cap: the read stopped there and the engine is left out of the diagnosis",
                fix_line("metrics_too_large", o),
                {"engines": big},
            )
        )


def _rho(o: dict[str, Any], p: Params, out: list[Finding]) -> None:
    rho, k, bw = o["rho"], o["k"], o["bw"]
    if rho is None or rho < p.warn_rho:
        return
    lower = o["rho_bound"] == "lower_bound"
    unstable = rho >= RHO_UNSTABLE
    sev, fid = ("critical", "rho_unstable") if unstable else ("warning", "rho_high")
    what = "the synchronous-load queue is unstable and grows without bound" if unstable else "the synchronous-load queue is close to saturation"
    shown = f"ρ ≥ {rho:.2f} (a lower bound: B from Valkey's server-side GET time)" if lower else f"ρ = {rho:.2f}"
    out.append(
        Finding(
            fid,
            sev,
            f"{shown} at the offered λ = {o['lam']:.3g} req/s (completions {o['completion'] if o['completion'] is None else round(o['completion'], 3)} req/s): {what}",
            fix_line(fid, {"instances_for_rho_target": k, "rho_target": p.rho_target}, _deployment(o)),
            {**_step_evidence(o),
                "rho": rho, "rho_bound": o["rho_bound"], "bandwidth_gbps": bw, "bandwidth_source": o["bw_src"],
                "instances_now": o["n_inst"], "instances_for_rho_target": k, "rho_target": p.rho_target,
                "l2_bytes_per_request": o["l2_per_req"], "arrival_rate_per_s": o["lam"], "completion_rate_per_s": o["completion"],
            },
        )
    )


def _tier_health(o: dict[str, Any], p: Params, out: list[Finding]) -> None:
    """No hits while the engines keep asking, a derived R that is a symptom, restarts, kvctl connector errors."""
    queried = (o["ext_queries"] or 0) + (o["lm_requested"] or 0)
    hit = (o["ext_hits"] or 0) + (o["lm_hits"] or 0) + (o["chunks_hit"] or 0)
    if (queried > 0 or (o["chunks_missed"] or 0) > 0) and hit == 0:
        slow = o["mean_prefill_s"] is not None and o["mean_prefill_s"] >= p.slow_lookup_s
        per_req = "" if o["mean_prefill_s"] is None else f"; prefill takes {o['mean_prefill_s']:.2f} s per request"
        out.append(
            Finding(
                "l2_no_hits",
                "critical" if slow else "warning",
                f"the engines asked the KV tier for {queried:,.0f} token(s) and got 0 hits{per_req}"
                + (": lookups are timing out, every request waits on a tier that answers nothing" if slow else ""),
                fix_line("l2_no_hits", o),
                {"queried_tokens": queried, "hit_tokens": hit, "mean_prefill_s": o["mean_prefill_s"], "chunks_missed": o["chunks_missed"]},
            )
        )
    if o["r_implausible"] is not None:
        out.append(
            Finding(
                "prefill_rate_implausible",
                "warning",
                f"the prefill rate derived from the engine's prefill time is {o['r_implausible']:.3g} tok/s: prefill time is spent "
                "waiting (a lookup timeout, a stalled load), not computing; B* and n* are not computed from it",
                fix_line("prefill_rate_implausible", o),
                {"derived_prefill_rate_tok_s": o["r_implausible"], "mean_prefill_s": o["mean_prefill_s"]},
            )
        )
    if o["bw_implausible"] is not None:
        out.append(
            Finding(
                "bandwidth_implausible",
                "warning",
                f"the tier bandwidth these counters give is {o['bw_implausible']:.3g} GB/s, beyond any network: bytes and GET "
                "time do not belong together (mixed label sets, a counter in the wrong unit), so ρ is not computed from it",
                fix_line("bandwidth_implausible", o),
                {"bandwidth_gbps": o["bw_implausible"]},
            )
        )
    if o["resets"]:
        out.append(
            Finding(
                "engine_restarted",
                "warning",
                f"counters went backwards inside the window (an engine restarted): {'; '.join(o['resets'])}",
                fix_line("engine_restarted", o),
                {"engines": o["resets"]},
            )
        )
    errs, short = o["kvctl_load_errors"] or 0, o["kvctl_shortfall"] or 0
    if errs > 0 or short > 0:
        out.append(
            Finding(
                "load_failures",
                "warning",
                f"{errs:g} L2 load error(s) and {short:g} chunk(s) dropped from agreed prefixes in the window (kvctl connector)",
                fix_line("load_failures", o),
                {"load_errors": errs, "agreed_prefix_shortfall_chunks": short},
            )
        )



def _saves_dropped(o: dict[str, Any], out: list[Finding]) -> None:
    """The kvctl connector refused saves: the ones waiting for the tier already held save_queue_bytes (their
    extracted chunks are GPU memory on CUDA), so the tier takes writes slower than the engines make them."""
    dropped = o.get("kvctl_saves_dropped") or 0
    if dropped > 0:
        out.append(
            Finding(
                "saves_dropped",
                "warning",
                f"{dropped:g} save(s) dropped in the window (kvctl connector): the saves waiting for the tier held "
                "save_queue_bytes, so the tier takes writes slower than the engines make them; those prompts will miss",
                fix_line("saves_dropped", o),
                {"saves_dropped": dropped},
            )
        )


def _shared_instances(o: dict[str, Any], p: Params, out: list[Finding]) -> None:
    """The busiest instance that several engines share, at ρ ≥ the warning threshold (summed over its engines)."""
    shared = [i for i in o.get("instance_loads") or () if i.rho is not None and len(i.engines) >= 2 and i.rho >= p.warn_rho]
    if not shared:
        return
    hot = max(shared, key=lambda i: i.rho)
    engines = {e.index: e for e in o.get("engine_loads") or ()}
    parts = ", ".join(f"engine {e} ({engines[e].url if e in engines else '?'}) ρ {share:.2f}" for e, share in sorted(hot.shares, key=lambda x: -x[1]))
    bound = " (a lower bound: B from Valkey's server side)" if hot.rho_bound == "lower_bound" else ""
    out.append(
        Finding(
            "instance_saturated",
            "critical" if hot.rho >= RHO_UNSTABLE else "warning",
            f"Valkey {hot.name or f'rank {hot.rank}'} ({hot.url}) is at ρ = {hot.rho:.2f}{bound} from {len(hot.engines)} engines sharing it: {parts}; "
            "each engine may look fine on its own while together they saturate the instance",
            fix_line("instance_saturated", {"engines": len(hot.engines)}, _deployment(o, hot.rank)),
            {**_step_evidence(o, hot.rank), "rank": hot.rank, "rho": hot.rho, "rho_bound": hot.rho_bound, "engines": list(hot.engines),
             "shares": {str(e): v for e, v in hot.shares}, "bandwidth_gbps": hot.bandwidth_gbps,
             "bandwidth_source": hot.bandwidth_source, "offered_bytes_per_s": hot.offered_bytes_per_s},
        )
    )


def _deployment(o: dict[str, Any], rank: int | None = None) -> Deployment:
    """The deployment a fix is said for (kvctl.diagnose.fixes): the engine's ranks W, the tier's instances per rank, and
    the instances of the window (of ``rank``'s, when given) that answered, each with its server version and io-threads;
    those on this host are sized with its cores, others as on a 16-core host, said so."""
    insts = [i for i in o.get("instances") or () if i.status == "ok" and (rank is None or i.rank == rank)]
    here = [i for i in insts if is_local(_host(i.url))]
    servers = tuple(Server(i.server_version, i.io_threads, host_cores() if i in here else None, len(here) if i in here else 1) for i in insts)
    return Deployment(o.get("ranks"), o.get("instances_per_rank") or 1, servers)


def _step(o: dict[str, Any], rank: int | None = None) -> FirstStep | None:
    """The server change that gives an instance of the window (of ``rank``'s) the most, before any instance is added
    (kvctl.tier.sizing.first_step: Valkey 8.x → 9.1, io-threads → its host's share); None when none would give much more."""
    return _deployment(o, rank).first_step()


def _step_evidence(o: dict[str, Any], rank: int | None = None) -> dict[str, Any]:
    step = _step(o, rank)
    return {"first_step": step.text, **step.evidence()} if step else {}


def _host(url: str) -> str:
    from kvctl.connector.urls import InvalidUrl, parse_resp_url  # noqa: PLC0415

    try:
        return parse_resp_url(url).host
    except (InvalidUrl, ValueError):
        return ""
