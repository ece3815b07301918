"""The saturated-tier drill (issue 46): a tier that cannot serve every hit in time, and the decision that copes.

One instance behind a link fast enough that a lone hit beats recompute (its load takes
:data:`~kvctl.drill.scenarios.SATURATED_LOAD_SHARE` of its recompute, T0 included), offered 1.3× the hits it can
serve, with asynchronous loading and the kvctl connector's load-or-recompute decision on in the drill engine
(``drill.load_policy``). Without the decision every hit would queue for the one link and the queue would grow for
the whole run; with it, a hit that would wait too long is recomputed, counted as
``kvctl:load_decisions{decision="recompute"|"partial",reason="tier_queue"}``, and diagnose reports
``hits_recomputed`` with its fix: the tier's capacity, sized with the decision (``kvctl plan --policy on``).
``--plant-nothing`` offers a calm rate: nothing to recompute, no finding.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from kvctl.drill import scenarios as S
from kvctl.drill.workload import Workload


def saturated_workload(sc: S.Scenario, rho: float, duration_s: float, seed: int) -> tuple[Workload, float]:
    """(the trace, one rank's link in chunks/s): prompts of SATURATED_BLOCKS blocks at λ = ρ × the hits the link serves."""
    w = Workload(rate_per_s=1.0, duration_s=1.0, blocks=S.SATURATED_BLOCKS)
    link = S.saturated_link_chunks_per_s(w.hit_chunks)
    rate = rho * link * sc.ranks / w.hit_chunks
    return replace(w, rate_per_s=rate, duration_s=duration_s + S.TRACE_TAIL_S, seed=seed), link


def saturated_phase(dr: Any, sc: S.Scenario) -> tuple[bool, str, list[str]]:
    """Run the drill on ``dr`` (a :class:`kvctl.drill.run.Drill`): (passed, verdict, finding ids)."""
    rho = sc.rho if dr.opts.plant else sc.calm_rho
    w, link = saturated_workload(sc, rho, dr.opts.duration_s, dr.opts.seed)
    targets = dr.start_tier(sc.ranks)
    base = dr.engine_settings(targets)
    dr.start_engine(replace(base, t0_s=sc.t0_s, stream_bytes_per_s=link * base.chunk_bytes, chunk_rtt_s=0.0,
                            load_policy=True), async_loading=True)
    dr.say("start", f"link {link:.0f} chunks/s: a lone hit of {w.hit_chunks} chunks loads in {S.SATURATED_LOAD_SHARE:g} "
                    f"of its recompute; λ = {w.rate_per_s:.2f} req/s offers {rho:g}× the hits the tier serves")
    dr.start_replay(w)
    warm, span = S.timeline(dr.opts.duration_s)
    time.sleep(warm)
    capture, d = dr.watch(targets, span)
    dr.last_capture = capture
    found = [f.id for f in d.findings]
    hits: Any = next((f for f in d.findings if f.id == sc.finding), None)
    if hits is None:
        return False, f"diagnose did not report {sc.finding} (findings: {found or 'none'})", found
    dr.findings = [hits]
    dr.say("finding", f"found {sc.finding}: the decision recomputed {hits.evidence['hits_recomputed']:g} of "
                      f"{hits.evidence['hits_judged']:g} hits; runbook: {sc.runbook}")
    share = d.hits_recomputed_share or 0.0
    return True, f"found {sc.finding}: {share:.0%} of the hits judged were recomputed because of the tier's queue", found
