"""Options and rendering shared by ``kvctl simulate`` and ``kvctl plan`` for fleets with variability."""

from __future__ import annotations

from typing import Any

import click

from kvctl import render
from kvctl.commands.options import count, non_negative, options, positive

ENGINES = count(1024)


#: ``--engines`` and the variability sources (see kvctl.variability).
fleet_options = options(
    click.option("--engines", type=ENGINES, default=1, show_default=True,
                 help="Engines sharing the tier, each with its own queue; --rate is per engine, a --trace is the whole fleet's arrivals (dealt to engines at random)."),
    click.option("--fit-from", type=click.Path(dir_okay=False), help="`kvctl replay --out` run file: T0 as the distribution its hits show (a low-load run fits best)."),
    click.option("--get-times-from", type=click.Path(dir_okay=False), help="`kvctl bench --save` file: GET time spread from its p50/p99 per batch (lognormal, mean kept)."),
    click.option("--readers-from", type=click.Path(dir_okay=False), help="`kvctl bench --sweep --save` file: an instance's throughput against concurrent readers."),
    click.option("--async-instance-gbps", type=positive(1e6), help="async: per-instance bandwidth of prefetches (the rank-0 store reads with one client), if not the sync one."),
    click.option("--async-overhead", "async_overhead_s", type=non_negative(3600), default=0.0, show_default=True, help="async: seconds of latency every request pays for the asynchronous lookup."),
)


FLEET_COLS = ["engine", "requests", "hits", "timeouts", "ρ", "GPU busy", "p50 s", "p90 s", "p99 s", "max s", "max queue"]


def render_fleet(res: Any, title: str) -> None:
    """The fleet's line, one line per engine, then where the inputs came from and what was extrapolated."""
    rows = [[e.engine, e.requests, e.hits, e.timeouts, e.rho, e.gpu_busy_frac, e.p50_s, e.p90_s, e.p99_s, e.max_s, e.max_queue]
            for e in res.per_engine]
    rows.append(["fleet", res.requests, res.hits, res.timeouts, res.rho, res.gpu_busy_frac, res.p50_s, res.p90_s, res.p99_s,
                 res.max_s, res.max_queue])
    lines = [f"tier ρ per instance (all engines) {render.fmt(res.tier_rho)} · stable {res.stable} · B_eff {res.bandwidth_gbps:g} GB/s · solver: {res.solver}"]
    lines += [f"input: {n}" for n in res.notes]
    lines += [f"EXTRAPOLATED: {x}" for x in res.extrapolated]
    if res.stable is False:
        lines.append("ρ ≥ 1: a queue grows for as long as requests keep arriving")
    render.table(title, FLEET_COLS, rows, caption="\n".join(lines))
