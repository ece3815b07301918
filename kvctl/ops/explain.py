"""Why did a request miss the tier, or load slowly? The connector's trace read back (``kvctl explain``).

The engine writes the trace with ``KVCTL_CONNECTOR_TRACE=/path/trace.jsonl`` (kvctl.connector.trace): per
request the scheduler's ``lookup`` (tokens, the chunks found, the ranks that failed, tags of its first
chunk: ``key0`` its key, ``tok0`` its tokens alone), its load-or-recompute ``decision`` (tokens found and
loaded, decision and reason, predicted and measured figures), ``scheduled_load`` and ``prefill_done``; the
workers' ``load`` (per rank: chunks planned, agreed and written, where the time went, given up at its
deadline or not), ``step`` (the forward's time), ``save_queued``/``save`` (with the chunk-0 tags) and
``save_dropped`` (a save refused at ``save_queue_bytes``) and ``shutdown`` (saves abandoned).

A request's story is read from those records alone. What they can tell about a miss:

* ``instance down`` -- a rank's instance erred or did not answer the lookup;
* ``policy`` -- the tier had the chunks and the decision recomputed them (its reason: tier queue,
  bandwidth below break-even, the hit below n*) or loaded a shorter prefix;
* ``deadline`` -- an async load passed its recompute time and the rest was recomputed;
* ``load came up short`` -- fewer chunks agreed than found (a chunk gone between lookup and load, an
  instance that erred during the load);
* ``evicted`` -- an earlier request's save of the same first chunk was written, and the lookup did not find it;
* ``save lost at shutdown`` -- it was queued, never written, and the engine's shutdown abandoned saves;
* ``save dropped`` -- its save was refused: the saves waiting for the tier already held ``save_queue_bytes``
  (the tier is slower than the engine's saves);
* ``save failed`` -- its write erred; ``save not written yet`` -- still queued when looked up;
* ``key format or salt mismatch`` -- the same tokens were saved under another key (another cache_salt,
  LoRA adapter, model name, KV format or layer grouping);
* ``never saved`` -- no earlier request in the trace stored this prompt's first chunk;
* ``prompt shorter than a chunk`` -- nothing loadable (the last prompt token is always computed);
* ``not looked up`` -- no lookup of it in the trace (vLLM's own prefix cache held it, or the trace began later).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvctl.core.errors import InvalidInput
from kvctl.records.connector_trace import read_events

__all__ = ["CAUSES", "Explanation", "RequestStory", "explain"]

LOADED, PARTLY = "loaded", "partly in the tier"
INSTANCE_DOWN, POLICY, DEADLINE, LOAD_SHORT = "instance down", "policy", "deadline", "load came up short"
EVICTED, SAVE_LOST, SAVE_FAILED, SAVE_PENDING = "evicted", "save lost at shutdown", "save failed", "save not written yet"
SAVE_DROPPED = "save dropped"
KEY_MISMATCH, NEVER_SAVED = "key format or salt mismatch", "never saved"
SHORT_PROMPT, NOT_LOOKED_UP = "prompt shorter than a chunk", "not looked up"
#: every answer, in the order the summary lists them
CAUSES = (LOADED, PARTLY, POLICY, DEADLINE, LOAD_SHORT, INSTANCE_DOWN, EVICTED, SAVE_LOST, SAVE_DROPPED, SAVE_FAILED,
          SAVE_PENDING, KEY_MISMATCH, NEVER_SAVED, SHORT_PROMPT, NOT_LOOKED_UP)
_PHASE_TEXT = {"lookup_s": "the lookup", "queued_s": "the queue of loads ahead", "get_s": "GETs",
               "copy_tail_s": "copies after the last GET", "exchange_s": "the exchange between ranks",
               "insert_s": "the insert into the cache"}
#: a load is slow when it took this many times its prediction
SLOW_FACTOR = 1.5
_REASON_TEXT = {
    "tier_queue": "the tier's queue ahead of it made loading slower than recomputing",
    "below_breakeven": "the measured bandwidth is below break-even: no hit length loads faster than it recomputes",
    "below_n_star": "the hit is shorter than n*: the fixed cost T0 outweighs what loading saves",
}


@dataclass(frozen=True)
class RequestStory:
    """One request as the trace tells it (tokens, seconds; None: not in the trace)."""

    req: str
    prompt_tokens: int | None
    found_tokens: int
    loaded_tokens: int
    decision: str | None
    reason: str | None
    cause: str
    detail: str
    predicted_load_s: float | None = None
    predicted_recompute_s: float | None = None
    # how long it waited in vLLM's line before it was asked (async: credited to recomputing it, connector/policy.py)
    line_wait_s: float | None = None
    budget_s: float | None = None
    actual_load_s: float | None = None
    slow: bool = False
    phases: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Explanation:
    """What ``kvctl explain`` found in a trace: every request's story (or the one asked for), causes counted."""

    trace: str
    events: int
    malformed_lines: int
    requests: list[RequestStory]
    causes: dict[str, int]
    request: str | None = None


def _num(e: dict | None, key: str) -> float | None:
    v = (e or {}).get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _int(e: dict | None, key: str, default: int = 0) -> int:
    v = _num(e, key)
    return int(v) if v is not None else default


class _Index:
    """The trace's events by request, and the saves by their first chunk's tags."""

    def __init__(self, events: list[dict]) -> None:
        self.by_req: dict[str, list[dict]] = {}
        self.saves_queued: list[dict] = []
        self.saves_dropped: list[dict] = []
        self.saves: list[dict] = []
        self.shutdowns: list[dict] = []
        self.steps: list[dict] = []
        for e in events:
            rid = e.get("req")
            if isinstance(rid, str):
                self.by_req.setdefault(rid, []).append(e)
            kind = e["ev"]
            if kind == "save_queued":
                self.saves_queued.append(e)
            elif kind == "save_dropped":
                self.saves_dropped.append(e)
            elif kind == "save" and e.get("key0"):
                self.saves.append(e)
            elif kind == "shutdown":
                self.shutdowns.append(e)
            elif kind == "step":
                self.steps.append(e)

    def miss_cause(self, lookup: dict) -> tuple[str, str]:
        """Why the lookup found nothing: the saves of its first chunk before it."""
        t, key0, tok0 = lookup["t"], lookup.get("key0"), lookup.get("tok0")
        if not key0:
            return NEVER_SAVED, "the trace has no tag of its first chunk (a trace from an older connector)"
        queued = [s for s in self.saves_queued if s.get("key0") == key0 and s["t"] < t]
        if queued:
            q = queued[-1]
            dropped = [d for d in self.saves_dropped if d.get("req") == q.get("req") and q["t"] <= d["t"] < t]
            if dropped:
                return SAVE_DROPPED, (f"request {q.get('req')}'s save was dropped: the saves waiting for the tier held "
                                      f"{_int(dropped[-1], 'pending_bytes')} bytes (save_queue_bytes; the tier is slower "
                                      "than the engine's saves, kvctl:saves_dropped_total)")
            done = [s for s in self.saves if s.get("key0") == key0 and q["t"] <= s["t"] < t]
            if any(not s.get("error") for s in done):
                return EVICTED, (f"request {q.get('req')} saved its first chunk {t - q['t']:.3g} s before this lookup, "
                                 "and the tier no longer held it (evicted: maxmemory, or deleted)")
            if done:
                return SAVE_FAILED, f"request {q.get('req')}'s save of it failed: {done[-1].get('error')}"
            lost = [s for s in self.shutdowns if s.get("pid") == q.get("pid") and s["t"] >= q["t"]
                    and _int(s, "abandoned") > 0]
            if lost:
                return SAVE_LOST, (f"request {q.get('req')}'s save was queued, never written, and the engine's shutdown "
                                   f"abandoned {_int(lost[0], 'abandoned')} save(s) (save_drain_s, --shutdown-timeout)")
            return SAVE_PENDING, f"request {q.get('req')}'s save of it was still queued or running at this lookup"
        other = [s for s in self.saves_queued if s.get("tok0") == tok0 and s.get("key0") != key0 and s["t"] < t]
        if other:
            return KEY_MISMATCH, (f"request {other[-1].get('req')} saved the same first-chunk tokens under another key: "
                                  "another cache_salt, LoRA adapter, model name, KV format or layer grouping")
        return NEVER_SAVED, "no earlier request in this trace stored this prompt's first chunk"

    def step_after(self, t: float, step: int | None) -> dict | None:
        """The worker's record of scheduler step ``step`` (the first one at or after ``t``)."""
        if step is None:
            return None
        return next((s for s in self.steps if _int(s, "step", -1) == step and s["t"] >= t - 1.0), None)


def _story(rid: str, evs: list[dict], idx: _Index) -> RequestStory:
    lookups = [e for e in evs if e["ev"] == "lookup"]
    decisions = [e for e in evs if e["ev"] == "decision"]
    loads = [e for e in evs if e["ev"] == "load"]
    done = next((e for e in evs if e["ev"] == "prefill_done"), None)
    dec = decisions[-1] if decisions else None
    look = lookups[-1] if lookups else None
    ct = _int(look, "chunk_tokens") or _int(loads[-1] if loads else None, "chunk_tokens")
    tokens = _int(look, "tokens") or _int(done, "tokens") or None
    phases: dict[str, float] = {}
    if lookups:
        phases["lookup_s"] = sum(_num(e, "s") or 0.0 for e in lookups)
    load = min(loads, key=lambda e: _int(e, "written")) if loads else None
    for key in ("queued_s", "get_s", "copy_tail_s", "exchange_s", "insert_s"):
        if _num(load, key) is not None:
            phases[key] = _num(load, key)
    step = idx.step_after(done["t"], _int(done, "step", -1)) if done else None
    if step is not None:
        phases["step_s"] = _num(step, "s") or 0.0
    found = _int(dec, "found") if dec else 0
    if not dec and look is not None and ct:
        found = max(0, (_int(look, "hit_chunks") - _int(look, "first_chunk")) * ct)
    loaded = _int(dec, "tokens") if dec else 0
    if load is not None and ct:
        loaded = max(0, loaded - (_int(load, "planned") - _int(load, "written")) * ct)
    actual = None
    if load is not None and _num(load, "total_s") is not None:
        actual = (_num(load, "total_s") or 0.0) + (_num(load, "queued_s") or 0.0)
    predicted = _num(dec, "predicted_load_s")
    slow = bool(actual is not None and predicted and actual > SLOW_FACTOR * predicted)
    common = dict(req=rid, prompt_tokens=tokens, found_tokens=found, loaded_tokens=loaded,
                  decision=(dec or {}).get("decision"), reason=(dec or {}).get("reason"),
                  predicted_load_s=predicted, predicted_recompute_s=_num(dec, "predicted_recompute_s"),
                  budget_s=_num(dec, "budget_s"), actual_load_s=actual, slow=slow, phases=phases,
                  line_wait_s=_num(dec, "line_wait_s"))
    cause, detail = _cause(look, dec, load, found, loaded, ct, idx)
    if slow and cause in (LOADED, PARTLY):
        biggest = max((k for k in phases if k != "step_s"), key=lambda k: phases[k], default=None)
        detail += (f"; slow: {actual:.3g} s against {predicted:.3g} s predicted, most of it in {_PHASE_TEXT.get(biggest, biggest)}"
                   if biggest else "")
    return RequestStory(cause=cause, detail=detail, **common)


def _cause(look: dict | None, dec: dict | None, load: dict | None, found: int, loaded: int, ct: int,
           idx: _Index) -> tuple[str, str]:
    if look is None:
        return NOT_LOOKED_UP, "the trace has no lookup of it (vLLM's own prefix cache held it, or the trace began later)"
    failed = look.get("failed") or []
    if failed:
        return INSTANCE_DOWN, f"rank(s) {', '.join(map(str, failed))} erred or did not answer the lookup: recomputed"
    tokens = _int(look, "tokens")
    if ct and max(0, tokens - 1) // ct == 0:
        return SHORT_PROMPT, f"{tokens} tokens: no whole chunk of {ct} before the last token, which is always computed"
    if found <= 0:
        return idx.miss_cause(look)
    decision, reason = (dec or {}).get("decision"), (dec or {}).get("reason")
    if decision == "recompute":
        return POLICY, f"found {found} tokens and recomputed them: {_REASON_TEXT.get(reason, reason)}"
    if load is not None and load.get("given_up"):
        return DEADLINE, (f"the load passed its deadline ({_num(load, 'budget_s') or 0:.3g} s, the predicted recompute "
                          f"time) after {_int(load, 'written')} of {_int(load, 'planned')} chunks: the rest was recomputed")
    if load is not None and _int(load, "written") < _int(load, "planned"):
        return LOAD_SHORT, (f"{_int(load, 'written')} of {_int(load, 'planned')} chunks agreed: a chunk went between lookup "
                            "and load, or an instance erred during it; the rest was recomputed")
    if decision == "partial" and reason == "probe":
        return POLICY, (f"loaded {loaded} of {found} tokens found, a re-probe after a veto: a short prefix whose GETs "
                        "measure the tier again; the rest was recomputed")
    if decision == "partial":
        return POLICY, (f"loaded {loaded} of {found} tokens found, the longest prefix predicted to win: "
                        f"{_REASON_TEXT.get(reason, reason)}")
    loadable = (max(0, tokens - 1) // ct - _int(look, "first_chunk")) * ct if ct else found
    if loadable > found:
        return PARTLY, f"loaded {loaded} tokens; the tier held {found} of {loadable} loadable tokens"
    why = {"no_data": "nothing measured yet", "probe": "a re-probe after a veto", "off": "the policy is off"}.get(reason, "")
    return LOADED, f"loaded {loaded} tokens" + (f" ({why})" if why else "")


def explain(path: str | Path, request: str | None = None) -> Explanation:
    """Read the connector trace at ``path``; every request's story, or the one whose id is (or contains) ``request``."""
    events, malformed = read_events(str(path))
    idx = _Index(events)
    rids = list(idx.by_req)
    if request is not None:
        chosen = [request] if request in idx.by_req else [r for r in rids if request in r]
        if not chosen:
            raise InvalidInput(f"{path}: no request {request!r} in the trace ({len(rids)} request(s) in it)")
        if len(chosen) > 1:
            raise InvalidInput(f"{path}: {len(chosen)} requests match {request!r} (e.g. {', '.join(chosen[:3])}): "
                               "give the whole id")
        rids = chosen
    stories = [_story(rid, idx.by_req[rid], idx) for rid in rids]
    counts = {c: 0 for c in CAUSES}
    for s in stories:
        counts[s.cause] += 1
    return Explanation(str(path), len(events), malformed, stories, counts, request)
