"""Load or recompute (paper §4 cost model, §7's suggestion): torch-free, for the scheduler side and the CLI.

* :class:`LoadPolicy` -- the one cost test: load ``n`` tokens only when
  ``T0 + n*s/B <= n/R``.
* :func:`decide` -- the vLLM scheduler's queue-aware decision for one hit
  (the whole hit, its longest prefix that wins, or nothing), pure, with its
  reason; its estimates (R, T0, each rank's bandwidth) are measured by the
  engine in :mod:`kvctl.connector.calibration`.
* :func:`ewma` -- the one smoothing rule for measured GET bandwidth (the store's
  per-rank figure and the scheduler's engine-wide one).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvctl.core.cost import load_s as _load_s, recompute_s as _recompute_s  # pure: connector/ may import the cost model

__all__ = ["BANDWIDTH_EWMA_NEW", "PROBE_EXCESS_S", "PROBE_MIN_CHUNKS_PER_RANK", "Decision", "Estimates", "HitShape", "Line", "LoadPolicy", "NO_LINE", "TierQueue", "as_probe", "decide", "ewma", "prefill_s"]

#: weight of the newest GET-bandwidth measurement in the running estimate
BANDWIDTH_EWMA_NEW = 0.3


def ewma(old: float | None, new: float) -> float:
    """The running bandwidth estimate after one more measurement (the first one is taken as it is)."""
    return new if old is None else (1.0 - BANDWIDTH_EWMA_NEW) * old + BANDWIDTH_EWMA_NEW * new


@dataclass(frozen=True)
class LoadPolicy:
    """Load-or-recompute (paper §4 cost model, §7's suggestion).

    ``bandwidth_gbps``: the tier bandwidth one prompt sees (all ranks together,
    1e9 bytes/s); None = this rank's measured L2 GET bandwidth x W, and no
    veto until something has been measured.
    """

    bytes_per_token: float
    prefill_tokens_per_s: float
    t0_s: float
    bandwidth_gbps: float | None = None

    def load_wins(self, tokens: int, bandwidth_gbps: float | None) -> bool:
        """True when loading ``tokens`` is predicted no slower than recomputing them."""
        bw = self.bandwidth_gbps if self.bandwidth_gbps is not None else bandwidth_gbps
        if tokens <= 0 or bw is None:
            return True
        if bw <= 0:
            return False
        return _load_s(tokens, self.bytes_per_token, bw, self.t0_s) <= _recompute_s(tokens, self.prefill_tokens_per_s)


# -- the queue-aware decision (docs/connector.md, "Load or recompute") ----------------------------------------
#: decisions: load the whole hit, a shorter prefix of it, or none of it
LOAD, PARTIAL, RECOMPUTE = "load", "partial", "recompute"
#: an async load that reached its deadline (counted by the worker, after the decision)
GIVEN_UP = "given_up"
#: why: predicted faster / nothing measured yet / a re-probe after a veto / the policy is off
WINS, NO_DATA, PROBE, OFF = "wins", "no_data", "probe", "off"
#: why not: the tier's queue / bandwidth below break-even (no length wins) / the hit is below n* (T0 dominates)
TIER_QUEUE, BELOW_BREAKEVEN, BELOW_N_STAR = "tier_queue", "below_breakeven", "below_n_star"
#: why an async load stopped short: it waited past its recompute time
DEADLINE = "deadline"
REASONS = (WINS, NO_DATA, PROBE, OFF, TIER_QUEUE, BELOW_BREAKEVEN, BELOW_N_STAR, DEADLINE)


@dataclass(frozen=True)
class Estimates:
    """What the decision knows: R (prefill tokens/s), T0 (s) and each rank's GET bandwidth (bytes/s).

    A rank's bandwidth is that of its instances together (a load reads them in parallel); None: not
    measured yet (and no value in the config).
    """

    prefill_tokens_per_s: float | None
    t0_s: float | None
    rank_bps: tuple[float | None, ...]
    # vLLM runs a step of at most ``graph_tokens`` tokens as a CUDA graph (0: none); a step above costs
    # ``graph_jump_s`` more besides its tokens (fitted from the engine's steps: kvctl.connector.calibration.Calibration)
    graph_tokens: int = 0
    graph_jump_s: float = 0.0
    # a hit vLLM receives (async loading, or sync under async scheduling) waits one more engine step than
    # recomputing it: that step's fixed cost, paid once by each hit (never once per load queued ahead of it)
    hit_step_s: float = 0.0
    # what any step costs besides its prefill tokens (the step fit's a; 0: not fitted), and vLLM's token budget a
    # step (max_num_batched_tokens; 0: not known, the prefill is priced as one step): a recompute is priced in the
    # steps it takes (:func:`prefill_s`)
    step_s: float = 0.0
    step_budget: int = 0

    @property
    def tier_gbps(self) -> float | None:
        """The whole tier's bandwidth (every rank's together), GB/s; None until every rank is measured."""
        if not self.rank_bps or any(b is None for b in self.rank_bps):
            return None
        return sum(self.rank_bps) / 1e9


@dataclass(frozen=True)
class TierQueue:
    """What is queued ahead of a new load: bytes per rank and how many loads (each pays its own T0)."""

    rank_bytes: tuple[int, ...]
    loads: int = 0


@dataclass(frozen=True)
class Decision:
    """One request's hit judged: ``found`` tokens past what the engine holds, ``tokens`` of them to load.

    ``load_s``/``recompute_s``: the predictions for what is loaded (the whole hit when nothing is);
    ``budget_s``: how long the load may take before the rest is given up (its recompute time; None: no bound).
    """

    found: int
    tokens: int
    decision: str
    reason: str
    load_s: float | None = None
    recompute_s: float | None = None
    budget_s: float | None = None


def owned_in(first: int, end: int, rank: int, world: int) -> int:
    """How many chunks of ``first..end-1`` rank ``rank`` owns (``c mod W == rank``)."""
    def below(n: int) -> int:
        return 0 if n <= rank else (n - rank + world - 1) // world
    return below(end) - below(first)


@dataclass(frozen=True)
class HitShape:
    """A hit in the tier: chunks ``first..end-1``, of which the engine already holds ``skip`` tokens."""

    first: int
    end: int
    skip: int
    chunk_tokens: int
    chunk_bytes: int  # one chunk's bytes, all on its owner
    world: int
    prompt: int = 0  # the prompt's tokens (0: not known, no step regime counted)

    def tokens(self, k: int) -> int:
        return max(0, (self.first + k) * self.chunk_tokens - self.skip)

    def recompute_s(self, k: int, est: Estimates, r: float, engine_tokens: float) -> tuple[float, float]:
        """(recompute(k) as :func:`decide` compares it with the load, the recompute's own GPU time).

        With the prompt's length known: the engine's time to compute the prefill work ahead (``engine_tokens``) and
        the prompt's rest (``prompt - skip``), in steps of its token budget (:func:`prefill_s`), less its time to
        compute what a hit of k chunks leaves (the step the hit's rest runs in: both pay it, and the load's
        prediction ends before it); its own GPU time is the same with nothing ahead: its step(s) beyond a received
        hit's. Each step's fixed cost and graph jump count where the recompute adds a step (a 16k prompt behind
        16k of work under a 16k budget) or lifts one above vLLM's largest CUDA graph. Without it (``prompt`` 0):
        tokens / R."""
        t = self.tokens(k)
        if not self.prompt:
            return (t + engine_tokens) / r, t / r
        left = max(self.prompt - self.skip, t)
        after = prefill_s(left - t, r, est)
        return prefill_s(engine_tokens + left, r, est) - after, prefill_s(left, r, est) - after

    def rank_bytes(self, k: int) -> list[int]:
        return [owned_in(self.first, self.first + k, r, self.world) * self.chunk_bytes for r in range(self.world)]


def prefill_s(tokens: float, r: float, est: Estimates) -> float:
    """vLLM's time to compute ``tokens`` prefill tokens and nothing else: tokens / R, in steps of at most
    ``est.step_budget`` tokens (0: one step), each costing ``est.step_s`` more, and ``est.graph_jump_s`` more where it
    is above vLLM's largest CUDA graph (``est.graph_tokens``)."""
    if tokens <= 0:
        return 0.0
    full, last = step_costs(tokens, est.step_budget, est.step_s, est.graph_tokens, est.graph_jump_s)
    return tokens / r + full + last


def step_costs(tokens: float, budget: float, step_s: float, graph_tokens: float, graph_jump_s: float) -> tuple[float, float]:
    """What computing ``tokens`` (> 0) prefill tokens alone costs besides tokens / R, as (its full steps of ``budget``
    tokens, its last, shorter step; 0 where there is none): ``step_s`` a step and ``graph_jump_s`` more for a step above
    ``graph_tokens`` (0: no graphs); ``budget`` 0: one step. :func:`prefill_s`'s steps, and kvctl.sim.steps'."""
    size = budget if budget > 0 else tokens
    full = int(tokens // size)
    last = tokens - full * size
    if last < 1e-6:  # a float a hair above a whole number of steps (0.1 * 3 * 10240): no step of 5e-13 tokens
        last = 0.0

    def step(n: float) -> float:
        return step_s + (graph_jump_s if graph_tokens and n > graph_tokens else 0.0)
    return full * step(size), (step(last) if last > 0 else 0.0)


def _hit_load_s(shape: HitShape, k: int, est: Estimates, queue: TierQueue, t0: float) -> float:
    own = shape.rank_bytes(k)
    return t0 * (queue.loads + 1) + est.hit_step_s + max(
        ((q + b) / bw if (q + b) else 0.0) for q, b, bw in zip(queue.rank_bytes, own, est.rank_bps))


def _known_rates(est: Estimates, t0: float) -> Estimates:
    """``est`` with T0 set and an unmeasured rank's bandwidth as unbounded (a rank the hit neither reads nor waits on)."""
    return replace(est, t0_s=t0, rank_bps=tuple(bw if bw is not None else float("inf") for bw in est.rank_bps))


#: The line's credit is at most this × the recompute time: a load wins at no more than 1 + CREDIT_CAP times its own
#: recompute, here 2.5 times: the 2026-12-02 trace's lone 16k hit through a 600 MB/s link (0.85 s against 0.3 s of
#: recompute) stays a veto. It was 1 (and the arrivals during the recompute counted half of it) until 2026-12-06, sixth: in
#: benchmarks/head_of_line.py with that session's step costs the tier then served 4-11 points more of what it could at
#: 7.7/s behind 800 MB/s links (0.83-0.88 against 0.74-0.84 over three seeds), p99 5-8 % lower (benchmarks/README).
CREDIT_CAP = 1.5


@dataclass(frozen=True)
class Line:
    """vLLM's waiting line as the connector sees it when it is asked about a request (at the line's head): how long
    that request waited (``wait_s``: since its arrival) and the engine's arrival rate (requests/s; 0: not known);
    ``cap``: the credit's cap, :data:`CREDIT_CAP` unless ``load_policy.line_credit_cap`` sets another (and
    ``head_of_line.py --credit-caps`` in the model)."""

    wait_s: float = 0.0
    arrival_rate: float = 0.0
    cap: float = CREDIT_CAP

    def credit_s(self, rec_s: float) -> float:
        """What recomputing ``rec_s`` of prefill costs the other requests, counted at most ``cap`` ×
        ``rec_s``: the requests that arrived while this one waited (``arrival_rate × wait_s``) wait all of it, and so
        do as many again as arrive while it runs (``arrival_rate × rec_s``, its own GPU time, one step or more):
        vLLM plans a step while the one before
        it runs (async scheduling, its default on CUDA), so a request that arrives before the recompute's step starts
        is scheduled only after it (see :func:`decide`)."""
        if self.arrival_rate <= 0 or rec_s <= 0:
            return 0.0
        return min(self.cap * rec_s, self.arrival_rate * rec_s * (max(0.0, self.wait_s) + rec_s))


NO_LINE = Line()


def _rec_s(shape: HitShape, k: int, est: Estimates, r: float, engine_tokens: float, line: Line) -> float:
    """recompute(k) of :func:`decide`: :meth:`HitShape.recompute_s`, and the line's credit on its own GPU time."""
    rec, own = shape.recompute_s(k, est, r, engine_tokens)
    return rec + line.credit_s(own)


def _longest_winning(shape: HitShape, est: Estimates, queue: TierQueue, t0: float, r: float, engine_tokens: float,
                     upto: int, slack_s: float = 0.0, line: Line = NO_LINE) -> tuple[int, float | None]:
    """The longest k <= ``upto`` chunks whose load wins, or loses by at most ``slack_s``, and its predicted load time
    ((0, None): none does).

    One pass up the lengths: chunk k adds its bytes to its owner's total, so the slowest rank's time is kept
    as a running maximum (exact, whatever the ranks' bandwidths and queues; O(upto + W)).
    """
    W, cb, bws, qs = shape.world, shape.chunk_bytes, est.rank_bps, queue.rank_bytes
    n = [0] * W  # chunks of each rank so far
    worst, fixed = max(q / bw for q, bw in zip(qs, bws)), t0 * (queue.loads + 1) + est.hit_step_s
    best, best_load = 0, None
    for k in range(1, upto + 1):
        owner = (shape.first + k - 1) % W
        n[owner] += 1
        worst = max(worst, (qs[owner] + n[owner] * cb) / bws[owner])  # the same expression as _hit_load_s
        if fixed + worst <= _rec_s(shape, k, est, r, engine_tokens, line) + slack_s:
            best, best_load = k, fixed + worst
    return best, best_load


def decide(shape: HitShape, est: Estimates, queue: TierQueue, engine_tokens: float = 0.0,
           line: Line = NO_LINE) -> Decision:
    """Load or recompute the hit ``shape`` (see docs/connector.md, "Load or recompute"). Pure.

    load(k) = T0 × (loads queued + 1) + the received hit's step (``hit_step_s``, once) + max over ranks (bytes
    queued + its bytes of k chunks) / its bandwidth;
    recompute(k) = the engine's time for ``engine_tokens`` (the prefill work it would wait behind) and the prompt, in
    steps, less its time for the rest a load of k chunks leaves (:meth:`HitShape.recompute_s`: each step's fixed cost
    and graph jump count where recomputing adds a step or lifts one above vLLM's largest CUDA graph), plus the
    line's credit (:meth:`Line.credit_s` of the recompute's own GPU time). vLLM asks about a request only once it
    is at the head of its waiting line, where recomputing looks as cheap as on an idle engine, yet holds every request
    behind it and every one that arrives meanwhile for its recompute time, while a load costs the engine only the
    rest. On the H100 of 2026-12-06 a tier that served a lone 16k hit in 0.23 s against 0.21 s of recompute was
    turned away hit after hit at 7.7 prompts/s and the line grew through the run (p99 10.6 s); in
    ``benchmarks/head_of_line.py``, a model of that scheduler with the H100's figures, the credit keeps the line
    short (p99 1.1 s). At most :data:`CREDIT_CAP` × the recompute time.
    The whole hit when it wins; else the longest prefix that wins; else nothing. Nothing measured (R, or the
    bandwidth of a rank the load reads or waits on): load.
    """
    k_all = shape.end - shape.first
    found = shape.tokens(k_all)
    r, bws = est.prefill_tokens_per_s, est.rank_bps
    if k_all <= 0 or found <= 0:
        return Decision(0, 0, RECOMPUTE, WINS)

    def recompute(k: int) -> float | None:
        return None if r is None else _rec_s(shape, k, est, r, engine_tokens, line)

    reads = [b or q for b, q in zip(shape.rank_bytes(k_all), queue.rank_bytes)]
    if r is None or any(x and bw is None for x, bw in zip(reads, bws)):
        return Decision(found, found, LOAD, NO_DATA, None, recompute(k_all), recompute(k_all))
    t0 = est.t0_s or 0.0
    rates = _known_rates(est, t0)

    full_load, full_rec = _hit_load_s(shape, k_all, rates, queue, t0), recompute(k_all)
    if full_load <= full_rec:
        return Decision(found, found, LOAD, WINS, full_load, full_rec, full_rec)
    idle = _hit_load_s(shape, k_all, rates, TierQueue((0,) * shape.world), t0)
    # per chunk, a long hit: each rank moves 1/W of it at its own bandwidth; recompute: chunk_tokens / R
    slope_load = max(shape.chunk_bytes / (shape.world * bw) for bw in rates.rank_bps)
    if (queue.loads or any(queue.rank_bytes)) and idle <= full_rec:
        why = TIER_QUEUE
    elif slope_load >= shape.chunk_tokens / r:
        why = BELOW_BREAKEVEN
    else:
        why = BELOW_N_STAR
    k, k_load = _longest_winning(shape, rates, queue, t0, r, engine_tokens, k_all - 1, line=line)
    if k:
        part_rec = recompute(k)
        return Decision(found, shape.tokens(k), PARTIAL, why, k_load, part_rec, part_rec)
    return Decision(found, 0, RECOMPUTE, why, full_load, full_rec, None)


#: A re-probe loads the longest prefix whose predicted load exceeds its recompute by at most this (s), and at least
#: PROBE_MIN_CHUNKS_PER_RANK chunks a rank (or the whole hit): enough GETs to measure each rank's bandwidth again.
#: It loaded the whole hit before: on the H100 (2026-12-05) one 16k probe through a 600 MB/s link held a sync
#: engine 1.34 s where recomputing took 0.24 s, and the 11 prompts behind it made R2's p99 1.32x R1's.
PROBE_EXCESS_S = 0.05
PROBE_MIN_CHUNKS_PER_RANK = 4


def as_probe(d: Decision, shape: HitShape | None = None, est: Estimates | None = None,
             queue: TierQueue | None = None, engine_tokens: float = 0.0, line: Line = NO_LINE) -> Decision:
    """A veto turned into a load (a re-probe: its GETs measure the bandwidth again).

    With the hit's ``shape`` and the estimates that vetoed it: a prefix, the longest whose predicted load costs at
    most :data:`PROBE_EXCESS_S` more than recomputing it, and at least :data:`PROBE_MIN_CHUNKS_PER_RANK` chunks a
    rank (the rest is recomputed; its deadline, async, is that prefix's recompute time + PROBE_EXCESS_S). Without:
    the whole hit.
    """
    if shape is None or est is None or est.prefill_tokens_per_s is None:
        return Decision(d.found, d.found, LOAD, PROBE, d.load_s, d.recompute_s, d.recompute_s)
    k_all = shape.end - shape.first
    r, t0 = est.prefill_tokens_per_s, est.t0_s or 0.0
    queue = queue or TierQueue((0,) * shape.world)
    rates = _known_rates(est, t0)
    k, _ = _longest_winning(shape, rates, queue, t0, r, engine_tokens, k_all, slack_s=PROBE_EXCESS_S, line=line)
    k = max(k, min(k_all, PROBE_MIN_CHUNKS_PER_RANK * shape.world))
    if k >= k_all:
        return Decision(d.found, d.found, LOAD, PROBE, d.load_s, d.recompute_s, d.recompute_s)
    rec = _rec_s(shape, k, rates, r, engine_tokens, line)
    return Decision(d.found, shape.tokens(k), PARTIAL, PROBE, _hit_load_s(shape, k, rates, queue, t0), rec,
                    rec + PROBE_EXCESS_S)
