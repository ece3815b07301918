"""The offered arrival rate λ from the states an engine publishes (issue 48, item 15).

vLLM (0.32) publishes its counters and gauges once per engine step, at the step's end, and what they count is the
scheduler's state as the step began: a request that arrives during a step waits in the engine core's input queue,
outside ``vllm:num_requests_waiting``/``_running``, until the step ends. With a synchronous KV load a step lasts
seconds (the H200 run R2 of 2026-12-02: 3.5 to 10 s), so the finished + waiting + running seen at a sample lag the
arrivals by one step: finished + the growth of waiting and running between two samples missed the ~19 requests in
the input queue, and λ read 2.11 req/s where 2.64 arrived (paper_gpu R2's run file: its published state at 30.22 s,
21 finished + 46 waiting and running = 67, is exactly the 67 requests sent by 26.67 s, when that step began).

So ``kvctl diagnose`` reads each engine between its two samples too (:mod:`kvctl.diagnose.polls`). A run of samples
that show the same step marks (:data:`MARKS`) is one published :class:`State`; its ``arrivals`` (finished, every
reason, + waiting + running) held

* as the step that produced it began, i.e. when the state before it was published, first seen at that state's
  ``first_s`` (a busy state, waiting + running > 0);
* until its last sighting (an idle state: nothing was admitted since, or the counters would have moved).

λ = Δarrivals between the first and the last state whose time is known, over the time between them. With one or two
states (an idle engine, two samples only) there is no such pair and λ is finished + queue growth over the samples,
as before. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvctl.connector import metric_names as N
from kvctl.core.thresholds import DIAGNOSIS_STATES_MIN_SPAN
from kvctl.records import prometheus as M

#: what moves at every published step: a new value of any is a new state (the iteration histogram counts steps)
MARKS = (N.VLLM_REQUEST_SUCCESS, N.VLLM_NUM_REQUESTS_WAITING, N.VLLM_NUM_REQUESTS_RUNNING, N.VLLM_ITERATION_TOKENS,
         N.VLLM_GENERATION_TOKENS, N.VLLM_PROMPT_TOKENS, N.VLLM_PREFIX_CACHE_QUERIES, N.VLLM_EXTERNAL_PREFIX_CACHE_HITS)
BASIS_STATES = "engine states, each as of its step's start"
BASIS_QUEUE = "finished + waiting and running growth at the sample times"


@dataclass(frozen=True)
class Mark:
    """What one scrape says of an engine's published state."""

    key: tuple[float | None, ...]  # the MARKS' values: equal keys, one state
    arrivals: float  # finished (every reason) + waiting + running
    busy: bool  # waiting + running > 0


def mark(s: M.Scrape) -> Mark | None:
    """The state a scrape shows; None without a finished-request count."""
    finished = s.counter(N.VLLM_REQUEST_SUCCESS)
    if finished is None:
        finished = s.hist_count(N.VLLM_REQUEST_PROMPT_TOKENS)
    if finished is None:
        return None
    queue = (s.gauge(N.VLLM_NUM_REQUESTS_WAITING) or 0.0) + (s.gauge(N.VLLM_NUM_REQUESTS_RUNNING) or 0.0)
    key = (finished, s.gauge(N.VLLM_NUM_REQUESTS_WAITING), s.gauge(N.VLLM_NUM_REQUESTS_RUNNING), s.hist_count(N.VLLM_ITERATION_TOKENS),
           *(s.counter(n) for n in MARKS[4:]))
    return Mark(key, finished + queue, queue > 0)


@dataclass(frozen=True)
class State:
    """One published state: the samples that showed it, from the first to the last."""

    first_s: float
    last_s: float
    arrivals: float
    busy: bool


def states(marks: Sequence[tuple[float, Mark | None]]) -> list[State]:
    """Runs of equal marks, in time order (samples without a mark are skipped)."""
    out: list[State] = []
    key = None
    for t, m in marks:
        if m is None:
            continue
        if out and m.key == key:
            last = out[-1]
            out[-1] = State(last.first_s, t, last.arrivals, last.busy)
        else:
            out.append(State(t, t, m.arrivals, m.busy))
            key = m.key
    return out


def as_of(seq: Sequence[State], k: int) -> float | None:
    """When state k's arrivals held: its last sighting when idle; when busy, the first sighting of the state before it
    (the publish that began its step), known only from the second change on (the first state's publish is unseen)."""
    s = seq[k]
    if not s.busy:
        return s.last_s
    return seq[k - 1].first_s if k >= 2 else None


@dataclass(frozen=True)
class StatesRate:
    rate_per_s: float
    arrivals: float  # counted between the two states
    start_s: float
    end_s: float
    states: int  # states seen in the window


def states_rate(seq: Sequence[State], window_s: float) -> StatesRate | None:
    """λ between the first and the last state whose time is known; None with fewer than 3 states, a span under
    DIAGNOSIS_STATES_MIN_SPAN of the window, or counters that went backwards (a restart)."""
    if len(seq) < 3:
        return None
    known = [(k, t) for k in range(len(seq)) if (t := as_of(seq, k)) is not None]
    if len(known) < 2:
        return None
    (k0, t0), (k1, t1) = known[0], known[-1]
    n = seq[k1].arrivals - seq[k0].arrivals
    if t1 - t0 < DIAGNOSIS_STATES_MIN_SPAN * window_s or t1 <= t0 or n < 0:
        return None
    return StatesRate(n / (t1 - t0), n, t0, t1, len(seq))
