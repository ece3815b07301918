"""``kvctl exporter``: serve the diagnosis (ρ, λ, B, B*, findings) as Prometheus metrics."""

from __future__ import annotations

import logging
import signal
import textwrap
import time
from typing import Any

import click

from kvctl.core import thresholds
from kvctl.commands.diagnose import TIMEOUT_S, model_options
from kvctl.commands.options import WINDOW_HELP, FiniteFloat, engine_http, engine_http_options, output_options, positive, valkey_options, valkey_targets
from kvctl.diagnose.analysis import Params
from kvctl.hooks import hookimpl
from kvctl.core.signals import ExitNow, exit_now, on_signals
from kvctl.views.exporter import show_listening, show_stopped
from kvctl.ops.exporter import INSTANCE_LABEL, METRICS
from kvctl.core.thresholds import EXPORTER_MIN_INTERVAL_S, EXPORTER_STOP_S

INTERVAL_S = FiniteFloat(min=EXPORTER_MIN_INTERVAL_S, max=3600.0)
WINDOW_S = positive(86400.0)
DURATION_S = positive(10 * 365 * 86400.0)
log = logging.getLogger("kvctl.ops.exporter")


def _metric_lines(width: int = 95) -> list[str]:
    """Every series the exporter serves (kvctl.ops.exporter.METRICS), with its labels, wrapped for --help."""
    names = [n + ("{" + ",".join(labels) + "}" if labels else "") for n, (_, labels) in METRICS.items()]
    return textwrap.wrap("Metrics: " + ", ".join(names) + ".", width, break_on_hyphens=False, break_long_words=False)


HELP = "\n".join([
    "Serve kvctl diagnose's analysis as Prometheus metrics, over a sliding window of samples.",
    "",
    "\b",
    "kvctl exporter --engine-url http://HOST:8000 --dir ./kv-tier --bytes-per-token 48437.5 \\",
    "               --prefill-rate 52200 --interval 15 --window 60",
    *_metric_lines(),
    f"On tiers of K > 1 instances per rank, per-instance series also carry {INSTANCE_LABEL}.",
    "/metrics never waits on a component: a slow or dead one drops its *_up to 0 and the",
    "last good values age out after --stale-after. Alert rules and a Grafana dashboard:",
    "configs/prometheus/kvctl-alerts.yaml, configs/grafana/kvctl-dashboard.json.",
    f"SIGTERM or Ctrl-C stops it within {EXPORTER_STOP_S:g} s (EXPORTER_STOP_S: reads in flight are cut); a second one at once.",
])


@hookimpl
def register_commands(cli: click.Group) -> None:
    cli.add_command(exporter_cmd)


@click.command("exporter", help=HELP)
@click.option("--listen", default=thresholds.EXPORTER_LISTEN, show_default=True, envvar="KVCTL_EXPORTER_LISTEN", help="HOST:PORT to serve /metrics on (port 0: a free one). A non-loopback HOST is allowed and printed.")
@click.option("--engine-url", "engine_urls", multiple=True, envvar="KVCTL_ENGINE_URL", help="Engine base URL or /metrics URL (repeatable; another spelling of the same host and port is read once), e.g. http://HOST:8000.")
@engine_http_options
@valkey_options
@model_options
@click.option("--interval", "interval_s", type=INTERVAL_S, default=15.0, show_default=True, help=f"Seconds between samples (one /metrics read per engine, one INFO per instance); at least {EXPORTER_MIN_INTERVAL_S:g}.")
@click.option("--window", "window_s", type=WINDOW_S, default=thresholds.DIAGNOSIS_WINDOW_S, show_default=True, help=f"{WINDOW_HELP}: a sliding window, every value the diagnosis of the newest sample and the oldest kept in the last --window seconds (λ: of the states the engines published in it).")
@click.option("--timeout", "timeout_s", type=TIMEOUT_S, help=f"Per-source read timeout in seconds (default: --interval, at most {thresholds.READ_TIMEOUT_S:g}); a source that does not answer drops its *_up to 0.")
@click.option("--stale-after", "stale_after_s", type=WINDOW_S, help="Seconds a last good value is kept while a component is missing (default: max(--window, 3 x --interval)).")
@click.option("--duration", "duration_s", type=DURATION_S, help="Stop after this many seconds (default: run until Ctrl-C or SIGTERM).")
@output_options
@click.pass_context
def exporter_cmd(
    ctx: click.Context, listen: str, engine_urls: tuple[str, ...], engine_api_key_file: str | None, max_metrics_bytes: int,
    valkey_urls: tuple[str, ...], ranks: int | None, instances_per_rank: int | None, tier_dir: str | None, password_file: str | None, bytes_per_token: float | None, prefill_rate: float | None, t0: float | None,
    tier_gbps: float | None, interval_s: float,
    window_s: float, timeout_s: float | None, stale_after_s: float | None, duration_s: float | None, as_json: bool,
) -> None:
    from kvctl.ops.exporter import Exporter, ExporterConfig, check_config  # noqa: PLC0415
    from kvctl.ops.exporter_http import Server, parse_listen  # noqa: PLC0415

    if not engine_urls:
        raise click.UsageError("give --engine-url (repeatable)")
    targets = valkey_targets(valkey_urls, ranks, tier_dir, password_file, required=False, instances_per_rank=instances_per_rank)
    timeout_s = timeout_s if timeout_s is not None else min(thresholds.READ_TIMEOUT_S, interval_s)
    params = Params(bytes_per_token=bytes_per_token, prefill_rate=prefill_rate, t0_s=t0, bandwidth_gbps=tier_gbps)
    http = engine_http(engine_api_key_file, max_metrics_bytes)
    cfg = ExporterConfig(tuple(engine_urls), tuple(targets), params, interval_s, window_s, timeout_s, stale_after_s, http)
    check_config(cfg)
    where = parse_listen(listen)
    def logged(rnd: Any) -> None:  # kvctl -v exporter: one line per sampling round
        d = rnd.diagnosis
        what = rnd.error if d is None else f"outcome {d.outcome}, rho {d.rho}, findings {[f.id for f in d.findings]}"
        log.info("round took %.3f s, %d sample(s) in the window: %s", rnd.duration_s, rnd.samples_in_window, what)

    server = Server(Exporter(cfg), where, on_round=logged)

    # a second SIGTERM/Ctrl-C raises ExitNow: out without the orderly stop; kvctl.cli.main ends the process (nothing
    # here does: run in-process, by a test's CliRunner, this command returns or raises, whatever threads are alive).
    # The handlers are in place before the "listening" line: a supervisor that signals once it reads the line (a
    # test did, 2026-12-07) never finds the default action, which killed the process without its summary
    with on_signals(lambda sig: server.request_stop(), again=exit_now, signals=(signal.SIGTERM, signal.SIGINT)):
        show_listening(server, len(targets), interval_s, window_s, cfg.stale_s, as_json)
        started = time.time()
        try:
            server.wait(duration_s)
        except ExitNow:
            raise
        except BaseException:
            server.stop()
            raise
        server.stop()  # the handlers stay: a second SIGTERM/Ctrl-C during the stop raises ExitNow out of it
    show_stopped(server.exporter.rounds, time.time() - started, as_json)
    left = server.stragglers()
    if left:  # reads that ignored being cut: daemon threads of the exporter's own, left behind (they hold no exit)
        log.info("leaving %d reader thread(s) behind: %s", len(left), ", ".join(t.name for t in left))
