"""``kvctl drill [SCENARIO]``: on-call drills on this machine (a real tier, the drill engine, replay, diagnose)."""

from __future__ import annotations

import click

from kvctl.core import render
from kvctl.commands.options import count, output_options, positive
from kvctl.core.signals import signals_raise
from kvctl.drill import scenarios as S
from kvctl.core.errors import ExitStatus
from kvctl.hooks import hookimpl
from kvctl.views.drill import show_engine, show_results, show_samples, show_scenarios, show_stopped


@hookimpl
def register_commands(cli: click.Group) -> None:
    cli.add_command(drill_cmd)


def _duration(ctx: click.Context, param: click.Parameter, value: float) -> float:
    if value < S.MIN_DURATION_S:
        raise click.BadParameter(f"must be at least {S.MIN_DURATION_S:g} s (a warm-up and a diagnosis window), got {value:g}")
    return value


@click.command("drill")
@click.argument("scenario", required=False, type=click.Choice([*S.ORDER, "samples", "engine"]))
@click.option("--all", "run_all", is_flag=True, help="Run every scenario in turn (a self-test for a new host); exit 0 only when all pass.")
@click.option("--duration", type=positive(S.MAX_DURATION_S), default=S.DEFAULT_DURATION_S, show_default=True, callback=_duration,
              help="Seconds of traffic per drill (async-fix splits it before and after the flip); at least 8.")
@click.option("--keep", "keep_dir", type=click.Path(file_okay=False), help="Copy the drill's files (engine config and log, trace, run file, tier logs, capture) to this directory: a new or empty one, never a link.")
@click.option("--model-config", type=click.Path(dir_okay=False, exists=True), help="Model config.json whose chunk size the drill uses (default: configs/models/deepseek-v3.json, FP8).")
@click.option("--seed", type=count(2**32 - 1, min=0), default=0, show_default=True, help="Seed of the trace's arrival jitter.")
@click.option("--plant-nothing", is_flag=True, hidden=True, help="Leave the scenario's fault out (tests: the drill must then fail).")
@click.option("--path", "sample", type=click.Choice(["capture", "run", "trace", "calib"]), help="With `samples`: print this sample's path alone (for a shell: \"$(kvctl drill samples --path calib)\").")
@click.option("--dir", "tier_dir", type=click.Path(file_okay=False), help="With `engine`: the `kvctl deploy-valkey up` tier the drill engine runs on (its instances are its ranks).")
@click.option("--stop", is_flag=True, help="With `engine`: stop the drill engine `kvctl drill engine --dir` left running.")
@output_options
@click.pass_context
def drill_cmd(ctx: click.Context, scenario: str | None, run_all: bool, duration: float, keep_dir: str | None,
              model_config: str | None, seed: int, plant_nothing: bool, sample: str | None, tier_dir: str | None, stop: bool,
              as_json: bool) -> None:
    """Practise the on-call job: start a tier, an engine and traffic, plant a fault, and check diagnose finds it.

    \b
    kvctl drill                    list the scenarios
    kvctl drill overload           one instance at ρ ≈ 1.2: diagnose must say rho_unstable
    kvctl drill --all              every scenario (exit 0 only when diagnose finds every fault)
    kvctl drill samples            paths of the bundled samples and the commands that read them
    kvctl drill engine --dir D     the drill engine on your tier D, left running (prints its
                                   URL): a replay target; --stop stops it
    Everything runs on this machine on free loopback ports and is stopped at the end (also on
    Ctrl-C or SIGTERM). Exit code: 0 when diagnose reported what the drill planted, 7 when it
    did not, 8 when the drill could not run (a child died, the tier or engine did not start).
    """
    if (sample and scenario != "samples") or ((tier_dir or stop) and scenario != "engine"):
        raise click.UsageError("--path goes with `kvctl drill samples`, --dir and --stop with `kvctl drill engine`")
    if scenario == "samples":
        _samples(as_json, sample)
        return
    if scenario == "engine":
        _engine(tier_dir, stop, model_config, as_json)
        return
    if run_all and scenario:
        raise click.UsageError("give a SCENARIO or --all, not both")
    if not run_all and not scenario:
        show_scenarios(as_json)
        return
    from kvctl.drill.run import DrillOptions, run_drill  # noqa: PLC0415 - keep `kvctl --help` light
    from kvctl.drill.workdir import check_keep  # noqa: PLC0415

    names = list(S.ORDER) if run_all else [scenario]
    opts = DrillOptions(duration_s=duration, plant=not plant_nothing, model_config=model_config, seed=seed)
    say = (lambda text: None) if as_json else (lambda text: render.literal(text))
    keeps = {name: f"{keep_dir}/{name}" if keep_dir and run_all else keep_dir for name in names}
    for keep in keeps.values():  # every one before the first drill starts
        if keep:
            check_keep(keep)
    results = []
    with signals_raise(said="stopped everything the drill had started"):  # the drill unwinds, KvctlGroup says so: 128 + N
        for name in names:
            results.append(run_drill(name, DrillOptions(**{**opts.__dict__, "keep_dir": keeps[name]}), say))
    passed = all(r.passed for r in results)
    code = ExitStatus.OK if passed else ExitStatus.DRILL_MISSED
    show_results(results, run_all, code, as_json)
    ctx.exit(int(code))


def _engine(tier_dir: str | None, stop: bool, model_config: str | None, as_json: bool) -> None:
    """Start the drill engine on a tier and leave it running (print its URL), or stop it."""
    from kvctl.drill import standalone  # noqa: PLC0415 - keep `kvctl --help` light

    if not tier_dir:
        raise click.UsageError("`kvctl drill engine` needs --dir, the tier it runs on (`kvctl deploy-valkey up --dir ...`)")
    if stop:
        show_stopped(tier_dir, standalone.stop(tier_dir), as_json)
        return
    show_engine(tier_dir, standalone.start(tier_dir, model_config), as_json)


def _samples(as_json: bool, sample: str | None = None) -> None:
    from kvctl.drill.samples import sample_commands, sample_paths  # noqa: PLC0415

    paths, cmds = sample_paths(), sample_commands()
    if sample:
        render.plain(str(paths[sample]))
        return
    show_samples(paths, cmds, as_json)
