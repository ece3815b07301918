"""``kvctl simulate`` and ``kvctl plan``: their tables, JSON and plots (results from :mod:`kvctl.sim.model`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvctl.core import render

from kvctl.core import thresholds

if TYPE_CHECKING:
    from kvctl.sim.plan import PlanResult
    from kvctl.sim.model import Sized, WhatIf
    from kvctl.sim.simulate import SimResult
    from kvctl.sim.workload import Bandwidth

#: The columns of every simulate result, sync or async, one engine or a fleet's rows or a sweep's points ("—" where one
#: does not apply, the reason in a note: :data:`SYNC_TIMEOUTS`, :data:`PER_ENGINE`).
RESULT_COLS = ["requests", "hits", "timeouts", "engine ρ", "tier ρ", "GPU util %", "p50 s", "p90 s", "p99 s", "max s", "p50 by third (s)",
               "max queue", "stable"]
FLEET_COLS = ["engine", *RESULT_COLS]
PLAN_COLS = ["instances", "loading", "B_eff GB/s", "engine ρ", "tier ρ", "GPU util %", "p50 s", "p99 s", "timeouts", "meets", "why"]
#: What each ρ column is, under every simulate and plan table: two names, one meaning each.
RHO_LEGEND = ("engine ρ: λ × the mean time a request holds its engine (sync: the transfer too; on a fleet row, its busiest engine's) · "
              "tier ρ: the hits' λ × n·s/B_eff of all engines, the load on each instance (per instance)")
STABLE = "stable: engine ρ and tier ρ both below 1"
SYNC_TIMEOUTS = ("timeouts — unless async: a synchronous load holds the engine until it is done and is never recomputed "
                 "(and recomputing has no load)")
PER_ENGINE = "per engine, tier ρ, p50 by third and stable are —: one tier serves every engine, and the fleet row has them"


def gpu_cell(pct: float | None) -> str | None:
    """GPU utilisation as a table shows it: a percentage with one decimal."""
    return None if pct is None else f"{pct:.1f}"


def _timeouts(loading: str, timeouts: int | None) -> int | None:
    """Async loads recomputed after --async-timeout; None ("—") under sync loading, which never recomputes one, or none."""
    return timeouts if loading == "async" else None


def _row(res: SimResult) -> list[Any]:
    """One result's cells under :data:`RESULT_COLS`."""
    return [res.requests, res.hits, _timeouts(res.loading, res.timeouts), res.rho, res.tier_rho, gpu_cell(res.gpu_utilization_pct),
            res.p50_s, res.p90_s, res.p99_s, res.max_s, " / ".join(render.fmt(v) for v in res.thirds_p50_s), res.max_queue, res.stable]


def _notes(loadings: set[str], per_engine: bool = False, stable: bool = True) -> list[str]:
    """The legend of the ρ columns (and of stable), and why a column shows "—"."""
    return ([RHO_LEGEND + (f" · {STABLE}" if stable else "")] + ([SYNC_TIMEOUTS] if loadings - {"async"} else [])
            + ([PER_ENGINE] if per_engine else []))


def stability_footer(res: SimResult) -> str | None:
    """What an unstable result's footer says, naming the ρ that is ≥ 1: the engine's (its queue grows) or, with
    async loading, the tier's (prefetches arrive faster than it serves them: its backlog grows, and loads past
    --async-timeout are recomputed)."""
    if res.stable is not False:
        return None
    if res.rho is not None and res.rho >= thresholds.RHO_UNSTABLE:
        return f"engine ρ {res.rho:.3g} ≥ 1: its queue grows for as long as requests keep arriving"
    return (f"tier ρ {res.tier_rho:.3g} ≥ 1 (engine ρ {render.fmt(res.rho)}): prefetches arrive faster than the tier serves "
            f"them, so its backlog grows and loads past --async-timeout are recomputed ({res.timeouts:,} timeouts)")


def render_result(res: SimResult, title: str, notes: tuple[str, ...], extrapolated: str | None) -> None:
    """One result, one engine or a fleet, sync or async, under the same columns: one row, or a row per engine and the fleet's
    (:data:`FLEET_COLS`) when there are several; then what it adds up to, where the inputs came from, and the legend."""
    per_engine = getattr(res, "per_engine", ())
    if len(per_engine) > 1:
        cols = FLEET_COLS
        rows = [[e.engine, e.requests, e.hits, _timeouts(res.loading, e.timeouts), e.rho, None, gpu_cell(e.gpu_utilization_pct),
                 e.p50_s, e.p90_s, e.p99_s, e.max_s, None, e.max_queue, None] for e in per_engine]
        rows.append(["fleet", *_row(res)])
    else:
        cols, rows = RESULT_COLS, [_row(res)]
    solver = getattr(res, "solver", None)
    lines = [f"mean {res.mean_s:.3f} s · mean wait {res.mean_wait_s:.3f} s · B_eff {res.bandwidth_gbps:g} GB/s" + (f" · solver: {solver}" if solver else "")]
    if res.by_class:
        lines.append(render.by_class_line(res.by_class))
    if res.decisions is not None:
        lines.append("load-or-recompute decision (--policy on), hits: " + ", ".join(f"{k} {v:,}" for k, v in sorted(res.decisions.items()))
                     + " (hits: the requests that loaded)")
    lines += [f"input: {n}" for n in notes]
    lines += [f"EXTRAPOLATED: {x}" for x in getattr(res, "extrapolated", ())]
    footer = stability_footer(res)
    if footer:
        lines.append(footer)
    if extrapolated:
        lines.append(f"* B_eff {extrapolated}")
    lines += _notes({res.loading}, per_engine=len(per_engine) > 1)
    render.table(title, cols, rows, caption="\n".join(lines))


def _extrapolated(bw: Bandwidth) -> bool:
    from kvctl.sim.workload import BASIS_EXTRAPOLATED  # noqa: PLC0415 - numpy only when used

    return bw.basis == BASIS_EXTRAPOLATED


def bandwidth_json(bw: Bandwidth) -> dict[str, Any]:
    """Where B_eff came from, in every simulate JSON: ``bandwidth_basis`` (instance_gbps, bench_measured or
    bench_extrapolated) and a sentence."""
    return {"bandwidth_basis": bw.basis, "bandwidth_note": bw.note}


def bandwidth_cell(gbps: float, bw: Bandwidth) -> str:
    """B_eff as a table shows it: starred when the bench did not measure that instance count."""
    return f"{gbps:g}" + ("*" if _extrapolated(bw) else "")


def plot_sweep(path: str, w: WhatIf) -> None:
    """p99 (and p50) against the first numeric swept key, one line per value of the others."""
    grid = w.grid or {}
    numeric = [k for k, vs in grid.items() if all(isinstance(v, (int, float)) for v in vs)]
    x_key = numeric[0] if numeric else None
    series: dict[str, tuple[list[float], list[float]]] = {}
    for i, p in enumerate(w.points):
        label = ", ".join(f"{k}={v}" for k, v in p.parameters.items() if k != x_key) or "run"
        x = p.parameters[x_key] if x_key else i
        for q, val in (("p99", p.result.p99_s), ("p50", p.result.p50_s)):
            xs, ys = series.setdefault(f"{label} {q}", ([], []))
            xs.append(x)
            ys.append(val)
    render.line_plot(path, "What-if: latency", x_key or "point", "latency (s)", series)
    render.plots_written([path])


def show_whatif(w: WhatIf, as_json: bool) -> None:
    """``kvctl simulate``'s answer: the sweep's table, the fleet's, or the one run's (or their JSON)."""
    from kvctl.sim import fleet  # noqa: PLC0415 - numpy only when used
    from kvctl.sim import simulate as sim  # noqa: PLC0415

    i = w.inputs
    if w.grid:
        if as_json:
            to_dict = fleet.fleet_dict if w.fleet else sim.result_dict
            render.emit_json([{"parameters": p.parameters, **to_dict(p.result), **bandwidth_json(bw)} for p, bw in zip(w.points, w.bandwidths)])
            return
        keys = list(w.grid)
        extrapolated = sorted({bw.note for bw in w.bandwidths if _extrapolated(bw)})
        render.table(
            f"What if — {w.source}",
            [k.replace("_", " ") for k in keys] + ["B_eff GB/s"] + RESULT_COLS,
            [[p.parameters[k] for k in keys] + [bandwidth_cell(p.result.bandwidth_gbps, bw)] + _row(p.result) for p, bw in zip(w.points, w.bandwidths)],
            caption=f"s = {i.bytes_per_token:g} B/token · R = {i.prefill_rate:g} tok/s · T0 = {i.t0_s:g} s"
            + "".join(f"\n* B_eff {n}" for n in extrapolated)
            + "".join(f"\n{n}" for n in _notes({p.result.loading for p in w.points})),
        )
        return
    res, bw = w.result, w.bandwidth
    if _extrapolated(bw) and not as_json:
        render.warn(f"B_eff {bw.gbps:g} GB/s is {bw.note}")
    if as_json:
        if w.fleet:
            render.emit_json({**fleet.fleet_dict(res), **bandwidth_json(bw)})
        else:
            render.emit_json({**sim.result_dict(res), **bandwidth_json(bw), "notes": list(w.notes)})
        return
    render_result(res, f"{i.engines} engine(s), {i.loading} loading, {i.instances} instance(s), B_eff {bandwidth_cell(res.bandwidth_gbps, bw)} GB/s — "
                  f"{w.source}", res.notes if w.fleet else w.notes, bw.note if _extrapolated(bw) else None)


def plot_plan(path: str, res: PlanResult) -> None:
    """p99 against instances, one line per loading mode, the SLO dashed and recompute at 0."""
    series: dict[str, tuple[list[float], list[float]]] = {}
    for p in res.points:
        if p.simulated and p.instances > 0:
            xs, ys = series.setdefault(f"{p.loading} p99", ([], []))
            xs.append(p.instances)
            ys.append(p.p99_s)
    hlines = {f"SLO p99 {res.slo_p99_s:g} s": res.slo_p99_s}
    base = next((p for p in res.points if p.instances == 0), None)
    if base is not None and base.p99_s is not None:
        series["recompute p99 (no tier, at 0)"] = ([0], [base.p99_s])
    render.line_plot(path, "Plan: p99 against instances", "instances", "p99 latency (s)", series, hlines=hlines)
    render.plots_written([path])


def show_plan(s: Sized, as_json: bool, exit_code: int) -> None:
    """``kvctl plan``'s answer: every point it tried (or skipped, and why) and the plan, or their JSON."""
    res = s.plan
    if as_json:
        d: dict[str, Any] = dict(res.__dict__)
        d["points"] = [dict(p.__dict__, extrapolated=list(p.extrapolated)) for p in res.points]
        d["notes"] = list(res.notes) + list(s.notes)
        d["exit_code"] = int(exit_code)
        render.emit_json(d)
        return
    rows = [["—" if p.instances == 0 else p.instances, p.loading, p.bandwidth_gbps, p.engine_rho, p.tier_rho, gpu_cell(p.gpu_utilization_pct), p.p50_s,
             p.p99_s, _timeouts(p.loading, p.timeouts), "yes" if p.meets else "no", p.why] for p in res.points]
    caption = [f"{res.engines} engine(s) · {s.source} · n* = R·T0 = {res.min_hit_tokens:,.0f} tokens · B* = s·R = {res.breakeven_gbps:.3f} GB/s"]
    caption += [f"note: {n}" for n in (*res.notes, *s.notes)]
    caption += sorted({f"EXTRAPOLATED: {x}" for p in res.points for x in p.extrapolated})
    caption += _notes({p.loading for p in res.points}, stable=False)
    caption.append(("PLAN: " if res.instances is not None else "NO PLAN: ") + res.verdict)
    limit = "with the load-or-recompute decision" if res.policy == "on" else f"at tier ρ ≤ {res.rho_target:g}"
    render.table(f"Plan — p99 ≤ {res.slo_p99_s:g} s {limit}", PLAN_COLS, rows, caption="\n".join(caption))
