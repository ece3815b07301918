"""KvctlConnector's load-or-recompute decision on the scheduler side (see :mod:`kvctl.plugins.vllm`).

The scheduler is one process and its LoadSpecs go to every rank: every rank loads what it planned, so the
ranks agree by construction. For each hit it predicts (:func:`kvctl.connector.policy.decide`):

* load: T0 × (loads queued + 1) + max over ranks (bytes queued on the rank's instances + its share) / the
  rank's bandwidth. The queue is what this side planned and has not seen finished (an async or "receive"
  load until vLLM reports it received, a load in a step until that step's output), less what the tier has
  served of it since: each load's end is predicted when it is planned, behind the ones before it, at the measured
  bandwidth (:func:`~kvctl.connector.tier_queue.plan_ends`, :func:`~kvctl.connector.tier_queue.tier_backlog`).
* recompute: the engine's time for the prefill work it would wait behind and the prompt, in steps of vLLM's
  token budget, less its time for the rest a load leaves (:meth:`~kvctl.connector.policy.HitShape.recompute_s`). That work, for an async load,
  is what this side can see: the prompt tokens still to compute of requests it has scheduled, and of those
  it looked up earlier and has not seen scheduled. Plus, async and with other requests in the engine, the
  line's credit (:class:`~kvctl.connector.policy.Line`): vLLM asks about a request at the head of its waiting
  line, and recomputing it holds the requests behind it, about ``arrival rate × its wait`` (``now -
  request.arrival_time``), and those arriving meanwhile; the arrival rate from the arrival times of the last
  :data:`ARRIVALS_KEPT` requests within :data:`ARRIVALS_HORIZON_S` of the newest. A sync load stops the engine
  for every request, so it is judged against its own tokens only.
* an async load's budget: its predicted recompute time; the worker gives up what it has not fetched by then
  (:class:`~kvctl.plugins.vllm_meta.LoadSpec` ``budget_s``). A sync load has none: it blocks the step, and a
  slow tier is what the decision itself turns away.

What it cannot see: requests vLLM has not asked about yet (behind the token budget), decode work beyond
what the step fit folds into R, other engines reading the same instances (their load shows only as a
lower measured bandwidth), and LMCache's or vLLM's own caches.

The estimates come from the workers' stats (:class:`~kvctl.connector.calibration.Calibration`); each decision
is counted (``kvctl:load_decisions{decision,reason}``) and, with ``KVCTL_CONNECTOR_TRACE``, traced with
its predictions, for ``kvctl explain``.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from kvctl.connector import metric_names as M
from kvctl.connector.ownership import ChunkParts, KeyExtra, chunk_keys
from kvctl.connector.calibration import Calibration
from kvctl.connector.policy import (LOAD, NO_LINE, OFF, PROBE, RECOMPUTE, TIER_QUEUE, Decision, Estimates,
                                    HitShape, Line, TierQueue, as_probe, decide)
from kvctl.connector.tier_queue import plan_ends, tier_backlog
from kvctl.connector.settings import LoadPolicySettings

__all__ = ["ARRIVALS_KEPT", "ArrivalRate", "SchedulerPolicy", "chunk0_tags"]

#: the arrival rate is measured over this many of the latest requests (at least ARRIVALS_MIN of them), those that
#: arrived within ARRIVALS_HORIZON_S s of the newest: on an H100 (2026-12-06) the 64 latest of a run at 10.3/s
#: still held the priming's requests, paced 0.3 s apart: the rate read 3.3–5.8/s through its first 9 s
ARRIVALS_KEPT, ARRIVALS_MIN, ARRIVALS_HORIZON_S = 64, 4, 10.0


class ArrivalRate:
    """Requests/s into the engine, from the arrival times (wall clock) of the latest :data:`ARRIVALS_KEPT` requests
    the scheduler side was asked about, each counted once, those within :data:`ARRIVALS_HORIZON_S` of the newest:
    (n - 1) / (newest - oldest)."""

    def __init__(self) -> None:
        self._times: deque[float] = deque(maxlen=ARRIVALS_KEPT)
        self._seen: OrderedDict[str, None] = OrderedDict()

    def arrived(self, rid: str, arrival_time: float | None) -> None:
        if not isinstance(arrival_time, (int, float)) or arrival_time <= 0 or rid in self._seen:
            return
        self._seen[rid] = None
        if len(self._seen) > 4 * ARRIVALS_KEPT:
            self._seen.popitem(last=False)
        self._times.append(float(arrival_time))

    def rate(self) -> float:
        """Requests/s (0.0 until ARRIVALS_MIN arrivals spread over time were seen within the horizon)."""
        if len(self._times) < ARRIVALS_MIN:
            return 0.0
        newest = max(self._times)
        recent = [t for t in self._times if t >= newest - ARRIVALS_HORIZON_S]
        span = newest - min(recent)
        return (len(recent) - 1) / span if len(recent) >= ARRIVALS_MIN and span > 0 else 0.0


def chunk0_tags(tokens: Sequence[int], chunk_tokens: int, model: str, fmt: str, extra: KeyExtra | None,
                parts: ChunkParts | None = None) -> dict:
    """Short tags of a prompt's first chunk for the trace: ``key0`` its key (tokens, model, format, salt, LoRA)
    and the names of the values the tier holds it as (``parts``: a sparse chunk's, layer groups'), ``tok0`` its
    tokens alone; equal tokens under another ``key0`` is a key format or salt mismatch (kvctl explain). Engines
    with different ``layer_groups`` key a chunk alike but store other values: the part names tell them apart."""
    if len(tokens) < chunk_tokens:
        return {}
    first = list(tokens[:chunk_tokens])
    key = chunk_keys(first, chunk_tokens, model, fmt, extra)[0]
    if parts is not None:
        key += "/" + ",".join(parts.names)
    raw = b"".join(int(t).to_bytes(8, "little", signed=True) for t in first)
    return {"key0": hashlib.blake2b(key.encode(), digest_size=8).hexdigest(),
            "tok0": hashlib.blake2b(raw, digest_size=8).hexdigest()}


@dataclass
class _Planned:
    rank_bytes: tuple[int, ...]
    since: float
    until_received: bool  # async or "receive": queued until vLLM reports it received; else until the step's output
    shipped: bool = False
    ends: tuple[float | None, ...] = ()  # when each rank will have served it, predicted when planned (plan_ends)


@dataclass
class _Judged:
    decision: Decision
    est: Estimates
    queue: TierQueue
    engine_tokens: float
    line: Line = NO_LINE


class SchedulerPolicy:
    """The decision, its estimates and the two queues, for one scheduler side.

    ``settings`` None: the decision is off (every hit loads, counted with reason ``off``); the estimates are
    still measured, so the records say what it would have predicted.
    """

    def __init__(self, settings: LoadPolicySettings | None, *, world: int, chunk_tokens: int, chunk_bytes: int,
                 async_loading: bool, timeout_s: float, stats: Any, trace: Any, clock: Callable[[], float] = time.monotonic,
                 hit_step: bool = False, graph_tokens: int = 0, step_budget: int = 0):
        s = settings or LoadPolicySettings()
        self.on = settings is not None
        self.cal = Calibration(world, prefill_tokens_per_s=s.prefill_tokens_per_s, t0_s=s.t0_s,
                               tier_gbps=s.bandwidth_gbps, reprobe_after_s=s.reprobe_after_s, hit_step=hit_step,
                               graph_tokens=graph_tokens, step_budget=step_budget, clock=clock)
        self.world, self.ct, self.cb = world, chunk_tokens, chunk_bytes
        self.async_loading, self.timeout_s = async_loading, timeout_s
        self.credit_cap = s.line_credit_cap
        self.stats, self.trace, self.clock = stats, trace, clock
        self._planned: dict[str, _Planned] = {}
        self._waiting: dict[str, int] = {}  # request -> its prompt tokens to compute, in the order first asked
        self._judged: dict[str, _Judged] = {}
        self.arrivals = ArrivalRate()
        self._tier_free = [float("-inf")] * world  # each rank's predicted end of what it was given (plan_ends)

    # -- the decision ------------------------------------------------------------------------------------
    def queue(self, est: Estimates | None = None) -> TierQueue:
        """What is queued on the tier now: the loads planned and not seen finished (stale ones dropped), less what
        the tier has served of them since they were planned at the measured bandwidth (:func:`tier_backlog`)."""
        now = self.clock()
        stale = [rid for rid, p in self._planned.items() if now - p.since > self._stale_s()]
        for rid in stale:
            del self._planned[rid]
        est = est or self.cal.estimates()
        return tier_backlog([(p.ends, p.rank_bytes) for p in self._planned.values()], now, self._bps(est))

    def _bps(self, est: Estimates) -> tuple[float | None, ...]:
        return est.rank_bps if len(est.rank_bps) == self.world else (None,) * self.world

    def _stale_s(self) -> float:
        # a load ends within its budget plus one GET after it starts; a finish that never came is forgotten
        return self.cal.reprobe_after_s + 4 * self.timeout_s

    def engine_tokens(self, rid: str, running_left: int) -> int:
        """Prefill tokens the request would wait behind: the scheduled prompts' rest, and earlier waiting requests'."""
        ahead = 0
        for other, left in self._waiting.items():
            if other == rid:
                break
            ahead += left
        return running_left + ahead

    def waiting(self, rid: str, tokens: int) -> None:
        """A request looked up and not scheduled yet will compute ``tokens`` prompt tokens (its place: first asked)."""
        self._waiting[rid] = max(0, tokens)

    def judge(self, rid: str, prompt_len: int, local: int, hit_end_chunk: int, running_left: int,
              line_wait_s: float = 0.0, others_running: bool = False) -> Decision:
        """The decision for a request's hit (chunks up to ``hit_end_chunk``; ``local`` tokens already computed;
        ``line_wait_s``: how long it waited in vLLM's line before it was asked; ``others_running``: requests
        scheduled and not finished). The line's credit counts for async loads with other requests in the engine."""
        shape = HitShape(local // self.ct, hit_end_chunk, local, self.ct, self.cb, self.world, prompt=prompt_len)
        est = self.cal.estimates()
        queue = self.queue(est)
        engine = self.engine_tokens(rid, running_left) if self.async_loading else 0
        others = others_running or any(r != rid for r in self._waiting) or any(r != rid for r in self._planned)
        line = (Line(max(0.0, line_wait_s), self.arrivals.rate(), self.credit_cap) if self.async_loading and others
                else NO_LINE)
        d = decide(shape, est, queue, engine, line)
        before = self._judged.get(rid)
        if not self.on:
            d = Decision(d.found, d.found, LOAD, OFF, d.load_s, d.recompute_s, None) if d.found else d
        elif d.decision == RECOMPUTE and d.found and d.reason != TIER_QUEUE:
            if before is not None and before.decision.reason == PROBE:
                d = before.decision  # asked again before it was scheduled: the same probe
            elif self.cal.probe_due():
                d = as_probe(d, shape, est, queue, engine, line)
        if not self.async_loading and d.budget_s is not None:
            d = replace(d, budget_s=None)  # a sync load blocks the step: it is judged, never cut short
        self._judged[rid] = _Judged(d, est, queue, engine, line)
        self.waiting(rid, prompt_len - local - d.tokens)
        return d

    # -- what became of it ----------------------------------------------------------------------------------
    def scheduled(self, rid: str, first_chunk: int, end_chunk: int, tokens: int, until_received: bool,
                  count: bool) -> Decision | None:
        """The request was allocated with ``tokens`` external tokens (chunks ``first_chunk..end_chunk-1``): its
        load joins the queue, its decision is counted (``count``: not a resumed preemption) and traced."""
        self._waiting.pop(rid, None)
        judged = self._judged.pop(rid, None)
        if tokens > 0:
            per = [0] * self.world
            for c in range(first_chunk, end_chunk):
                per[c % self.world] += self.cb
            now = self.clock()
            est = judged.est if judged is not None else self.cal.estimates()  # judged this step: the same estimates
            ends = plan_ends(self._tier_free, now, est.t0_s or 0.0, per, self._bps(est))
            self._planned[rid] = _Planned(tuple(per), now, until_received, ends=ends)
        if judged is None or not judged.decision.found:
            return None
        d = judged.decision
        if count:
            self.stats.add(M.LOAD_DECISIONS, 1, d.decision, d.reason)
        if self.trace.on:
            self.trace.event("decision", req=rid, found=d.found, tokens=tokens, decision=d.decision, reason=d.reason,
                             predicted_load_s=d.load_s, predicted_recompute_s=d.recompute_s, budget_s=d.budget_s,
                             prefill_tokens_per_s=judged.est.prefill_tokens_per_s, t0_s=judged.est.t0_s,
                             hit_step_s=judged.est.hit_step_s, graph_jump_s=judged.est.graph_jump_s,
                             step_s=judged.est.step_s, step_budget=judged.est.step_budget,
                             line_wait_s=round(judged.line.wait_s, 6), arrival_rate=round(judged.line.arrival_rate, 3),
                             tier_gbps=judged.est.tier_gbps, queued_bytes=max(judged.queue.rank_bytes, default=0),
                             loads_ahead=judged.queue.loads, engine_tokens=judged.engine_tokens,
                             asynchronous=self.async_loading)
        return d

    def shipped(self, rid: str) -> None:
        """The request's load went to the workers in this step's metadata."""
        p = self._planned.get(rid)
        if p is not None:
            p.shipped = True

    def forget(self, rid: str) -> None:
        self._waiting.pop(rid, None)
        self._judged.pop(rid, None)
        self._planned.pop(rid, None)

    def on_output(self, output: Any) -> None:
        """A step's output: loads it finished leave the queue; the workers' stats calibrate the estimates."""
        for rid in getattr(output, "finished_recving", None) or ():
            self._planned.pop(rid, None)
        for rid in [rid for rid, p in self._planned.items() if p.shipped and not p.until_received]:
            del self._planned[rid]  # a load in a step is done once that step's output is back
        stats = getattr(output, "kv_connector_stats", None)
        data = getattr(stats, "data", None) if stats is not None else None
        if data:
            self.calibrate(data)

    def calibrate(self, data: dict) -> None:
        c = self.cal
        c.observe_steps(data.get(M.STEPS_TIMED, 0), data.get(M.STEP_PREFILL_TOKENS, 0), data.get(M.STEP_SECONDS, 0),
                        data.get(M.STEPS_ABOVE_GRAPHS, 0))
        c.observe_loads(data.get(M.TIMED_LOADS, 0), data.get(M.LOAD_FIXED_SECONDS, 0))
        ranked = False
        for rank in range(self.world):
            b = data.get(M.labelled(M.RANK_GET_BYTES, rank), 0)
            s = data.get(M.labelled(M.RANK_GET_SECONDS, rank), 0)
            if b or s:
                ranked = True
                c.observe_gets(rank, b, s)
        if not ranked:  # workers that report no rank of their own: the summed figures for every rank
            c.observe_tier(data.get(M.L2_GET_BYTES, 0), data.get(M.L2_GET_SECONDS, 0))

    @property
    def measured_gbps(self) -> float | None:
        """The tier's bandwidth as measured (GB/s, every rank together)."""
        return self.cal.measured_gbps
