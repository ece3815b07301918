"""``kvctl report``: runs side by side, with the paper's Table 2 columns."""

from __future__ import annotations

import click

from kvctl.commands.options import BYTES_PER_TOKEN, count, output_options, plot_dir_option
from kvctl.hooks import hookimpl


@hookimpl
def register_commands(cli: click.Group) -> None:
    cli.add_command(report_cmd)


@click.command("report")
@click.argument("runs", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--hit-tokens", type=count(10**9), default=1, show_default=True, help="A request is a hit when cached_tokens ≥ this.")
@click.option("--bytes-per-token", type=BYTES_PER_TOKEN, help="KV bytes per token of the whole model (all ranks, `kvctl cost kv-size`), to turn LMCache's remote read bytes into L2 tokens.")
@plot_dir_option("latency over time, the latency CDF and the share of tokens from cache")
@output_options
def report_cmd(runs: tuple[str, ...], hit_tokens: int, bytes_per_token: float | None, plot_dir: str | None, as_json: bool) -> None:
    """Compare replay runs (kvctl replay --out files): what became of each request, latency, drift, hits, L2 share.

    \b
    Outcomes: the trace's requests = not sent (due after a stop) + sent, and sent =
    hits + misses + no usage + HTTP errors + timeouts + other errors + interrupted
    (open when a stop signal ended the run).
    Columns (paper Table 2): p50 / p90 / p99 / max latency (linear-interpolation
    percentiles over the requests that finished ok), p50 of each third of the run in
    scheduled order (a queue that grows shows as rising thirds), hit rate
    (cached_tokens ≥ --hit-tokens), share of prompt tokens from L2 (engine counters
    before/after the run; without them the rows' cached_tokens, exact on an engine
    with no prefix cache of its own, else "≤" an upper bound; the note says which)
    and the most requests in flight at once.
    """
    from kvctl.records.summary import load_runs, summarize_run  # noqa: PLC0415
    from kvctl.views.report import show_runs  # noqa: PLC0415

    loaded = load_runs(runs)
    sums = [summarize_run(r, hit_tokens=hit_tokens, bytes_per_token=bytes_per_token) for r in loaded]
    show_runs(loaded, sums, hit_tokens, plot_dir, as_json)
