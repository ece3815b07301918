"""``kvctl explain``: each request's story from the connector's trace, and the causes counted."""

from __future__ import annotations

from kvctl.core import render
from kvctl.ops.explain import Explanation, RequestStory

#: where a request's time went, as the phases read
PHASES = {"lookup_s": "lookup", "queued_s": "queued behind other loads", "get_s": "GETs",
          "copy_tail_s": "copies after the last GET", "exchange_s": "exchange between ranks",
          "insert_s": "insert into the cache", "step_s": "the step that computed the rest"}


def _s(value: float | None) -> str:
    return "" if value is None else f"{value:.3g}"


def _one(story: RequestStory) -> None:
    pairs = [("request", story.req), ("prompt tokens", story.prompt_tokens), ("found in the tier", story.found_tokens),
             ("loaded", story.loaded_tokens), ("decision", f"{story.decision or '-'} ({story.reason or '-'})"),
             ("predicted load (s)", _s(story.predicted_load_s)), ("predicted recompute (s)", _s(story.predicted_recompute_s)),
             ("budget (s)", _s(story.budget_s)), ("actual load (s)", _s(story.actual_load_s))]
    pairs += [(f"time: {PHASES.get(k, k)} (s)", _s(v)) for k, v in story.phases.items()]
    pairs += [("answer", story.cause), ("why", story.detail)]
    render.key_values(f"Request {story.req}", pairs)


def show_explanation(ex: Explanation, as_json: bool) -> None:
    """One request in full (``--request``), or every request in a table and the causes counted."""
    if as_json:
        render.emit_json(ex)
        return
    if ex.request is not None:
        for story in ex.requests:
            _one(story)
    else:
        render.table(f"Requests in {ex.trace}", ["request", "tokens", "found", "loaded", "decision", "reason", "answer"],
                     [(s.req, s.prompt_tokens, s.found_tokens, s.loaded_tokens, s.decision or "", s.reason or "",
                       s.cause + (" (slow)" if s.slow else "")) for s in ex.requests])
        render.table("Why requests missed or loaded", ["answer", "requests"], list(ex.causes.items()),
                     caption="kvctl explain TRACE --request ID: one request's story, where its time went")
    if ex.malformed_lines:
        render.warn(f"{ex.malformed_lines} line(s) of the trace were not JSON (skipped: a torn last line, or not a trace)")
