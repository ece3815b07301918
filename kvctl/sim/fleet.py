"""E prefill engines sharing one remote KV tier, with the variability of :mod:`kvctl.sim.variability`.

The model extends :func:`kvctl.sim.simulate.simulate` (whose module docstring gives the per-request costs):

* requests of the workload are dealt to the E engines at random (seeded), so a Poisson stream at
  ``E·λ`` gives each engine its own Poisson stream at ``λ``; each engine is a FIFO queue;
* the tier: W instances, every prompt split evenly over them (chunk c on instance ``c mod W``), so all
  W see the same requests and each carries ``1/W`` of every prompt at ``1/W`` of ``B_eff``. With one
  transfer-time multiplier per request (all ranks of a load see the same spread) the W instances are
  W identical FIFO servers; the tier is solved as one. Per-instance ρ is therefore the SUM over
  engines of ``λ_e·E[h·s/W] / (B_eff/W)``.
* a load that starts with ``k − 1`` loads ahead of it in the tier is served at ``g(k)`` times the
  one-reader bandwidth (the ``bench --sweep`` curve);
* sync: an engine issues the load when it starts the request and is held until the load is done
  (its wait for the tier included) plus the uncached tail. Engines and tier depend on each other;
  the waits are found by iterating the two vectorised FIFO passes to their fixed point (exact: the
  system is causal, so the fixed point is the event-by-event answer), and, if that takes more than
  :data:`MAX_ITERATIONS` passes, by an event-by-event loop;
* async: the prefetch is issued on arrival at the async bandwidth; an abandoned load (past the
  timeout) still occupies the tier and the engine recomputes the request, queued on the same engine
  from ``arrival + timeout``; every async request pays ``async_overhead_s`` of latency; each load holds
  the tier ``async_load_s`` besides its transfer (the connector's loader: copies, exchange, insert; with a
  readers curve it is scaled with the transfer);
* ``t0_engine_share`` θ: θ·T0 of every served hit holds its engine after the load (with the
  tail), the rest only adds latency (see :mod:`kvctl.sim.simulate`);
* ``max_batch`` M > 1: an engine admits up to M waiting requests into one step; their loads go to
  the tier in order, then the step computes, and all of them finish when it ends (the event loop);
  ``max_batched_tokens`` bounds the prefill tokens of a step: running requests continue first, a
  longer prompt is chunked over steps and finishes with the step of its last token (vLLM's chunked
  prefill, :func:`kvctl.sim.simulate.engine_steps`);
* ``hit_gpu_s``: the GPU time of a served hit, part of its T0: it holds the engine (with θ of the rest
  of T0) and counts as GPU busy;
* GPU utilisation (%): the compute an engine does (prefill of misses and timeouts, tails of hits)
  over the run's span. A synchronous load holds the engine but not its GPU.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvctl.core.cost import GB, require_positive
from kvctl.core.errors import InvalidInput
from kvctl.records.stats import latency_by_class
from kvctl.sim.simulate import (
    SimConfig, SimResult, in_system_ahead, check_config, engine_steps, fifo, hit_tokens_of, np_percentile, plan_step, split_t0,
)
from kvctl.sim.policy import decided_hits
from kvctl.sim.steps import StepCost
from kvctl.sim.vllm_line import line_config, run_line
from kvctl.sim.workload import Workload
from kvctl.core.thresholds import RHO_UNSTABLE
from kvctl.sim.variability import Variability, gain_for

#: passes of the tier alone before its reader counts must have settled
MAX_ITERATIONS = 200
#: arrivals per block of the synchronous fixed point, passes per block, and the most requests carried
#: from block to block before the event-by-event loop takes over
BLOCK = 2048
BLOCK_PASSES = 200
CARRY_MAX = 16 * BLOCK
#: a load finishing within this of another's issue is not in flight with it (an engine's next load is
#: issued the instant its previous one ends; rounding must not count that one as a concurrent reader)
TIE_S = 1e-9


@dataclass(frozen=True)
class EngineStats:
    engine: int
    requests: int
    hits: int
    timeouts: int
    p50_s: float
    p90_s: float
    p99_s: float
    max_s: float
    mean_s: float
    mean_wait_s: float
    rho: float | None  # offered: λ_e·E[engine hold without waiting for the tier]
    gpu_utilization_pct: float  # the compute it does over the run's span, % (a synchronous load holds the engine, not its GPU)
    max_queue: int


@dataclass(frozen=True, kw_only=True)
class FleetResult(SimResult):
    """:class:`kvctl.sim.simulate.SimResult`'s fields for the whole fleet, then the fleet's own. Of the shared ones,
    ``rho`` is the busiest engine's offered ρ, ``arrival_rate_per_s`` the fleet's λ (all engines), ``tier_rho``
    per instance summed over the engines that use it, ``gpu_utilization_pct`` the mean over engines."""

    engines: int
    per_engine: tuple[EngineStats, ...]
    extrapolated: tuple[str, ...]
    notes: tuple[str, ...]
    solver: str  # "fixed point (N passes)", "event loop", "closed form"


def _pcts(x: np.ndarray) -> tuple[float, float, float]:
    p50, p90, p99 = np.percentile(x, [50, 90, 99])
    return float(p50), float(p90), float(p99)


def _gain_table(gain: dict[int, float], most: int) -> np.ndarray:
    """``g(k)`` for k = 0 … most (index k), linear between measured counts, flat past the last."""
    g, _ = gain_for(gain, np.arange(most + 1, dtype=float))
    return g


def _tier_pass(arrival: np.ndarray, transfer: np.ndarray, gtab: np.ndarray | None,
               k: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """One pass of the tier's FIFO server (loads arriving at sorted ``arrival``), each load served at
    ``g(k)`` times the one-reader bandwidth for ``k`` loads in the tier when it arrived (itself
    included; None: 1). Returns (start, finish, k as this pass's finishes give it)."""
    if gtab is None:
        start, finish = fifo(arrival, transfer)
        return start, finish, None
    g = gtab[np.minimum(k, len(gtab) - 1)] if k is not None else 1.0
    start, finish = fifo(arrival, transfer / g)
    # finishes of a FIFO server are sorted; a load finishing at (or within TIE_S of) an arrival is gone
    new_k = np.arange(1, len(arrival) + 1) - np.searchsorted(finish, arrival + TIE_S, side="right")
    return start, finish, new_k


def _tier(arrival: np.ndarray, transfer: np.ndarray, gtab: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The tier alone (async prefetches issued on arrival): passes until ``k`` settles (it depends on
    earlier finishes only, so it does)."""
    k = None
    for _ in range(MAX_ITERATIONS):
        start, finish, new_k = _tier_pass(arrival, transfer, gtab, k)
        if new_k is None or (k is not None and np.array_equal(new_k, k)):
            break
        k = new_k
    return start, finish, k


def _engine_fifo(ready: np.ndarray, fixed: np.ndarray, tokens: np.ndarray, prefill_rate: float, groups: list[np.ndarray],
                 max_batch: int = 1, max_tokens: int | None = None, cost: StepCost | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Each engine a queue over its requests ``groups[e]``, served in order of ``ready`` in steps of up to
    ``max_batch`` requests and ``max_tokens`` tokens (:func:`kvctl.sim.simulate.engine_steps`)."""
    start = np.empty(len(ready))
    finish = np.empty(len(ready))
    for idx in groups:
        order = idx[np.argsort(ready[idx], kind="stable")]
        s, f = engine_steps(ready[order], fixed[order], tokens[order], prefill_rate, max_batch, max_tokens, cost)
        start[order] = s
        finish[order] = f
    return start, finish


def _sync_event_loop(arrival, hit, transfer, tail, prefill, gtab, groups, max_batch=1, budget=None):  # noqa: ANN001, ANN202
    """Sync fleet, one engine step at a time in the order engines start them (the reference answer).

    A step of engine e starts at t (e free, a request of its running or arrived) and first continues its
    running requests, then admits its requests arrived by t while fewer than ``max_batch`` run: their
    loads go to the tier in order at t, then the step computes (tails of hits, prefills of misses) and
    the requests it finished end with it. ``budget`` (the engine hold of each request besides its tokens,
    the tokens, R, the step's token budget, the step's own cost) chunks long prefills over steps; without it every request
    computes whole (``tail``/``prefill``). One request per step is the FIFO engine of the module docstring."""
    n = len(arrival)
    arr, tr, ht = arrival.tolist(), transfer.tolist(), hit.tolist()
    if budget is None:
        fx, tk, rate, max_tokens, cost = np.where(hit, tail, prefill).tolist(), [0.0] * n, 1.0, None, None
    else:
        fixed, tokens, rate, max_tokens, cost = budget
        fx, tk = fixed.tolist(), tokens.tolist()
    gl = gtab.tolist() if gtab is not None else None
    start, finish, twait, ks = [0.0] * n, [0.0] * n, [0.0] * n, [1] * n
    queues = [g.tolist() for g in groups]
    pos = [0] * len(queues)
    running: list[list[list[float]]] = [[] for _ in queues]  # per engine: [index, tokens left] of partly computed requests
    heap = [(arr[q[0]], e) for e, q in enumerate(queues) if q]
    heapq.heapify(heap)
    tier_free: float = 0.0
    inflight: deque[float] = deque()
    while heap:
        t, e = heapq.heappop(heap)
        step = plan_step(running[e], queues[e], pos[e], arr, t, tk, fx, rate, max_batch, max_tokens, cost)
        admitted, done, compute, q, p1, still = step.admitted, step.done, step.seconds, queues[e], step.pos, step.running
        loaded = t
        for i in admitted:
            start[i] = t
            if ht[i]:
                while inflight and inflight[0] <= t + TIE_S:
                    inflight.popleft()
                h = tr[i]
                if gl is not None:
                    ks[i] = k = len(inflight) + 1
                    h /= gl[min(k, len(gl) - 1)]
                ts = t if t > tier_free else tier_free
                tier_free = ts + h
                inflight.append(tier_free)
                twait[i] = ts - t
                loaded = tier_free
        end = loaded + compute
        for i in done:
            finish[i] = end
        pos[e], running[e] = p1, still
        if still:
            heapq.heappush(heap, (end, e))
        elif p1 < len(q):
            j = q[p1]
            heapq.heappush(heap, (arr[j] if arr[j] > end else end, e))
    k_hits = np.array(ks)[hit] if gl is not None else None
    return np.array(start), np.array(finish), np.array(twait), k_hits


def _fifo_from(free: float, arrival: np.ndarray, hold: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A FIFO server that is busy until ``free`` before the first of these arrivals (Lindley's
    recursion holds for any service order, so a zero-length job at ``free`` in front does it)."""
    s, f = fifo(np.concatenate(([free], arrival)), np.concatenate(([0.0], hold)))
    return s[1:], f[1:]


@dataclass
class _State:
    """What the requests before a block's first arrival leave behind."""

    engine_free: np.ndarray  # per engine: when its last request finishes
    tier_free: float  # when the tier's last load finishes
    inflight: np.ndarray  # finishes (sorted) of loads still in the tier


def _sync_block(idx: np.ndarray, arrival, eng, hit, transfer, tail, prefill, gtab, st: _State):  # noqa: ANN001, ANN202
    """Fixed point of the engines' and the tier's FIFO passes for requests ``idx`` (sorted by arrival)
    from state ``st``. Returns (start, finish, tier wait, tier hold, k) over ``idx``, or None if it did
    not settle within :data:`BLOCK_PASSES` passes."""
    m = len(idx)
    a, e, h = arrival[idx], eng[idx], hit[idx]
    hl = np.flatnonzero(h)
    tr, tl, pf = transfer[idx], tail[idx], prefill[idx]
    # the engines side by side: row g holds engine g's requests in arrival order, padded at the end with
    # zero-length jobs (they change nothing before them); a zero-length job at engine_free leads each row
    by = np.argsort(e, kind="stable")
    counts = np.bincount(e, minlength=len(st.engine_free))
    width = int(counts.max()) + 1
    row = e[by]
    col = np.arange(m) - np.repeat(np.cumsum(counts) - counts, counts) + 1
    a2 = np.empty((len(counts), width))
    a2[:, 0] = st.engine_free
    a2[:, 1:] = np.maximum(st.engine_free, a.max())[:, None]
    a2[row, col] = a[by]
    flat = row * width + col  # where request by[j] sits in the flattened rows
    da = np.diff(a2, axis=1)  # constant over the passes
    h2 = np.zeros((len(counts), width))
    x = np.zeros_like(a2)
    trh, tlh, ah = tr[hl], tl[hl], a[hl]
    # first guess: every load issued on arrival (right wherever no engine queues, which is most requests);
    # tier waits and holds are kept per hit (hl order)
    ts0, _ = _fifo_from(st.tier_free, ah, trh)
    twait, hold_t = ts0 - ah, trh.copy()
    k = np.ones(len(hl), dtype=np.int64)
    base = len(st.inflight)
    start = np.empty(m)
    hold = pf.copy()
    for _ in range(BLOCK_PASSES):
        hold[hl] = twait + hold_t + tlh
        np.put(h2, flat, hold[by])
        np.subtract(h2[:, :-1], da, out=x[:, 1:])
        c = np.cumsum(x, axis=1)
        c -= np.minimum.accumulate(np.minimum(c, 0.0), axis=1)
        c += a2
        start[by] = np.take(c, flat)
        issue = start[hl]
        order = np.argsort(issue, kind="stable")
        iss = issue[order]
        g_now = gtab[np.minimum(k[order], len(gtab) - 1)] if gtab is not None else 1.0
        ts, tf = _fifo_from(st.tier_free, iss, trh[order] / g_now)
        new_k = k
        if gtab is not None:
            new_k = np.empty_like(k)
            fins = np.concatenate((st.inflight, tf))
            new_k[order] = base + np.arange(1, len(iss) + 1) - np.searchsorted(fins, iss + TIE_S, side="right")
        new_wait = np.empty(len(hl))
        new_hold = np.empty(len(hl))
        new_wait[order] = ts - iss
        new_hold[order] = tf - ts
        if (np.abs(new_wait - twait).max(initial=0.0) <= 1e-9 and np.abs(new_hold - hold_t).max(initial=0.0) <= 1e-12
                and np.array_equal(new_k, k)):
            tw_full, ht_full = np.zeros(m), tr.copy()
            tw_full[hl], ht_full[hl] = twait, hold_t
            return start, start + hold, tw_full, ht_full, k
        twait, hold_t, k = new_wait, new_hold, new_k
    return None


def _sync(arrival, eng, hit, transfer, tail, prefill, gtab, engines, max_batch=1, budget=None):  # noqa: ANN001, ANN202
    """(start, finish, tier wait, k per hit or None, solver) of a synchronous fleet (``budget``: see
    :func:`_sync_event_loop`; it changes nothing while one request is served at a time).

    Blocks of :data:`BLOCK` arrivals in time order: each block's fixed point is exact for the requests
    it issues before the next block's first arrival (nothing later can reach back); those issued later
    (engines backlogged) are carried into the next block with the state the final ones leave.
    """
    n = len(arrival)
    groups = [np.flatnonzero(eng == g) for g in range(engines)]
    if engines == 1 and gtab is None:
        if budget is None or max_batch == 1:
            fixed, tokens, rate, max_tokens, cost = np.where(hit, transfer + tail, prefill), np.zeros(n), 1.0, None, None
        else:
            held, tokens, rate, max_tokens, cost = budget
            fixed = np.where(hit, transfer, 0.0) + held
        start, finish = engine_steps(arrival, fixed, tokens, rate, max_batch, max_tokens, cost)
        return start, finish, np.zeros(n), None, "closed form" if max_batch == 1 else "steps of one engine"
    if max_batch > 1:  # steps of several requests: the event loop (the fixed point solves FIFO engines)
        start, finish, twait, k = _sync_event_loop(arrival, hit, transfer, tail, prefill, gtab, groups, max_batch, budget)
        return start, finish, twait, k, "event loop"
    start, finish, twait = np.empty(n), np.empty(n), np.zeros(n)
    kk = np.ones(n, dtype=np.int64)
    st = _State(np.full(engines, -np.inf), -np.inf, np.empty(0))
    pending = np.empty(0, dtype=np.int64)
    pos = blocks = 0
    while pos < n or len(pending):
        if len(pending) > CARRY_MAX:
            break  # engines backlogged without end: the event loop is cheaper than re-solving the carry
        idx = np.concatenate((pending, np.arange(pos, min(pos + BLOCK, n))))
        pos = min(pos + BLOCK, n)
        blocks += 1
        if np.isneginf(st.tier_free):
            st.tier_free = float(arrival[idx[0]])
            st.engine_free[:] = arrival[idx[0]]
        out = _sync_block(idx, arrival, eng, hit, transfer, tail, prefill, gtab, st)
        if out is None:
            break
        s, f, tw, ht, k = out
        t_next = arrival[pos] if pos < n else np.inf
        final = s < t_next
        fi = idx[final]
        start[fi], finish[fi], twait[fi] = s[final], f[final], tw[final]
        hfinal = final[hit[idx]]
        kk[idx[hit[idx]][hfinal]] = k[hfinal]
        for g in np.unique(eng[fi]):
            st.engine_free[g] = f[final & (eng[idx] == g)].max()
        hl = hit[idx] & final
        if hl.any():
            tier_fin = s[hl] + tw[hl] + ht[hl]
            st.tier_free = max(st.tier_free, float(tier_fin.max()))
            st.inflight = np.sort(np.concatenate((st.inflight, tier_fin)))
        st.inflight = st.inflight[st.inflight > t_next + TIE_S] if np.isfinite(t_next) else st.inflight
        pending = idx[~final]
    else:
        return start, finish, twait, (kk[hit] if gtab is not None else None), f"fixed point ({blocks} blocks)"
    start, finish, twait, k = _sync_event_loop(arrival, hit, transfer, tail, prefill, gtab, groups)
    return start, finish, twait, k, "event loop"


def simulate_fleet(w: Workload, cfg: SimConfig, bandwidth_gbps: float, engines: int = 1,
                   var: Variability | None = None, engine_of: np.ndarray | None = None) -> FleetResult:
    """Run ``engines`` engines over workload ``w`` (the whole fleet's arrivals) against one shared tier.

    ``engine_of``: the engine of each request (default: dealt at random with ``cfg.seed``).
    """
    var = var or Variability()
    check_config(cfg, bandwidth_gbps)
    if engines < 1:
        raise InvalidInput(f"--engines must be at least 1, got {engines}")
    n = len(w.arrival_s)
    arrival, tokens = w.arrival_s, w.tokens
    hit_tokens = hit_tokens_of(w, cfg)
    hit = hit_tokens > 0
    if engine_of is not None:
        eng = np.asarray(engine_of, dtype=np.int64)
        if len(eng) != n or (n and (eng.min() < 0 or eng.max() >= engines)):
            raise InvalidInput(f"engine_of must give an engine in [0, {engines}) for each of the {n} requests")
    else:
        eng = np.random.default_rng([cfg.seed, 4]).integers(0, engines, n) if engines > 1 else np.zeros(n, dtype=np.int64)
    groups = [np.flatnonzero(eng == e) for e in range(engines)]
    async_ = cfg.loading == "async"
    bw = bandwidth_gbps
    if async_ and var.async_instance_gbps:
        bw = require_positive("--async-instance-gbps", var.async_instance_gbps) * cfg.instances
    mult = np.ones(n)
    if async_ and var.load_spread:  # the engine's own loads (--fit-load-spread) in place of the bench's lognormal
        mult = np.random.default_rng([cfg.seed, 5]).choice(np.asarray(var.load_spread), n)
    elif var.get_sigma > 0:
        z = np.random.default_rng([cfg.seed, 5]).standard_normal(n)
        mult = np.exp(var.get_sigma * z - var.get_sigma**2 / 2)  # mean 1: bandwidth keeps its mean
    per_token = cfg.bytes_per_token / (bw * GB) * mult
    load_s = var.async_load_s if async_ else 0.0  # the loader's own seconds a load besides its GETs (async: on the tier)
    t0 = (np.random.default_rng([cfg.seed, 6]).choice(np.asarray(var.t0_samples_s), n) if var.t0_samples_s
          else np.full(n, cfg.t0_s))
    gpu_t0, held_t0, late_t0 = split_t0(t0, cfg.t0_engine_share, cfg.hit_gpu_s)  # GPU part; on the engine after the load; latency only
    decisions = None
    if cfg.policy == "on" and cfg.scheduler != "vllm":  # the connector's decision first (kvctl.sim.policy): what each hit loads
        hit_tokens, decisions = decided_hits(arrival, tokens, hit_tokens, hit_tokens * per_token, t0, cfg.prefill_rate,
                                             cfg.loading, held_t0, eng, engines, load_s, (cfg.step_cost, cfg.max_batched_tokens))
        hit = hit_tokens > 0
    transfer = hit_tokens * per_token
    todo = np.where(hit, tokens - hit_tokens, tokens)  # prefill tokens each request computes (a served hit: its tail)
    # the steps' own cost (kvctl.sim.steps): one request at a time, each pays its own steps' (tail and prefill carry
    # them); steps of several requests pay theirs in the step model (plan_step), where a batch shares its step
    own_tail = own_prefill = 0.0
    if cfg.step_cost.active and cfg.max_batch <= 1:
        own_tail = cfg.step_cost.prefill_many(tokens - hit_tokens, cfg.max_batched_tokens)
        own_prefill = cfg.step_cost.prefill_many(tokens, cfg.max_batched_tokens)
    prefill = tokens / cfg.prefill_rate + own_prefill
    tail = (tokens - hit_tokens) / cfg.prefill_rate + own_tail
    extrapolated: list[str] = []
    # g(k) for every k up to the most loads the tier can hold at once (sync: one per engine)
    gtab = _gain_table(var.readers_gain, engines if not async_ else max(engines, max(var.readers_gain) + 1)) if var.readers_gain else None
    timed_out = np.zeros(n, dtype=bool)
    notes = var.notes
    if cfg.scheduler == "vllm":  # vLLM's scheduler: each hit decided and loaded at the head of the line (kvctl.sim.vllm_line)
        if engines != 1:
            raise InvalidInput(f"--scheduler vllm models one engine, got --engines {engines}")
        beside = (np.random.default_rng([cfg.seed, 7]).choice(np.asarray(var.load_spread_beside), n)
                  if async_ and var.load_spread_beside else None)
        line = run_line(arrival, tokens, hit_tokens, line_config(cfg, bw, var.async_load_s or None), mult, beside)
        hit, timed_out, compute, finish = line.loaded > 0, line.given_up, line.compute_s, line.done
        transfer, offered_hold, decisions = line.loaded * per_token, compute, line.decisions if cfg.policy == "on" else None
        latency = finish - arrival + var.async_overhead_s
        wait, k, solver = np.maximum(0.0, finish - arrival - compute), None, "vLLM's scheduler, step by step"
        if var.t0_samples_s:  # the line's T0 is the connector's, a load's fixed seconds
            notes = (*notes, f"--scheduler vllm: T0 is each load's fixed seconds on the tier, {cfg.t0_s:g} s (--t0); "
                             "--fit-from's T0 distribution is not used (--async-overhead gives what a request spends outside the engine)")
    elif not async_:
        budget = (np.where(hit, held_t0, 0.0), todo, cfg.prefill_rate, cfg.max_batched_tokens, cfg.step_cost)
        start, finish, wait_tier, k, solver = _sync(arrival, eng, hit, transfer, tail + held_t0, prefill, gtab, engines, cfg.max_batch, budget)
        compute = np.where(hit, tail + gpu_t0, prefill)
        offered_hold = np.where(hit, transfer + tail + held_t0, prefill)
        latency = finish - arrival + np.where(hit, late_t0, 0.0)
        wait = start - arrival + wait_tier
    else:
        require_positive("--async-timeout", cfg.async_timeout_s, allow_zero=True)
        hidx = np.flatnonzero(hit)
        t_start, loaded, k = _tier(arrival[hidx], transfer[hidx] + load_s, gtab)
        in_time = loaded - arrival[hidx] <= cfg.async_timeout_s
        timed_out[hidx[~in_time]] = True
        ready = arrival.copy()
        ready[hidx] = np.where(in_time, loaded, arrival[hidx] + cfg.async_timeout_s)
        served = hit & ~timed_out
        compute = np.where(served, tail + gpu_t0, prefill)
        offered_hold = np.where(served, tail + held_t0, prefill)
        start, finish = _engine_fifo(ready, np.where(served, held_t0, 0.0), np.where(served, todo, tokens), cfg.prefill_rate, groups,
                                     cfg.max_batch, cfg.max_batched_tokens, cfg.step_cost)
        latency = finish - arrival + np.where(served, late_t0, 0.0) + var.async_overhead_s
        wait = start - ready
        wait[hidx[in_time]] += (t_start - arrival[hidx])[in_time]
        solver = "closed form"
    if var.t0_samples_s and var.t0_fit_hit_tokens and hit.any():  # prompts on both sides: a run's hits cache whole chunks only
        lo, hi = var.t0_fit_hit_tokens
        h_lo, h_hi = float(tokens[hit].min()), float(tokens[hit].max())
        if h_lo < lo or h_hi > hi:
            extrapolated.append(f"T0 was fitted on hits of prompts of {lo:,.0f}–{hi:,.0f} tokens; simulated hits' prompts span {h_lo:,.0f}–{h_hi:,.0f}")
    if k is not None and len(k) and k.max() > max(var.readers_gain):
        extrapolated.append(f"concurrent readers per instance beyond the {max(var.readers_gain)} measured: throughput held flat")
    span = float(max(finish.max(), arrival[-1]) - arrival[0]) if n else 0.0
    rate = w.offered_rate
    per = []
    for e, idx in enumerate(groups):
        if not len(idx):
            continue
        lat = latency[idx]
        p50, p90, p99 = _pcts(lat)
        lam_e = rate * len(idx) / n if rate else None
        per.append(EngineStats(
            engine=e, requests=len(idx), hits=int(hit[idx].sum()), timeouts=int(timed_out[idx].sum()),
            p50_s=p50, p90_s=p90, p99_s=p99, max_s=float(lat.max()), mean_s=float(lat.mean()),
            mean_wait_s=float(wait[idx].mean()),
            rho=float(lam_e * offered_hold[idx].mean()) if lam_e else None,
            gpu_utilization_pct=100.0 * float(compute[idx].sum() / span) if span > 0 else 0.0,
            max_queue=in_system_ahead(arrival[idx], finish[idx]),
        ))
    tier_rho = float(rate * ((transfer[hit].sum() + load_s * hit.sum()) / n)) if rate else None
    rhos = [p.rho for p in per if p.rho is not None]
    rho = max(rhos) if rhos else None
    p50, p90, p99 = _pcts(latency)
    return FleetResult(
        p50_s=p50, p90_s=p90, p99_s=p99, max_s=float(latency.max()), mean_s=float(latency.mean()),
        thirds_p50_s=[float(np.percentile(part, 50)) if len(part) else None for part in np.array_split(latency, 3)],
        rho=rho,
        max_queue=max(p.max_queue for p in per),
        stable=None if rho is None else rho < RHO_UNSTABLE and (tier_rho or 0.0) < RHO_UNSTABLE,
        requests=n, hits=int(hit.sum()), timeouts=int(timed_out.sum()), mean_wait_s=float(wait.mean()),
        arrival_rate_per_s=rate, bandwidth_gbps=bw, tier_rho=tier_rho, loading=cfg.loading, instances=cfg.instances,
        engines=engines, gpu_utilization_pct=float(np.mean([p.gpu_utilization_pct for p in per])), per_engine=tuple(per),
        extrapolated=tuple(extrapolated), notes=notes, solver=solver,
        by_class=latency_by_class(latency[hit], latency[~hit], pct=np_percentile), decisions=decisions,
    )


def fleet_dict(res: FleetResult) -> dict[str, Any]:
    """JSON of a fleet result: ``simulate``'s keys first, then the fleet's, per engine last."""
    from kvctl.sim.simulate import result_dict  # noqa: PLC0415

    d = result_dict(res)
    d["per_engine"] = [e.__dict__ for e in res.per_engine]
    d["extrapolated"] = list(res.extrapolated)
    d["notes"] = list(res.notes)
    return d
