"""``kvctl report``: replay runs side by side (the paper's Table 2 columns), what became of every request, and plots."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvctl.core import render

if TYPE_CHECKING:
    from kvctl.records.runfile import Run
    from kvctl.records.summary import RunSummary

#: Each outcome's column in the outcomes table (keys: :data:`kvctl.records.summary.OUTCOMES`, in that order).
OUTCOME_COLUMNS = {"hit": "hits", "miss": "misses", "ok_no_usage": "no usage", "http_error": "HTTP errors", "timeout": "timeouts",
                   "error": "other errors", "interrupted": "interrupted"}
JSON_KEYS = ("name", "trace_requests", "not_sent", "requests", "outcomes", "ok", "errors", "p50_s", "p90_s", "p99_s", "max_s", "mean_s",
             "thirds_p50_s", "hit_rate", "cached_token_share", "l2_token_share", "l2_token_share_max", "l2_token_share_source",
             "max_in_flight", "capped", "interrupted", "signal", "duration_s", "unfinished", "open_rows", "warnings", "by_class")


def _thirds(values: list[float | None]) -> str:
    return " / ".join(render.fmt(v) for v in values)


def _l2_cell(s: RunSummary) -> str | float | None:
    """The share from L2, or "≤ x" when only an upper bound is known (``—`` when neither)."""
    if s.l2_token_share is None and s.l2_token_share_max is not None:
        return f"≤ {render.fmt(s.l2_token_share_max)}"
    return s.l2_token_share


def _stop_line(s: RunSummary) -> str | None:
    """What a stopped run's rows hold: when it stopped, how many were open then, how many were never sent."""
    if not s.interrupted:
        return None
    at = f" at {s.duration_s:.1f} s" if s.duration_s is not None else ""
    unsent = f"{s.not_sent:,} of the trace's {s.trace_requests:,} have no row" if s.trace_requests is not None else "the requests with no row"
    if not s.open_rows:
        how = "has no summary line (stopped hard)" if s.signal is None and s.duration_s is None else f"stopped{at}"
        return f"{s.name}: {how}; it has no rows for the requests open then: not sent ({unsent}) counts them too"
    return (f"{s.name}: stopped by {s.signal or 'a stop signal'}{at}: {s.outcomes.get('interrupted', 0):,} request(s) open then "
            f"(interrupted, no answer); {unsent} (not sent: due after the stop)")


def show_runs(loaded: list[Run], sums: list[RunSummary], hit_tokens: int, plot_dir: str | None, as_json: bool) -> None:
    """Each run's warnings, the plots into ``plot_dir``, then the outcomes and the latency tables (or the JSON) of the runs."""
    from kvctl.records.summary import OUTCOMES, series  # noqa: PLC0415 - numpy only when used

    if not as_json:
        for r in loaded:
            for w in r.warnings:
                render.warn(f"{r.path}: {w}")
    paths = []
    if plot_dir:
        paths = render.report_plots(plot_dir, [(s.name, *series(r), s.cached_token_share, s.l2_token_share) for s, r in zip(sums, loaded)])
        render.plots_written(paths)
    if as_json:
        data: dict = {"runs": [{k: getattr(s, k) for k in JSON_KEYS} for s in sums]}
        if paths:
            data["plots"] = paths
        render.emit_json(data)
        return
    name = [s.name + (" (interrupted)" if s.interrupted else "") for s in sums]
    render.table(
        "Replay runs: what became of each request",
        ["run", "trace", "not sent", "sent", *(OUTCOME_COLUMNS[o] for o in OUTCOMES)],
        [(s.name, s.trace_requests, s.not_sent if s.trace_requests is not None else None, s.requests, *(s.outcomes[o] for o in OUTCOMES))
         for s in sums],
        caption=f"sent (a row each) = {' + '.join(OUTCOME_COLUMNS[o] for o in OUTCOMES)}; trace = sent + not sent"
        + f"\nhit: cached_tokens ≥ {hit_tokens}; no usage: ok, without cached_tokens; interrupted: open when a stop signal ended the run"
        + "".join(f"\n{line}" for line in map(_stop_line, sums) if line),
    )
    render.table(
        "Replay runs: latency and cache",
        ["run", "ok", "p50 s", "p90 s", "p99 s", "max s", "p50 by third (s)", "hit rate", "cached", "from L2", "max in flight"],
        [
            (n, s.ok, s.p50_s, s.p90_s, s.p99_s, s.max_s, _thirds(s.thirds_p50_s), s.hit_rate, s.cached_token_share, _l2_cell(s), s.max_in_flight)
            for n, s in zip(name, sums)
        ],
        caption="percentiles by linear interpolation over the ok requests; hit rate and cached over those that report cached_tokens"
        + "".join(f"\n{s.name}: {render.by_class_line(s.by_class)}" for s in sums if s.by_class)
        + "".join(f"\n{s.name}: {s.capped} sends delayed by --max-in-flight (not fully open loop)" for s in sums if s.capped)
        + "".join(f"\n{s.name}: from L2 {render.fmt(_l2_cell(s))}: {s.l2_token_share_source}" for s in sums),
    )
