"""One diagnosis of a live tier, once (``kvctl diagnose``) or every window (``--watch``): sample the window, analyse
it, save it as the last diagnosis (``kvctl loading sync`` reads it). The sequence is written once, here (issue 49
item 4): :func:`diagnosed` analyses a window's capture and saves the result; :func:`once` and :func:`watch` differ
only in how many windows they sample.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from kvctl.core.engine_http import EngineHttp
from kvctl.core.thresholds import READ_TIMEOUT_S
from kvctl.diagnose import capture as cap
from kvctl.diagnose import polls
from kvctl.diagnose.analysis import Diagnosis, Params, analyse
from kvctl.diagnose.jsonform import diagnosis_json
from kvctl.tier.targets import Target


def recorded(params: Params) -> dict[str, Any]:
    """The model inputs the user gave (s, R, T0, B), as a capture records them."""
    given = {"bytes_per_token": params.bytes_per_token, "prefill_rate": params.prefill_rate, "t0_s": params.t0_s,
             "bandwidth_gbps": params.bandwidth_gbps}
    return {k: v for k, v in given.items() if v is not None}


def diagnosed(capture: cap.Capture, params: Params) -> Diagnosis:
    """The diagnosis of a live window's ``capture``, saved as the last diagnosis (of its tier)."""
    diag = analyse(capture, params)
    cap.save_last_diagnosis({"saved_at": cap.now_iso(), **diagnosis_json(diag)})
    return diag


def once(engine_urls: Sequence[str], targets: Sequence[Target], window_s: float, params: Params, timeout_s: float = READ_TIMEOUT_S,
         http: EngineHttp | None = None, tick: Callable[[float], None] | None = None, save_dir: str | Path | None = None) -> Diagnosis:
    """Two samples ``window_s`` apart (:func:`kvctl.diagnose.polls.collect`: at once when nothing answers the first),
    the capture saved to ``save_dir`` when given, its diagnosis saved as the last one."""
    capture = polls.collect(engine_urls, targets, window_s, recorded(params), tick=tick, timeout_s=timeout_s, http=http)
    if save_dir:
        cap.save_capture(capture, save_dir)
    return diagnosed(capture, params)


def watch(engine_urls: Sequence[str], targets: Sequence[Target], window_s: float, params: Params, timeout_s: float = READ_TIMEOUT_S,
          count: int | None = None, http: EngineHttp | None = None) -> Iterator[Diagnosis]:
    """One sample now (before this returns: nothing answering it is refused at once), then one every ``window_s``: the
    diagnosis of each new sample against the one before (``count`` of them, or until the caller stops), each saved as
    the last diagnosis."""
    first = cap.take_sample(engine_urls, targets, timeout_s, http=http)
    cap.refuse_when_nothing_answered(first, engine_urls, targets, window_s)
    return _refreshes(first, engine_urls, targets, window_s, params, timeout_s, count, http)


def _refreshes(prev: cap.Sample, engine_urls: Sequence[str], targets: Sequence[Target], window_s: float, params: Params, timeout_s: float,
               count: int | None, http: EngineHttp | None) -> Iterator[Diagnosis]:
    for i in itertools.count():
        if count is not None and i >= count:
            return
        capture, prev = polls.window_capture(prev, engine_urls, targets, window_s, recorded(params), timeout_s, http)
        yield diagnosed(capture, params)
