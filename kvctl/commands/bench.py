"""``kvctl bench``: real GET bandwidth of the remote tier, per instance and at scale (paper Fig. 3)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from typing import TYPE_CHECKING

import click

from kvctl import cost, render, thresholds
from kvctl.commands.options import BYTES_PER_TOKEN, CHUNK_TOKENS, PREFILL_RATE, TP, ByteSize, count, output_options, positive, valkey_options, valkey_targets
from kvctl.errors import ExitStatus, InvalidInput
from kvctl.files import write_atomic
from kvctl.hooks import hookimpl
from kvctl.kvsize import DTYPE_BYTES
from kvctl.signals import exit_code, on_signals
from kvctl.tier.targets import NAMING

if TYPE_CHECKING:
    from kvctl.bench.results import BenchReport, RunResult

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
@click.option("--embedded-maxmemory", type=ByteSize(2**50), help="maxmemory of each --embedded instance (default: sized for instances × clients × batch × chunk, within half the host's available memory).")
@click.option("--chunk-bytes", type=CHUNK_BYTES, help="Bytes per value, a size (12.4e6, 12MiB, 400kb; default 12.4e6: one 256-token GLM-5.3 FP8 chunk).")
@click.option("--model-config", type=click.Path(dir_okay=False), help="config.json to derive the chunk size (and bytes per token) from.")
@click.option("--chunk-tokens", type=CHUNK_TOKENS, default=thresholds.CHUNK_TOKENS, show_default=True, help="Tokens per chunk with --model-config.")
@click.option("--dtype", type=click.Choice(sorted(DTYPE_BYTES)), help="KV dtype with --model-config.")
@click.option("--tp", type=TP, default=1, show_default=True, help="Tensor-parallel ranks with --model-config (one instance each): the chunk is one rank's; the verdict's s stays the whole model's.")
@click.option("--batch", type=count(4096), default=8, show_default=True, help="Chunks per pipelined GET batch (one rank's share of a prompt).")
@click.option("--clients", type=count(4096), help="Client processes per instance (default 1; with --sweep, the largest count, default = instances).")
@click.option("--duration", type=SECONDS, default=10.0, show_default=True, help="Seconds per run.")
@click.option("--keys", type=count(10**9), help="Distinct keys per instance (default: about 1 GB of values, within maxmemory).")
@click.option("--write", is_flag=True, help="Also measure SET bandwidth (a write run before each GET run).")
@click.option("--sweep", is_flag=True, help="Figure 3 grid: 1 instance with 1, 2, 4… clients, then 2, 4… instances with one client each.")
@click.option("--engines", type=count(256), help="Contention curve: 1, 2, 4 … E engines sharing every instance, each one client per instance whose ranks load their shares of a prompt together.")
@click.option("--timeout", "timeout_s", type=positive(3600.0), default=thresholds.BENCH_TIMEOUT_S, show_default=True, help="Seconds any socket operation may take before it counts as an error.")
@click.option("--seed", type=count(2**32 - 1, min=0), default=0, show_default=True, help="Seed of the key order of every client.")
@click.option("--prefill-rate", type=PREFILL_RATE, help="Prefill tokens/s R; with bytes per token, ends with the verdict against B* = s·R.")
@click.option("--bytes-per-token", type=BYTES_PER_TOKEN, help="KV bytes per token s of the WHOLE model (all ranks) for the verdict (or --model-config).")
@click.option("--save", type=click.Path(dir_okay=False), help="Also write the JSON result to FILE.")
@click.option("--plot", type=click.Path(dir_okay=False), help="Draw the scaling chart to FILE.png.")
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
    # multiprocessing, the RESP client and the workers load only when a bench runs, not for `kvctl --help`
    import psutil  # noqa: PLC0415

    from kvctl.bench.runner import embedded_tier, run_bench  # noqa: PLC0415
    from kvctl.bench.spec import BenchSpec, check_host, grid, size_embedded  # noqa: PLC0415

    if embedded and (valkey_urls or tier_dir or ranks):
        raise InvalidInput("--embedded starts its own instances; do not combine it with --valkey, --ranks or --dir")
    if not embedded and not (valkey_urls or tier_dir or ranks):
        raise InvalidInput(f"name the Valkey instances to bench with {NAMING}, or start some with --embedded N")
    if engines and (sweep or clients):
        raise click.UsageError("--engines runs its own grid (one client per engine per instance): drop --sweep and --clients")
    from kvctl.bench.sizing import bench_sizes  # noqa: PLC0415

    named = [] if embedded else valkey_targets(valkey_urls, ranks, tier_dir, password_file, instances_per_rank=instances_per_rank)
    chunk_source = None
    if named and chunk_bytes is None and not model_config:  # the tier's own chunks, when its engines stored some
        from kvctl.bench.info import tier_chunk_bytes  # noqa: PLC0415
        from kvctl.bench.runner import url_with_password  # noqa: PLC0415

        with contextlib.suppress(Exception):  # an instance that does not answer is the bench's to report
            chunk_bytes = tier_chunk_bytes([url_with_password(t) for t in named], timeout_s)
        chunk_source = "the largest of a few random keys per instance (the chunks the tier holds)" if chunk_bytes else None
    sizes = bench_sizes(chunk_bytes, model_config, dtype, chunk_tokens, tp, bytes_per_token, prefill_rate)
    chunk, bytes_per_token, params = sizes.chunk_bytes, sizes.bytes_per_token, dict(sizes.parameters)
    if chunk_source:
        params["chunk_source"] = chunk_source
    fit_batch = ctx.get_parameter_source("batch") != click.core.ParameterSource.COMMANDLINE

    def make_spec(instances: int, n_keys: int | None, warn: bool = True) -> BenchSpec:
        spec = BenchSpec(chunk_bytes=chunk, batch=batch, clients=clients or (instances if sweep else 1), duration_s=duration,
                         keys=n_keys, write=write, sweep=sweep, timeout_s=timeout_s, seed=seed, engines=engines or 0,
                         fit_batch=fit_batch)  # fmt: skip
        spec.check()
        for w in check_host(instances, spec, os.cpu_count() or 1, psutil.virtual_memory().available):
            if warn:
                render.warn(w)
        return spec

    stop_requested = threading.Event()

    def go(targets, n_keys: int | None = keys) -> BenchReport:
        spec = make_spec(len(targets), n_keys)
        n_runs = len(grid(len(targets), spec)) * (2 if write else 1)
        with render.progress("bench", total=n_runs * duration, enabled=not as_json, what="bench", unit=" s") as advance:
            state = {"label": None, "elapsed": 0.0}

            def on_progress(label: str, elapsed: float, dur: float, live_gbps: float) -> None:
                if label != state["label"]:
                    if state["label"] is not None:
                        advance(max(0.0, dur - state["elapsed"]))
                    state.update(label=label, elapsed=0.0)
                advance(max(0.0, elapsed - state["elapsed"]), description=f"{label}: {live_gbps:.2f} GB/s", step=label)
                state["elapsed"] = max(state["elapsed"], elapsed)

            return run_bench(targets, spec, on_progress, bytes_per_token, prefill_rate, params, stop_requested=stop_requested)

    with on_signals(lambda sig: stop_requested.set(), again=_abort, signals=BENCH_SIGNALS) as caught:
        if embedded:
            n_keys = keys
            if embedded_maxmemory is None:
                sizing = size_embedded(embedded, make_spec(embedded, keys, warn=False), psutil.virtual_memory().available)
                embedded_maxmemory, n_keys = sizing.maxmemory_bytes, sizing.keys
            params["embedded_maxmemory_bytes"] = embedded_maxmemory
            with embedded_tier(embedded, embedded_maxmemory) as targets:
                report = go(targets, n_keys)
        else:
            report = go(named)

    note = report.metadata.parameters.get("sizing_note")
    if note and not as_json:
        render.warn(note)
    if chunk_source and not as_json:
        render.message(f"values of {chunk / 1e6:g} MB: {chunk_source}", stderr=True)
    data = render.to_jsonable(report)
    data["errors"] = report.errors
    data["interrupted"] = caught[0].name if caught else None
    if save:
        try:
            write_atomic(save, json.dumps(render.finite_json(data), indent=2, allow_nan=False) + "\n")
        except OSError as e:
            raise InvalidInput(f"cannot write --save {save}: {e.strerror or e}") from e
    if plot:
        plot_report(report, plot)
        render.message(f"plot: wrote {plot}", stderr=True)
    if as_json:
        render.emit_json(data)
    else:
        render_report(report)
        if report.verdict and tp > 1 and report.verdict.ranks != tp:
            had = f"{report.verdict.ranks} instance(s)" if report.verdict.instances in (0, report.verdict.ranks) else (
                f"{report.verdict.ranks} rank(s) ({report.verdict.instances} instances)")
            render.warn(f"--tp {tp}, but the verdict's run had {had}: it judges the tier measured; "
                        f"bench {tp} instances (one per rank) for the engine's tier")
    if caught:
        sig = caught[0]
        last = f"; the last lasted {report.runs[-1].duration_s:.1f} s of {duration:g} s" if report.runs else ""
        render.error_line(
            f"interrupted by {sig.name}: {len(report.runs)} of {report.runs_planned} run(s) measured{last}; "
            "bench keys deleted" + ("; embedded servers stopped" if embedded else "")
        )
        ctx.exit(exit_code(sig))
    if report.errors:
        for run in report.runs:
            for inst in run.per_instance:
                if inst.errors:
                    render.error_line(
                        f"{run.op.upper()} {run.instances}×{run.clients}: {inst.name or f'rank {inst.rank}'} ({inst.url}): "
                        f"{inst.errors} error(s), first: {inst.first_error}"
                    )
        ctx.exit(int(ExitStatus.UNREACHABLE))


def _f(x: float | None, digits: int) -> str:
    return "—" if x is None else f"{x:,.{digits}f}"


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.0f}%"


def render_report(report: BenchReport) -> None:
    """The runs table, then misses/verdict notes."""
    p = report.metadata.parameters
    k = p.get("instances_per_rank", 1)
    rows = []
    for r in report.runs:
        usec = r.server_usec_per_get if r.op == "get" else r.server_usec_per_set
        per_inst = " ".join(f"{g:.2f}" for g in r.per_instance_gbps)
        if k > 1:  # grouped by rank: "r0 1.20+1.31 = 2.51"
            per_inst = "  ".join(
                f"r{rank} " + "+".join(f"{q.client_gbps:.2f}" for q in r.per_instance if q.rank == rank) + f" = {g:.2f}"
                for rank, g in zip(sorted({q.rank for q in r.per_instance}), r.per_rank_gbps))
        rows.append((
            r.op.upper(), f"{r.instances}×{r.clients}", _f(r.aggregate_gbps, 2),
            per_inst,
            "—" if r.scaling_vs_1x1 is None else f"{r.scaling_vs_1x1:.2f}×",
            _f(r.p50_batch_ms, 1), _f(r.p99_batch_ms, 1), _f(usec, 0), _pct(r.server_busy_frac), _f(r.server_gbps, 2),
            f"[red]{r.errors}[/]" if r.errors else "0",
        ))
    caption = (
        f"{p['chunk_bytes'] / cost.MB:g} MB values, batches of {p['batch']}, {p['duration_s']:g} s per run"
        + (f" (INTERRUPTED: {len(report.runs)} of {report.runs_planned} runs, the last ran {report.runs[-1].duration_s:.1f} s), " if report.interrupted and report.runs else ", ")
        + f"{p['keys_per_instance']} keys per instance · valkey {', '.join(sorted(set(report.metadata.server_versions)))} (io-threads {', '.join(sorted({str(n) if n else '?' for n in report.metadata.server_io_threads})) or '?'}) · "
        f"{report.metadata.host_cores} cores\ninst×cl = instances × clients each · ms per batch · GB = 1e9 bytes\nµs/op, busy (busiest main thread), srv GB/s: INFO deltas"
        + (f"\n{k} instances per rank: per inst grouped by rank, rN a+b = rank N's instances and their sum (what rank N loads at once)" if k > 1 else "")
    )
    render.table(
        "kvctl bench",
        ["op", "inst×cl", "GB/s", "per inst", "vs 1×1", "p50 ms", "p99 ms", "µs/op", "busy", "srv GB/s", "err"],
        rows,
        caption=caption,
    )
    if any(r.per_engine for r in report.runs):
        render_engines(report)
    misses = sum(r.misses for r in report.runs)
    if misses:
        render.warn(f"{misses} GETs missed (evicted keys?): lower --keys or raise maxmemory")
    v = report.verdict
    if v is not None:
        style = "green" if v.loading_wins else "red"
        render.message(f"verdict: {v.text}", style=style)


def render_engines(report: BenchReport) -> None:
    """bench --engines: the contention curve, one row per engine count."""
    rows = []
    for r in report.runs:
        if not r.per_engine:
            continue
        per = [e.gbps for e in r.per_engine]
        p50 = [e.p50_prompt_ms for e in r.per_engine if e.p50_prompt_ms is not None]
        p99 = [e.p99_prompt_ms for e in r.per_engine if e.p99_prompt_ms is not None]
        srv_bytes = sum(p.server_net_bytes or 0 for p in r.per_instance)
        rows.append((
            r.engines, r.instances, _f(r.aggregate_gbps, 2), " ".join(f"{g:.2f}" for g in r.per_instance_gbps),
            f"{min(per):.2f}–{max(per):.2f}", _f(max(p50) if p50 else None, 1), _f(max(p99) if p99 else None, 1),
            sum(e.prompts for e in r.per_engine), _pct(r.server_busy_frac), f"{srv_bytes / 1e9:.2f}",
        ))
    render.table(
        "kvctl bench --engines: engines sharing the instances",
        ["engines", "inst", "GB/s", "per inst", "per engine", "prompt p50 ms", "prompt p99 ms", "prompts", "busy", "srv GB"],
        rows,
        caption="prompt = one batch on every instance, the engine's ranks started together; p50/p99: the slowest engine's\n"
        "per engine: min–max GB/s of the engines' ranks together · busy: busiest main thread · srv GB: bytes the servers sent (INFO)",
    )


def plot_report(report: BenchReport, path: str) -> None:
    """Aggregate GB/s over total clients: one instance (more clients) vs one instance per client."""
    series: dict[str, tuple[list[float], list[float]]] = {}
    eng = [r for r in report.runs if r.per_engine]
    if eng:  # the contention curve
        series["aggregate"] = ([r.engines for r in eng], [r.aggregate_gbps for r in eng])
        series["per engine (mean)"] = ([r.engines for r in eng], [sum(e.gbps for e in r.per_engine) / len(r.per_engine) for r in eng])
        render.line_plot(path, f"GET bandwidth, {eng[0].instances} instance(s) shared by E engines", "engines E", "GB/s", series)
        return
    for op in ("get", "set"):
        runs: list[RunResult] = [r for r in report.runs if r.op == op]
        if not runs:
            continue
        suffix = "" if op == "get" else " (SET)"
        one = [r for r in runs if r.instances == 1]
        many = [r for r in runs if r.clients == 1]
        if one:
            series[f"1 instance, N clients{suffix}"] = ([r.clients for r in one], [r.aggregate_gbps for r in one])
        if len(many) > 1 or not one:
            series[f"N instances, 1 client each{suffix}"] = ([r.instances for r in many], [r.aggregate_gbps for r in many])
        if not one and not many:
            series[f"{runs[0].instances} × {runs[0].clients}{suffix}"] = ([runs[0].instances * runs[0].clients], [runs[0].aggregate_gbps])
    hlines = {f"B* = {report.verdict.breakeven_gbps:.2f} GB/s": report.verdict.breakeven_gbps} if report.verdict else None
    chunk = report.metadata.parameters["chunk_bytes"] / cost.MB
    render.line_plot(
        path,
        f"{'GET/SET' if any(r.op == 'set' for r in report.runs) else 'GET'} bandwidth, {chunk:g} MB values × {report.metadata.parameters['batch']}-chunk batches",
        "N (clients on one instance, or instances with one client each)",
        "aggregate GB/s",
        series,
        hlines=hlines,
    )
