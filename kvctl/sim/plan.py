"""``kvctl plan``: the fewest tier instances and the loading mode that meet a p99 SLO at a target ρ.

The search runs :func:`kvctl.sim.fleet.simulate_fleet` (with the variability the operator fitted) at every
instance count 1 … ``max_instances`` (one instance per rank at most: the rank-partitioned tier has no use
for more) for each loading mode, on the same arrivals (common random numbers). A point is skipped without
simulating when arithmetic already rules it out:

* ``B_eff ≤ B* = s·R``: every load is slower than recomputing, and a synchronous one holds the engine
  longer than its prefill would;
* the tier's ρ per instance (summed over the engines) above the target.

The search has a budget: the memory of one simulation (:func:`kvctl.sim.workload.check_memory`, as ``simulate``)
and PLAN_MAX_SECONDS of simulating; a search that would pass either is refused up front or as soon as the
points simulated so far show it, saying how much work was asked for.

Recomputing (no tier, 0 instances) is a candidate like any other: the plan is the fewest instances that
meet the SLO, so when recomputing meets it the plan is "no tier", and a tier point that meets the SLO
with a p99 above recompute's is marked as slower, never recommended. When nothing tried meets the SLO
the result has no plan (``instances`` None; ``kvctl plan`` exits with ``ExitStatus.SLO_UNMET``).

No instance count can help when even ``max_instances`` × the per-instance bandwidth is at most B*
(B per instance below B*/W), or when the prompts are below ``n* = R·T0`` (a hit is slower than
recomputing on an idle engine) and recomputing alone already meets the SLO. Prompts below n* with a
recompute baseline that misses the SLO are said, and searched: loading then helps only by taking
prefill off a busy engine (the paper's case: 16 310 tokens against n* ≈ 17 200).

Instances are sized from the measured bandwidth of the actual server (``--bench``, or ``--instance-gbps``), never
from a constant of the paper's. When the bench file says which server it measured (``metadata.server_versions``,
``server_io_threads``, ``host_cores``) and a newer Valkey or more io-threads would give each instance much more
(:func:`server_step`, :func:`kvctl.tier.sizing.first_step`), the plan says that first, before more instances.

With the engines' ranks W given (``ranks``), the counts searched are W × K for K = 1, 2, … instances per
rank (``kvctl deploy-valkey up --instances-per-rank K``: rank r's chunk c on its instance (c // W) mod K),
up to ``max_instances``, and the plan says N instances as W ranks × K instances per rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np

from kvctl.core.cost import GB, breakeven_gbps, min_hit_tokens
from kvctl.core.errors import InvalidInput
from kvctl.sim.fleet import FleetResult, simulate_fleet
from kvctl.sim.simulate import SimConfig
from kvctl.sim.workload import Workload, check_memory, effective_gbps
from kvctl.core.thresholds import PLAN_MAX_SECONDS, RHO_UNSTABLE
from kvctl.sim.variability import Variability

@dataclass(frozen=True)
class PlanPoint:
    instances: int  # 0: the recompute baseline (no tier)
    loading: str  # "sync", "async" or "recompute"
    bandwidth_gbps: float | None
    tier_rho: float | None  # per instance, all engines
    simulated: bool
    p50_s: float | None
    p99_s: float | None
    engine_rho: float | None
    timeouts: int | None
    meets: bool
    why: str
    extrapolated: tuple[str, ...] = ()
    instances_per_rank: int | None = None  # K = instances / W, when the ranks W were given
    gpu_utilization_pct: float | None = None  # the engines' mean (simulated points)


@dataclass(frozen=True)
class PlanResult:
    instances: int | None  # None: nothing tried meets the SLO; 0: recompute (no tier)
    loading: str | None  # "sync", "async", "recompute" or None
    points: tuple[PlanPoint, ...]
    verdict: str
    cannot_help: str | None  # why no instance count can help, when that is the answer
    notes: tuple[str, ...]
    min_hit_tokens: float  # n* = R·T0
    breakeven_gbps: float
    slo_p99_s: float
    rho_target: float
    engines: int
    ranks: int | None = None  # W, when given: instances were searched as W × K
    instances_per_rank: int | None = None  # K of the plan, when W was given
    policy: str = "off"  # "on": every point simulated with the connector's load-or-recompute decision


@dataclass
class _Budget:
    """The search's time budget: InvalidInput, saying what was asked, once PLAN_MAX_SECONDS has passed or the
    points simulated so far say that those left would pass it."""

    asked: str
    limit_s: float = PLAN_MAX_SECONDS
    started: float = field(default_factory=time.monotonic)

    def check(self, done: int, left: int) -> None:
        elapsed = time.monotonic() - self.started
        need = elapsed / done * (done + left) if done else elapsed
        if need > self.limit_s:
            raise InvalidInput(f"plan asked for {self.asked}: {done} simulated in {elapsed:.1f} s, so the {done + left:,} would take "
                               f"about {need:,.0f} s, past the {self.limit_s:g}-s budget (PLAN_MAX_SECONDS): lower --max-instances, "
                               "--engines or --requests")


def _point(res: FleetResult, instances: int, loading: str, slo: float, rho_target: float, policy: str = "off") -> PlanPoint:
    # the target ρ is the headroom a tier without the decision needs; with it (--policy on) a hit the tier cannot
    # serve in time is recomputed, so a point is judged by its p99 and its stability alone
    ok_rho = res.tier_rho is None or res.tier_rho <= rho_target or policy == "on"
    meets = bool(res.stable) and res.p99_s <= slo and ok_rho
    why = ("meets the SLO" if meets else
           f"p99 {res.p99_s:.3f} s > {slo:g} s" if res.p99_s > slo else
           "unstable" if not res.stable else f"ρ {res.tier_rho:.3g} > {rho_target:g}")
    return PlanPoint(instances, loading, res.bandwidth_gbps if instances else None, res.tier_rho if instances else None, True,
                     res.p50_s, res.p99_s, res.rho, res.timeouts, meets, why, res.extrapolated,
                     gpu_utilization_pct=res.gpu_utilization_pct)


def plan(w: Workload, cfg: SimConfig, *, engines: int, slo_p99_s: float, rho_target: float, max_instances: int,
         instance_gbps: float | None = None, bench: dict[int, float] | None = None, var: Variability | None = None,
         loadings: Sequence[str] = ("sync", "async"), ranks: int | None = None, first_step: str | None = None) -> PlanResult:
    """Search instance counts × ``loadings`` for the fewest instances meeting ``p99 ≤ slo_p99_s`` at ``ρ ≤ rho_target``.

    ``ranks`` W: only W × K instances (K per rank) are searched, and the result says K. ``first_step``: the server
    change (:func:`server_step`) the verdict puts before any instance beyond one per rank."""
    var = var or Variability()
    if slo_p99_s <= 0 or not 0 < rho_target <= RHO_UNSTABLE:
        raise InvalidInput("--slo-p99 must be positive and --rho-target in (0, 1]")
    if max_instances < 1:
        raise InvalidInput(f"--max-instances must be at least 1, got {max_instances}")
    if ranks is not None and not 1 <= ranks <= max_instances:
        raise InvalidInput(f"--ranks {ranks} is more than --max-instances {max_instances}: every rank needs at least one instance; "
                           f"give --max-instances {ranks} or more (W × K instances for K per rank)")
    check_memory(len(w.arrival_s), fleet=True)
    budget = _Budget(f"{max_instances:,} instance count(s) × {len(loadings)} loading mode(s) and the recompute baseline, each "
                     f"{len(w.arrival_s):,} requests over {engines:,} engine(s)")
    s, r = cfg.bytes_per_token, cfg.prefill_rate
    b_star = breakeven_gbps(s, r)
    # T0 as the hits see it: the --fit-from run's median when T0 was fitted (the constant --t0 is then unused)
    n_star = min_hit_tokens(r, float(np.median(var.t0_samples_s)) if var.t0_samples_s else cfg.t0_s)
    median_tokens = float(np.median(w.tokens))
    hit_bytes = float(np.mean(w.tokens)) * cfg.hit_fraction * s  # mean bytes loaded per request
    notes: list[str] = []
    if bench and max_instances > max(bench):
        notes.append(f"the bench measured up to {max(bench)} instance(s); more are extrapolated linearly")
    base = simulate_fleet(w, replace(cfg, hit_fraction=0.0, hits_from_trace=False), 1.0, engines, var)
    points = [_point(base, 0, "recompute", slo_p99_s, rho_target)]
    best_w = effective_gbps(max_instances, instance_gbps, bench)
    cannot: str | None = None
    decided = cfg.policy == "on"
    if decided:
        notes.append("with the load-or-recompute decision (--policy on): each hit loads only the part that beats recomputing "
                      "behind the tier's queue and the engine's; the target ρ does not rule a point out, its p99 does")
    if best_w <= b_star and decided and "async" in loadings:
        notes.append(f"{max_instances} instance(s) deliver {best_w:.3f} GB/s ≤ B* = {b_star:.3f} GB/s: only prefixes the engine's "
                     "queue hides can load (async)")
    elif best_w <= b_star:
        cannot = (f"no instance count can help: {max_instances} instance(s) deliver {best_w:.3f} GB/s ≤ B* = s·R = {b_star:.3f} GB/s "
                  f"(B per instance below B*/W = {b_star / max_instances:.3f} GB/s): every load is slower than recomputing")
    elif median_tokens < n_star:
        gap = f"prompts (median {median_tokens:,.0f} tokens) are below n* = R·T0 = {n_star:,.0f}: a hit is slower than recomputing on an idle engine"
        if points[0].meets:
            cannot = f"no instance count can help: {gap}"
        else:
            notes.append(f"{gap}; loading helps only by taking prefill off the engines (recompute p99 {base.p99_s:.3f} s misses the SLO)")
    if cannot is None:

        def screen(loading: str, inst: int) -> tuple[str, int, float, float, list[str]]:
            bw = effective_gbps(inst, instance_gbps, bench)
            tier_bw = (var.async_instance_gbps * inst) if loading == "async" and var.async_instance_gbps else bw
            per_load = var.async_load_s * cfg.hit_fraction if loading == "async" else 0.0  # the loader's own time a hit
            rho = (w.offered_rate or 0.0) * (hit_bytes / (tier_bw * GB) + per_load)
            ruled_out = ([f"B_eff {bw:.3f} ≤ B* {b_star:.3f} GB/s"] if bw <= b_star and not (decided and loading == "async") else []) + \
                ([f"ρ {rho:.3g} > {rho_target:g}"] if rho > rho_target and not decided else [])
            return loading, inst, bw, rho, ruled_out

        screened = [screen(loading, inst) for loading in loadings for inst in candidates(max_instances, ranks)]
        left = sum(1 for *_, ruled_out in screened if not ruled_out)
        budget.check(1, left)  # the recompute baseline took this long
        for loading, inst, bw, rho, ruled_out in screened:
            if ruled_out:
                points.append(PlanPoint(inst, loading, bw, rho, False, None, None, None, None, False,
                                        "; ".join(ruled_out) + " (not simulated)"))
                continue
            c = replace(cfg, instances=inst, loading=loading)
            points.append(_point(simulate_fleet(w, c, bw, engines, var), inst, loading, slo_p99_s, rho_target, cfg.policy))
            left -= 1
            budget.check(sum(p.simulated for p in points), left)
    points = _mark_slower_than_recompute(points)
    winners = [p for p in points if p.meets]
    best = min(winners, key=lambda p: (p.instances, p.p99_s or 0.0)) if winners else None
    if best is not None and best.instances == 0:
        faster = [p for p in winners if p.instances > 0]
        verdict = (f"no tier: recompute meets p99 ≤ {slo_p99_s:g} s (p99 {best.p99_s:.3f} s)"
                   + (f"; {cannot}" if cannot else "")
                   + (f"; a tier lowers p99 to {min(faster, key=lambda p: (p.p99_s, p.instances)).p99_s:.3f} s with "
                      f"{_fastest(faster)}" if faster else ""))
    elif best is not None and decided:
        verdict = (f"{best.instances} instance(s), {best.loading} loading with the load-or-recompute decision: p99 {best.p99_s:.3f} s ≤ "
                   f"{slo_p99_s:g} s, the tier carrying ρ {best.tier_rho:.3g} per instance"
                   + (f" (fewer fail: {_fewer(points, best)})" if best.instances > 1 else ""))
    elif best is not None:
        verdict = (f"{best.instances} instance(s), {best.loading} loading: p99 {best.p99_s:.3f} s ≤ {slo_p99_s:g} s at ρ per instance "
                   f"{best.tier_rho:.3g} ≤ {rho_target:g}" + (f" (fewer fail: {_fewer(points, best)})" if best.instances > 1 else ""))
    elif cannot:
        verdict = f"{cannot}; recompute misses p99 ≤ {slo_p99_s:g} s (p99 {base.p99_s:.3f} s)"
    else:
        verdict = f"no instance count up to {max_instances} meets p99 ≤ {slo_p99_s:g} s at ρ ≤ {rho_target:g}, nor does recompute (p99 {base.p99_s:.3f} s)"
    if first_step and (best is None or best.instances > (ranks or 1)):
        verdict = f"first, before adding instances: {first_step}, then plan again on a new bench; on the server measured: {verdict}"
    elif first_step:
        notes.append(f"each instance could give more: {first_step}")
    return PlanResult(best.instances if best else None, best.loading if best else None, tuple(points),
                      verdict, cannot, tuple(notes), n_star, b_star, slo_p99_s, rho_target, engines, policy=cfg.policy)


def candidates(max_instances: int, ranks: int | None) -> range:
    """The instance counts searched: 1 … max_instances, or W, 2W, … ≤ max_instances with the ranks W given."""
    return range(1, max_instances + 1) if not ranks else range(ranks, max_instances + 1, ranks)


def with_layout(res: PlanResult, ranks: int | None) -> PlanResult:
    """``res`` with its points' and its plan's K = instances / W, and the verdict saying W ranks × K instances per rank."""
    if not ranks:
        return res
    points = tuple(replace(p, instances_per_rank=p.instances // ranks) if p.instances else p for p in res.points)
    k = res.instances // ranks if res.instances else None
    verdict = res.verdict
    if k == 1:  # nothing below W was tried: fewer instances than ranks is no tier of this kind
        verdict = verdict.replace(" (fewer fail: none tried)", f" (fewer cannot give each of the {ranks} ranks an instance)")
    if k:
        verdict += f"; that is {ranks} rank(s) × {k} instance(s) per rank: kvctl deploy-valkey up --ranks {ranks} --instances-per-rank {k}"
    return replace(res, points=points, verdict=verdict, ranks=ranks, instances_per_rank=k)


def _mark_slower_than_recompute(points: list[PlanPoint]) -> list[PlanPoint]:
    """When recomputing meets the SLO, a tier point whose p99 is above recompute's does not meet the plan:
    loading would make the tail slower than not having a tier."""
    base = points[0]
    if not base.meets or base.p99_s is None:
        return points
    return [replace(p, meets=False, why=f"meets the SLO, but p99 {p.p99_s:.3f} s > recompute's {base.p99_s:.3f} s")
            if p.meets and p.instances > 0 and p.p99_s is not None and p.p99_s > base.p99_s else p for p in points]


def _fastest(points: Sequence[PlanPoint]) -> str:
    p = min(points, key=lambda q: (q.p99_s or 0.0, q.instances))
    return f"{p.instances} instance(s), {p.loading} loading"


def _fewer(points: Sequence[PlanPoint], best: PlanPoint) -> str:
    """The largest count tried below the plan's, with the same loading (W below with the ranks W given)."""
    tried = [q for q in points if q.loading == best.loading and 0 < q.instances < best.instances]
    p = max(tried, key=lambda q: q.instances, default=None)
    return f"{p.instances} {p.loading}: {p.why}" if p else "none tried"


def server_step(bench_path: str, bench: dict[int, float]) -> str | None:
    """The server change a ``kvctl bench --save`` file calls for: its instances' Valkey version and io-threads, on its host
    (``metadata.host_cores``, the bench's host: a tier it benched over loopback), against the best GB/s one instance gave
    (the aggregate over instances at each count measured, per instance); None when the file does not say which server
    it measured, or no change would give each instance much more (:func:`kvctl.tier.sizing.first_step`)."""
    from kvctl.sim.variability import read_bench_file  # noqa: PLC0415
    from kvctl.tier.sizing import first_step, parse_version  # noqa: PLC0415

    meta = (read_bench_file(bench_path, "--bench") or {}).get("metadata") or {}
    versions = [parse_version(v) for v in meta.get("server_versions") or () if isinstance(v, str)]
    threads = [t for t in meta.get("server_io_threads") or () if isinstance(t, int) and not isinstance(t, bool)]
    if not versions or None in versions or not bench:
        return None
    cores = meta.get("host_cores") if isinstance(meta.get("host_cores"), int) and meta.get("host_cores", 0) > 0 else None
    per_instance = max(g / k for k, g in bench.items())
    step = first_step(min(versions), min(threads) if threads else None, cores, max(bench), per_instance)
    return step.text if step else None
