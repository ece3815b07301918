"""The inputs of ``kvctl simulate``: workloads (rate-driven or from a trace), the tier's bandwidth, memory caps.

A workload is arrival times and prompt tokens (and, from a trace, the cached tokens of each request);
the bandwidth is ``instances × instance_gbps`` or what a ``kvctl bench --save`` file measured at that
many instances. :mod:`kvctl.sim.simulate` runs the queues on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from kvctl.core.cost import GB, require_positive
from kvctl.core.errors import InvalidInput
from kvctl.core.thresholds import SIMULATE_BYTES_PER_REQUEST, SIMULATE_FLEET_BYTES_PER_REQUEST, SIMULATE_MEMORY_FRACTION
from kvctl.records.trace import DEFAULT_BLOCK_TOKENS
from kvctl.sim.variability import read_bench_file

PROMPT_DISTS = ("fixed", "exponential")
#: arrival processes of a rate-driven workload: the gaps between arrivals are exponential (Poisson, CV 1),
#: all equal (deterministic, CV 0), or gamma with a chosen coefficient of variation (< 1 smoother than
#: Poisson, > 1 burstier)
ARRIVALS = ("poisson", "deterministic", "gamma")
#: the largest arrival CV accepted (a gamma shape of 1/CV² = 1e-4: bursts of thousands at once)
MAX_ARRIVAL_CV = 100.0


@dataclass(frozen=True)
class Workload:
    """Arrivals (seconds, non-decreasing) and prompt tokens per request."""

    arrival_s: np.ndarray
    tokens: np.ndarray
    offered_rate: float | None  # λ, requests/s
    source: str
    hit_tokens: np.ndarray | None = None  # cached tokens per request, when the trace tells


# --- workloads ---------------------------------------------------------------


def available_memory() -> tuple[int, str]:
    """(bytes this process may still allocate, what bounds it): the host's available memory, or the
    address-space limit (``ulimit -v``) less what is already mapped, whichever is smaller."""
    import resource  # noqa: PLC0415

    import psutil  # noqa: PLC0415

    avail, what = int(psutil.virtual_memory().available), "the host's available memory"
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        left = max(0, soft - psutil.Process().memory_info().vms)
        if left < avail:
            avail, what = left, "the address-space limit (ulimit -v) left"
    return avail, what


def check_memory(requests: int | None, fleet: bool = False) -> None:
    """InvalidInput, with the figures, when ``requests`` simulated requests would not fit in memory
    (SIMULATE_*BYTES_PER_REQUEST each against SIMULATE_MEMORY_FRACTION of :func:`available_memory`)."""
    if not requests:
        return
    per = SIMULATE_FLEET_BYTES_PER_REQUEST if fleet else SIMULATE_BYTES_PER_REQUEST
    need = requests * per
    avail, what = available_memory()
    if need > SIMULATE_MEMORY_FRACTION * avail:
        fits = int(SIMULATE_MEMORY_FRACTION * avail // per)
        raise InvalidInput(
            f"--requests {requests:,} needs about {need / GB:.1f} GB ({per} bytes a request{' with several engines' if fleet else ''}), "
            f"more than {SIMULATE_MEMORY_FRACTION:.0%} of {what} ({avail / GB:.1f} GB): use at most about {fits:,} requests"
        )


def arrival_gaps(rate: float, requests: int, process: str = "poisson", cv: float | None = None, seed: int = 0) -> np.ndarray:
    """Gaps between ``requests`` arrivals at mean ``rate``: exponential (Poisson), equal (deterministic) or
    gamma with coefficient of variation ``cv`` (shape 1/cv², scale cv²/rate; cv 1 is Poisson's)."""
    if process not in ARRIVALS:
        raise InvalidInput(f"--arrivals must be one of {', '.join(ARRIVALS)}, got {process!r}")
    rng = np.random.default_rng([seed, 1])
    if process == "poisson":
        return rng.exponential(1.0 / rate, size=requests)
    if process == "deterministic":
        return np.full(requests, 1.0 / rate)
    if cv is None or not 0 <= cv <= MAX_ARRIVAL_CV:
        raise InvalidInput(f"--arrivals gamma needs --arrival-cv in [0, {MAX_ARRIVAL_CV:g}], got {cv!r}")
    if cv == 0:
        return np.full(requests, 1.0 / rate)
    return rng.gamma(1.0 / cv**2, cv**2 / rate, size=requests)


def poisson_workload(rate: float, requests: int, prompt_tokens: float, dist: str = "fixed", seed: int = 0,
                     arrivals: str = "poisson", cv: float | None = None) -> Workload:
    """Arrivals at mean ``rate`` (Poisson by default; see :func:`arrival_gaps`); prompts of ``prompt_tokens``
    tokens (fixed, or exponential with that mean)."""
    require_positive("--arrival-rate", rate)
    require_positive("--prompt-tokens", prompt_tokens)
    if requests < 1:
        raise InvalidInput(f"--requests must be at least 1, got {requests}")
    if dist not in PROMPT_DISTS:
        raise InvalidInput(f"--prompt-dist must be one of {', '.join(PROMPT_DISTS)}, got {dist!r}")
    arrival = np.cumsum(arrival_gaps(rate, requests, arrivals, cv, seed))
    arrival -= arrival[0]
    if dist == "fixed":
        tokens = np.full(requests, float(prompt_tokens))
    else:
        tokens = np.random.default_rng([seed, 2]).exponential(prompt_tokens, size=requests)
    process = {"poisson": "Poisson", "deterministic": "deterministic"}.get(arrivals) or f"gamma CV {cv:g}"
    return Workload(arrival, tokens, rate, f"{process} λ={rate:g}/s, {requests} requests, {dist} {prompt_tokens:g} tokens")


def arrival_cv_of(path: str) -> tuple[float, str]:
    """The coefficient of variation of a trace's inter-arrival gaps (std / mean), for gamma arrivals of the same
    burstiness at any rate; and a note of where it came from."""
    w = trace_workload(path)
    gaps = np.diff(np.sort(w.arrival_s))
    if len(gaps) < 2 or gaps.mean() <= 0:
        raise InvalidInput(f"--arrivals-from {path}: fitting an arrival CV needs at least three requests at different times")
    cv = float(gaps.std() / gaps.mean())
    return min(cv, MAX_ARRIVAL_CV), f"arrivals: gamma CV {cv:.3g} fitted on the {len(gaps):,} inter-arrival gaps of {path}"


def trace_hit_tokens(reqs: Sequence[Any], block_tokens: int) -> np.ndarray | None:
    """Cached tokens per request as the trace tells, or None when some request does not say.

    A run file's ``cached_tokens`` (what the engine reported) first; else, for Mooncake lines, the
    leading hash ids already seen in an earlier request × ``block_tokens`` (a hash id names its whole
    prefix, so the cache is assumed to hold every block ever sent: the paper's "L2 primed").
    """
    seen: set[int] = set()
    out = []
    for r in reqs:
        if r.cached_tokens is not None:
            out.append(float(r.cached_tokens))
        elif r.hash_ids is not None:
            lead = 0
            for h in r.hash_ids:
                if h not in seen:
                    break
                lead += 1
            out.append(float(min(lead * block_tokens, r.token_count or 0)))
        else:
            return None
        seen.update(r.hash_ids or ())
    return np.array(out)


def trace_workload(path: str, requests: int | None = None, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> Workload:
    """Arrivals, prompt lengths and (when it tells) cached tokens from a trace in any ``kvctl replay`` format."""
    from kvctl.records.trace import read_trace  # noqa: PLC0415

    tr = read_trace(path)
    reqs = tr.requests[:requests] if requests else tr.requests
    missing = [r.line for r in reqs if r.token_count is None]
    if missing:
        lines = ", ".join(str(n) for n in missing[:5])
        raise InvalidInput(f"{path}: line(s) {lines} give a text prompt without a token count; simulate needs input_length or prompt_tokens")
    arrival = np.array([r.offset_s for r in reqs], dtype=float)
    tokens = np.array([r.token_count for r in reqs], dtype=float)
    span = float(arrival[-1] - arrival[0]) if len(arrival) > 1 else 0.0
    rate = (len(arrival) - 1) / span if span > 0 else None
    torn = "".join(f"; {w}" for w in tr.warnings)  # a run file's torn last line, skipped: said where the trace is named
    return Workload(arrival, tokens, rate, f"trace {path} ({tr.format}, {len(reqs)} requests){torn}",
                    trace_hit_tokens(reqs, block_tokens))


# --- bandwidth ---------------------------------------------------------------


def bench_bandwidths(path: str) -> dict[int, float]:
    """Best aggregate GET GB/s per instance count from a ``kvctl bench --save`` file."""
    data = read_bench_file(path, "--bench")
    try:
        runs = data["runs"]
    except (KeyError, TypeError) as e:
        raise InvalidInput(f"--bench {path} is not a `kvctl bench --save` file: {e}") from e
    out: dict[int, float] = {}
    for r in runs:
        try:
            if r.get("op") == "get" and r["aggregate_gbps"] > 0:
                k = int(r["instances"])
                out[k] = max(out.get(k, 0.0), float(r["aggregate_gbps"]))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise InvalidInput(f"--bench {path}: a run lacks instances/aggregate_gbps: {e}") from e
    if not out:
        raise InvalidInput(f"--bench {path} has no GET run with bandwidth")
    return out


#: Where B_eff came from (JSON ``bandwidth_basis``).
BASIS_GIVEN, BASIS_MEASURED, BASIS_EXTRAPOLATED = "instance_gbps", "bench_measured", "bench_extrapolated"


@dataclass(frozen=True)
class Bandwidth:
    """B_eff for a number of instances, and where it came from."""

    gbps: float
    basis: str  # BASIS_*
    note: str  # one sentence for tables and JSON


def bandwidth_for(instances: int, instance_gbps: float | None = None, bench: dict[int, float] | None = None) -> Bandwidth:
    """B_eff for ``instances``: the aggregate a bench measured at that count, else per-instance bandwidth ×
    instances; a count the bench did not measure is scaled linearly from its largest one, and said so."""
    if instances < 1:
        raise InvalidInput(f"--instances must be at least 1, got {instances}")
    if instance_gbps is not None:
        gbps = require_positive("--instance-gbps", instance_gbps) * instances
        return Bandwidth(gbps, BASIS_GIVEN, f"{instances} × --instance-gbps {instance_gbps:g}")
    if bench:
        if instances in bench:
            return Bandwidth(bench[instances], BASIS_MEASURED, f"measured by --bench at {instances} instance(s)")
        most = max(bench)
        measured = ", ".join(str(k) for k in sorted(bench))
        return Bandwidth(
            bench[most] / most * instances,
            BASIS_EXTRAPOLATED,
            f"EXTRAPOLATED: --bench measured {measured} instance(s), not {instances}; scaled linearly from "
            f"{bench[most]:g} GB/s at {most}",
        )
    raise InvalidInput("give --instance-gbps or --bench FILE")


def effective_gbps(instances: int, instance_gbps: float | None = None, bench: dict[int, float] | None = None) -> float:
    """B_eff for ``instances`` (see :func:`bandwidth_for`)."""
    return bandwidth_for(instances, instance_gbps, bench).gbps


# --- queues ------------------------------------------------------------------
