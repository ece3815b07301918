"""``kvctl plan``: size a (shared) tier — fewest instances and the loading mode that meet a p99 SLO."""

from __future__ import annotations

import click
from click.core import ParameterSource

from kvctl.sim import model as sim_model

from kvctl.core import thresholds
from kvctl.commands.fleet_options import bench_option, check_fleet_options, check_workload_options, fleet_options
from kvctl.commands.options import (ARRIVAL_RATE, PREFILL_RATE, T0_S, FiniteFloat, RenamedOption, bytes_per_token_options, count, non_negative,
                                    output_options, plot_option, positive)
from kvctl.core.errors import ExitStatus
from kvctl.hooks import hookimpl


@hookimpl
def register_commands(cli: click.Group) -> None:
    cli.add_command(plan_cmd)


@click.command("plan")
@click.option("--arrival-rate", "rate", type=ARRIVAL_RATE, cls=RenamedOption, old=["--rate"], help="Arrival rate λ of EACH engine, requests/s (Poisson arrivals; or --trace).")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False), help="The whole fleet's arrivals and prompt lengths from a trace (any `kvctl replay` format).")
@click.option("--requests", type=count(10**7), help=f"Requests simulated per point (Poisson: default {sim_model.PLAN_REQUESTS}; trace: the first N).")
@click.option("--prompt-tokens", type=positive(1e9), help="Prompt tokens per request with --arrival-rate (the mean with --prompt-dist exponential).")
@click.option("--prompt-dist", type=click.Choice(["fixed", "exponential"]), default="fixed", show_default=True, help="Prompt lengths with --arrival-rate.")
@click.option("--hit-fraction", type=FiniteFloat(min=0, max=1), default=1.0, show_default=True, help="Share of requests that hit the tier.")
@bytes_per_token_options()
@click.option("--prefill-rate", type=PREFILL_RATE, required=True, help="Prefill throughput R, tokens/s.")
@click.option("--t0", type=T0_S, default=thresholds.PAPER_T0_S, show_default=True,
              help="Fixed per-hit cost T0, seconds (the paper's by default). Without --t0, --fit-from's run gives its distribution; given, it wins over that fit.")
@click.option("--slo-p99", "slo_p99_s", type=positive(86400), required=True, help="The SLO: p99 latency at most this many seconds.")
@click.option("--rho-target", type=FiniteFloat(min=0, max=1, min_open=True), default=thresholds.RHO_TARGET, show_default=True, help="Highest tier ρ per instance (all engines) a plan may run at.")
@click.option("--max-instances", type=count(4096), default=8, show_default=True, help="Most instances to try: the ranks W (one instance per rank), or W × K with --ranks.")
@click.option("--ranks", type=count(4096), help="Ranks W of each engine's shard group (TP × PCP): search W × K instances, K = 1, 2, … per rank (`kvctl deploy-valkey up --instances-per-rank K`), and say the plan as W ranks × K instances per rank.")
@click.option("--instance-gbps", type=positive(1e6), help="GET bandwidth of one instance, GB/s (or --bench).")
@bench_option("B_eff as measured at each instance count (scaled linearly past the largest)")
@click.option("--loading", type=click.Choice(["sync", "async", "both"]), default="both", show_default=True, help="Loading modes to search.")
@click.option("--async-timeout", "async_timeout_s", type=non_negative(86400), default=thresholds.ASYNC_TIMEOUT_S, show_default=True, help="async: a load not done this long after arrival is recomputed (LMCache's asynchronous lookup, the paper's 3 s; kvctl's connector never recomputes a load for its age: give 86400).")
@click.option("--seed", type=count(2**32 - 1, min=0), default=0, show_default=True, help="Seed of arrivals, lengths, hits and variability (the same for every point).")
@plot_option("p99 against instances (one line per loading, the SLO dashed)")
@fleet_options("plan")
@output_options
@click.pass_context
def plan_cmd(ctx: click.Context, rate: float | None, trace_path: str | None, requests: int | None, prompt_tokens: float | None, prompt_dist: str,
             hit_fraction: float, bytes_per_token: float, prefill_rate: float, t0: float, slo_p99_s: float, rho_target: float,
             max_instances: int, instance_gbps: float | None, bench_path: str | None, loading: str, async_timeout_s: float, seed: int,
             plot: str | None, engines: int, fit_from: str | None, fit_instances: int | None, fit_loading: str | None,
             async_instance_gbps: float | None, async_overhead_s: float, t0_engine_share: float, max_batch: int, max_batched_tokens: int,
             hit_gpu_s: float | str, fit_gpu_util: float | None, arrivals: str, arrival_cv: float | None, arrivals_from: str | None,
             as_json: bool, ranks: int | None = None) -> None:
    """Fewest tier instances and the loading mode (sync/async) that meet p99 ≤ --slo-p99 at ρ ≤ --rho-target.

    \b
    Searches `kvctl simulate` (E --engines at --arrival-rate each, with the variability
    of --fit-from and --bench) over 1 … --max-instances for each loading mode;
    prints the table of what it tried, skips points that
    arithmetic rules out (B_eff ≤ B* = s·R, or tier ρ above the target), and
    says when no instance count can help (B per instance below B*/W, or prompts
    below n* = R·T0 while recomputing already meets the SLO). Recomputing is a
    candidate: when it meets the SLO the plan is "no tier", and a tier slower
    than recompute is never recommended. Exit 0 with a plan, 9 when nothing
    tried meets the SLO.

    \b
    kvctl plan --arrival-rate 1.21 --prompt-tokens 16310 --bytes-per-token 48437.5 --prefill-rate 52200 \\
        --engines 6 --bench sweep.json --fit-from calib.jsonl --slo-p99 1.0
    """
    from kvctl.views.sim import plot_plan, show_plan  # noqa: PLC0415 - numpy only when used

    check_workload_options(rate, trace_path, prompt_tokens, instance_gbps, bench_path, "per engine")
    check_fleet_options(trace_path, t0_engine_share, fit_from, hit_gpu_s, fit_gpu_util, arrivals, arrival_cv, arrivals_from, fit_instances, fit_loading)
    sized = sim_model.size_tier(sim_model.Inputs(
        bytes_per_token, prefill_rate, rate=rate, trace_path=trace_path, requests=requests, prompt_tokens=prompt_tokens, prompt_dist=prompt_dist,
        hit_fraction=hit_fraction, t0_s=t0, instances=None, instance_gbps=instance_gbps, bench_path=bench_path, async_timeout_s=async_timeout_s,
        seed=seed, engines=engines, fit_from=fit_from, fit_instances=fit_instances, fit_loading=fit_loading,
        t0_given=ctx.get_parameter_source("t0") not in (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP),
        async_instance_gbps=async_instance_gbps, async_overhead_s=async_overhead_s, t0_engine_share=t0_engine_share, max_batch=max_batch,
        max_batched_tokens=max_batched_tokens, hit_gpu_s=hit_gpu_s, fit_gpu_util=fit_gpu_util, arrivals=arrivals, arrival_cv=arrival_cv,
        arrivals_from=arrivals_from,
    ), slo_p99_s=slo_p99_s, rho_target=rho_target, max_instances=max_instances, loadings=("sync", "async") if loading == "both" else (loading,),
        ranks=ranks)
    if plot:
        plot_plan(plot, sized.plan)
    code = ExitStatus.OK if sized.plan.instances is not None else ExitStatus.SLO_UNMET
    show_plan(sized, as_json, code)
    ctx.exit(int(code))
