"""``kvctl report``: runs side by side, with the paper's Table 2 columns."""

from __future__ import annotations

import click

from kvctl import render
from kvctl.commands.options import BYTES_PER_TOKEN, count, output_options
from kvctl.hooks import hookimpl



@hookimpl
def register_commands(cli: click.Group) -> None:
    cli.add_command(report_cmd)


def _thirds(values: list[float | None]) -> str:
    return " / ".join(render.fmt(v) for v in values)


@click.command("report")
@click.argument("runs", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--hit-tokens", type=count(10**9), default=1, show_default=True, help="A request is a hit when cached_tokens ≥ this.")
@click.option("--bytes-per-token", type=BYTES_PER_TOKEN, help="KV bytes per token of the whole model (all ranks, `kvctl cost kv-size`), to turn LMCache's remote read bytes into L2 tokens.")
@click.option("--plot", "plot_dir", type=click.Path(file_okay=False), help="Write latency-over-time, latency-CDF and cache-share PNGs into DIR.")
@output_options
def report_cmd(runs: tuple[str, ...], hit_tokens: int, bytes_per_token: float | None, plot_dir: str | None, as_json: bool) -> None:
    """Compare replay runs (kvctl replay --out files): latency percentiles, drift, hits, L2 share.

    \b
    Columns (paper Table 2): p50 / p90 / p99 / max latency (linear-interpolation
    percentiles over the requests that finished ok), p50 of each third of the run in
    scheduled order (a queue that grows shows as rising thirds), hit rate
    (cached_tokens ≥ --hit-tokens), share of prompt tokens from L2 (engine counters
    before/after the run) and the most requests in flight at once.
    """
    from kvctl.report import load_runs, series, summarize_run  # noqa: PLC0415

    loaded = load_runs(runs)
    sums = [summarize_run(r, hit_tokens=hit_tokens, bytes_per_token=bytes_per_token) for r in loaded]
    if not as_json:
        for r in loaded:
            for w in r.warnings:
                render.warn(f"{r.path}: {w}")
    paths = []
    if plot_dir:
        paths = render.report_plots(plot_dir, [(s.name, *series(r), s.cached_token_share, s.l2_token_share) for s, r in zip(sums, loaded)])
    if as_json:
        keys = ("name", "requests", "errors", "p50_s", "p90_s", "p99_s", "max_s", "mean_s", "thirds_p50_s", "hit_rate",
                "cached_token_share", "l2_token_share", "max_in_flight", "capped", "interrupted", "unfinished", "warnings")
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
        + "".join(f"\n{s.name}: {s.capped} sends delayed by --max-in-flight (not fully open loop)" for s in sums if s.capped)
        + (f"\nplots: {', '.join(paths)}" if paths else ""),
    )
