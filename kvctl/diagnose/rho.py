"""ρ = λ·(L2 bytes per request)/B, the last step of :func:`kvctl.diagnose.analysis.analyse`, and how sure it is.

Pure (no I/O). The L2 bytes per request are those of an *offered* request, loaded or not: the L2 bytes per hit token
times the hit tokens per admitted request (:func:`kvctl.diagnose.quantities.prompts_and_hits`, both counted as vLLM
admits a request). Dividing the bytes loaded by the requests finished was 0.68 GB a request on the H200's run R2
where a loaded one carries 0.49 GB and an offered one 0.41 GB: under a growing queue requests are admitted and load
long before they finish (issue 48, item 15).

How sure: λ's two estimators (the engines' published states, finished + queue growth at the sample times) give a
range, and so ρ; λ counted n arrivals, a Poisson count, so ±1/√n besides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvctl.core import cost
from kvctl.diagnose.findings import Params
from kvctl.diagnose.observations import ratio
from kvctl.tier.sizing import up_command
from kvctl.diagnose.quantities import BW_VALKEY, Bandwidth, L2Load, Notebook, Prompts, Quantity, Rates

L2_PER_REQUEST_BASES = {
    "admitted": "L2 bytes per hit token × hit tokens per admitted request",
    "finished": "L2 bytes/s / completions/s (no vllm:prefix_cache_queries: a queue that grows inflates it)",
    "hits": "hit tokens per finished request × s",
}


@dataclass(frozen=True)
class Rho:
    rho: float | None
    bound: str | None  # "estimate", "lower_bound" or None
    l2_bytes_per_request: float | None
    busy_fraction: float | None  # served L2 bytes/s over B: capped at 1, NOT ρ
    n_instances: int
    instances_for_target: int | None
    l2_basis: str | None = None  # a key of L2_PER_REQUEST_BASES
    arrival_rate_range_per_s: tuple[float, float] | None = None  # λ's estimators, lowest and highest
    rho_range: tuple[float, float] | None = None  # ρ at those two λ
    relative_error: float | None = None  # 1/√n of the n arrivals λ counted


def l2_bytes_per_request(rates: Rates, prompts: Prompts, l2: L2Load, s_bpt: float | None, nb: Notebook) -> tuple[float | None, str | None]:
    """The L2 bytes of an offered request, and how they were found (a key of L2_PER_REQUEST_BASES)."""
    if prompts.admitted and prompts.hits_per_request:  # no hit admitted but bytes loaded: the counters disagree, use the bytes
        measured = l2.kvctl_bytes if l2.kvctl_bytes is not None else l2.lmcache_bytes
        if l2.kvctl_bytes is not None and s_bpt:  # the connector loads s bytes per hit token, summed over its ranks
            per_token, how = s_bpt, f"s = {_g(s_bpt)} B (the kvctl connector loads s bytes per hit token)"
        else:  # measured; loads that end after the window was read make it a little low
            per_token, how = ratio(measured, prompts.hit_tokens), f"Δ L2 bytes / Δ hit tokens = {_g(measured)} / {_g(prompts.hit_tokens)}"
        if per_token is not None:
            value = per_token * prompts.hits_per_request
            nb.explain.append(Quantity("L2 bytes per offered request", value, f"{how} × {_g(prompts.hits_per_request)} hit tokens per admitted request",
                                       L2_PER_REQUEST_BASES["admitted"]))
            return value, "admitted"
    value = ratio(l2.bytes_per_s, rates.completion)
    if value is not None:
        nb.explain.append(Quantity("L2 bytes per request", value, f"{_g(l2.bytes_per_s)} B/s / {_g(rates.completion)} req/s", L2_PER_REQUEST_BASES["finished"]))
        return value, "finished"
    if prompts.hits_per_request is not None and s_bpt:
        return prompts.hits_per_request * s_bpt, "hits"
    return None, None


def rho_of(
    rates: Rates, prompts: Prompts, l2: L2Load, bw: Bandwidth, s_bpt: float | None, n_ok_inst: int,
    have_engines: bool, params: Params, nb: Notebook, ranks: int | None = None,
) -> Rho:
    """ρ = λ_offered · (L2 bytes per request) / B, the range λ's estimators give it, and the instances that would bring
    it to the target (said as ``ranks`` × K instances per rank, too, when the engine's W is known and one per rank is
    too few)."""
    lam, bw_gbps = rates.offered, bw.gbps
    l2_per_req, l2_basis = l2_bytes_per_request(rates, prompts, l2, s_bpt, nb)
    engine_side_zero = (l2.kvctl_bytes == 0 and l2.kvctl_bytes_per_s is not None) or (l2.kvctl_bytes is None and l2.lmcache_bytes == 0)
    rho = rho_bound = None
    if lam is not None and l2_per_req == 0 and engine_side_zero:
        rho, rho_bound = 0.0, "estimate"
        nb.notes.append("no L2 bytes loaded by the engines in the window: no load queue (ρ = 0)")
    elif lam is not None and l2_per_req is not None and bw_gbps:
        rho = ratio(lam * l2_per_req, bw_gbps * cost.GB)
        rho_bound = "lower_bound" if bw.source == BW_VALKEY else "estimate"
    else:
        nb.why["rho"] = (
            "λ unknown" if lam is None else nb.why.get("l2_bytes_per_request") or nb.why.get("bandwidth_gbps") or "L2 bytes per request unknown"
        )
    if rho is None and "rho" not in nb.why:
        nb.why["rho"] = "λ·(L2 bytes/request)/B is not a finite number with these counters"
        rho_bound = None
    busy_frac = ratio(l2.bytes_per_s, bw_gbps * cost.GB) if bw_gbps else None
    n_inst = max(1, n_ok_inst)
    k = cost.instances_for_rho(rho, params.rho_target, n_inst) if rho else None
    nb.explain.append(Quantity(
        "ρ = λ·(L2 bytes/request) / B" + (" (lower bound)" if rho_bound == "lower_bound" else ""), rho,
        f"{_g(lam)} req/s × {_g(l2_per_req)} B / {_g(bw_gbps)} GB/s", "synchronous-load queue §4; λ offered, not completed",
    ))
    nb.explain.append(Quantity("load-path busy fraction (served bytes/s over B; ≤ 1, not ρ)", busy_frac, f"{_g(l2.bytes_per_s)} B/s / {_g(bw_gbps)} GB/s", l2.source or "—"))
    if rho is None and not nb.insufficient and have_engines:
        nb.insufficient.append(f"ρ unknown: {nb.why['rho']}")
    if rho_bound == "lower_bound":
        nb.notes.append(f"B is Valkey's server-side time per GET, an upper bound: ρ ≥ {rho:.2f} (a lower bound). Engine-side metrics (kvctl connector or LMCache) give ρ itself.")
    layout = instances_layout(k, ranks) if k and k > n_inst else None  # only when more instances are needed
    if layout:
        nb.notes.append(f"{k} instances of this bandwidth for the target ρ: {layout} ({up_command(ranks, -(-k // ranks))}, "
                        "the command the finding's fix gives; rank r keeps its chunk c on its instance (c // W) mod K)")
    lam_range = _range(lam, rates.offered_queue)
    rho_range = None
    if rho and lam_range and lam:
        rho_range = (rho * lam_range[0] / lam, rho * lam_range[1] / lam)
    n = rates.arrivals_counted
    return Rho(rho, rho_bound, l2_per_req, busy_frac, n_inst, k, l2_basis, lam_range, rho_range,
               1 / math.sqrt(n) if n and n > 0 else None)


def _range(*values: float | None) -> tuple[float, float] | None:
    known = [v for v in values if v is not None and math.isfinite(v)]
    return (min(known), max(known)) if known else None


def instances_layout(instances: int, ranks: int | None) -> str | None:
    """N instances said as W ranks × K instances per rank (K rounded up to a whole number), when W is known and
    N is more than W (one per rank cannot reach it); None otherwise."""
    if not ranks or instances <= ranks:
        return None
    per = -(-instances // ranks)
    return f"{ranks} rank(s) × {per} instances per rank = {ranks * per} instances"



def _g(x: float | None) -> str:
    return "?" if x is None else f"{x:.4g}"
