"""The drills: what each starts, what it plants, what diagnose must find, which runbook answers it, and its fix (the
finding's own fix line, :func:`kvctl.diagnose.fixes.fix_line`, said for the drill's tier).

The numbers mirror the paper's §4 setup at drill scale (see :mod:`kvctl.drill.workload`): a
synchronous loader sees ~0.36 × the break-even bandwidth at one instance (the paper: 0.85 of
2.53 GB/s), eight instances give 8 × that; arrival rates are set from the target ρ.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvctl.core.runbooks import runbook_for
from kvctl.diagnose.fixes import Deployment, fix_line
from kvctl.core.thresholds import CALM_RHO, CHUNK_TOKENS

#: the simulated GPU: R (tokens/s) and T0 (s) of the drill engine
PREFILL_RATE = 40960.0
T0_S = 0.05
#: a synchronous loader (chunk by chunk, a round trip each) moves this many chunks per second per rank
STREAM_CHUNKS_PER_S = 57.0
#: one rank's link while bytes flow (a pipelined batch pays one round trip, then this)
LINK_CHUNKS_PER_S = 3 * STREAM_CHUNKS_PER_S
#: the round trip a synchronous loader pays per chunk: 1/57 s per chunk in all
CHUNK_RTT_S = 1 / STREAM_CHUNKS_PER_S - 1 / LINK_CHUNKS_PER_S
#: the saturated-tier drill (issue 46): a faster link where a lone hit wins (its load takes SATURATED_LOAD_SHARE of its
#: recompute), a smaller T0, prompts of 32 chunks, asynchronous loading with the connector's decision on
SATURATED_T0_S = 0.01
SATURATED_BLOCKS = 16  # 16 × 512 tokens = 32 chunks of 256
SATURATED_LOAD_SHARE = 0.7
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
    calm_rho: float = CALM_RHO  # the arrival rate's ρ when --plant-nothing takes the fault away
    t0_s: float = T0_S  # the drill engine's T0 (and diagnose's)

    @property
    def runbook(self) -> str | None:
        return runbook_for(self.finding) if self.finding else None

    @property
    def fix(self) -> str:
        """The finding's fix line for this drill's tier (its numbers are the diagnosis's: a drill that ran says those)."""
        return fix_line(self.finding, deployment=Deployment(ranks=self.ranks)) if self.finding else HEALTHY_FIX


HEALTHY_FIX = "nothing to fix: this is what a healthy tier looks like"

SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "healthy", "8 instances, one per rank, ρ ≈ 0.1: the tier keeps up", 8, CALM_RHO,
            "ρ below 0.7, no rho_* or critical finding", None,
        ),
        Scenario(
            "overload", "one instance at ρ ≈ 1.2 (the paper's H1b): synchronous loading is an unstable queue", 1, 1.2,
            "rho_unstable (critical)", "rho_unstable",
        ),
        Scenario(
            "async-fix", "overload, then `kvctl loading async` on the engine's config and a restart", 1, 1.2,
            "rho_unstable before the flip, none after it", "rho_unstable",
        ),
        Scenario(
            "missing-key-stall", "the engine's tier client reads a fixed-size reply header (LMCache's native client); "
            "chunks are evicted behind the engine's back", 1, 0.3,
            "missing-key-get from `kvctl diagnose stalls`", "missing-key-get",
        ),
        Scenario(
            "saturated-tier", "one instance behind a link where a lone hit wins, offered 1.3× the hits it serves, "
            "asynchronous loading with the connector's load-or-recompute decision: it recomputes what the tier cannot "
            "serve in time", 1, 1.3, "hits_recomputed (warning)", "hits_recomputed", t0_s=SATURATED_T0_S,
        ),
        Scenario(
            "dead-instance", "2 instances, rank 1's valkey-server SIGSTOPped", 2, 0.2,
            "Valkey rank 1 unreachable (exit 5)", "instance_down",
        ),
    )
}
ORDER = tuple(SCENARIOS)


#: seconds the drill's trace runs past --duration, so the traffic never stops before the drill's last sample
TRACE_TAIL_S = 5.0


def timeline(duration: float) -> tuple[float, float]:
    """(warm-up, watch) seconds of a one-phase drill of ``duration`` seconds."""
    warm = min(6.0, max(3.0, duration / 5))
    return warm, duration - warm


def saturated_link_chunks_per_s(hit_chunks: int) -> float:
    """One rank's link in the saturated-tier drill: a lone hit of ``hit_chunks`` loads in SATURATED_LOAD_SHARE of its
    recompute, T0 included (T0 + hit_chunks/link = share × hit tokens / R)."""
    recompute = hit_chunks * CHUNK_TOKENS / PREFILL_RATE
    return hit_chunks / (SATURATED_LOAD_SHARE * recompute - SATURATED_T0_S)


def arrival_rate(rho: float, ranks: int, hit_chunks: int) -> float:
    """λ (req/s) giving ``rho`` when every request loads ``hit_chunks`` chunks over ``ranks`` parallel streams."""
    return rho * STREAM_CHUNKS_PER_S * ranks / hit_chunks
