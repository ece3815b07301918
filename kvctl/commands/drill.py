"""``kvctl drill [SCENARIO]``: on-call drills on this machine (a real tier, the drill engine, replay, diagnose)."""

from __future__ import annotations

import click

from kvctl import __version__, render
from kvctl.commands.options import count, output_options, positive
from kvctl.signals import Signalled, signals_raise
from kvctl.drill import scenarios as S
from kvctl.errors import ExitStatus
from kvctl.hooks import hookimpl


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
        _list(as_json)
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
    try:
        with signals_raise():
            for name in names:
                results.append(run_drill(name, DrillOptions(**{**opts.__dict__, "keep_dir": keeps[name]}), say))
    except Signalled as e:
        render.error_line(f"interrupted by {e.signal.name}: stopped everything the drill had started")
        raise click.exceptions.Exit(e.exit_code) from None
    passed = all(r.passed for r in results)
    code = ExitStatus.OK if passed else ExitStatus.DRILL_MISSED
    if as_json:
        data = [{**render.to_jsonable(r)} for r in results]
        render.emit_json({"kvctl_version": __version__, "passed": passed, "drills": data, "exit_code": int(code)} if run_all
                         else {"kvctl_version": __version__, **data[0], "exit_code": int(code)})
    elif run_all:
        render.table("Drills", ["scenario", "result", "expected", "verdict", "seconds"],
                     [(r.scenario, "PASS" if r.passed else "FAIL", r.expected, r.verdict, r.duration_s) for r in results])
    ctx.exit(int(code))


def _list(as_json: bool) -> None:
    rows = [(s.name, s.summary, s.expect, s.runbook or "") for s in S.SCENARIOS.values()]
    if as_json:
        render.emit_json({"scenarios": [{"name": n, "summary": m, "expect": e, "runbook": r or None} for n, m, e, r in rows]})
        return
    render.text_table("Drills (kvctl drill SCENARIO)", ["scenario", "what it plants", "diagnose must report", "runbook"], rows)


def _engine(tier_dir: str | None, stop: bool, model_config: str | None, as_json: bool) -> None:
    """Start the drill engine on a tier and leave it running (print its URL), or stop it."""
    from kvctl.drill import standalone  # noqa: PLC0415 - keep `kvctl --help` light

    if not tier_dir:
        raise click.UsageError("`kvctl drill engine` needs --dir, the tier it runs on (`kvctl deploy-valkey up --dir ...`)")
    if stop:
        state = standalone.stop(tier_dir)
        if as_json:
            render.emit_json({"stopped": state is not None, "pid": state.pid if state else None})
        elif state is None:
            render.message(f"no drill engine recorded in {tier_dir}", stderr=True)
        else:
            render.message(f"stopped the drill engine pid {state.pid} ({state.url})", stderr=True)
        return
    state = standalone.start(tier_dir, model_config)
    if as_json:
        render.emit_json(state)
        return
    click.echo(state.url)  # stdout is the URL alone: ENGINE=$(kvctl drill engine --dir ./kv-tier)
    render.message(
        f"drill engine pid {state.pid} on {state.ranks} rank(s), log {state.log}; model it with --prefill-rate {state.prefill_rate:g} "
        f"--t0 {state.t0_s:g} --bytes-per-token {state.bytes_per_token:g} --instance-gbps {state.instance_gbps:.3g} "
        f"(--async-instance-gbps {state.async_instance_gbps:.3g}); stop it: kvctl drill engine --stop --dir {tier_dir}", stderr=True)


def _samples(as_json: bool, sample: str | None = None) -> None:
    from kvctl.drill.samples import sample_commands, sample_paths  # noqa: PLC0415

    paths, cmds = sample_paths(), sample_commands()
    if sample:
        click.echo(str(paths[sample]))
        return
    if as_json:
        render.emit_json({k: {"path": str(paths[k]), "command": cmds[k]} for k in paths})
        return
    render.text_table("Bundled samples (from `kvctl drill overload`)", ["sample", "path", "try"], [(k, str(paths[k]), cmds[k]) for k in paths])
