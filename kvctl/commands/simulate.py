"""``kvctl simulate``: what-if runs of the cost model as a queue, without a GPU fleet."""

from __future__ import annotations

import click

from kvctl.commands.options import output_options
from kvctl.commands.whatif_options import check_sweep, whatif_options
from kvctl.hooks import hookimpl
from kvctl.sim import model as sim_model


@hookimpl
def register_commands(cli: click.Group) -> None:
    cli.add_command(simulate_cmd)


@click.command("simulate")
@whatif_options("simulate")
@output_options
def simulate_cmd(inputs: sim_model.Inputs, sweep_specs: tuple[str, ...], plot: str | None, as_json: bool) -> None:
    """Simulate one prefill engine with a remote KV tier: latency percentiles, ρ, stability.

    \b
    Service per request (paper §4):  miss  n/R  ·  hit  T0 + n·s/B_eff
    (a hit of h < n cached tokens: T0 + h·s/B_eff + (n − h)/R, with --hits-from-trace)
    sync   the transfer n·s/B_eff holds the engine (a single-server FIFO queue,
           ρ = λ·n·s/B); T0 adds to the hit's latency only (--t0-engine-share
           puts that share of it on the engine)
    async  loads run on the tier while the engine computes; a load not done within
           --async-timeout of arrival is recomputed (its prefetch still uses the tier);
           each holds the tier --async-load-s besides its transfer (--fit-loads TRACE
           fits both from a connector trace)
    B_eff = --instances × --instance-gbps, or the aggregate a --bench file measured.
    Output, the same columns for sync and async: requests, hits, timeouts (async),
    engine ρ (λ × a request's time on its engine), tier ρ (the hits' λ × n·s/B_eff:
    each instance's load), GPU utilisation (prefills, tails and --hit-gpu-s of
    each hit over the run), p50/p90/p99/max, p50 by third of the run (drift),
    max queue, stable (both ρ below 1).
    \b
    The engine steps as vLLM's: up to --max-batch requests and --max-batched-tokens
    prefill tokens a step, long prompts chunked over steps; each step costs --step-s
    more, and --graph-jump-s more above --graph-tokens (--fit-steps TRACE fits them
    from a connector trace's steps; none by default: n/R alone). Arrivals: Poisson, or
    --arrivals deterministic|gamma (--arrival-cv, or the CV of --arrivals-from TRACE).
    \b
    Fleets (--engines E) and variability (--fit-from, --bench's GET-time spread and
    readers curve, --async-*): E engines with their own queues share the W
    instances; a row per engine and the fleet's (tier ρ: each instance's,
    summed over engines); inputs past what was measured are flagged.

    \b
    kvctl simulate --arrival-rate 1.21 --prompt-tokens 16310 --bytes-per-token 48437.5 --prefill-rate 52200 \\
        --instances 8 --instance-gbps 1.345 --sweep 'loading=sync,async'
    """
    from kvctl.sim import simulate as sim  # noqa: PLC0415 - numpy only when used
    from kvctl.views.sim import plot_sweep, show_whatif  # noqa: PLC0415

    if plot and not sweep_specs:
        raise click.UsageError("--plot draws a --sweep")
    grid = None
    if sweep_specs:
        grid = sim.parse_sweep(sweep_specs)
        check_sweep(grid)
    found = sim_model.whatif(inputs, grid)
    if plot:
        plot_sweep(plot, found)
    show_whatif(found, as_json)
