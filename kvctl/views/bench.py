"""``kvctl bench``: the runs table, the --engines contention table, the scaling plot and what the run left to say."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvctl.core import cost

from kvctl.core import render

if TYPE_CHECKING:
    from kvctl.bench.results import BenchReport, RunResult
    from kvctl.bench.session import BenchOutcome


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
    if report.advice and (v is None or v.loading_wins):  # a losing verdict says it first
        render.message(f"advice: before adding instances, {report.advice}", style="yellow")
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
    """Aggregate GB/s over total clients: one instance (more clients) vs one instance per client; stderr says where."""
    _draw_report(report, path)
    render.plots_written([path])


def _draw_report(report: BenchReport, path: str) -> None:
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


def show_bench(outcome: BenchOutcome, data: dict, as_json: bool, tp: int) -> None:
    """The report (or its JSON, ``data``): the sizing note and the chunks' source first, then the tables, then a
    verdict whose run had not the engine's --tp instances."""
    report = outcome.report
    note = report.metadata.parameters.get("sizing_note")
    if note and not as_json:
        render.warn(note)
    if outcome.chunk_source and not as_json:
        render.message(f"values of {outcome.chunk_bytes / 1e6:g} MB: {outcome.chunk_source}", stderr=True)
    if as_json:
        render.emit_json(data)
        return
    render_report(report)
    if report.verdict and tp > 1 and report.verdict.ranks != tp:
        had = f"{report.verdict.ranks} instance(s)" if report.verdict.instances in (0, report.verdict.ranks) else (
            f"{report.verdict.ranks} rank(s) ({report.verdict.instances} instances)")
        render.warn(f"--tp {tp}, but the verdict's run had {had}: it judges the tier measured; "
                    f"bench {tp} instances (one per rank) for the engine's tier")


def show_interrupted(report: BenchReport, signal_name: str, duration_s: float, embedded: bool) -> None:
    """The line of a bench a signal stopped: what it measured and what it cleaned up."""
    last = f"; the last lasted {report.runs[-1].duration_s:.1f} s of {duration_s:g} s" if report.runs else ""
    render.error_line(
        f"interrupted by {signal_name}: {len(report.runs)} of {report.runs_planned} run(s) measured{last}; "
        "bench keys deleted" + ("; embedded servers stopped" if embedded else "")
    )


def show_errors(report: BenchReport) -> None:
    """One line per instance that failed in a run: how many errors, and the first."""
    for run in report.runs:
        for inst in run.per_instance:
            if inst.errors:
                render.error_line(
                    f"{run.op.upper()} {run.instances}×{run.clients}: {inst.name or f'rank {inst.rank}'} ({inst.url}): "
                    f"{inst.errors} error(s), first: {inst.first_error}"
                )
