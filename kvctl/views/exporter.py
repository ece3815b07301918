"""``kvctl exporter``: the line saying where it serves (one JSON line with --json), and the one saying it stopped."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvctl.core import render
from kvctl.diagnose.capture import merged_warning

if TYPE_CHECKING:
    from kvctl.ops.exporter_http import Server


def show_listening(server: Server, instances: int, interval_s: float, window_s: float, stale_after_s: float, as_json: bool) -> None:
    """Engines read once though named twice (first: a caller that reads the listening line and stops us has seen it),
    where /metrics is served and what is sampled, and a warning when that is not loopback only."""
    if server.exporter.merged:
        render.warn(merged_warning(server.exporter.merged))
    info: dict[str, Any] = {
        "metrics_url": server.url, "loopback_only": server.loopback, "engines": list(server.exporter.engine_labels),
        "valkey_instances": instances, "interval_s": interval_s, "window_s": window_s, "stale_after_s": stale_after_s,
    }
    if as_json:
        render.emit_json_line({"event": "listening", **info})
    else:
        render.message(f"serving {server.url} (sampling {len(info['engines'])} engine(s), {instances} Valkey instance(s) every {interval_s:g} s, window {window_s:g} s); Ctrl-C stops")
    if not server.loopback:
        render.warn(f"listening on {server.host}, which is not loopback: anyone who can reach this host reads the tier's metrics")


def show_stopped(rounds: int, ran_s: float, as_json: bool) -> None:
    """How long it ran and how many sampling rounds it took."""
    summary = {"event": "stopped", "rounds": rounds, "ran_s": round(ran_s, 3)}
    if as_json:
        render.emit_json_line(summary)
    else:
        render.message(f"stopped after {summary['ran_s']:g} s, {summary['rounds']} sampling round(s)")
