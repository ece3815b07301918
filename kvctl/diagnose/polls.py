"""A diagnosis' samples over its window (:func:`collect`) and the engine reads between them: when each engine published a new state (issue 48, item 15).

:func:`poll_until` reads every engine's ``/metrics`` every ``every_s`` until the window ends (engines only: no
Valkey INFO, no NVML) and keeps the few reads the analysis needs (:mod:`kvctl.diagnose.arrivals`): for each engine,
the first and last read of its first three states and of its last two. A read that fails is left out (the two
samples decide what is unreachable). The kept reads go into the capture between its first and last sample.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any, Callable, Sequence

from kvctl.core.engine_http import EngineHttp, masked
from kvctl.core.errors import InvalidInput, KvctlError
from kvctl.core.thresholds import DIAGNOSIS_POLL_S, READ_TIMEOUT_S
from kvctl.diagnose import arrivals, sources
from kvctl.diagnose.capture import (
    MAX_WINDOW_S, Capture, Sample, instances_per_rank_of, masked_valkey_url, nothing_answered, now_iso, take_sample,
    unique_engine_urls, wait_until, without_a_window,
)
from kvctl.tier.targets import Target

#: states kept from the start of the window and from its end (arrivals.as_of reads no other)
FIRST_STATES, LAST_STATES = 3, 2


class Kept:
    """The reads of one window that hold a state's first or last sighting at its start or end, per engine."""

    def __init__(self, first: Sample) -> None:
        self.runs: list[list[list]] = [[] for _ in first.engines]  # per engine: [first read, last read, key]
        self.count = 0
        self.add(first)

    def add(self, s: Sample) -> None:
        self.count += 1
        for i, runs in enumerate(self.runs):
            scrape = None
            try:
                scrape = s.scrape(i) if i < len(s.engines) else None
            except KvctlError:  # not Prometheus text: the samples' analysis says so
                pass
            m = arrivals.mark(scrape) if scrape is not None else None
            if m is None:
                continue
            if runs and runs[-1][2] == m.key:
                runs[-1][1] = s
                continue
            runs.append([s, s, m.key])
            if len(runs) > FIRST_STATES + LAST_STATES:
                del runs[FIRST_STATES]

    def states(self) -> list[int]:
        """States seen per engine (the first and last ones are kept)."""
        return [len(r) for r in self.runs]

    def samples(self, *skip: Sample) -> list[Sample]:
        """The kept reads in time order, ``skip`` (the window's first and last samples, in the capture already) left out."""
        seen = {id(s) for s in skip}
        out = []
        for runs in self.runs:
            for first, last, _ in runs:
                for s in (first, last):
                    if id(s) not in seen:
                        seen.add(id(s))
                        out.append(s)
        return sorted(out, key=lambda s: s.t_s)


def engine_read(engine_urls: Sequence[str], timeout_s: float, pool: concurrent.futures.Executor, http: EngineHttp | None) -> Sample:
    """Every engine's /metrics once, in parallel; a failed read is None (not an error: the samples judge reachability)."""
    def one(u: str) -> tuple[str | None, float]:
        start = time.time()
        try:
            text = sources.fetch_metrics(u, timeout_s, http)
        except KvctlError:
            text = None
        return text, (start + time.time()) / 2

    t0 = time.time()
    got = list(pool.map(one, engine_urls))
    return Sample(t0, [t for t, _ in got], [], engine_t_s=[t for _, t in got], engines_only=True)


def poll_until(first: Sample, engine_urls: Sequence[str], deadline: float, timeout_s: float, http: EngineHttp | None = None,
               tick: Callable[[float], None] | None = None, step_s: float | None = None) -> Kept:
    """Engine reads every ``step_s`` (DIAGNOSIS_POLL_S) from ``first`` until wall time ``deadline`` (none within half a
    step of it: a window under two steps has none), each read bounded by ``timeout_s`` and what is left of the window;
    ``tick(seconds)`` is told of every second spent."""
    kept = Kept(first)
    step = step_s if step_s is not None else DIAGNOSIS_POLL_S
    next_t = first.t_s + step
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(engine_urls))) as pool:
        while next_t < deadline - step / 2:
            wait_until(next_t, tick)
            start = time.time()
            kept.add(engine_read(engine_urls, max(0.05, min(timeout_s, deadline - start)), pool, http))
            if tick:
                tick(time.time() - start)
            next_t = max(next_t + step, time.time())
    wait_until(deadline, tick)
    return kept


def collect(engine_urls: Sequence[str], targets: Sequence[Target], window_s: float, parameters: dict[str, Any] | None = None,
            tick: Callable[[float], None] | None = None, timeout_s: float = READ_TIMEOUT_S, http: EngineHttp | None = None) -> Capture:
    """Two samples ``window_s`` apart, the engines read in between (:func:`poll_until`); ``tick(seconds)`` is called
    while waiting (progress). When nothing answers the first sample, the second is taken as none at once (every source
    unreachable with its reason, exit 5, and a note): no window is waited for nothing.

    Repeated engine URLs are read once (a repeat would double λ). Valkey URLs are kept with their passwords masked
    (:func:`masked_valkey_url`), engine URLs too (:func:`engine_http.masked`): a capture is printed and saved.
    """
    if not (0 < window_s <= MAX_WINDOW_S):
        raise InvalidInput(f"--window must be a number of seconds in (0, {MAX_WINDOW_S:g}], got {window_s}")
    engine_urls, _ = unique_engine_urls(engine_urls)
    first = take_sample(engine_urls, targets, timeout_s, http=http)
    if nothing_answered(first):  # every source reported at once, with its reason: no window waited for nothing
        second, said = without_a_window(first, window_s)
        return _capture(engine_urls, targets, first, Kept(first), second, parameters, [said])
    return window_capture(first, engine_urls, targets, window_s, parameters, timeout_s, http, tick)[0]


def window_capture(first: Sample, engine_urls: Sequence[str], targets: Sequence[Target], window_s: float, parameters: dict[str, Any] | None = None,
                   timeout_s: float = READ_TIMEOUT_S, http: EngineHttp | None = None, tick: Callable[[float], None] | None = None,
                   ) -> tuple[Capture, Sample]:
    """The capture of the window that starts at ``first``: the engines read in between (:func:`poll_until`) and a
    sample ``window_s`` after ``first``, which is returned too (a watch's next window starts at it)."""
    kept = poll_until(first, engine_urls, first.t_s + window_s, timeout_s, http, tick)
    last = take_sample(engine_urls, targets, timeout_s, http=http)
    kept.add(last)
    return _capture(engine_urls, targets, first, kept, last, parameters), last


def _capture(engine_urls: Sequence[str], targets: Sequence[Target], first: Sample, kept: Kept, last: Sample, parameters: dict[str, Any] | None,
             notes: list[str] | None = None) -> Capture:
    # the targets keep their passwords for connecting; the capture (shown, saved) only masked URLs
    return Capture([masked(u) for u in engine_urls], [masked_valkey_url(t.url) for t in targets], [first, *kept.samples(first, last), last],
                   dict(parameters or {}), now_iso(), instances_per_rank=instances_per_rank_of(targets), engine_states=kept.states(), notes=notes or [])
