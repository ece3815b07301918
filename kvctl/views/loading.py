"""``kvctl loading``: the mode each file sets, and a flip's diffs, writes and restart."""

from __future__ import annotations

import os
from pathlib import Path

from kvctl.loading import edit as loading

from kvctl.loading import flip as loading_flip

from kvctl.loading import vllm as loading_vllm

from kvctl.core import render
from kvctl.loading.types import SourceState


def _mode(value: bool | None, kind: str = "yaml") -> str:
    if value is None:
        return "not set (synchronous, " + ("LMCache's" if kind in ("yaml", "env") else "the connector's") + " default)"
    return "asynchronous" if value else "synchronous"


def _setting(kind: str) -> str:
    return {"yaml": loading.KEY, "env": loading.ENV_VAR}.get(kind, loading_vllm.SETTING)


def show_states(states: list[SourceState], as_json: bool) -> None:
    """``kvctl loading show``: which loading mode each file sets, the env-var form, and files that disagree."""
    process_env = os.environ.get(loading.ENV_VAR)
    if as_json:
        render.emit_json({"sources": states, "env_var": loading.ENV_VAR, "process_env": process_env})
        return
    render.table(
        "Loading mode",
        ["file", "kind", "setting", "line", "mode"],
        [(s.path, s.found or loading_vllm.DESCRIPTIONS[s.kind], _setting(s.kind), s.line, _mode(s.async_loading, s.kind)) for s in states],
        caption=None if all(s.kind in loading_vllm.KINDS for s in states) else f"env-var form: {loading.ENV_VAR}=True|False" + (f" (set here: {process_env})" if process_env is not None else ""),
    )
    values = {s.async_loading for s in states}
    if len(values) > 1:
        render.warn("the files disagree; check which one the engine actually reads")
    _unknown_keys(u for s in states for u in s.unknown_keys)


def _unknown_keys(found) -> None:
    """One warning per key a file's engine does not know, with the key it was probably meant to be."""
    for u in found:  # literal: a path or key may hold [...]
        render.literal(f"warning: {u.message()}", style="yellow", stderr=True)


def show_flip(result: loading_flip.FlipResult, as_json: bool) -> None:
    """``kvctl loading sync|async``: the flip's safety note, diffs, writes and restart (or their JSON)."""
    if as_json:
        _render_flip_json(result)
    else:
        _render_flip(result)


def _render_flip_json(result: loading_flip.FlipResult) -> None:
    restart = result.restart
    render.emit_json(
        {
            "mode": result.mode,
            "dry_run": result.dry_run,
            "changes": [{k: v for k, v in render.to_jsonable(c).items() if k != "new_text"} for c in result.changes],
            "env_var": loading.env_form(result.value),
            "safety": result.safety,
            "restart": None if restart is None else {**render.to_jsonable(restart), "ok": restart.ok},
        }
    )


def _render_flip(result: loading_flip.FlipResult) -> None:
    safety, restart = result.safety, result.restart
    if safety is not None:
        forced = safety.note.startswith("forced")
        render.literal(("warning: " if forced else "") + safety.note, style="yellow" if forced else None, stderr=forced)
    _unknown_keys(u for c in result.changes for u in c.unknown_keys)
    for c in result.changes:  # paths and diffs printed as they are: no markup, no wrapping
        if c.kind in loading_vllm.KINDS:
            render.literal(f"{c.path}: {loading_vllm.DESCRIPTIONS[c.kind]} found; editing {loading_vllm.SETTING}")
        if not c.changed:
            render.literal(f"{c.path}: already {_mode(c.after)}; nothing to change")
            continue
        render.literal(c.diff.rstrip("\n"))
        if result.dry_run:
            render.literal(f"{c.path}: dry run, not written")
        else:
            real = loading.real_path(c.path)
            via = f" (via the symlink {c.path})" if Path(c.path).is_symlink() else ""
            render.literal(f"{real}: now {_mode(c.after)}{via}" + (f" (backup: {c.backup})" if c.backup else ""), style="green")
    if any(c.kind in ("yaml", "env") for c in result.changes):
        render.message(f"env-var form: {loading.env_form(result.value)}")
    if result.restart_cmd and restart is None:
        render.message("restart command not run (nothing changed)" if not result.dry_run else "restart command not run (dry run)")
    elif restart is not None:
        status = "ok" if restart.ok else ("timed out" if restart.timed_out else f"exit {restart.returncode}")
        render.literal(f"restart `{restart.command}`: {status} in {restart.duration_s:.1f} s", style="green" if restart.ok else "red")
        if restart.output_tail.strip():
            render.literal(restart.output_tail.rstrip())
