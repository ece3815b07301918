"""Several engines sharing Valkey instances: ρ per instance summed over the engines that use it (pure).

Which instances an engine uses: rank r of an engine with W_e ranks loads from instance r (the ``{rank}``
URL, one instance per rank), so engine e uses instances 0 … W_e − 1 of the tier given (``--valkey`` per
rank, ``--ranks`` or ``--dir``), W_e from its ``kvctl:ranks`` gauge, else every instance. Each of its ranks
loads 1/W_e of its L2 bytes.

* an engine's ρ_e = λ_e·(its L2 bytes per request) / B_e, against the bandwidth B_e it actually gets (its
  own ``kvctl:l2_get_*`` or LMCache counters: the GETs' time includes waiting behind other engines);
* an instance's ρ_i = Σ over the engines e using it of λ_e·(bytes_e / W_e) / B_i, with B_i what one
  instance delivers: the best per-rank bandwidth any of its engines saw (B_e / W_e, the least contended
  view), else Valkey's server-side bytes per GET second (an UPPER bound on B_i, so ρ_i is then a lower
  bound). λ_e is the OFFERED rate (finished + queue growth), as everywhere in diagnose.

K instances per rank: rank r of every engine loads from rank r's K instances at once, chunk c from its
instance (c // W) mod K, so each gets 1/K of the rank's bytes, and a rank's bandwidth is the sum over
its K instances. Per instance: offered_i = Σ_e λ_e·bytes_e / (W_e·K) and, engine side, B_i = best
B_e / (W_e·K) (the rank's share of B_e, split over its instances), else the instance's own server-side
bandwidth: ρ_i is then the same for a rank's K instances when they are equally fast, and it is what
ρ_rank = Σ_e λ_e·bytes_e / W_e over Σ_i B_i would be.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvctl.core import cost
from kvctl.diagnose.observations import EngineObs, InstanceObs, Deltas, ratio, EnginePair
from kvctl.connector import metric_names as N


@dataclass(frozen=True)
class EngineLoad:
    index: int
    url: str
    ranks: int  # W_e
    ranks_source: str  # "kvctl:ranks" or "every instance"
    arrival_rate_per_s: float | None
    l2_bytes_per_request: float | None
    bandwidth_gbps: float | None  # B_e: what this engine gets
    rho: float | None  # λ_e·bytes_e / B_e
    instances: tuple[int, ...]  # ranks of the instances it uses


@dataclass(frozen=True)
class InstanceLoad:
    rank: int
    url: str
    engines: tuple[int, ...]  # indices of the engines using it
    offered_bytes_per_s: float  # Σ_e λ_e·bytes_e / W_e
    bandwidth_gbps: float | None  # B_i
    bandwidth_source: str | None  # "engine side (best B_e / W_e)" or "Valkey server side (upper bound)"
    rho: float | None
    rho_bound: str | None  # "estimate" or "lower_bound"
    shares: tuple[tuple[int, float], ...]  # (engine, its ρ contribution on this instance)
    instance: int = 0  # which of its rank's instances
    name: str = ""  # "rank 2", or "rank 2 instance 1"


def _engine_load(e: EnginePair, o: EngineObs, n_inst: int, s_bpt: float | None) -> EngineLoad:
    gauge = e.b.gauge(N.RANKS)
    ranks, src = (int(gauge), N.RANKS) if gauge is not None and gauge >= 1 else (n_inst, "every instance")
    ranks = max(1, min(ranks, n_inst)) if n_inst else max(1, ranks)
    one = Deltas([e])
    k_bytes, k_secs = one.total(N.L2_GET_BYTES), one.total(N.L2_GET_SECONDS)
    lm_bytes, lm_ms = one.total(N.LMCACHE_NUM_REMOTE_READ_BYTES), one.total(N.LMCACHE_REMOTE_TIME_TO_GET, "sum")
    hits = one.total(N.VLLM_EXTERNAL_PREFIX_CACHE_HITS)
    bw = None
    if k_bytes and k_secs:
        l2 = k_bytes
        bw = ranks * k_bytes / k_secs / cost.GB  # the ranks load in parallel; the connector sums their seconds
    elif lm_bytes and lm_ms:
        l2, bw = lm_bytes, lm_bytes / (lm_ms / 1e3) / cost.GB
    else:
        l2 = k_bytes if k_bytes is not None else lm_bytes if lm_bytes is not None else (hits * s_bpt if hits is not None and s_bpt else None)
    per_req = ratio(l2, o.finished)
    lam = o.arrival_rate_per_s
    rho = ratio(lam * per_req, bw * cost.GB) if lam is not None and per_req is not None and bw else None
    if rho is None and lam is not None and per_req == 0:
        rho = 0.0
    return EngineLoad(o.index, o.url, ranks, src, lam, per_req, bw, rho, tuple(range(ranks)))


def fleet_loads(engines: list[EnginePair], obs: dict[int, EngineObs], instances: list[InstanceObs],
                s_bpt: float | None, instances_per_rank: int = 1) -> tuple[list[EngineLoad], list[InstanceLoad]]:
    """Per-engine and per-instance loads; empty unless at least two engines were read.

    ``instances`` in tier order, ``instances_per_rank`` K of them per rank (see the module's docstring)."""
    if len(engines) < 2:
        return [], []
    k = max(1, instances_per_rank)
    n_inst = len({i.rank for i in instances})  # the tier's ranks: an engine's W_e is at most these
    loads = [_engine_load(e, obs[e.index], n_inst, s_bpt) for e in engines if e.index in obs]
    out = []
    for inst in sorted(instances, key=lambda i: (i.rank, i.instance)):
        rank = inst.rank
        users = [ld for ld in loads if rank in ld.instances]
        offered = [(ld.index, ld.arrival_rate_per_s * ld.l2_bytes_per_request / ld.ranks) for ld in users
                   if ld.arrival_rate_per_s is not None and ld.l2_bytes_per_request is not None]
        per_rank_bw = [ld.bandwidth_gbps / ld.ranks for ld in users if ld.bandwidth_gbps]
        if per_rank_bw:
            b_i, b_src, bound = max(per_rank_bw) / k, "engine side (best B_e / W_e)" + (f" / {k} instances" if k > 1 else ""), "estimate"
        elif inst.status == "ok" and inst.bandwidth_gbps:
            b_i, b_src, bound = inst.bandwidth_gbps, "Valkey server side (upper bound)", "lower_bound"
        else:
            b_i = b_src = bound = None
        offered = [(e, v / k) for e, v in offered]  # a rank's bytes spread over its K instances
        total = sum(v for _, v in offered)
        rho = ratio(total, b_i * cost.GB) if b_i and offered else None
        shares = tuple((e, v / (b_i * cost.GB)) for e, v in offered) if b_i else ()
        out.append(InstanceLoad(rank, inst.url, tuple(ld.index for ld in users), total, b_i, b_src, rho,
                                bound if rho is not None else None, shares, inst.instance, inst.name))
    return loads, out
