"""The types the analysis and its rules share: a finding, its severity, the analysis parameters.

Below both :mod:`kvctl.diagnose.analysis` and :mod:`kvctl.diagnose.rules` (and the stall classifier),
so neither imports the other back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterable

from kvctl.core.thresholds import GPU_NOT_COMPUTE_BOUND_PCT, HITS_RECOMPUTED_MIN, HITS_RECOMPUTED_SHARE, MAX_BANDWIDTH_GBPS, RHO_HIGH, RHO_TARGET


class Severity(str, Enum):
    """Ordered severities; a ``str`` enum, so ``"warning" == Severity.WARNING``."""

    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"

    @property
    def rank(self) -> int:
        return SEVERITY_ORDER.index(self.value)


SEVERITY_ORDER = ("info", "warning", "critical")


def worst_severity(severities: Iterable[str]) -> Severity | None:
    """The most severe of ``severities`` (strings or ``Severity``), or None when there are none."""
    found = [Severity(s) for s in severities]
    return max(found, key=lambda s: s.rank) if found else None


@dataclass(frozen=True)
class Params:
    """What the user told us (flags), plus thresholds for the findings."""

    bytes_per_token: float | None = None
    prefill_rate: float | None = None
    t0_s: float | None = None  # None: the capture's, else the paper's 0.33 s
    bandwidth_gbps: float | None = None  # B given (--tier-gbps, measured with kvctl bench): used instead of the counters'
    rho_target: float = RHO_TARGET
    warn_rho: float = RHO_HIGH  # rho_high from here, rho_unstable from RHO_UNSTABLE (kvctl.core.thresholds)
    slow_lookup_s: float = 1.0
    gpu_idle_pct: float = GPU_NOT_COMPUTE_BOUND_PCT  # not stalls' "idle": the MEAN utilisation below which a growing queue is not compute-bound
    hot_ratio: float = 2.0
    hot_min_gets: int = 100
    min_prefill_rate: float = 100.0  # tok/s: a derived R below this is a symptom, not a rate
    max_bandwidth_gbps: float = MAX_BANDWIDTH_GBPS  # a B above this (per engine) is a counter mix-up, not a bandwidth
    recomputed_share: float = HITS_RECOMPUTED_SHARE  # hits_recomputed: of the hits the connector judged
    recomputed_min: int = HITS_RECOMPUTED_MIN


@dataclass(frozen=True)
class Finding:
    id: str
    severity: str  # "info", "warning" or "critical"
    message: str
    recommendation: str
    evidence: dict[str, Any] = field(default_factory=dict)
