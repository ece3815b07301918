"""``kvctl bench``: real GET bandwidth of the remote tier, per instance and at scale (paper Fig. 3)."""

from __future__ import annotations

import signal
import threading

import click

from kvctl.core import render

from kvctl.core import thresholds
from kvctl.commands.options import BYTES_PER_TOKEN, CHUNK_TOKENS, PREFILL_RATE, PREFILL_RATE_HELP, TP, ByteSize, count, output_options, plot_option, positive, valkey_options, valkey_targets
from kvctl.core.errors import ExitStatus, InvalidInput
from kvctl.hooks import hookimpl
from kvctl.core.kvsize import DTYPE_BYTES
from kvctl.core.signals import exit_code, on_signals
from kvctl.tier.targets import NAMING

#: A value beyond 4 GiB is not a KV chunk (Valkey's own limit is 512 MB per string by default).
CHUNK_BYTES = ByteSize(4 * 2**30)
SECONDS = positive(86400.0)


#: SIGINT (Ctrl-C) and SIGTERM stop a bench, which then cleans up; a second one aborts at once
BENCH_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _abort(sig: signal.Signals) -> None:
    raise KeyboardInterrupt  # a second signal: no more cleanup


@hookimpl
def register_commands(cli: click.Group) -> None:
    cli.add_command(bench_cmd)


@click.command("bench")
@valkey_options
@click.option("--embedded", type=count(256), help="Start N local valkey-servers for the run and stop them after.")
@click.option("--embedded-maxmemory", type=ByteSize(2**50), help="TOTAL memory of the --embedded tier, split evenly over its N instances, as `deploy-valkey up --maxmemory` (default: sized for instances × clients × batch × chunk, within half the host's available memory).")
@click.option("--chunk-bytes", type=CHUNK_BYTES, help="Bytes per value, a size (12.4e6, 12MiB, 400kb; default 12.4e6: one 256-token GLM-5.3 FP8 chunk).")
@click.option("--model-config", type=click.Path(dir_okay=False), help="config.json to derive the chunk size (and bytes per token) from.")
@click.option("--chunk-tokens", type=CHUNK_TOKENS, default=thresholds.CHUNK_TOKENS, show_default=True, help="Tokens per chunk with --model-config.")
@click.option("--dtype", type=click.Choice(sorted(DTYPE_BYTES)), help="KV dtype with --model-config.")
@click.option("--tp", type=TP, default=1, show_default=True, help="Tensor-parallel ranks with --model-config (one instance each): the chunk is one rank's; the verdict's s stays the whole model's.")
@click.option("--batch", type=count(4096), default=8, show_default=True, help="Chunks per pipelined GET batch (one rank's share of a prompt).")
@click.option("--clients", type=count(4096), help="Client processes per instance (default: with --dir one per I/O thread of the tier's instances, at least 2 and at most 16, the connections an engine keeps busy on them; else 1; with --sweep, the largest count, default = instances).")
@click.option("--duration", type=SECONDS, default=10.0, show_default=True, help="Seconds per run.")
@click.option("--keys", type=count(10**9), help="Distinct keys per instance (default: about 1 GB of values, within maxmemory).")
@click.option("--write", is_flag=True, help="Also measure SET bandwidth (a write run before each GET run).")
@click.option("--sweep", is_flag=True, help="Figure 3 grid: 1 instance with 1, 2, 4… clients, then 2, 4… instances with one client each.")
@click.option("--engines", type=count(256), help="Contention curve: 1, 2, 4 … E engines sharing every instance, each one client per instance whose ranks load their shares of a prompt together.")
@click.option("--timeout", "timeout_s", type=positive(3600.0), default=thresholds.BENCH_TIMEOUT_S, show_default=True, help="Seconds any socket operation may take before it counts as an error.")
@click.option("--seed", type=count(2**32 - 1, min=0), default=0, show_default=True, help="Seed of the key order of every client.")
@click.option("--prefill-rate", type=PREFILL_RATE, help=f"{PREFILL_RATE_HELP}; with bytes per token, ends with the verdict against B* = s·R.")
@click.option("--bytes-per-token", type=BYTES_PER_TOKEN, help="KV bytes per token s of the WHOLE model (all ranks) for the verdict (or --model-config).")
@click.option("--save", type=click.Path(dir_okay=False), help="Also write the JSON result to FILE.")
@plot_option("the scaling chart (with --engines, the contention curve)")
@output_options
@click.pass_context
def bench_cmd(
    ctx: click.Context,
    valkey_urls: tuple[str, ...],
    ranks: int | None,
    instances_per_rank: int | None,
    tier_dir: str | None,
    embedded: int | None,
    embedded_maxmemory: int | None,
    password_file: str | None,
    chunk_bytes: float | None,
    model_config: str | None,
    chunk_tokens: int,
    dtype: str | None,
    tp: int,
    batch: int,
    clients: int | None,
    duration: float,
    keys: int | None,
    write: bool,
    sweep: bool,
    engines: int | None,
    timeout_s: float,
    seed: int,
    prefill_rate: float | None,
    bytes_per_token: float | None,
    save: str | None,
    plot: str | None,
    as_json: bool,
) -> None:
    """GET bandwidth of the remote tier: per instance, over clients, and one instance per rank (or K).

    \b
    Each client is its own process fetching --batch chunks per pipelined request
    into preallocated buffers (the engine's RESP client). Server-side numbers come
    from INFO commandstats/stats deltas of every instance. Exit 5 when any instance
    failed during the run (killed, stalled, refusing). A tier of K instances per
    rank (--dir, or --instances-per-rank K with --valkey) is measured per
    instance (rank r instance i) and per rank (the sum over its K instances);
    --batch is then one instance's share.
    \b
    SIGINT (Ctrl-C) or SIGTERM stops the clients, deletes the bench keys, stops
    --embedded servers, prints what was measured and exits 130 or 143 (a second
    signal aborts at once). Bench keys carry a TTL, so a SIGKILLed bench's expire.
    \b
    Examples:
      kvctl bench --embedded 2 --sweep --chunk-bytes 4e6 --duration 2
      kvctl bench --valkey 'resp://valkey-{rank}:6379' --ranks 8 --sweep --prefill-rate 52200 --bytes-per-token 48437.5
    """
    from kvctl.bench.session import BenchRequest, bench, report_data, save as save_report  # noqa: PLC0415 - the workers load when a bench runs
    from kvctl.views.bench import plot_report, show_bench, show_errors, show_interrupted  # noqa: PLC0415

    if embedded and (valkey_urls or tier_dir or ranks):
        raise InvalidInput("--embedded starts its own instances; do not combine it with --valkey, --ranks or --dir")
    if not embedded and not (valkey_urls or tier_dir or ranks):
        raise InvalidInput(f"name the Valkey instances to bench with {NAMING}, or start some with --embedded N")
    if engines and (sweep or clients):
        raise click.UsageError("--engines runs its own grid (one client per engine per instance): drop --sweep and --clients")
    named = [] if embedded else valkey_targets(valkey_urls, ranks, tier_dir, password_file, instances_per_rank=instances_per_rank)
    if clients is None and not (sweep or engines or valkey_urls or ranks):
        from kvctl.bench.sizing import tier_clients  # noqa: PLC0415

        clients = tier_clients(tier_dir)
    req = BenchRequest(tuple(named), embedded, embedded_maxmemory, chunk_bytes, model_config, chunk_tokens, dtype, tp, batch,
                       ctx.get_parameter_source("batch") != click.core.ParameterSource.COMMANDLINE, clients, duration, keys, write, sweep,
                       engines, timeout_s, seed, prefill_rate, bytes_per_token)
    stop_requested = threading.Event()
    with on_signals(lambda sig: stop_requested.set(), again=_abort, signals=BENCH_SIGNALS) as caught:
        outcome = bench(req, progress=lambda total_s: render.progress("bench", total=total_s, enabled=not as_json, what="bench", unit=" s"),
                        warn=render.warn, stop_requested=stop_requested)
    report = outcome.report
    data = report_data(report, caught[0].name if caught else None)
    if save:
        save_report(save, data)
    if plot:
        plot_report(report, plot)
    show_bench(outcome, data, as_json, tp)
    if caught:
        show_interrupted(report, caught[0].name, duration, bool(embedded))
        ctx.exit(exit_code(caught[0]))
    if report.errors:
        show_errors(report)
        ctx.exit(int(ExitStatus.UNREACHABLE))
