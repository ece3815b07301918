"""``kvctl report``: replay runs side by side (the paper's Table 2 columns), and their plots."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvctl.core import render

if TYPE_CHECKING:
    from kvctl.replay.runfile import Run
    from kvctl.ops.report import RunSummary


def _thirds(values: list[float | None]) -> str:
    return " / ".join(render.fmt(v) for v in values)


def show_runs(loaded: list[Run], sums: list[RunSummary], hit_tokens: int, plot_dir: str | None, as_json: bool) -> None:
    """Each run's warnings, the plots into ``plot_dir``, then the table (or the JSON) of the runs."""
    from kvctl.ops.report import series  # noqa: PLC0415 - numpy only when used

    if not as_json:
        for r in loaded:
            for w in r.warnings:
                render.warn(f"{r.path}: {w}")
    paths = []
    if plot_dir:
        paths = render.report_plots(plot_dir, [(s.name, *series(r), s.cached_token_share, s.l2_token_share) for s, r in zip(sums, loaded)])
    if as_json:
        keys = ("name", "requests", "errors", "p50_s", "p90_s", "p99_s", "max_s", "mean_s", "thirds_p50_s", "hit_rate",
                "cached_token_share", "l2_token_share", "max_in_flight", "capped", "interrupted", "unfinished", "warnings", "by_class")
        data: dict = {"runs": [{k: getattr(s, k) for k in keys} for s in sums]}
        if paths:
            data["plots"] = paths
        render.emit_json(data)
        return
    render.table(
        "Replay runs",
        ["run", "requests", "errors", "p50 s", "p90 s", "p99 s", "max s", "p50 by third (s)", "hit rate", "cached", "from L2", "max in flight"],
        [
            (s.name + (" (interrupted)" if s.interrupted else ""), s.requests, s.errors, s.p50_s, s.p90_s, s.p99_s, s.max_s,
             _thirds(s.thirds_p50_s), s.hit_rate, s.cached_token_share, s.l2_token_share, s.max_in_flight)
            for s in sums
        ],
        caption=f"hit: cached_tokens ≥ {hit_tokens}; percentiles by linear interpolation over ok requests"
        + "".join(f"\n{s.name}: {render.by_class_line(s.by_class)}" for s in sums if s.by_class)
        + "".join(f"\n{s.name}: {s.capped} sends delayed by --max-in-flight (not fully open loop)" for s in sums if s.capped)
        + (f"\nplots: {', '.join(paths)}" if paths else ""),
    )
