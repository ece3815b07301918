"""``kvctl plan``: size a (shared) tier — fewest instances and the loading mode that meet a p99 SLO."""

from __future__ import annotations

import click

from kvctl.commands.options import output_options
from kvctl.commands.whatif_options import whatif_options
from kvctl.core.errors import ExitStatus
from kvctl.hooks import hookimpl
from kvctl.sim import model as sim_model


@hookimpl
def register_commands(cli: click.Group) -> None:
    cli.add_command(plan_cmd)


@click.command("plan")
@whatif_options("plan")
@output_options
@click.pass_context
def plan_cmd(ctx: click.Context, inputs: sim_model.Inputs, slo_p99_s: float, rho_target: float, max_instances: int, ranks: int | None,
             loading: str, plot: str | None, as_json: bool) -> None:
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

    sized = sim_model.size_tier(inputs, slo_p99_s=slo_p99_s, rho_target=rho_target, max_instances=max_instances,
                                loadings=("sync", "async") if loading == "both" else (loading,), ranks=ranks)
    if plot:
        plot_plan(plot, sized.plan)
    code = ExitStatus.OK if sized.plan.instances is not None else ExitStatus.SLO_UNMET
    show_plan(sized, as_json, code)
    ctx.exit(int(code))
