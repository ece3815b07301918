"""``kvctl simulate``: what-if runs of the cost model as a queue, without a GPU fleet."""

from __future__ import annotations

from typing import Any

import click
from click.core import ParameterSource

from kvctl.sim import model as sim_model

from kvctl.core import thresholds
from kvctl.commands.fleet_options import bench_option, check_fleet_options, check_workload_options, fleet_options
from kvctl.commands.options import (PREFILL_RATE, T0_S, FiniteFloat, RenamedOption, bytes_per_token_options, count, non_negative, output_options,
                                    plot_option, positive)
from kvctl.hooks import hookimpl


@hookimpl
def register_commands(cli: click.Group) -> None:
    cli.add_command(simulate_cmd)


#: λ and one instance's bandwidth, bounded below too: past these the model's times leave a float's range.
SIM_RATE = FiniteFloat(min=1e-6, max=1e6)  # requests/s
INSTANCE_GBPS = FiniteFloat(min=1e-6, max=1e6)  # GB/s


#: --sweep keys whose option's parameter has another name
SWEEP_PARAMS = {"arrival_rate": "rate"}


def _check_sweep(grid: dict[str, list[Any]]) -> None:
    """Every --sweep value through its option's own type: the same bounds, the same message (exit 2)."""
    ctx = click.get_current_context()
    params = {p.name: p for p in ctx.command.params}
    for key, values in grid.items():
        param = params.get(SWEEP_PARAMS.get(key, key))
        if param is None:  # a sweep key that is not an option of its own: parse_sweep checked it
            continue
        for v in values:
            try:
                param.type.convert(v, param, ctx)
            except click.BadParameter as e:
                raise click.BadParameter(f"{key}={v}: {e.message}", ctx=ctx, param_hint="'--sweep'") from None


@click.command("simulate")
@click.option("--arrival-rate", "rate", type=SIM_RATE, cls=RenamedOption, old=["--rate"], help="Arrival rate λ, requests/s (Poisson arrivals; or --trace).")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False), help="Arrivals and prompt lengths from a trace (any `kvctl replay` format).")
@click.option("--requests", type=count(10**8), help=f"Requests to simulate (Poisson: default {sim_model.SIMULATE_REQUESTS}; trace: the first N); refused with the figures when it would not fit in memory.")
@click.option("--prompt-tokens", type=positive(1e9), help="Prompt tokens per request in Poisson mode (the mean with --prompt-dist exponential).")
@click.option("--prompt-dist", type=click.Choice(["fixed", "exponential"]), default="fixed", show_default=True, help="Prompt lengths in Poisson mode.")
@click.option("--hit-fraction", type=FiniteFloat(min=0, max=1), default=1.0, show_default=True, help="Share of requests that hit the remote tier (each for its whole prompt).")
@click.option("--hits-from-trace", is_flag=True, help="With --trace: cached tokens per request from the trace (a run file's cached_tokens, or Mooncake hash ids seen before) instead of --hit-fraction.")
@click.option("--block-tokens", type=count(1 << 20), default=sim_model.BLOCK_TOKENS, show_default=True, help="Tokens per Mooncake hash_id block (with --hits-from-trace).")
@bytes_per_token_options()
@click.option("--prefill-rate", type=PREFILL_RATE, required=True, help="Prefill throughput R, tokens/s (misses cost n/R).")
@click.option("--t0", type=T0_S, default=thresholds.PAPER_T0_S, show_default=True,
              help="Fixed per-hit cost T0, seconds (the paper's by default). Without --t0, --fit-from's run gives its distribution; given, it wins over that fit.")
@click.option("--instances", type=count(4096), default=1, show_default=True, help="Tier instances (one per rank); B_eff scales with them.")
@click.option("--instance-gbps", type=INSTANCE_GBPS, help="GET bandwidth of one instance, GB/s (B_eff = instances × this).")
@bench_option("B_eff as measured at --instances (scaled linearly past its largest count)")
@click.option("--loading", type=click.Choice(["sync", "async"]), default="sync", show_default=True, help="sync: the transfer holds the engine (one FIFO queue); async: loads overlap compute.")
@click.option("--async-timeout", "async_timeout_s", type=non_negative(86400), default=thresholds.ASYNC_TIMEOUT_S, show_default=True, help="async: a load not done this many seconds after arrival is recomputed instead (LMCache's asynchronous lookup, the paper's 3 s; kvctl's connector never recomputes a load for its age: give 86400).")
@click.option("--seed", type=count(2**32 - 1, min=0), default=0, show_default=True, help="Seed of arrivals, lengths and hits (the same for every sweep point).")
@click.option("--sweep", "sweep_specs", multiple=True, help="What-if grid, e.g. --sweep 'instances=1,2,4,8 loading=sync,async'.")
@plot_option("p50/p99 against the swept values", when="With --sweep: draw")
@fleet_options("simulate")
@output_options
def simulate_cmd(rate: float | None, trace_path: str | None, requests: int | None, prompt_tokens: float | None, prompt_dist: str,
                 hit_fraction: float, hits_from_trace: bool, block_tokens: int, bytes_per_token: float, prefill_rate: float, t0: float, instances: int,
                 instance_gbps: float | None, bench_path: str | None, loading: str, async_timeout_s: float, seed: int,
                 sweep_specs: tuple[str, ...], plot: str | None, engines: int, fit_from: str | None, fit_instances: int | None, fit_loading: str | None,
                 async_instance_gbps: float | None, async_overhead_s: float, t0_engine_share: float, max_batch: int,
                 max_batched_tokens: int, hit_gpu_s: float | str, fit_gpu_util: float | None, arrivals: str, arrival_cv: float | None,
                 arrivals_from: str | None, as_json: bool) -> None:
    """Simulate one prefill engine with a remote KV tier: latency percentiles, ρ, stability.

    \b
    Service per request (paper §4):  miss  n/R  ·  hit  T0 + n·s/B_eff
    (a hit of h < n cached tokens: T0 + h·s/B_eff + (n − h)/R, with --hits-from-trace)
    sync   the transfer n·s/B_eff holds the engine (a single-server FIFO queue,
           ρ = λ·n·s/B); T0 adds to the hit's latency only (--t0-engine-share
           puts that share of it on the engine)
    async  loads run on the tier while the engine computes; a load not done within
           --async-timeout of arrival is recomputed (its prefetch still uses the tier)
    B_eff = --instances × --instance-gbps, or the aggregate a --bench file measured.
    Output, the same columns for sync and async: requests, hits, timeouts (async),
    engine ρ (λ × a request's time on its engine), tier ρ (the hits' λ × n·s/B_eff:
    each instance's load), GPU utilisation (prefills, tails and --hit-gpu-s of
    each hit over the run), p50/p90/p99/max, p50 by third of the run (drift),
    max queue, stable (both ρ below 1).
    \b
    The engine steps as vLLM's: up to --max-batch requests and --max-batched-tokens
    prefill tokens a step, long prompts chunked over steps. Arrivals: Poisson, or
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

    check_workload_options(rate, trace_path, prompt_tokens, instance_gbps, bench_path, "Poisson")
    if plot and not sweep_specs:
        raise click.UsageError("--plot draws a --sweep")
    if hits_from_trace and not trace_path:
        raise click.UsageError("--hits-from-trace needs --trace")
    check_fleet_options(trace_path, t0_engine_share, fit_from, hit_gpu_s, fit_gpu_util, arrivals, arrival_cv, arrivals_from, fit_instances, fit_loading)
    grid = None
    if sweep_specs:
        grid = sim.parse_sweep(sweep_specs)
        _check_sweep(grid)
        if trace_path and ("arrival_rate" in grid or "prompt_tokens" in grid):
            raise click.UsageError("--sweep arrival_rate/prompt_tokens need Poisson mode (--arrival-rate)")
    found = sim_model.whatif(sim_model.Inputs(
        bytes_per_token, prefill_rate, rate=rate, trace_path=trace_path, requests=requests, prompt_tokens=prompt_tokens, prompt_dist=prompt_dist,
        hit_fraction=hit_fraction, hits_from_trace=hits_from_trace, block_tokens=block_tokens, t0_s=t0, instances=instances,
        instance_gbps=instance_gbps, bench_path=bench_path, loading=loading, async_timeout_s=async_timeout_s, seed=seed, engines=engines,
        fit_from=fit_from, fit_instances=fit_instances, fit_loading=fit_loading, async_instance_gbps=async_instance_gbps,
        t0_given=click.get_current_context().get_parameter_source("t0") not in (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP),
        async_overhead_s=async_overhead_s, t0_engine_share=t0_engine_share, max_batch=max_batch, max_batched_tokens=max_batched_tokens,
        hit_gpu_s=hit_gpu_s, fit_gpu_util=fit_gpu_util, arrivals=arrivals, arrival_cv=arrival_cv, arrivals_from=arrivals_from,
    ), grid)
    if plot:
        plot_sweep(plot, found)
    show_whatif(found, as_json)
