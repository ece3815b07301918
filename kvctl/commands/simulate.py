"""``kvctl simulate``: what-if runs of the cost model as a queue, without a GPU fleet."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import click

from kvctl import render, thresholds
from kvctl.commands.fleet_options import arrival_process, engine_model, fleet_options, gpu_cell, render_fleet, stability_footer
from kvctl.commands.options import PREFILL_RATE, T0_S, FiniteFloat, RenamedOption, bytes_per_token_options, count, non_negative, output_options, positive
from kvctl.hooks import hookimpl


@hookimpl
def register_commands(cli: click.Group) -> None:
    cli.add_command(simulate_cmd)


def _row(res: Any) -> list[Any]:
    return [res.rho, res.tier_rho, gpu_cell(res.gpu_utilization_pct), res.p50_s, res.p90_s, res.p99_s, res.max_s,
            " / ".join(render.fmt(v) for v in res.thirds_p50_s), res.max_queue, res.stable]


RESULT_COLS = ["ρ", "tier ρ", "GPU util %", "p50 s", "p90 s", "p99 s", "max s", "p50 by third (s)", "max queue", "stable"]
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
@click.option("--requests", type=count(10**8), help="Requests to simulate (Poisson: default 10000; trace: the first N); refused with the figures when it would not fit in memory.")
@click.option("--prompt-tokens", type=positive(1e9), help="Prompt tokens per request in Poisson mode (the mean with --prompt-dist exponential).")
@click.option("--prompt-dist", type=click.Choice(["fixed", "exponential"]), default="fixed", show_default=True, help="Prompt lengths in Poisson mode.")
@click.option("--hit-fraction", type=FiniteFloat(min=0, max=1), default=1.0, show_default=True, help="Share of requests that hit the remote tier (each for its whole prompt).")
@click.option("--hits-from-trace", is_flag=True, help="With --trace: cached tokens per request from the trace (a run file's cached_tokens, or Mooncake hash ids seen before) instead of --hit-fraction.")
@click.option("--block-tokens", type=count(1 << 20), default=512, show_default=True, help="Tokens per Mooncake hash_id block (with --hits-from-trace).")
@bytes_per_token_options()
@click.option("--prefill-rate", type=PREFILL_RATE, required=True, help="Prefill throughput R, tokens/s (misses cost n/R).")
@click.option("--t0", type=T0_S, default=thresholds.PAPER_T0_S, show_default=True, help="Fixed per-hit cost T0, seconds (the paper's 0.33).")
@click.option("--instances", type=count(4096), default=1, show_default=True, help="Tier instances (one per rank); B_eff scales with them.")
@click.option("--instance-gbps", type=INSTANCE_GBPS, help="GET bandwidth of one instance, GB/s (B_eff = instances × this).")
@click.option("--bench", "bench_path", type=click.Path(dir_okay=False), help="`kvctl bench --save` file: B_eff = its measured aggregate at --instances.")
@click.option("--loading", type=click.Choice(["sync", "async"]), default="sync", show_default=True, help="sync: the transfer holds the engine (one FIFO queue); async: loads overlap compute.")
@click.option("--async-timeout", "async_timeout_s", type=non_negative(86400), default=thresholds.ASYNC_TIMEOUT_S, show_default=True, help="async: a load not done this many seconds after arrival is recomputed instead.")
@click.option("--seed", type=count(2**32 - 1, min=0), default=0, show_default=True, help="Seed of arrivals, lengths and hits (the same for every sweep point).")
@click.option("--sweep", "sweep_specs", multiple=True, help="What-if grid, e.g. --sweep 'instances=1,2,4,8 loading=sync,async'.")
@click.option("--plot", type=click.Path(dir_okay=False), help="With --sweep: draw p50/p99 against the swept values to FILE.png.")
@fleet_options
@output_options
def simulate_cmd(rate: float | None, trace_path: str | None, requests: int | None, prompt_tokens: float | None, prompt_dist: str,
                 hit_fraction: float, hits_from_trace: bool, block_tokens: int, bytes_per_token: float, prefill_rate: float, t0: float, instances: int,
                 instance_gbps: float | None, bench_path: str | None, loading: str, async_timeout_s: float, seed: int,
                 sweep_specs: tuple[str, ...], plot: str | None, engines: int, fit_from: str | None, get_times_from: str | None,
                 readers_from: str | None, async_instance_gbps: float | None, async_overhead_s: float, t0_engine_share: float, max_batch: int,
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
    Output: p50/p90/p99/max, p50 by third of the run (drift), ρ, max queue, stable,
    GPU utilisation (prefills, tails and --hit-gpu-s of each hit over the run).
    \b
    The engine steps as vLLM's: up to --max-batch requests and --max-batched-tokens
    prefill tokens a step, long prompts chunked over steps. Arrivals: Poisson, or
    --arrivals deterministic|gamma (--arrival-cv, or the CV of --arrivals-from TRACE).
    \b
    Fleets (--engines E) and variability (--fit-from, --get-times-from,
    --readers-from, --async-*): E engines with their own queues share the W
    instances; per-engine and fleet percentiles, tier ρ per instance summed
    over engines, GPU utilisation; inputs past what was measured are flagged.
    """
    from kvctl import fleet, variability  # noqa: PLC0415
    from kvctl import simulate as sim  # noqa: PLC0415 - numpy only when used

    if (rate is None) == (trace_path is None):
        raise click.UsageError("give exactly one of --arrival-rate (Poisson) or --trace FILE")
    if rate is not None and prompt_tokens is None:
        raise click.UsageError("--arrival-rate needs --prompt-tokens")
    if (instance_gbps is None) == (bench_path is None):
        raise click.UsageError("give exactly one of --instance-gbps or --bench FILE")
    if plot and not sweep_specs:
        raise click.UsageError("--plot draws a --sweep")
    bench = sim.bench_bandwidths(bench_path) if bench_path else None
    if hits_from_trace and not trace_path:
        raise click.UsageError("--hits-from-trace needs --trace")
    base = sim.SimConfig(bytes_per_token, prefill_rate, t0, instances, instance_gbps, loading, async_timeout_s, hit_fraction, seed,
                         hits_from_trace)
    fit_gbps = sim.effective_gbps(instances, instance_gbps, bench)
    var = variability.build(fit_from=fit_from, get_times_from=get_times_from, readers_from=readers_from,
                            async_instance_gbps=async_instance_gbps, async_overhead_s=async_overhead_s,
                            bytes_per_token=bytes_per_token, prefill_rate=prefill_rate, fit_gbps=fit_gbps, instances=instances)
    base, var = engine_model(t0_engine_share, fit_from, base, fit_gbps, var, block_tokens, max_batch, max_batched_tokens, hit_gpu_s, fit_gpu_util)
    process, cv, cv_note = arrival_process(trace_path, arrivals, arrival_cv, arrivals_from)
    if cv_note:
        var = replace(var, notes=(*var.notes, cv_note))
    is_fleet = engines > 1 or var.active or base.t0_engine_share > 0
    sim.check_memory(requests or (None if trace_path else 10000), fleet=is_fleet)  # refused with the figures, before any allocation
    cache: dict[Any, Any] = {}

    def workload_for(r: float | None = None, n: float | None = None) -> Any:
        key = (r, n)
        if key not in cache:
            if trace_path:
                cache[key] = sim.trace_workload(trace_path, requests, block_tokens)
            else:
                cache[key] = sim.poisson_workload((r or rate) * engines, requests or 10000, n or prompt_tokens, prompt_dist, seed, process, cv)
        return cache[key]

    if sweep_specs:
        grid = sim.parse_sweep(sweep_specs)
        _check_sweep(grid)
        if trace_path and ("arrival_rate" in grid or "prompt_tokens" in grid):
            raise click.UsageError("--sweep arrival_rate/prompt_tokens need Poisson mode (--arrival-rate)")
        points = sim.sweep(base, grid, workload_for, bench,
                           runner=(lambda w, c, bw: fleet.simulate_fleet(w, c, bw, engines, var)) if is_fleet else None)
        if plot:
            _plot(plot, grid, points)
        bws = [sim.bandwidth_for(p.parameters.get("instances", instances), p.parameters.get("instance_gbps", instance_gbps), bench)
               for p in points]
        if as_json:
            to_dict = fleet.fleet_dict if is_fleet else sim.result_dict
            render.emit_json([{"parameters": p.parameters, **to_dict(p.result), **_bandwidth_json(bw)} for p, bw in zip(points, bws)])
            return
        keys = list(grid)
        extrapolated = sorted({bw.note for bw in bws if bw.basis == sim.BASIS_EXTRAPOLATED})
        render.table(
            f"What if — {workload_for().source}",
            [k.replace("_", " ") for k in keys] + ["B_eff GB/s"] + RESULT_COLS,
            [[p.parameters[k] for k in keys] + [_bandwidth_cell(p.result.bandwidth_gbps, bw)] + _row(p.result) for p, bw in zip(points, bws)],
            caption=f"s = {bytes_per_token:g} B/token · R = {prefill_rate:g} tok/s · T0 = {t0:g} s" + (f" · plot: {plot}" if plot else "")
        + "\nρ: the engine's utilisation; tier ρ: the tier's (async loads that miss --async-timeout are recomputed)"
        + "".join(f"\n* B_eff {n}" for n in extrapolated),
        )
        return
    w = workload_for()
    bw = sim.bandwidth_for(instances, instance_gbps, bench)
    if bw.basis == sim.BASIS_EXTRAPOLATED and not as_json:
        render.warn(f"B_eff {bw.gbps:g} GB/s is {bw.note}")
    if is_fleet:
        fres = fleet.simulate_fleet(w, base, bw.gbps, engines, var)
        if as_json:
            render.emit_json({**fleet.fleet_dict(fres), **_bandwidth_json(bw)})
        else:
            render_fleet(fres, f"{engines} engine(s), {loading} loading, {instances} instance(s) — {w.source}")
        return
    res = sim.simulate(w, base, bw.gbps)
    if as_json:
        render.emit_json({**sim.result_dict(res), **_bandwidth_json(bw), "notes": list(var.notes)})
        return
    render.table(
        f"{loading} loading, {instances} instance(s), B_eff {_bandwidth_cell(res.bandwidth_gbps, bw)} GB/s — {w.source}",
        RESULT_COLS,
        [_row(res)],
        caption=(f"mean {res.mean_s:.3f} s · mean wait {res.mean_wait_s:.3f} s · hits {res.hits:,} of {res.requests:,}"
                 + (f" · timeouts {res.timeouts:,}" if loading == "async" else "")
                 + "".join(f"\ninput: {n}" for n in var.notes)
                 + (f"\n{stability_footer(res)}" if res.stable is False else "")
                 + (f"\n* B_eff {bw.note}" if bw.basis == sim.BASIS_EXTRAPOLATED else "")),
    )


def _bandwidth_json(bw: Any) -> dict[str, Any]:
    """Where B_eff came from, in every simulate JSON: ``bandwidth_basis`` (instance_gbps, bench_measured or
    bench_extrapolated) and a sentence."""
    return {"bandwidth_basis": bw.basis, "bandwidth_note": bw.note}


def _bandwidth_cell(gbps: float, bw: Any) -> str:
    """B_eff as a table shows it: starred when the bench did not measure that instance count."""
    from kvctl.simulate import BASIS_EXTRAPOLATED  # noqa: PLC0415 - numpy only when used

    return f"{gbps:g}" + ("*" if bw.basis == BASIS_EXTRAPOLATED else "")


def _plot(path: str, grid: dict[str, list[Any]], points: list[Any]) -> None:
    """p99 (and p50) against the first numeric swept key, one line per value of the others."""
    numeric = [k for k, vs in grid.items() if all(isinstance(v, (int, float)) for v in vs)]
    x_key = numeric[0] if numeric else None
    series: dict[str, tuple[list[float], list[float]]] = {}
    for i, p in enumerate(points):
        label = ", ".join(f"{k}={v}" for k, v in p.parameters.items() if k != x_key) or "run"
        x = p.parameters[x_key] if x_key else i
        for q, val in (("p99", p.result.p99_s), ("p50", p.result.p50_s)):
            xs, ys = series.setdefault(f"{label} {q}", ([], []))
            xs.append(x)
            ys.append(val)
    render.line_plot(path, "What-if: latency", x_key or "point", "latency (s)", series)
