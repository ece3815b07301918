"""``kvctl diagnose --watch``: a diagnosis every window, each of the last two samples, saved as the last diagnosis."""

from __future__ import annotations

import itertools
from typing import Any, Iterator, Sequence

from kvctl.diagnose import capture as cap
from kvctl.diagnose.polls import poll_until
from kvctl.diagnose.analysis import Diagnosis, Params, analyse
from kvctl.diagnose.jsonform import diagnosis_json
from kvctl.core.engine_http import EngineHttp, masked
from kvctl.tier.targets import Target


def watch(engine_urls: Sequence[str], targets: Sequence[Target], window_s: float, parameters: dict[str, Any], params: Params,
          timeout_s: float, count: int | None = None, http: EngineHttp | None = None) -> Iterator[Diagnosis]:
    """One sample now (before this returns), then one every ``window_s``: the diagnosis of each new sample against the
    one before (``count`` of them, or until the caller stops), each saved as the last diagnosis (``kvctl loading sync``
    reads it)."""
    first = cap.take_sample(engine_urls, targets, timeout_s, http=http)
    cap.refuse_when_nothing_answered(first, engine_urls, targets, window_s)
    return _refreshes(first, engine_urls, targets, window_s, parameters, params, timeout_s, count, http)


def _refreshes(prev: cap.Sample, engine_urls: Sequence[str], targets: Sequence[Target], window_s: float, parameters: dict[str, Any],
               params: Params, timeout_s: float, count: int | None, http: EngineHttp | None) -> Iterator[Diagnosis]:
    shown = [cap.masked_valkey_url(t.url) for t in targets]  # shown and saved: no password
    for i in itertools.count():
        if count is not None and i >= count:
            return
        kept = poll_until(prev, engine_urls, prev.t_s + window_s, timeout_s, http)  # the engines read in between
        new = cap.take_sample(engine_urls, targets, timeout_s, http=http)
        kept.add(new)
        diag = analyse(cap.Capture([masked(u) for u in engine_urls], shown, [prev, *kept.samples(prev, new), new], parameters, cap.now_iso(),
                                   instances_per_rank=cap.instances_per_rank_of(targets), engine_states=kept.states()), params)
        cap.save_last_diagnosis({"saved_at": cap.now_iso(), **diagnosis_json(diag)})
        yield diag
        prev = new
