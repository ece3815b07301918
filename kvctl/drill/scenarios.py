"""The drills: what each starts, what it plants, what diagnose must find, and which runbook answers it.

The numbers mirror the paper's §4 setup at drill scale (see :mod:`kvctl.drill.workload`): a
synchronous loader sees ~0.36 × the break-even bandwidth at one instance (the paper: 0.85 of
2.53 GB/s), eight instances give 8 × that; arrival rates are set from the target ρ.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvctl.core.runbooks import runbook_for
from kvctl.core.thresholds import CALM_RHO

#: the simulated GPU: R (tokens/s) and T0 (s) of the drill engine
PREFILL_RATE = 40960.0
T0_S = 0.05
#: a synchronous loader (chunk by chunk, a round trip each) moves this many chunks per second per rank
STREAM_CHUNKS_PER_S = 57.0
#: one rank's link while bytes flow (a pipelined batch pays one round trip, then this)
LINK_CHUNKS_PER_S = 3 * STREAM_CHUNKS_PER_S
#: the round trip a synchronous loader pays per chunk: 1/57 s per chunk in all
CHUNK_RTT_S = 1 / STREAM_CHUNKS_PER_S - 1 / LINK_CHUNKS_PER_S
DEFAULT_DURATION_S = 30.0
MIN_DURATION_S = 8.0
MAX_DURATION_S = 600.0


@dataclass(frozen=True)
class Scenario:
    name: str
    summary: str
    ranks: int  # Valkey instances = engine ranks
    rho: float  # target ρ of the arrival rate (against the synchronous loader's bandwidth)
    expect: str  # what diagnose must report
    finding: str | None  # the finding id that shows it (None: no finding, a healthy diagnosis)
    fix: str
    calm_rho: float = CALM_RHO  # the arrival rate's ρ when --plant-nothing takes the fault away

    @property
    def runbook(self) -> str | None:
        return runbook_for(self.finding) if self.finding else None


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "healthy", "8 instances, one per rank, ρ ≈ 0.1: the tier keeps up", 8, CALM_RHO,
            "ρ below 0.7, no rho_* or critical finding", None,
            "nothing to fix: this is what a healthy tier looks like",
        ),
        Scenario(
            "overload", "one instance at ρ ≈ 1.2 (the paper's H1b): synchronous loading is an unstable queue", 1, 1.2,
            "rho_unstable (critical)", "rho_unstable",
            "more instances (one per rank: `kvctl deploy-valkey up --ranks N`) or `kvctl loading async`",
        ),
        Scenario(
            "async-fix", "overload, then `kvctl loading async` on the engine's config and a restart", 1, 1.2,
            "rho_unstable before the flip, none after it", "rho_unstable",
            "`kvctl loading async --config ENGINE.yaml --restart-cmd ...`; for headroom, more instances",
        ),
        Scenario(
            "missing-key-stall", "the engine's tier client reads a fixed-size reply header (LMCache's native client); "
            "chunks are evicted behind the engine's back", 1, 0.3,
            "missing-key-get from `kvctl diagnose stalls`", "missing-key-get",
            "a client that parses RESP headers up to CRLF (kvctl's), maxmemory headroom, `kvctl loading async`",
        ),
        Scenario(
            "dead-instance", "2 instances, rank 1's valkey-server SIGSTOPped", 2, 0.2,
            "Valkey rank 1 unreachable (exit 5)", "instance_down",
            "restart or replace the instance (`kvctl deploy-valkey status`, then `up`); its chunks are recomputed meanwhile",
        ),
    )
}
ORDER = tuple(SCENARIOS)


def arrival_rate(rho: float, ranks: int, hit_chunks: int) -> float:
    """λ (req/s) giving ``rho`` when every request loads ``hit_chunks`` chunks over ``ranks`` parallel streams."""
    return rho * STREAM_CHUNKS_PER_S * ranks / hit_chunks
