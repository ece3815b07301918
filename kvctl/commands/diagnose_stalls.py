"""``kvctl diagnose stalls``: stalled lookups from live py-spy stacks (paper §5.4).

Attached to the ``kvctl diagnose`` group as ``stalls_cmd``.
"""

from __future__ import annotations

import click

from kvctl.commands.options import FiniteFloat, output_options, severity_exit
from kvctl.diagnose import stalls
from kvctl.core.errors import KvctlError
from kvctl.views.diagnose import show_stalls


@click.command("stalls")
@click.option("--pid", "pids", type=click.IntRange(min=1), multiple=True, help="Process to inspect (repeatable: one per rank).")
@click.option(
    "--match",
    envvar="KVCTL_STALLS_MATCH",
    help="Inspect every process whose name or command line contains this text, e.g. `vllm`.",
)
@click.option("--samples", type=click.IntRange(min=2, max=100), default=3, show_default=True, help="py-spy dumps per process.")
@click.option(
    "--interval",
    type=FiniteFloat(min=0.05, max=60),
    default=1.0,
    show_default=True,
    help="Seconds between samples; a thread counts as stalled when it stays put across all of them.",
)
@output_options
@click.pass_context
def stalls_cmd(ctx: click.Context, pids: tuple[int, ...], match: str | None, samples: int, interval: float, as_json: bool) -> None:
    """Stalled lookups: sample thread stacks with py-spy and name the §5.4 stall signatures.

    \b
    lost-completion   a lookup blocked in a future's result() with nothing outstanding
    missing-key-get   a socket receive that never returns inside a remote GET
    lockstep-stall    a rank waiting in a torch.distributed collective its peer never entered
    Needs ptrace: run as root or the engine's user (SYS_PTRACE in containers).
    """
    as_json = as_json or bool(((ctx.parent.obj or {}) if ctx.parent else {}).get("group_options", {}).get("as_json"))
    targets = list(pids)
    if match:
        found = stalls.find_processes(match)
        if not found and not targets:
            raise KvctlError(f"no process matches {match!r} (searched process names and command lines)")
        targets += [p.pid for p in found if p.pid not in targets]
    if not targets:
        raise click.UsageError("give --pid PID (repeatable) or --match TEXT")
    report = stalls.diagnose_stalls(targets, samples=samples, interval_s=interval)
    show_stalls(report, as_json)
    code = severity_exit(report.worst_severity)
    if code:
        click.get_current_context().exit(int(code))
