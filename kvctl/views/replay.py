"""``kvctl replay``: the dry run's schedule, and a run's summary."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvctl.core import render

if TYPE_CHECKING:
    from kvctl.replay.sender import ReplayResult
    from kvctl.records.trace import Trace, TraceRequest

#: rows of the schedule a dry run shows (its JSON has them all)
DRY_RUN_ROWS = 50


def show_schedule(tr: Trace, plan: list[tuple[TraceRequest, float]], max_tokens: int | None, as_json: bool) -> None:
    """``--dry-run``: when each request would go out, its prompt and output tokens (``max_tokens`` None: the trace's)."""
    rows = [
        {"index": r.index, "scheduled_s": round(at, 6), "prompt_tokens": r.token_count,
         "hash_ids": len(r.hash_ids) if r.hash_ids is not None else None,
         "max_tokens": max_tokens if max_tokens is not None else (r.max_tokens or 1), "line": r.line}
        for r, at in plan
    ]
    if as_json:
        render.emit_json({"trace": tr.path, "format": tr.format, "requests": len(rows), "schedule": rows})
        return
    span = plan[-1][1] if plan else 0.0
    render.literal(f"Schedule of {tr.path} ({tr.format}, {len(rows)} requests)")  # a path is never wrapped inside
    render.table(
        None,
        ["#", "scheduled s", "prompt tokens", "hash ids", "max tokens", "line"],
        [(r["index"], r["scheduled_s"], r["prompt_tokens"], r["hash_ids"], r["max_tokens"], r["line"]) for r in rows[:DRY_RUN_ROWS]],
        caption=(f"first {DRY_RUN_ROWS} of {len(rows)} · " if len(rows) > DRY_RUN_ROWS else "")
        + f"span {span:.3f} s · mean rate {len(rows) / span if span > 0 else float('nan'):.3f} req/s",
    )


def show_replay(tr: Trace, res: ReplayResult, as_json: bool) -> None:
    """A run's summary: requests, outcomes, the most in flight, and where the run file is (or why it stopped)."""
    if as_json:
        render.emit_json(res)
    else:
        # paths on a line of their own, never wrapped: a table title wrapped them mid-path (issue 48)
        render.literal(f"Replay of {tr.path}\n        → {res.out}")
        render.key_values(
            None,
            [("model", res.model), ("requests", res.requests), ("finished", res.finished), ("ok", res.ok),
             ("errors", res.errors), ("max in flight", res.max_in_flight), ("capped sends", res.cap_hits),
             ("duration (s)", res.duration_s), ("prompts from", res.token_pool or "the trace's text")],
        )
        render.literal(f"interrupted by {res.signal or 'a stop'}: the run file holds the requests that finished"
                       f" and the {res.unfinished} still open" if res.interrupted else f"kvctl report {res.out}")
