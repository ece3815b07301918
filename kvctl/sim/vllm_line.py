"""One engine as vLLM's scheduler runs it, with async loads decided at the head of its waiting line (issue 46).

``kvctl simulate``'s default engine (:mod:`kvctl.sim.fleet`) starts an async prefetch on arrival, while the request
waits for the engine, and decides on arrival (:mod:`kvctl.sim.policy`). vLLM does neither. It asks a KV connector
about a request (``get_num_new_matched_tokens``) only when its scheduler reaches that request in the waiting line,
inside a step's token budget: the queue wait comes first, then the load. An async load takes no budget, so the
scheduler goes on to the next request. A recompute of a long prompt takes the whole budget, so the line waits a step.
Once vLLM has the load, the request's rest goes first in a later step. On an H100 (2026-12-06, eighth) a hit whose
tier was saturated waited 0.28 s in the line, loaded for 0.34 s, then waited for a 16k step: 1.1 s in all.
``simulate --scheduler vllm`` runs this model (``--sched-lag``, ``--async-overhead`` and the step costs of
:mod:`kvctl.sim.steps` with it); ``benchmarks/head_of_line.py`` is its workbench.

The model (one engine, one FIFO tier, time in seconds):

* steps run back to back while there is work. A step costs its tokens / R and :class:`~kvctl.sim.steps.StepCost`
  of them. Its budget (vLLM's ``max_num_batched_tokens``) goes first to prefill in progress and received hits'
  rests, in order, then to the waiting line in order. A request finishes (its first token) when the step that
  computes its last token ends.
* at the head of the line a hit is decided by the connector's own :func:`kvctl.connector.policy.decide`, with the
  figures the connector has: R, T0, the tier's bandwidth, the received hit's step, the loads planned and not
  received, and the prefill left of requests already scheduled. With ``measured`` (simulate's) the bandwidth is the
  connector's running estimate, moved by each load received to what that load got
  (:func:`kvctl.connector.policy.ewma`); without, the tier's own, exact (``head_of_line.py``). Rule ``credit`` (the connector since 2026-12-06)
  adds the line's credit (:class:`~kvctl.connector.policy.Line`) and counts the planned loads less what the tier
  served of them (:func:`~kvctl.connector.tier_queue.tier_backlog`). Rule ``whole`` counts each planned load whole
  until vLLM reports it, and ``head`` decides without the credit. Rule ``off`` loads every hit.
* the tier is one FIFO. A load holds it for its fixed seconds plus its bytes / bandwidth, times the request's
  spread (``mult``: ``--fit-load-spread``'s draws, else the lognormal of ``--bench``; 1 without). The decision predicts the load
  without the spread. With ``mult_beside`` (``--fit-load-beside``), a load that starts while the engine has
  BESIDE_STEP_TOKENS or more to prefill (its steps run beside the GETs) takes that draw instead: on an H100 such loads
  were the slow ones (2026-12-07, third). A load still going at its budget (the decision's ``budget_s``, the worker's deadline) keeps the
  chunks it got by then; the rest is recomputed, and the load counts as given up.
* ``sched_lag`` 1 is vLLM's async scheduling, its default on CUDA. A step is planned while the one before it
  runs, so an arrival or a finished load is seen a step later; an idle engine sees it at once.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np

from kvctl.connector.policy import CREDIT_CAP, LOAD, NO_LINE, OFF, Estimates, HitShape, Line, TierQueue, decide, ewma
from kvctl.connector.tier_queue import plan_ends, tier_backlog
from kvctl.core.thresholds import BESIDE_STEP_TOKENS, CHUNK_TOKENS
from kvctl.plugins.vllm_policy import ArrivalRate
from kvctl.sim.steps import StepCost

RULES = ("off", "head", "whole", "credit")


@dataclass(frozen=True)
class LineConfig:
    """One engine's figures for :func:`run_line`."""

    prefill_rate: float  # R, tokens/s
    tier_bps: float  # what one load gets from the tier, bytes/s
    t0_s: float  # the connector's T0: a load's fixed seconds besides its transfer (the decision's)
    budget: int  # vLLM's max_num_batched_tokens
    chunk_tokens: int
    bytes_per_token: float
    rule: str = "credit"
    cost: StepCost = StepCost()
    sched_lag: int = 0
    est_prefill_rate: float | None = None  # the R the decision believes (None: the engine's own)
    load_fixed_s: float | None = None  # what a load holds the tier besides its bytes (None: t0_s)
    #: the decision's bandwidth as the connector measures it: starting at ``tier_bps``, each load received moves it
    #: (:func:`kvctl.connector.policy.ewma`) to what that load got; False: ``tier_bps``, exact
    measured: bool = False
    #: the line's credit at most this × the recompute: the connector's (``head_of_line.py --credit-caps`` varies it)
    credit_cap: float = CREDIT_CAP


@dataclass
class LineResult:
    """Per request: when its first token came (``done``, s), the tokens the tier held of it (whole chunks before its
    last token) and those it loaded, whether its load was given up at its budget; the GPU's busy seconds, the bytes the
    tier served, and the decisions (``{"decision/reason": n}``)."""

    done: np.ndarray
    hit: np.ndarray
    loaded: np.ndarray
    given_up: np.ndarray
    compute_s: np.ndarray  # each request's share of the steps it was computed in (by tokens)
    busy_s: float
    loaded_bytes: float
    decisions: dict[str, int] = field(default_factory=dict)


@dataclass
class _Req:
    i: int
    arrival: float
    tokens: int
    hit: int
    left: int = 0
    loaded: int = 0
    given_up: bool = False
    done: float | None = None


class _Tier:
    """The tier and what the connector knows of it: the loads planned and not yet reported received."""

    def __init__(self, cfg: LineConfig) -> None:
        self.cfg = cfg
        self.free = 0.0
        self.planned: dict[int, tuple[tuple, int]] = {}  # request -> (predicted ends, bytes)
        self.predicted_free: list[float] = [float("-inf")]  # the connector's plan_ends state
        self.loaded_bytes = 0.0
        self.arrivals = ArrivalRate()
        self.bps = cfg.tier_bps  # the decision's bandwidth (measured: the connector's running estimate)
        self.got: dict[int, float] = {}  # request -> the bandwidth its load got (bytes / its transfer seconds)

    def received(self, q: _Req) -> None:
        """vLLM reported ``q``'s load received: off the planned list, and (measured) into the estimate."""
        self.planned.pop(q.i, None)
        got = self.got.pop(q.i, None)
        if self.cfg.measured and got:
            self.bps = ewma(self.bps, got)

    def decide(self, q: _Req, now: float, left_ahead: int, others: bool) -> tuple[int, float | None, str]:
        """Chunks of ``q``'s hit to load, the load's budget and ``decision/reason``; ``others``: other requests
        in the engine (the connector counts the line's credit only then)."""
        c = self.cfg
        k_all = q.hit // c.chunk_tokens
        if c.rule == "off":
            return k_all, None, f"{LOAD}/{OFF}"
        shape = HitShape(0, k_all, 0, c.chunk_tokens, int(c.chunk_tokens * c.bytes_per_token), 1, prompt=q.tokens)
        est = Estimates(c.est_prefill_rate or c.prefill_rate, c.t0_s, (self.bps,), graph_tokens=c.cost.graph_tokens,
                        graph_jump_s=c.cost.graph_jump_s, hit_step_s=c.cost.step_s, step_s=c.cost.step_s,
                        step_budget=c.budget)
        if c.rule == "whole":
            queue = TierQueue((sum(b for _, b in self.planned.values()),), len(self.planned))
        else:
            queue = tier_backlog([(e, (b,)) for e, b in self.planned.values()], now, (self.bps,))
        crediting = c.rule in ("credit", "whole") and others
        line = Line(now - q.arrival, self.arrivals.rate(), c.credit_cap) if crediting else NO_LINE
        d = decide(shape, est, queue, float(left_ahead), line)
        return d.tokens // c.chunk_tokens, d.budget_s, f"{d.decision}/{d.reason}"

    def start(self, q: _Req, k: int, now: float, budget_s: float | None, mult: float) -> float:
        """Queue the load of ``k`` chunks; when the request's rest can be scheduled (sets ``q.loaded``)."""
        c = self.cfg
        fixed = c.t0_s if c.load_fixed_s is None else c.load_fixed_s
        start = max(now, self.free)
        per = c.chunk_tokens * c.bytes_per_token / c.tier_bps * mult
        end = start + fixed + k * per
        if budget_s is not None and end > now + budget_s:  # the deadline: the chunks that came by then are kept
            k = max(0, min(k, int((now + budget_s - start - fixed) / per)))
            end = now + budget_s
            q.given_up = True
        self.free = max(self.free, start + fixed + k * per)
        nbytes = int(k * c.chunk_tokens * c.bytes_per_token)
        self.planned[q.i] = (plan_ends(self.predicted_free, now, c.t0_s, (nbytes,), (self.bps,)), nbytes)
        if k:
            self.got[q.i] = c.tier_bps / mult
        self.loaded_bytes += nbytes
        q.loaded = k * c.chunk_tokens
        return end


def run_line(arrival: np.ndarray, tokens: np.ndarray, hit_tokens: np.ndarray, cfg: LineConfig,
             mult: np.ndarray | None = None, mult_beside: np.ndarray | None = None) -> LineResult:
    """The engine of the module docstring over requests arriving at ``arrival`` (s, non-decreasing), each ``tokens``
    long with ``hit_tokens`` of them in the tier (whole chunks; the last token is always computed). ``mult`` and
    ``mult_beside``: each request's load-time multiplier alone and beside big steps (None: 1, and ``mult``)."""
    n = len(arrival)
    ct = cfg.chunk_tokens
    reqs = [_Req(i, float(arrival[i]), int(tokens[i]), int(min(hit_tokens[i], tokens[i] - 1) // ct * ct))
            for i in range(n)]
    spread = np.ones(n) if mult is None else np.asarray(mult, dtype=float)
    spread_beside = None if mult_beside is None else np.asarray(mult_beside, dtype=float)
    tier = _Tier(cfg)
    counts: Counter[str] = Counter()
    compute = np.zeros(n)
    waiting: deque[_Req] = deque()
    loading: list[tuple[float, int]] = []  # (ready time, request index) heap
    running: list[_Req] = []  # prefill in progress and received hits, in order
    nxt, now, seen, busy = 0, 0.0, 0.0, 0.0  # seen: what the scheduler knows of by now (lag 1: up to the last step's start)
    if n:
        now = seen = float(arrival[0])
    while nxt < n or waiting or loading or running:
        while nxt < n and reqs[nxt].arrival <= seen:
            waiting.append(reqs[nxt])
            nxt += 1
        while loading and loading[0][0] <= seen:
            q = reqs[heapq.heappop(loading)[1]]
            tier.received(q)
            q.left = q.tokens - q.loaded
            running.append(q)
        budget = cfg.budget
        sched: list[tuple[_Req, int]] = []
        for q in running:
            if budget <= 0:
                break
            take = min(budget, q.left)
            sched.append((q, take))
            budget -= take
        while waiting and budget > 0:
            q = waiting.popleft()
            tier.arrivals.arrived(str(q.i), q.arrival)
            k = 0
            if q.hit:
                left_ahead = sum(x.left - t for x, t in sched)  # the connector counts a scheduled chunk as computed
                k, budget_s, what = tier.decide(q, now, left_ahead, bool(running or loading or waiting))
                counts[what] += 1
            if k:
                m = float(spread[q.i])
                # beside: the prefill of this step and the next ones
                if spread_beside is not None and sum(x.left for x in running) >= BESIDE_STEP_TOKENS:
                    m = float(spread_beside[q.i])
                heapq.heappush(loading, (tier.start(q, k, now, budget_s, m), q.i))
                continue
            q.left = q.tokens
            running.append(q)
            take = min(budget, q.left)
            sched.append((q, take))
            budget -= take
        step_tokens = sum(t for _, t in sched)
        if step_tokens == 0:  # idle: to the next arrival or finished load, seen at once
            events = ([reqs[nxt].arrival] if nxt < n else []) + ([loading[0][0]] if loading else [])
            now = seen = max(now, min(events))
            continue
        if cfg.sched_lag:  # the next step is planned now, while this one runs
            seen = now
        step = step_tokens / cfg.prefill_rate + cfg.cost.of(step_tokens)
        now += step
        busy += step
        for q, t in sched:
            compute[q.i] += step * t / step_tokens
            q.left -= t
            if q.left <= 0:
                q.done = now
        running = [q for q in running if q.done is None]
        if not cfg.sched_lag:
            seen = now
    return LineResult(np.array([q.done for q in reqs], dtype=float), np.array([q.hit for q in reqs], dtype=float),
                      np.array([q.loaded for q in reqs], dtype=float),
                      np.array([q.given_up for q in reqs], dtype=bool), compute, busy, tier.loaded_bytes, dict(counts))


def line_config(cfg, bandwidth_gbps: float, load_fixed_s: float | None) -> LineConfig:  # noqa: ANN001 - a SimConfig
    """The engine of ``simulate --scheduler vllm`` from its :class:`~kvctl.sim.simulate.SimConfig`: the decision on
    (rule ``credit``, the connector's) or off, the tier at ``bandwidth_gbps`` (GB/s, what one load gets), a load's
    fixed seconds on it ``load_fixed_s`` (``--async-load-s``/``--fit-loads``; None: T0), and the decision's bandwidth
    measured as the connector measures it (``measured``: a slow load lowers it for the decisions after it)."""
    return LineConfig(cfg.prefill_rate, bandwidth_gbps * 1e9, cfg.t0_s, int(cfg.max_batched_tokens), CHUNK_TOKENS,
                      cfg.bytes_per_token, "credit" if cfg.policy == "on" else "off", cfg.step_cost, cfg.sched_lag,
                      load_fixed_s=load_fixed_s, measured=True)
