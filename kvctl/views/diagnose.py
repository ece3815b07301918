"""``kvctl diagnose``: the diagnosis (summary, components, findings, formulas), a capture's summary and the stalls."""

from __future__ import annotations

import datetime
import socket
from pathlib import Path
from typing import Any

from kvctl import __version__

from kvctl.core import render
from kvctl.diagnose import stalls
from kvctl.diagnose.analysis import BW_GIVEN, Diagnosis
from kvctl.diagnose.capture import Capture
from kvctl.diagnose.fixes import verdict
from kvctl.diagnose.jsonform import diagnosis_json
from kvctl.core.errors import ExitStatus
from kvctl.core.runbooks import runbook_for


def show_diagnosis(diag: Diagnosis, explain: bool, as_json: bool, saved_to: str | None = None) -> None:
    """One diagnosis (its JSON with ``as_json``), and where its samples were saved."""
    if as_json:
        render.emit_json(diagnosis_json(diag, explain))
    else:
        render_diagnosis(diag, explain)
    if saved_to and not as_json:
        render.literal(f"samples saved to {saved_to} (replay: kvctl diagnose --from {saved_to})")  # a path never wrapped inside


def show_refresh(diag: Diagnosis, explain: bool, as_json: bool, i: int, count: int | None, window_s: float) -> None:
    """``--watch``: refresh ``i`` (from 0) redrawn on a cleared screen, or one JSON line."""
    if as_json:
        render.emit_json_line(diagnosis_json(diag, explain))
        return
    render.clear_screen()
    render_diagnosis(diag, explain)
    render.message(f"refresh {i + 1}{f'/{count}' if count else ''} · every {window_s:g} s · Ctrl-C to stop", style="dim")


def _rho_text(diag: Diagnosis) -> Any:
    if diag.rho is None:
        return None
    return f"≥ {diag.rho:.3g} (lower bound: B from Valkey server side)" if diag.rho_bound == "lower_bound" else diag.rho


#: the typical prompt's row, short (the summary's label column is as wide as its longest label: a 90-character one
#: made the table 109 columns wide, issue 48); --explain says how each was found in full (quantities.MEDIAN_BASIS)
MEDIAN_LABELS = {"one_bucket_mean": "median prompt tokens (exact)", "mean": "median prompt tokens (the mean)"}


def _decisions_text(diag: Diagnosis) -> str:
    """The kvctl connector's load-or-recompute decisions of the window: ``load 10 (wins 10); recompute 9 (...)``."""
    parts = [f"{d} {sum(r.values()):g} (" + ", ".join(f"{why} {n:g}" for why, n in r.items()) + ")"
             for d, r in diag.load_decisions.items()]
    share = "" if diag.hits_recomputed_share is None else f"; {diag.hits_recomputed_share:.0%} recomputed for the tier"
    return "; ".join(parts) + share


def _median_label(diag: Diagnosis) -> str:
    """The typical prompt's row says whether it is exact (one histogram bucket: sum/count) or an estimate."""
    return MEDIAN_LABELS.get(diag.typical_prompt_tokens_basis, "median prompt tokens (estimate)")


def how_sure(diag: Diagnosis) -> str | None:
    """One line: λ's basis, the range of its estimators, the arrivals counted (±1/√n) and ρ's range; None without λ."""
    if diag.arrival_rate_per_s is None:
        return None
    lo, hi = diag.arrival_rate_range_per_s or (diag.arrival_rate_per_s, diag.arrival_rate_per_s)
    parts = [f"λ {diag.arrival_rate_per_s:.3g} req/s from {diag.arrival_rate_basis}"
             + (f" ({diag.engine_states} state(s) seen)" if diag.engine_states else "")]
    if hi > lo * 1.005:
        parts.append(f"its estimators span {lo:.3g}–{hi:.3g} req/s (finished + queue growth at the samples is low while "
                     "engine steps are long: what arrives during a step waits outside waiting and running)")
    if diag.arrivals_counted:
        parts.append(f"{diag.arrivals_counted:.0f} arrivals counted: ±{diag.rho_relative_error or 0:.0%} (1/√n)")
    if diag.rho_range and diag.rho_range[1] > diag.rho_range[0] * 1.005:
        parts.append(f"ρ {diag.rho_range[0]:.3g}–{diag.rho_range[1]:.3g}")
    return "how sure: " + "; ".join(parts)


def render_diagnosis(diag: Diagnosis, explain: bool = False) -> None:
    """Summary, per-component tables, findings, insufficient data, and (with --explain) the formulas."""
    v = verdict(diag.findings, diag.rho, bool(diag.unreachable) and not diag.findings, diag.rho_bound == "lower_bound")
    # the first lines: the verdict and its one fix, each one whole line (never wrapped: grep and copy it whole)
    render.literal(f"verdict ({v.severity}): {v.headline}")
    if v.fix:
        render.literal(f"fix: {v.fix}")
    if v.runbook:
        render.literal(f"runbook: {v.runbook}")
    pct = lambda x: None if x is None else f"{x:.1%}"  # noqa: E731
    bw_label = ("bandwidth B, upper bound (GB/s)" if diag.rho_bound == "lower_bound"
                else "bandwidth B, given (GB/s)" if diag.bandwidth_source == BW_GIVEN else "bandwidth the engine sees B (GB/s)")
    render.key_values(
        f"Diagnosis over {diag.window_s:.1f} s ({len(diag.engine_urls)} engine(s), {len(diag.instances)} Valkey instance(s))",
        [
            ("offered arrival rate λ (req/s)", diag.arrival_rate_per_s),
            ("completions (req/s)", diag.completion_rate_per_s),
            ("waiting + running growth", diag.queue_growth),
            ("mean prompt tokens", diag.mean_prompt_tokens),
            (_median_label(diag), diag.typical_prompt_tokens),
            ("hit-token fraction", pct(diag.hit_token_fraction)),
            ("L2-served tokens/s", diag.l2_tokens_per_s),
            (bw_label, diag.bandwidth_gbps),
            ("break-even B* = s·R (GB/s)", diag.breakeven_gbps),
            ("min hit tokens n* = R·T0", diag.min_hit_tokens),
            ("prefill rate R (tok/s)", diag.prefill_rate_tok_s),
            ("ρ = λ·n·s/B (sync loading)", _rho_text(diag)),
            ("requests waiting (start → end)", f"{render.fmt(diag.requests_waiting_start)} → {render.fmt(diag.requests_waiting_end)}"),
            ("GPU utilisation (%)", ", ".join(f"{u:.0f}" for u in diag.gpu_utilization_pct) if diag.gpu_utilization_pct else diag.gpu_note),
            *([("connector's decisions (hits)", _decisions_text(diag))] if diag.load_decisions else []),
        ],
        caption=f"B from {diag.bandwidth_source_detail}" if diag.bandwidth_source_detail else None,
    )
    sure = how_sure(diag)
    if sure:
        render.message(sure, style="dim")
    if len(diag.engines) > 1 or any(e.status != "ok" for e in diag.engines):
        render.table(
            "Engines",
            ["engine", "status", "window (s)", "finished", "queue start → end", "offered λ (req/s)", "note"],
            [
                (e.url, e.status, e.window_s, e.finished, f"{render.fmt(e.queue_start)} → {render.fmt(e.queue_end)}", e.arrival_rate_per_s,
                 e.error or (f"restarted: {', '.join(e.counter_resets)}" if e.counter_resets else ""))
                for e in diag.engines
            ],
        )
    k = max([i.instance + 1 for i in diag.instances] or [1])
    if diag.instances:
        render.table(
            "Valkey instances",
            ["rank", *(["inst"] if k > 1 else []), "status", "GET/s", "MB out/s", "µs per GET", "GET busy", "GB/s in GETs", "evicted"],
            [
                (i.rank, *([i.instance] if k > 1 else []), i.status if not i.error else f"{i.status}: {i.error}", i.get_rate_per_s,
                 None if i.bytes_out_per_s is None else i.bytes_out_per_s / 1e6, i.usec_per_get, pct(i.get_busy_fraction), i.bandwidth_gbps, i.evicted_keys)
                for i in diag.instances
            ],
        )
    if diag.engine_loads:
        render.table(
            "Engines sharing the tier",
            ["engine", "W (ranks)", "instances", "offered λ (req/s)", "L2 MB/request", "B it gets (GB/s)", "ρ"],
            [(e.url, f"{e.ranks} ({e.ranks_source})", f"0–{e.ranks - 1}", e.arrival_rate_per_s,
              None if e.l2_bytes_per_request is None else e.l2_bytes_per_request / 1e6, e.bandwidth_gbps, e.rho)
             for e in diag.engine_loads],
            caption="ρ_e = λ_e·(L2 bytes per request)/B_e, against what engine e gets; rank r of every engine uses instance r",
        )
        render.table(
            "Instances shared by engines",
            ["rank", *(["inst"] if k > 1 else []), "engines", "offered MB/s", "B_i (GB/s)", "ρ (all engines)", "per engine"],
            [(i.rank, *([i.instance] if k > 1 else []), ", ".join(str(e) for e in i.engines), i.offered_bytes_per_s / 1e6, i.bandwidth_gbps,
              None if i.rho is None else f"{i.rho:.3f}" + (" (lower bound)" if i.rho_bound == "lower_bound" else ""),
              " ".join(f"{e}: {v:.2f}" for e, v in i.shares))
             for i in diag.instance_loads],
            caption="ρ_i = Σ_e λ_e·(bytes_e / W_e) / B_i over the engines using instance i; B_i: the best B_e/W_e they saw "
                    "(else Valkey's server side, an upper bound)"
                    + (f"\n{k} instances per rank: a rank's bytes and its B_e/W_e are split over its {k} instances "
                       "(chunk c on instance (c // W) mod K)" if k > 1 else ""),
        )
    if diag.findings:
        # two columns, so the fix and the runbook's command keep a line each at 80 columns (issue 48: a path of the
        # repository, wrapped mid-word at 100, was the runbook)
        render.text_table("Findings", ["finding", "what it means · fix · runbook"],
                          [(f"{f.id}\n{f.severity}", f"{f.message}\nfix: {f.recommendation}\nrunbook: {runbook_for(f.id)}") for f in diag.findings])
    for reason in diag.insufficient_data:
        render.warn(f"insufficient data: {reason}")
    for u in diag.unreachable:
        render.warn(f"unreachable: {u}")
    if not diag.findings and not diag.insufficient_data and not diag.unreachable:
        if diag.rho_bound == "estimate":
            render.message(f"No findings: ρ = {diag.rho:.2f}, the tier keeps up with this load.", style="green")
        else:
            render.message("No findings from these samples (ρ is only a lower bound here: see the notes).")
    for note in diag.notes:
        render.warn(note)
    if explain:
        render.text_table("How each number was computed", ["quantity", "value", "formula", "source"], [(q.name, q.value, q.formula, q.source) for q in diag.explain])


def show_capture(path: Path, capture: Capture, engines: int, instances: int, missing: list[str], as_json: bool) -> None:
    """``kvctl diagnose capture``: where the samples went, and every source that did not answer."""
    full = sum(not s.engines_only for s in capture.samples)  # the engine reads between them are kept too
    reads = f", {len(capture.samples) - full} engine read(s) between them" if len(capture.samples) > full else ""
    if as_json:
        render.emit_json({
            "out": str(path), "samples": full, "engine_reads_between": len(capture.samples) - full, "engines": engines, "valkey_instances": instances,
            "window_s": capture.samples[-1].t_s - capture.samples[0].t_s, "unreachable": missing, "notes": list(capture.notes),
            "exit_code": int(ExitStatus.UNREACHABLE if missing else ExitStatus.OK),
        })
        return
    for m in missing:
        render.warn(f"unreachable: {m} (recorded in the capture)")
    for note in capture.notes:
        render.warn(note)
    render.literal(f"capture saved to {path} ({full} samples{reads}, {engines} engine(s), {instances} Valkey instance(s)); analyse with: kvctl diagnose --from {path}")


def show_stalls(report: stalls.StallReport, as_json: bool) -> None:
    """``kvctl diagnose stalls``: the processes skipped, then the findings (or the JSON, with host, date and runbooks)."""
    for p in report.processes:
        if p.error:
            render.warn(f"pid {p.pid} skipped: {p.error}")
    if not as_json:
        render_stalls(report)
        return
    data: dict[str, Any] = {
        "kvctl_version": __version__,
        "host": socket.gethostname(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "worst_severity": report.worst_severity.value if report.worst_severity else None,
    }
    data.update(render.to_jsonable(report))
    for f in data["findings"]:
        f["runbook"] = runbook_for(f["id"])
    render.emit_json(data)


def render_stalls(report: stalls.StallReport) -> None:
    """Processes, then one block per finding: frames, evidence, fix."""
    gpu = report.gpu_note or ", ".join(f"{n}: {u:g}%" for n, u in zip(report.gpu_names, report.gpu_utilization_pct))
    render.text_table(
        f"Stalled threads ({report.samples} samples, {report.interval_s:g}s apart, {report.window_s:.1f}s window)",
        ["pid", "process", "threads", "stayed put", "status"],
        [
            (str(p.pid), p.name, p.threads, p.stable_threads, p.error or f"{sum(f.pid == p.pid for f in report.findings)} finding(s)")
            for p in report.processes
        ],
        caption=f"GPU: {gpu}" + ("" if report.findings else "\nno stalled lookup, GET or collective found"),
    )
    for f in report.findings:
        render.text_table(
            f"{f.severity.value.upper()} {f.id}: pid {f.pid} ({f.process_name}), thread {f.thread_name}",
            ["", ""],
            [
                ("what", f.message),
                ("frames", "\n".join(f.frames)),
                ("evidence", f.evidence),
                ("fix", f.recommendation),
                ("runbook", runbook_for(f.id)),
            ],
        )
