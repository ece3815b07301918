"""The simulation model of ``kvctl simulate`` and ``kvctl plan``, built in one place from their inputs.

:class:`Inputs` is what the two commands (with their fleet options) are given. :func:`build` turns it into a
:class:`Model`: the bench's measured bandwidths, the variability (T0 fitted on a run, the GET-time spread, the
readers curve), the engine's model (batching, its token budget, θ and a hit's GPU time, given or fitted on the
--fit-from run), the arrival process and the workloads. :func:`whatif` runs ``kvctl simulate`` (one engine, a
fleet, or a sweep) and :func:`size_tier` runs ``kvctl plan``'s search. The request defaults live here
(:data:`SIMULATE_REQUESTS`, :data:`PLAN_REQUESTS`, :data:`BLOCK_TOKENS`), not in the commands.

Inputs are the options as parsed, and which of them go together is checked here, when an :class:`Inputs` is made
(:meth:`Inputs.check`: InvalidInput, a usage error, for the CLI and a library caller alike); the options themselves
are declared once in kvctl.commands.whatif_options. No click, and no numpy at import (``kvctl --help`` stays light): kvctl.sim.simulate,
kvctl.sim.fleet, kvctl.sim.variability and kvctl.sim.calibrate load when a model is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Sequence

from kvctl.core.errors import InvalidInput
from kvctl.records.trace import DEFAULT_BLOCK_TOKENS
from kvctl.core.thresholds import ASYNC_TIMEOUT_S, PAPER_T0_S, VLLM_MAX_NUM_BATCHED_TOKENS

if TYPE_CHECKING:
    from kvctl.sim.plan import PlanResult
    from kvctl.sim.simulate import SimConfig, SimResult, SweepPoint
    from kvctl.sim.workload import Bandwidth, Workload
    from kvctl.sim.variability import Variability

#: Requests `kvctl simulate` draws at --arrival-rate unless --requests says otherwise.
SIMULATE_REQUESTS = 10_000
#: Requests `kvctl plan` draws at --arrival-rate for every point it simulates unless --requests says otherwise.
PLAN_REQUESTS = 20_000
#: Tokens per Mooncake hash_id block of a trace (`simulate --block-tokens`; what `kvctl replay` sends).
BLOCK_TOKENS = DEFAULT_BLOCK_TOKENS


@dataclass(frozen=True)
class Inputs:
    """What ``kvctl simulate`` and ``kvctl plan`` are given, parsed (their options' names)."""

    bytes_per_token: float
    prefill_rate: float
    rate: float | None = None  # λ of EACH engine, requests/s (Poisson, deterministic or gamma arrivals), or a trace
    trace_path: str | None = None
    requests: int | None = None  # None: SIMULATE_REQUESTS / PLAN_REQUESTS at --arrival-rate, a trace's all
    prompt_tokens: float | None = None
    prompt_dist: str = "fixed"
    hit_fraction: float = 1.0
    hits_from_trace: bool = False
    block_tokens: int = BLOCK_TOKENS
    t0_s: float = PAPER_T0_S
    t0_given: bool = False  # --t0 given: it wins over the T0 --fit-from's run would give (the fit is only noted)
    instances: int | None = 1  # None (plan): the model is fitted at the bench's largest count (or 1), then searched
    instance_gbps: float | None = None
    bench_path: str | None = None  # B_eff per instance count (unless instance_gbps), the GET-time spread, the readers curve
    loading: str = "sync"
    async_timeout_s: float = ASYNC_TIMEOUT_S
    seed: int = 0
    engines: int = 1
    fit_from: str | None = None
    fit_instances: int | None = None  # the --fit-from run's tier; None: as ``instances`` (plan: the bench's largest, or 1)
    fit_loading: str | None = None  # the --fit-from run's loading; None: as ``loading``
    async_instance_gbps: float | None = None
    async_overhead_s: float = 0.0
    fit_loads: str | None = None  # a connector trace: the async loader's bandwidth and time a load (variability.fit_loads)
    async_load_s: float | None = None  # seconds an async load holds the loader besides its GETs (None: 0, or --fit-loads')
    fit_load_spread: bool = False  # each async load's GET time drawn from --fit-loads' trace
    fit_load_beside: bool = False  # ... from its loads beside big steps for a load beside one (the vLLM line)
    t0_engine_share: float | str = 0.0  # θ, or "fit"
    max_batch: int = 1
    max_batched_tokens: int | None = VLLM_MAX_NUM_BATCHED_TOKENS
    hit_gpu_s: float | str = 0.0  # seconds, or "fit" (with fit_gpu_util)
    fit_gpu_util: float | None = None
    arrivals: str = "poisson"
    arrival_cv: float | None = None
    arrivals_from: str | None = None
    policy: str = "off"  # "on": the kvctl connector's load-or-recompute decision judges each hit (kvctl.sim.policy)
    # what a step costs besides its tokens (kvctl.sim.steps): given, or --fit-steps' fit of a connector trace, else 0
    step_s: float | None = None
    graph_tokens: int | None = None
    graph_jump_s: float | None = None
    fit_steps: str | None = None
    scheduler: str = "fifo"  # "vllm": the engine as vLLM's scheduler runs it (kvctl.sim.vllm_line)
    sched_lag: int = 1

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """The inputs that do not go together, as usage errors (InvalidInput) named by their options: the workload
        (exactly one of --arrival-rate and --trace, --prompt-tokens with a rate, a bandwidth: --instance-gbps, --bench
        or both), what ``fit`` needs (--fit-from, and --fit-gpu-util for --hit-gpu-s), and the arrival process
        (--arrivals/--arrival-cv/--arrivals-from shape --arrival-rate's arrivals, a --trace brings its own; gamma needs
        a CV and only gamma takes one)."""
        self._check_workload()
        self._check_fits()
        self._check_arrivals()

    def _check_workload(self) -> None:
        if (self.rate is None) == (self.trace_path is None):
            raise InvalidInput("give exactly one of --arrival-rate (per engine) or --trace FILE")
        if self.rate is not None and self.prompt_tokens is None:
            raise InvalidInput("--arrival-rate needs --prompt-tokens")
        if self.instance_gbps is None and self.bench_path is None:
            raise InvalidInput("give the tier's bandwidth: --instance-gbps or --bench FILE (a `kvctl bench --save` file)")
        if self.hits_from_trace and not self.trace_path:
            raise InvalidInput("--hits-from-trace needs --trace")

    def _check_fits(self) -> None:
        if (self.hit_gpu_s == "fit" or self.fit_gpu_util is not None) and not self.fit_from:
            raise InvalidInput("--hit-gpu-s fit needs --fit-from RUN and --fit-gpu-util PCT (the run it is fitted on and its GPU utilisation)")
        if self.hit_gpu_s == "fit" and self.fit_gpu_util is None:
            raise InvalidInput("--hit-gpu-s fit needs --fit-gpu-util PCT: the GPU utilisation measured during the --fit-from run")
        if self.hit_gpu_s != "fit" and self.fit_gpu_util is not None:
            raise InvalidInput("--fit-gpu-util fits --hit-gpu-s: give --hit-gpu-s fit")
        if self.fit_instances is not None and not (self.fit_from or self.fit_loads):
            raise InvalidInput("--fit-instances says what tier the --fit-from run had (or the --fit-loads trace): give --fit-from RUN "
                               "or --fit-loads TRACE")
        if self.fit_loading is not None and not self.fit_from:
            raise InvalidInput("--fit-loading says how the --fit-from run loaded: give --fit-from RUN")
        if self.t0_engine_share == "fit" and not self.fit_from:
            raise InvalidInput("--t0-engine-share fit needs --fit-from RUN (the run it is fitted on)")

    def _check_arrivals(self) -> None:
        if self.trace_path and (self.arrivals != "poisson" or self.arrival_cv is not None or self.arrivals_from):
            raise InvalidInput("--arrivals/--arrival-cv/--arrivals-from shape --arrival-rate's arrivals; --trace brings its own")
        if self.arrivals_from:
            if self.arrival_cv is not None or self.arrivals not in ("poisson", "gamma"):
                raise InvalidInput("--arrivals-from fits the CV of gamma arrivals: not with --arrival-cv or --arrivals deterministic")
            return
        if self.arrivals == "gamma" and self.arrival_cv is None:
            raise InvalidInput("--arrivals gamma needs --arrival-cv CV (1 is Poisson's; below 1 smoother, above burstier) or --arrivals-from TRACE")
        if self.arrivals != "gamma" and self.arrival_cv is not None:
            raise InvalidInput("--arrival-cv is the CV of --arrivals gamma")


#: --sweep keys that draw a new Poisson workload: no trace has them
POISSON_SWEEP_KEYS = ("arrival_rate", "prompt_tokens")


@dataclass(frozen=True)
class Model:
    """The model :func:`build` made: what every simulated point shares."""

    inputs: Inputs
    cfg: SimConfig
    var: Variability
    bench: dict[int, float] | None  # instances -> measured aggregate GB/s (a --bench file)
    process: str  # the arrival process of --arrival-rate
    cv: float | None
    default_requests: int
    _workloads: dict[Any, Workload] = field(default_factory=dict, compare=False, repr=False)

    @property
    def fleet(self) -> bool:
        """Whether the fleet simulator runs (several engines, variability, θ > 0 or vLLM's scheduler), not the single-engine one."""
        return self.inputs.engines > 1 or self.var.active or self.cfg.t0_engine_share > 0 or self.cfg.scheduler == "vllm"

    def workload(self, rate: float | None = None, prompt_tokens: float | None = None) -> Workload:
        """The fleet's requests: the trace's, or drawn at ``rate`` (default the inputs' λ) × engines (kept per (rate, tokens))."""
        from kvctl.sim import workload as sim_workload  # noqa: PLC0415 - numpy only when used

        i, key = self.inputs, (rate, prompt_tokens)
        if key not in self._workloads:
            if i.trace_path:
                self._workloads[key] = sim_workload.trace_workload(i.trace_path, i.requests, i.block_tokens)
            else:
                self._workloads[key] = sim_workload.poisson_workload((rate or i.rate) * i.engines, i.requests or self.default_requests,
                                                            prompt_tokens or i.prompt_tokens, i.prompt_dist, i.seed, self.process, self.cv)
        return self._workloads[key]


def engine_model(i: Inputs, cfg: SimConfig, fit_gbps: float, var: Variability) -> tuple[SimConfig, Variability]:
    """(cfg, var) with the engine's model applied: --max-batch, --max-batched-tokens, --hit-gpu-s (the seconds
    given, or fitted on the --fit-from run from its --fit-gpu-util) and --t0-engine-share (the number given, or θ
    fitted on the --fit-from run as ``cfg`` and ``fit_gbps`` describe it). Each fit's note joins ``var``'s."""
    cfg = replace(cfg, max_batch=i.max_batch, max_batched_tokens=i.max_batched_tokens)
    cfg, var = step_model(i, cfg, var)
    if i.hit_gpu_s == "fit":
        from kvctl.sim import calibrate  # noqa: PLC0415 - numpy only when used

        gpu = calibrate.fit_hit_gpu_s(i.fit_from, i.fit_gpu_util, cfg)
        cfg, var = replace(cfg, hit_gpu_s=gpu.seconds), replace(var, notes=(*var.notes, gpu.note))
    else:
        cfg = replace(cfg, hit_gpu_s=float(i.hit_gpu_s))
    if i.t0_engine_share != "fit":
        return replace(cfg, t0_engine_share=float(i.t0_engine_share)), var
    from kvctl.sim import calibrate  # noqa: PLC0415 - numpy only when used

    result = calibrate.fit_engine_share(i.fit_from, cfg, fit_gbps, var, i.block_tokens)
    return replace(cfg, t0_engine_share=result.theta), replace(var, notes=(*var.notes, result.note))


def step_model(i: Inputs, cfg: SimConfig, var: Variability) -> tuple[SimConfig, Variability]:
    """(cfg, var) with what a step costs besides its tokens: --step-s, --graph-tokens and --graph-jump-s as given,
    else as --fit-steps fitted them on a connector trace (its note joins ``var``'s), else none."""
    from kvctl.sim.steps import StepCost, fit_steps  # noqa: PLC0415

    fitted = StepCost()
    if i.fit_steps:
        fit = fit_steps(i.fit_steps)
        fitted, var = fit.cost, replace(var, notes=(*var.notes, fit.note(i.fit_steps)))
    cost = StepCost(fitted.step_s if i.step_s is None else i.step_s,
                    fitted.graph_tokens if i.graph_tokens is None else i.graph_tokens,
                    fitted.graph_jump_s if i.graph_jump_s is None else i.graph_jump_s)
    cost.check()
    if cost.active and cost != fitted:  # what the model runs with, where a value given changed (or made) it
        jump = f", {cost.graph_jump_s * 1e3:g} ms more above {cost.graph_tokens} tokens" if cost.graph_tokens and cost.graph_jump_s else ""
        var = replace(var, notes=(*var.notes, f"each engine step costs {cost.step_s * 1e3:g} ms besides its tokens{jump} (given)"))
    return replace(cfg, step_cost=cost), var


def arrival_process(i: Inputs) -> tuple[str, float | None, str | None]:
    """(process, CV, note) of --arrival-rate's arrivals: --arrivals at --arrival-cv, or gamma at the CV of the gaps
    of --arrivals-from (the note says so)."""
    if i.arrivals_from:
        from kvctl.sim import workload as sim_workload  # noqa: PLC0415 - numpy only when used

        cv, note = sim_workload.arrival_cv_of(i.arrivals_from)
        return "gamma", cv, note
    return i.arrivals, i.arrival_cv, None


def build(i: Inputs, default_requests: int = SIMULATE_REQUESTS) -> Model:
    """The model of ``i``: the bench's bandwidths, the variability, the engine's model and the arrival process.

    The fits (--fit-from, --bench's GET-time spread, --t0-engine-share fit, --hit-gpu-s fit) see the tier at
    ``i.fit_instances`` instances, else ``i.instances``, or, when that is None (plan), at the bench's largest count (1 without a bench);
    the model then starts at 1 instance for the search. θ's fit replays the run loading as ``i.fit_loading`` (else ``i.loading``).
    Notes say where each input came from, in that order.
    """
    from kvctl.sim import simulate as sim  # noqa: PLC0415 - numpy only when used
    from kvctl.sim import workload as sim_workload  # noqa: PLC0415 - numpy only when used
    from kvctl.sim import variability  # noqa: PLC0415

    bench = sim_workload.bench_bandwidths(i.bench_path) if i.bench_path and i.instance_gbps is None else None  # B: --instance-gbps wins
    fit_instances = i.fit_instances or (i.instances if i.instances is not None else (max(bench) if bench else 1))
    fit_gbps = sim_workload.effective_gbps(fit_instances, i.instance_gbps, bench)
    if i.fit_load_beside and i.scheduler != "vllm":  # the fifo engine has no steps to put a load beside
        raise InvalidInput("--fit-load-beside draws by the engine's prefill when a load starts: give --scheduler vllm")
    var = variability.build(fit_from=i.fit_from, bench_from=i.bench_path,
                            async_instance_gbps=i.async_instance_gbps, async_overhead_s=i.async_overhead_s,
                            bytes_per_token=i.bytes_per_token, prefill_rate=i.prefill_rate, fit_gbps=fit_gbps, instances=i.instances,
                            t0_given_s=i.t0_s if i.t0_given else None, fit_loads_from=i.fit_loads,
                            async_load_s=i.async_load_s, fit_instances=fit_instances, fit_load_spread=i.fit_load_spread,
                            fit_load_beside=i.fit_load_beside)
    if i.bench_path and i.instance_gbps is not None:
        var = replace(var, notes=(*var.notes, f"--instance-gbps gives B ({i.instance_gbps:g} GB/s an instance): {i.bench_path}'s bandwidths are not used"))
    cfg = sim.SimConfig(i.bytes_per_token, i.prefill_rate, i.t0_s, fit_instances, i.instance_gbps, i.fit_loading or i.loading,
                        i.async_timeout_s, i.hit_fraction, i.seed, i.hits_from_trace)
    cfg, var = engine_model(i, cfg, fit_gbps, var)
    cfg = replace(cfg, loading=i.loading, policy=i.policy, scheduler=i.scheduler, sched_lag=i.sched_lag)  # fitted as the --fit-from run loaded, simulated at --loading
    process, cv, cv_note = arrival_process(i)
    if cv_note:
        var = replace(var, notes=(*var.notes, cv_note))
    if i.instances is None:
        cfg = replace(cfg, instances=1)
    elif cfg.instances != i.instances:  # fitted at --fit-instances, simulated at --instances
        cfg = replace(cfg, instances=i.instances)
    return Model(i, cfg, var, bench, process, cv, default_requests)


# --- kvctl simulate --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WhatIf:
    """What ``kvctl simulate`` found: one result (a FleetResult with ``fleet``), or one per point of a sweep."""

    inputs: Inputs
    source: str  # the workload's description
    notes: tuple[str, ...]  # where the inputs came from (the variability's and the fits' notes)
    fleet: bool
    result: SimResult | None = None  # without a sweep
    bandwidth: Bandwidth | None = None  # B_eff of that result and where it came from
    grid: dict[str, list[Any]] | None = None
    points: tuple[SweepPoint, ...] = ()
    bandwidths: tuple[Bandwidth, ...] = ()  # B_eff of each point


def whatif(i: Inputs, grid: dict[str, list[Any]] | None = None) -> WhatIf:
    """``kvctl simulate``: the model of ``i`` run once, or at every point of ``grid`` (:func:`kvctl.sim.simulate.parse_sweep`).

    Refused (InvalidInput, with the figures) before any allocation when the requests would not fit in memory, and
    when ``grid`` sweeps what only --arrival-rate's workload has (λ, prompt tokens) over a trace."""
    from kvctl.sim import fleet  # noqa: PLC0415 - numpy only when used
    from kvctl.sim import simulate as sim  # noqa: PLC0415
    from kvctl.sim import workload as sim_workload  # noqa: PLC0415

    if grid and i.trace_path and any(k in grid for k in POISSON_SWEEP_KEYS):
        raise InvalidInput("--sweep arrival_rate/prompt_tokens need Poisson mode (--arrival-rate)")
    model = build(i, SIMULATE_REQUESTS)
    sim_workload.check_memory(i.requests or (None if i.trace_path else SIMULATE_REQUESTS), fleet=model.fleet)
    if grid:
        runner = (lambda w, c, bw: fleet.simulate_fleet(w, c, bw, i.engines, model.var)) if model.fleet else None
        points = sim.sweep(model.cfg, grid, model.workload, model.bench, runner=runner)
        bws = tuple(sim_workload.bandwidth_for(p.parameters.get("instances", i.instances), p.parameters.get("instance_gbps", i.instance_gbps), model.bench)
                    for p in points)
        return WhatIf(i, model.workload().source, model.var.notes, model.fleet, grid=grid, points=tuple(points), bandwidths=bws)
    w = model.workload()
    bw = sim_workload.bandwidth_for(i.instances, i.instance_gbps, model.bench)
    res = fleet.simulate_fleet(w, model.cfg, bw.gbps, i.engines, model.var) if model.fleet else sim.simulate(w, model.cfg, bw.gbps)
    return WhatIf(i, w.source, model.var.notes, model.fleet, result=res, bandwidth=bw)


# --- kvctl plan --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sized:
    """What ``kvctl plan`` found: the search (kvctl.sim.plan), the notes of its inputs and the workload's description."""

    plan: PlanResult
    notes: tuple[str, ...]
    source: str


def size_tier(i: Inputs, *, slo_p99_s: float, rho_target: float, max_instances: int, loadings: Sequence[str],
              ranks: int | None = None) -> Sized:
    """``kvctl plan``: the fewest instances (W × K with ``ranks``) and the loading that meet ``p99 ≤ slo_p99_s`` at
    ρ ≤ ``rho_target`` for the model of ``i`` (``i.instances`` None: fitted at the bench's largest count)."""
    from kvctl.sim import plan as planner  # noqa: PLC0415 - numpy only when used

    model = build(i, PLAN_REQUESTS)
    w = model.workload()
    step = planner.server_step(i.bench_path, model.bench) if i.bench_path and model.bench and i.instance_gbps is None else None
    res = planner.plan(w, model.cfg, engines=i.engines, slo_p99_s=slo_p99_s, rho_target=rho_target, max_instances=max_instances,
                       instance_gbps=i.instance_gbps, bench=model.bench, var=model.var, loadings=loadings, ranks=ranks, first_step=step)
    return Sized(planner.with_layout(res, ranks), model.var.notes, w.source)
