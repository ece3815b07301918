"""Fit what a replay run file shows and no single number gives: how much of T0 holds the engine, and its GPU time.

``simulate``'s hit costs ``T0 + h·s/B + (n − h)/R``; in the paper's model T0 only adds latency, so
the engine saturates at ``ρ = λ·n·s/B = 1``. An engine whose fixed per-request work (scheduling,
the tier lookup, the step's own overhead) runs in the same loop as its loads and prefills holds the
engine for part θ of T0 too, and saturates earlier. θ is invisible in requests that ran alone (their
latency is the same for every θ) and shows in the ones that queued: :func:`fit_engine_share`
simulates the run itself, arrivals and cached tokens as they were, for θ = 0, 0.1, … 1 and keeps
the θ whose p50/p90/p99 come closest (sum of |log(simulated / measured)|) to what the run measured.
A run with some queueing (a burst, or a moderate load) fits it best.

The GPU time of a hit (``--hit-gpu-s``, its forward step, exchange and broadcast: the part of T0 that
computes) is what a run's measured GPU utilisation U leaves after the prefills the run did:
:func:`fit_hit_gpu_s` solves ``U·span = Σ misses' n/R + Σ hits' (n − h)/R + hits·g`` for g (the paper:
22 % over H5b's 372 s and 450 hits gives 0.18 s, about half of T0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from kvctl.core.errors import InvalidInput
from kvctl.sim.fleet import simulate_fleet
from kvctl.records.trace import DEFAULT_BLOCK_TOKENS
from kvctl.sim.simulate import SimConfig
from kvctl.sim.workload import trace_workload
from kvctl.sim.variability import Variability, engines_first_hit

#: θ values tried: 0, 0.1, … 1
GRID_STEPS = 11
#: fewest successful rows a run needs to fit θ on
MIN_ROWS = 10


@dataclass(frozen=True)
class HitGpuFit:
    seconds: float  # GPU time of one served hit
    note: str


def fit_hit_gpu_s(run_path: str, gpu_util_pct: float, cfg: SimConfig) -> HitGpuFit:
    """The GPU seconds of a hit that give ``run_path`` its measured GPU utilisation (see the module docstring),
    at most T0: a hit's GPU time is part of it."""
    from kvctl.records.runfile import read_run  # noqa: PLC0415

    rows = [r for r in read_run(run_path).rows if r.get("status") == "ok" and isinstance(r.get("prompt_tokens"), (int, float))]
    if len(rows) < MIN_ROWS:
        raise InvalidInput(f"{run_path} has {len(rows)} successful requests; fitting --hit-gpu-s needs at least {MIN_ROWS}")
    starts = [float(r["scheduled_s"]) for r in rows if isinstance(r.get("scheduled_s"), (int, float))]
    ends = [float(r["finished_s"]) for r in rows if isinstance(r.get("finished_s"), (int, float))]
    span = (max(ends) - min(starts)) if starts and ends else 0.0
    hits = [r for r in rows if (r.get("cached_tokens") or 0) > 0]
    if span <= 0 or not hits:
        raise InvalidInput(f"{run_path}: fitting --hit-gpu-s needs a run with hits that spans some time")
    prefill = sum(float(r["prompt_tokens"]) - min(float(r.get("cached_tokens") or 0), float(r["prompt_tokens"])) for r in rows) / cfg.prefill_rate
    g = (gpu_util_pct / 100.0 * span - prefill) / len(hits)
    note = (f"hit GPU time {max(g, 0.0):.3g} s: {gpu_util_pct:g} % GPU over {run_path}'s {span:.1f} s, less {prefill:.1f} s of prefill, "
            f"over its {len(hits):,} hits")
    if g < 0:
        note += " (its prefill alone is more than that GPU time: 0)"
    elif g > cfg.t0_s:
        note += f" (more than T0 = {cfg.t0_s:g} s: a hit's GPU time is part of T0, so T0 it is)"
    return HitGpuFit(min(max(g, 0.0), cfg.t0_s), note)


@dataclass(frozen=True)
class EngineShareFit:
    theta: float
    error: float  # sum over p50/p90/p99 of |log(simulated / measured)| at theta
    tried: tuple[tuple[float, float], ...]  # (θ, error) for every θ tried
    note: str


def measured_percentiles(run_path: str) -> tuple[np.ndarray, int]:
    """p50/p90/p99 of a run file's successful requests, as ``kvctl report`` gives them, and how many there were
    (without its engine's first external-cache hit, :func:`kvctl.sim.variability.engines_first_hit`)."""
    from kvctl.records.runfile import read_run  # noqa: PLC0415
    from kvctl.records.summary import summarize_run  # noqa: PLC0415

    run = read_run(run_path)
    first = engines_first_hit(run)  # left out as the T0 fit leaves it out: one-time setup, not the engine's steady cost
    summary = summarize_run(replace(run, rows=[r for r in run.rows if r is not first]) if first is not None else run)
    ok = summary.requests - summary.errors - summary.unfinished
    if ok < MIN_ROWS:
        raise InvalidInput(f"{run_path} has {ok} successful requests; fitting --t0-engine-share needs at least {MIN_ROWS}")
    return np.array([summary.p50_s, summary.p90_s, summary.p99_s]), ok


def fit_engine_share(run_path: str, cfg: SimConfig, bandwidth_gbps: float, var: Variability,
                     block_tokens: int = DEFAULT_BLOCK_TOKENS) -> EngineShareFit:
    """The θ in [0, 1] that best reproduces ``run_path``'s latency percentiles (see the module docstring).

    ``cfg`` and ``bandwidth_gbps`` describe the engine and tier the run saw; ``var`` its variability
    (T0 samples from the same run, typically).
    """
    meas, rows = measured_percentiles(run_path)
    w = trace_workload(run_path, None, block_tokens)
    if w.hit_tokens is None:
        raise InvalidInput(f"{run_path}: fitting --t0-engine-share needs a run file whose rows say cached_tokens")
    tried = []
    for theta in np.linspace(0.0, 1.0, GRID_STEPS):
        res = simulate_fleet(w, replace(cfg, hits_from_trace=True, t0_engine_share=float(theta)), bandwidth_gbps, 1, var)
        sim = np.array([res.p50_s, res.p90_s, res.p99_s])
        err = float(np.abs(np.log(np.maximum(sim, 1e-12) / np.maximum(meas, 1e-12))).sum())
        tried.append((round(float(theta), 3), err))
    theta, err = min(tried, key=lambda t: (t[1], t[0]))
    flat = max(e for _, e in tried) - min(e for _, e in tried) < 0.01
    note = (f"T0 engine share θ = {theta:g} fitted on {rows} requests of {run_path} (p50/p90/p99 off by "
            f"{math.expm1(err / 3) * 100:.0f} % on average at that θ)")
    if flat:
        note += "; the run barely queued, so every θ fits it alike: fit on a run with a burst"
    return EngineShareFit(theta, err, tuple(tried), note)
