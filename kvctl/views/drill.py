"""``kvctl drill``: the scenarios, the drills' verdicts, the bundled samples and the drill engine left running."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kvctl import __version__

from kvctl.core import render
from kvctl.drill import scenarios as S

if TYPE_CHECKING:
    from kvctl.drill.run import DrillResult
    from kvctl.drill.standalone import EngineState


def show_scenarios(as_json: bool) -> None:
    """``kvctl drill``: every scenario, what it plants and what diagnose must report."""
    rows = [(s.name, s.summary, s.expect, s.runbook or "") for s in S.SCENARIOS.values()]
    if as_json:
        render.emit_json({"scenarios": [{"name": n, "summary": m, "expect": e, "runbook": r or None} for n, m, e, r in rows]})
        return
    render.text_table("Drills (kvctl drill SCENARIO)", ["scenario", "what it plants", "diagnose must report", "runbook"], rows)


def show_results(results: list[DrillResult], run_all: bool, code: int, as_json: bool) -> None:
    """The drills run: one JSON object (all of them with --all), or the table of --all (one drill said its steps)."""
    passed = all(r.passed for r in results)
    if as_json:
        data = [{**render.to_jsonable(r)} for r in results]
        render.emit_json({"kvctl_version": __version__, "passed": passed, "drills": data, "exit_code": int(code)} if run_all
                         else {"kvctl_version": __version__, **data[0], "exit_code": int(code)})
    elif run_all:
        render.table("Drills", ["scenario", "result", "expected", "verdict", "seconds"],
                     [(r.scenario, "PASS" if r.passed else "FAIL", r.expected, r.verdict, r.duration_s) for r in results])


def show_engine(tier_dir: str, state: EngineState, as_json: bool) -> None:
    """``kvctl drill engine --dir``: its URL alone on stdout (``ENGINE=$(kvctl drill engine --dir ./kv-tier)``), and on
    stderr how to model it and how to stop it."""
    if as_json:
        render.emit_json(state)
        return
    render.plain(state.url)
    render.message(
        f"drill engine pid {state.pid} on {state.ranks} rank(s), log {state.log}; model it with --prefill-rate {state.prefill_rate:g} "
        f"--t0 {state.t0_s:g} --bytes-per-token {state.bytes_per_token:g} --instance-gbps {state.instance_gbps:.3g} "
        f"(--async-instance-gbps {state.async_instance_gbps:.3g}); stop it: kvctl drill engine --stop --dir {tier_dir}", stderr=True)


def show_stopped(tier_dir: str, state: EngineState | None, as_json: bool) -> None:
    """``kvctl drill engine --stop``: the drill engine stopped, or none recorded."""
    if as_json:
        render.emit_json({"stopped": state is not None, "pid": state.pid if state else None})
    elif state is None:
        render.message(f"no drill engine recorded in {tier_dir}", stderr=True)
    else:
        render.message(f"stopped the drill engine pid {state.pid} ({state.url})", stderr=True)


def show_samples(paths: dict[str, Path], commands: dict[str, str], as_json: bool) -> None:
    """``kvctl drill samples``: each bundled sample's path and a command that reads it."""
    if as_json:
        render.emit_json({k: {"path": str(paths[k]), "command": commands[k]} for k in paths})
        return
    render.text_table("Bundled samples (from `kvctl drill overload`)", ["sample", "path", "try"], [(k, str(paths[k]), commands[k]) for k in paths])
