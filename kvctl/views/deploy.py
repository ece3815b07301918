"""``kvctl deploy-valkey``: a started tier, the files rendered for systemd/k8s, a tier's status, a stopped tier."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from kvctl.core import render
from kvctl.core.files import write_atomic
from kvctl.tier import spec
from kvctl.tier.targets import TierState, state_path

if TYPE_CHECKING:
    from kvctl.drill.standalone import EngineStop
    from kvctl.tier.local import StopResult
    from kvctl.tier.status import TierStatus


def show_up(state: TierState, as_json: bool) -> None:
    """``up`` (local): every instance started, and what to run next."""
    if as_json:
        render.emit_json(
            {
                "dir": state.dir,
                "state_file": str(state_path(state.dir)),
                "maxmemory_per_instance": state.maxmemory_per_instance,
                "io_threads": state.io_threads,
                "auth": state.password_file is not None,
                "engine_user": state.engine_user,
                "instances_per_rank": state.instances_per_rank,
                "instances": [{"rank": i.rank, "instance": i.instance, "host": i.host, "port": i.port, "pid": i.pid, "url": i.url} for i in state.instances],
            }
        )
        return
    k = state.instances_per_rank
    render.table(
        f"Valkey tier in {state.dir} (valkey {state.server_version})" + (f": {state.ranks} ranks × {k} instances" if k > 1 else ""),
        ["rank", *(["inst"] if k > 1 else []), "host", "port", "pid", "url"],
        [(i.rank, *([i.instance] if k > 1 else []), i.host, str(i.port), str(i.pid), i.url) for i in state.instances],
        caption=(
            f"maxmemory {spec.format_size(state.maxmemory_per_instance)} per instance (allkeys-lru, no persistence) · io-threads {state.io_threads}"
            + (f" · auth on, engine user {state.engine_user}" if state.engine_user else "")
            + f"\nnext: kvctl deploy-valkey lmcache-config --dir {state.dir}  (LMCache) or vllm-config --dir {state.dir}  (kvctl's vLLM connector)"
        ),
    )


def show_rendered(target: str, out: Path, files: list[Path], applied: Any, remote_url: Any, ranks: int, instances_per_rank: int,
                  as_json: bool) -> None:
    """``up --target systemd|k8s|...``: the files rendered to --out, and what --apply did (or would do)."""
    if as_json:
        render.emit_json({"target": target, "out": str(out), "files": [str(f) for f in files], "applied": applied, "remote_url": remote_url})
        return
    layout = f"{ranks} rank(s)" + (f" × {instances_per_rank} instances" if instances_per_rank > 1 else "")
    render.table(f"{target}: {layout} rendered to {out}", ["file"], [(str(f),) for f in files])
    if applied:
        render.message(f"applied: {applied}")
    else:
        render.message(f"nothing installed or enabled; re-run with --apply to {'install and enable the units' if target == 'systemd' else 'kubectl apply'}")


def show_status(st: TierStatus, as_json: bool) -> None:
    """``status``: per instance, up, memory, keys, evictions, clients, GETs; each one down with its hint."""
    k = st.instances_per_rank
    if as_json:
        render.emit_json(st)
    else:
        render.table(
            f"Valkey tier in {st.dir}" if st.dir else "Valkey instances",
            ["rank", *(["inst"] if k > 1 else []), "port", "up", "used/max MiB", "keys", "evict", "conns", "GETs", "µs/GET"],
            [
                (
                    i.rank,
                    *([i.instance] if k > 1 else []),
                    str(i.port),
                    "[green]up[/]" if i.up else f"[red]{i.state}[/]",
                    f"{i.used_memory / 2**20:.1f}/{i.maxmemory / 2**20:.0f}" if i.up else "—",
                    i.keys,
                    i.evicted_keys,
                    i.connected_clients,
                    i.get_calls,
                    i.get_usec_per_call,
                )
                for i in st.instances
            ],
            caption="evict = evicted_keys, conns = other clients (not this status read), GETs/µs from INFO commandstats (— before the first GET)",
        )
    for i in st.instances:
        if not i.up:
            render.warn(f"{i.name} ({i.host}:{i.port}): {i.state}: {i.hint}")


def show_down(state: TierState, results: list[StopResult], purge: bool, timeout_s: float, as_json: bool,
              engine: EngineStop | None = None, left: list[str] | None = None) -> None:
    """``down``: what became of each instance (stopped, killed, not running, not ours), of the drill engine the tier's
    directory recorded, and what is left in the directory."""
    left = left or []
    if as_json:
        drill = None if engine is None else {"pid": engine.state.pid, "url": engine.state.url, "result": engine.result}
        render.emit_json({"dir": state.dir, "purged": purge, "instances": results, "drill_engine": drill, "left": left})
    else:
        styles = {"stopped": "green", "killed": "yellow", "not running": "yellow", "not ours": "red"}
        k = state.instances_per_rank
        render.table(
            f"Stopped tier in {state.dir}",
            ["rank", *(["inst"] if k > 1 else []), "port", "pid", "result", "port free"],
            [(r.rank, *([r.instance] if k > 1 else []), str(r.port), str(r.pid), f"[{styles[r.result]}]{r.result}[/]", r.port_free) for r in results],
        )
        _say_left(state.dir, purge, engine, left)
    for r in results:
        if r.result == "not ours":
            render.warn(f"{r.name}: {r.note or f'pid {r.pid} now belongs to another process; left it alone'}")
            continue
        if r.note:
            render.warn(f"{r.name} (pid {r.pid}): {r.result}, {r.note}")
        if r.result == "not running" and not state.stopped_at:  # stopped by an earlier `down`: its state says so, no surprise
            render.warn(f"{r.name}: no valkey-server of this tier was running (pid {r.pid})")
        elif r.result == "killed":
            render.warn(f"{r.name}: pid {r.pid} did not exit within --timeout {timeout_s:g}s of SIGTERM; sent SIGKILL")


def _say_left(tier_dir: str, purge: bool, engine: EngineStop | None, left: list[str]) -> None:
    """What ``down`` did to the drill engine of the tier, and what it left in the directory."""
    if engine is not None:
        what = {"stopped": "stopped", "killed": "killed (no exit within seconds of SIGTERM)",
                "not running": "was not running; its record removed"}[engine.result]
        render.literal(f"drill engine (pid {engine.state.pid}, {engine.state.url}) of this tier: {what}")
    if not left:
        render.literal(f"removed {tier_dir}" if purge else f"nothing left in {tier_dir}")
    elif purge:
        render.literal(f"left in {tier_dir} (not kvctl's, kept): {', '.join(left)}")
    else:
        render.literal(f"left in {tier_dir}: {', '.join(left)} (the tier's configs and logs: `kvctl deploy-valkey up --dir {tier_dir}` "
                       f"starts it again, `kvctl deploy-valkey down --dir {tier_dir} --purge` removes them)")


def show_engine_config(cfg: Any, text: Callable[[], str], out_file: Path | None, as_json: bool) -> None:
    """``lmcache-config``/``vllm-config``: the mapping as JSON, or its ``text`` (YAML, a JSON line, a shell argument)
    written to ``out_file`` (said on stderr) or printed on stdout as it is."""
    if as_json:
        render.emit_json(cfg)
        return
    if out_file:
        out_file.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out_file, text())
        render.message(f"wrote {out_file}", stderr=True)
    else:
        render.plain(text(), end="")
