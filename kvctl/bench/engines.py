"""``kvctl bench --engines``: E engines, each W ranks loading their shares of a prompt together.

Client j of every instance is rank i of engine j; before each batch the engine's W ranks meet at a barrier,
so a "prompt" is one batch on each of the W instances started at the same moment, and its time is from the
first rank's start to the last rank's end (CLOCK_MONOTONIC, one clock for every process of the host). The
engines do not wait for each other: they contend for the same instances, as engines sharing a tier do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from kvctl.records.stats import percentile
from kvctl.bench.worker import WorkerResult
from kvctl.core.cost import GB


@dataclass(frozen=True)
class EngineRun:
    """One engine (W ranks in lockstep) during one run."""

    engine: int
    prompts: int  # prompts every rank loaded
    bytes: int  # all of the engine's ranks
    gbps: float  # bytes / the engine's window
    p50_prompt_ms: float | None  # whole-prompt time: first rank's start → last rank's end
    p99_prompt_ms: float | None
    mean_prompt_ms: float | None
    errors: int


def prompt_times_s(ranks: Sequence[WorkerResult]) -> list[float]:
    """Whole-prompt times of one engine from its ranks' (start, end) spans; prompts a rank failed are left out."""
    if not ranks:
        return []
    n = min(len(r.spans) for r in ranks)
    out = []
    for k in range(n):
        spans = [r.spans[k] for r in ranks]
        if any(math.isnan(e) for _, e in spans):
            continue
        out.append(max(e for _, e in spans) - min(s for s, _ in spans))
    return out


def summarize_engines(workers: Sequence[WorkerResult], engines: int, instances: int) -> tuple[EngineRun, ...]:
    """One :class:`EngineRun` per engine; an engine missing ranks (a client that never reported) has no prompts."""
    out = []
    for e in range(engines):
        ranks = [w for w in workers if w.engine == e]
        times = prompt_times_s(ranks) if len(ranks) == instances else []
        ms = [t * 1e3 for t in times]
        nbytes = sum(w.bytes for w in ranks)
        window = max((w.elapsed_s for w in ranks), default=0.0)
        out.append(EngineRun(
            engine=e, prompts=len(times), bytes=nbytes, gbps=nbytes / window / GB if window > 0 else 0.0,
            p50_prompt_ms=percentile(ms, 50), p99_prompt_ms=percentile(ms, 99),
            mean_prompt_ms=sum(ms) / len(ms) if ms else None,
            errors=sum(w.errors for w in ranks) + (instances - len(ranks)),
        ))
    return tuple(out)
