"""``kvctl plan``: size a (shared) tier — fewest instances and the loading mode that meet a p99 SLO."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import click

from kvctl import render, thresholds
from kvctl.commands.fleet_options import arrival_process, engine_model, fleet_options, gpu_cell
from kvctl.commands.options import ARRIVAL_RATE, PREFILL_RATE, T0_S, FiniteFloat, RenamedOption, bytes_per_token_options, count, non_negative, output_options, positive
from kvctl.errors import ExitStatus
from kvctl.hooks import hookimpl


@hookimpl
def register_commands(cli: click.Group) -> None:
    cli.add_command(plan_cmd)


COLS = ["instances", "loading", "B_eff GB/s", "tier ρ", "engine ρ", "GPU util %", "p50 s", "p99 s", "timeouts", "meets", "why"]


@click.command("plan")
@click.option("--arrival-rate", "rate", type=ARRIVAL_RATE, cls=RenamedOption, old=["--rate"], help="Arrival rate λ of EACH engine, requests/s (Poisson arrivals; or --trace).")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False), help="The whole fleet's arrivals and prompt lengths from a trace (any `kvctl replay` format).")
@click.option("--requests", type=count(10**7), help="Requests simulated per point (Poisson: default 20000; trace: the first N).")
@click.option("--prompt-tokens", type=positive(1e9), help="Prompt tokens per request with --arrival-rate (the mean with --prompt-dist exponential).")
@click.option("--prompt-dist", type=click.Choice(["fixed", "exponential"]), default="fixed", show_default=True, help="Prompt lengths with --arrival-rate.")
@click.option("--hit-fraction", type=FiniteFloat(min=0, max=1), default=1.0, show_default=True, help="Share of requests that hit the tier.")
@bytes_per_token_options()
@click.option("--prefill-rate", type=PREFILL_RATE, required=True, help="Prefill throughput R, tokens/s.")
@click.option("--t0", type=T0_S, default=thresholds.PAPER_T0_S, show_default=True, help="Fixed per-hit cost T0, seconds (or its distribution with --fit-from).")
@click.option("--slo-p99", "slo_p99_s", type=positive(86400), required=True, help="The SLO: p99 latency at most this many seconds.")
@click.option("--rho-target", type=FiniteFloat(min=0, max=1, min_open=True), default=thresholds.RHO_TARGET, show_default=True, help="Highest tier ρ per instance (all engines) a plan may run at.")
@click.option("--max-instances", type=count(4096), default=8, show_default=True, help="Most instances to try: the ranks W (one instance per rank), or W × K with --ranks.")
@click.option("--ranks", type=count(4096), help="Ranks W of each engine's shard group (TP × PCP): search W × K instances, K = 1, 2, … per rank (`kvctl deploy-valkey up --instances-per-rank K`), and say the plan as W ranks × K instances per rank.")
@click.option("--instance-gbps", type=positive(1e6), help="GET bandwidth of one instance, GB/s (or --bench).")
@click.option("--bench", "bench_path", type=click.Path(dir_okay=False), help="`kvctl bench --save` file: the measured aggregate at each instance count.")
@click.option("--loading", type=click.Choice(["sync", "async", "both"]), default="both", show_default=True, help="Loading modes to search.")
@click.option("--async-timeout", "async_timeout_s", type=non_negative(86400), default=thresholds.ASYNC_TIMEOUT_S, show_default=True, help="async: a load not done this long after arrival is recomputed.")
@click.option("--seed", type=count(2**32 - 1, min=0), default=0, show_default=True, help="Seed of arrivals, lengths, hits and variability (the same for every point).")
@click.option("--plot", type=click.Path(dir_okay=False), help="Draw p99 against instances (one line per loading, the SLO dashed) to FILE.png.")
@fleet_options
@output_options
@click.pass_context
def plan_cmd(ctx: click.Context, rate: float | None, trace_path: str | None, requests: int | None, prompt_tokens: float | None, prompt_dist: str,
             hit_fraction: float, bytes_per_token: float, prefill_rate: float, t0: float, slo_p99_s: float, rho_target: float,
             max_instances: int, instance_gbps: float | None, bench_path: str | None, loading: str, async_timeout_s: float, seed: int,
             plot: str | None, engines: int, fit_from: str | None, get_times_from: str | None, readers_from: str | None,
             async_instance_gbps: float | None, async_overhead_s: float, t0_engine_share: float, max_batch: int, max_batched_tokens: int,
             hit_gpu_s: float | str, fit_gpu_util: float | None, arrivals: str, arrival_cv: float | None, arrivals_from: str | None,
             as_json: bool, ranks: int | None = None) -> None:
    """Fewest tier instances and the loading mode (sync/async) that meet p99 ≤ --slo-p99 at ρ ≤ --rho-target.

    \b
    Searches `kvctl simulate` (E --engines at --arrival-rate each, with the variability
    of --fit-from/--get-times-from/--readers-from) over 1 … --max-instances for
    each loading mode; prints the table of what it tried, skips points that
    arithmetic rules out (B_eff ≤ B* = s·R, or tier ρ above the target), and
    says when no instance count can help (B per instance below B*/W, or prompts
    below n* = R·T0 while recomputing already meets the SLO). Recomputing is a
    candidate: when it meets the SLO the plan is "no tier", and a tier slower
    than recompute is never recommended. Exit 0 with a plan, 8 when nothing
    tried meets the SLO.
    """
    from kvctl import plan as planner  # noqa: PLC0415 - numpy only when used
    from kvctl import simulate as sim  # noqa: PLC0415
    from kvctl import variability  # noqa: PLC0415

    if (rate is None) == (trace_path is None):
        raise click.UsageError("give exactly one of --arrival-rate (per engine) or --trace FILE")
    if rate is not None and prompt_tokens is None:
        raise click.UsageError("--arrival-rate needs --prompt-tokens")
    if (instance_gbps is None) == (bench_path is None):
        raise click.UsageError("give exactly one of --instance-gbps or --bench FILE")
    bench = sim.bench_bandwidths(bench_path) if bench_path else None
    process, cv, cv_note = arrival_process(trace_path, arrivals, arrival_cv, arrivals_from)
    if trace_path:
        w = sim.trace_workload(trace_path, requests)
    else:
        w = sim.poisson_workload(rate * engines, requests or 20000, prompt_tokens, prompt_dist, seed, process, cv)
    fit_instances = max(bench) if bench else 1
    fit_gbps = sim.effective_gbps(fit_instances, instance_gbps, bench)
    var = variability.build(fit_from=fit_from, get_times_from=get_times_from, readers_from=readers_from,
                            async_instance_gbps=async_instance_gbps, async_overhead_s=async_overhead_s,
                            bytes_per_token=bytes_per_token, prefill_rate=prefill_rate, fit_gbps=fit_gbps, instances=None)
    cfg = sim.SimConfig(bytes_per_token, prefill_rate, t0, 1, instance_gbps, "sync", async_timeout_s, hit_fraction, seed)
    cfg, var = engine_model(t0_engine_share, fit_from, replace(cfg, instances=fit_instances), fit_gbps, var, max_batch=max_batch,
                            max_batched_tokens=max_batched_tokens, hit_gpu_s=hit_gpu_s, fit_gpu_util=fit_gpu_util)
    if cv_note:
        var = replace(var, notes=(*var.notes, cv_note))
    cfg = replace(cfg, instances=1)
    res = planner.plan(w, cfg, engines=engines, slo_p99_s=slo_p99_s, rho_target=rho_target, max_instances=max_instances,
                       instance_gbps=instance_gbps, bench=bench, var=var,
                       loadings=("sync", "async") if loading == "both" else (loading,), ranks=ranks)
    res = planner.with_layout(res, ranks)
    if plot:
        _plot(plot, res)
    code = ExitStatus.OK if res.instances is not None else ExitStatus.SLO_UNMET
    if as_json:
        d: dict[str, Any] = dict(res.__dict__)
        d["points"] = [dict(p.__dict__, extrapolated=list(p.extrapolated)) for p in res.points]
        d["notes"] = list(res.notes) + list(var.notes)
        d["exit_code"] = int(code)
        render.emit_json(d)
        ctx.exit(int(code))
    rows = [["—" if p.instances == 0 else p.instances, p.loading, p.bandwidth_gbps, p.tier_rho, p.engine_rho, gpu_cell(p.gpu_utilization_pct), p.p50_s, p.p99_s,
             p.timeouts, "yes" if p.meets else "no", p.why] for p in res.points]
    caption = [f"{engines} engine(s) · {w.source} · n* = R·T0 = {res.min_hit_tokens:,.0f} tokens · B* = s·R = {res.breakeven_gbps:.3f} GB/s"]
    caption += [f"note: {n}" for n in (*res.notes, *var.notes)]
    caption += sorted({f"EXTRAPOLATED: {x}" for p in res.points for x in p.extrapolated})
    caption.append(("PLAN: " if res.instances is not None else "NO PLAN: ") + res.verdict + (f" · plot: {plot}" if plot else ""))
    render.table(f"Plan — p99 ≤ {slo_p99_s:g} s at ρ ≤ {rho_target:g}", COLS, rows, caption="\n".join(caption))
    ctx.exit(int(code))


def _plot(path: str, res: Any) -> None:
    series: dict[str, tuple[list[float], list[float]]] = {}
    for p in res.points:
        if p.simulated and p.instances > 0:
            xs, ys = series.setdefault(f"{p.loading} p99", ([], []))
            xs.append(p.instances)
            ys.append(p.p99_s)
    hlines = {f"SLO p99 {res.slo_p99_s:g} s": res.slo_p99_s}
    base = next((p for p in res.points if p.instances == 0), None)
    if base is not None and base.p99_s is not None:
        series["recompute p99 (no tier, at 0)"] = ([0], [base.p99_s])
    render.line_plot(path, "Plan: p99 against instances", "instances", "p99 latency (s)", series, hlines=hlines)
