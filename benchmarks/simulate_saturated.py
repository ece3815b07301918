"""``kvctl simulate`` against issue 46's saturated GPU runs: the async loader's service, with and without ``--fit-loads``.

On a tier near saturation the wait of each load is the backlog the tier has not served, and that grows with
(ρ − 1): a few per cent on each load's service time move the waits by tens of per cent. The connector's loader
serves one load at a time; besides its GETs each load holds it for the copy's tail, the agreed-prefix exchange and
the insert. ``--fit-loads`` takes both from a connector trace (:func:`kvctl.sim.variability.fit_loads`).

For each run directory given (``paper_gpu.py``'s files: ``main.planned.jsonl``, ``bench-k4.json``, ``meta.json``,
``R5.jsonl``) this runs, as a user types them:

* ``kvctl report RUN/R5.jsonl --json``: the run's p50 / p90 / p99;
* ``kvctl simulate --trace RUN/main.planned.jsonl --hits-from-trace --bench RUN/bench-k4.json --loading async ...``
  with the run's decision (``--policy``), R and T0 given, once as the bench alone gives the tier and once with
  ``--fit-loads FIT/R5.connector-trace.jsonl``, FIT another run of the same links (``--fit-run``, default: the run
  itself), and with ``--steps`` a third time with ``--fit-steps`` from the same trace too (what each engine step
  costs besides its tokens: :mod:`kvctl.sim.steps`), and with ``--line`` once per seed of ``--seeds`` with vLLM's
  scheduler as well (``--scheduler vllm --fit-load-spread --async-overhead API_S``: :mod:`kvctl.sim.vllm_line`);

and prints each prediction over the run's figure.

    .venv/bin/python benchmarks/simulate_saturated.py results/paper_gpu-h100-2026-12-06d-sat-1200-off \\
        --fit-run results/paper_gpu-h100-2026-12-06d-sat-1200-on [--prefill-rate 74000] [--t0 0.005] [--steps]
        [--max-batch M] [--line [--api-s 0.06] [--seeds 0,1,2]] [--json OUT]

R: the H100's 16k recompute (0.22 s for 16 384 tokens, the runs' own steps); T0: the connector's own time a hit
besides its load, as the trace measured it (lookup and insert, 5 ms). Neither run's API server is modelled.

``--calib DIR`` fits everything on a calibration run alone (issue 46's model target; ``paper_gpu.py``'s
``PAPER_STEPS=calib`` with the runs' flags, DIR holding ``calib.jsonl`` and ``calib.connector-trace.jsonl``), in place
of ``--prefill-rate``, ``--t0``, ``--api-s`` and ``--fit-run`` (:func:`calib_fits`).
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import paper_gpu  # noqa: E402
from benchmarks.paper_gpu_inputs import read_meta  # noqa: E402
from kvctl.core.errors import InvalidInput  # noqa: E402
from kvctl.records.connector_trace import read_events  # noqa: E402
from kvctl.records.runfile import read_run  # noqa: E402
from kvctl.sim.steps import fit_steps  # noqa: E402
from kvctl.sim.variability import fit_loads  # noqa: E402

KEYS = ("p50_s", "p90_s", "p99_s")


def kvctl(*args: str) -> dict:
    """``kvctl ARGS --json`` as paper_gpu.py runs kvctl, its JSON."""
    r = paper_gpu.kvctl(*args, "--json", check=False, timeout=600)
    if r.returncode not in (0, 3, 4):  # simulate exits 3/4 on an unstable model, with its JSON
        last = (r.stderr.strip().splitlines() or ["(nothing printed)"])[-1]
        raise SystemExit(f"kvctl {args[0]} exited {r.returncode}: {last}")
    return json.loads(r.stdout)


def trace_of(run: Path) -> Path:
    """The connector trace of a paper_gpu.py run directory: its R5 run's, else its calibration's."""
    r5 = run / "R5.connector-trace.jsonl"
    return r5 if r5.exists() else run / "calib.connector-trace.jsonl"


def calib_fits(calib: Path) -> dict:
    """What a calibration run alone gives the model (``--calib``):

    * ``prefill_rate``: R of the connector's own fit of the run's traced steps (:func:`kvctl.sim.steps.fit_steps`);
    * ``t0``: the connector's fixed time a hit, the median lookup plus the median of each load's time besides its GETs;
    * ``api_s``: each loaded hit's client latency less the connector's window, its first lookup to the end of the
      step that ran its rest (the API server, and any wait before vLLM looked it up), median over the hits. The run's
      requests are matched to the connector's in order of sending (the calibration sends at rate / 5, one at a time).
    """
    trace = calib / "calib.connector-trace.jsonl"
    try:
        events = read_events(str(trace), "calibration trace")[0]
    except InvalidInput as exc:
        raise SystemExit(f"--calib: {exc}") from None
    def num(e: dict, k: str) -> bool:
        return isinstance(e.get(k), (int, float)) and not isinstance(e.get(k), bool)
    lookups = [e["s"] for e in events if e["ev"] == "lookup" and num(e, "s")]
    try:  # the loader's own time a load besides its GETs, as --fit-loads fits it
        load_s = fit_loads(str(trace), 1).load_s
    except InvalidInput:
        load_s = None
    if load_s is None or not lookups:
        raise SystemExit(f"--calib: {trace} has no load or no lookup: the calibration loaded no hit")
    t0 = statistics.median(lookups) + load_s
    first: dict = {}
    for e in events:
        if e["ev"] == "lookup":
            first.setdefault(e["req"], e["t"])
    done = {e["req"]: e["t"] for e in events if e["ev"] == "prefill_done"}
    steps = sorted((e["t_start"], e["t_start"] + e["s"]) for e in events if e["ev"] == "step" and num(e, "t_start") and num(e, "s"))
    starts = [s for s, _ in steps]
    rows = sorted((r for r in read_run(calib / "calib.jsonl").rows if r["status"] == "ok" and r.get("sent_s") is not None),
                  key=lambda r: r["sent_s"])
    api = []
    for row, req in zip(rows, sorted(first, key=first.get)[-len(rows):]):  # the run's, after warm-up and priming
        i = bisect.bisect_left(starts, done.get(req, float("inf")) - 0.002)
        if (row.get("cached_tokens") or 0) > 0 and i < len(steps) and row.get("latency_s") is not None:
            api.append(row["latency_s"] - (steps[i][1] - first[req]))
    if not api:
        raise SystemExit(f"--calib: {calib / 'calib.jsonl'} has no hit to time the API server with")
    try:
        r = fit_steps(str(trace)).prefill_rate
    except InvalidInput as exc:
        raise SystemExit(f"--calib: {exc}") from None
    if not r:
        raise SystemExit(f"--calib: {trace}'s steps give no R (no prefill step timed)")
    return {"trace": str(trace), "prefill_rate": r, "t0": t0,
            "api_s": statistics.median(api), "hits_timed": len(api)}


def measured(run: Path) -> dict:
    rep = kvctl("report", str(run / "R5.jsonl"))["runs"][0]
    return {k: rep[k] for k in (*KEYS, "thirds_p50_s")}


def simulated(run: Path, meta: dict, a: argparse.Namespace, fit: Path | None, steps: Path | None = None,
              extra: tuple[str, ...] = ()) -> dict:
    args = ["simulate", "--trace", str(run / "main.planned.jsonl"), "--hits-from-trace", "--block-tokens", str(meta["block_tokens"]),
            "--bytes-per-token", str(meta["bytes_per_token"]), "--prefill-rate", str(a.prefill_rate), "--t0", str(a.t0),
            "--instances", str(meta["instances"]), "--bench", str(run / "bench-k4.json"), "--loading", "async",
            "--async-timeout", "86400", "--max-batched-tokens", str(meta["max_batched_tokens"]),
            "--policy", meta.get("load_policy") or "off"]
    if fit is not None:
        args += ["--fit-loads", str(trace_of(fit))]
    if steps is not None:  # what a step costs besides its tokens, fitted on the engine's traced steps (kvctl.sim.steps)
        args += ["--fit-steps", str(trace_of(steps))]
    if a.max_batch > 1:
        args += ["--max-batch", str(a.max_batch)]
    p = kvctl(*args, *extra)
    keep = ("timeouts", "hits", "gpu_utilization_pct", "decisions") if extra else ()
    return {**{k: p[k] for k in (*KEYS, "thirds_p50_s", "tier_rho", *keep)},
            "notes": [n for n in p.get("notes", []) if "async" in n or "--fit-steps" in n]}


def line_rows(run: Path, meta: dict, a: argparse.Namespace) -> dict:
    """``--line``: the same fits with vLLM's scheduler (``--scheduler vllm``: the decision and the load at the head of
    the line), each load's GET time drawn from the trace's own loads (``--fit-load-spread``) and ``--api-s`` of
    latency a request (``--async-overhead``: the API server), once per seed of ``--seeds``."""
    fit = a.fit_run or run
    extra = ("--scheduler", "vllm", "--fit-load-spread", *(("--fit-load-beside",) if a.beside else ()),
             "--async-overhead", str(a.api_s))
    return {str(s): simulated(run, meta, a, fit, fit, (*extra, "--seed", str(s))) for s in a.seeds}


def line_summary(rows: dict, m: dict) -> dict:
    """Over the seeds of ``rows`` (:func:`line_rows`): the median, 10th and 90th percentile of each predicted ÷
    measured, the share of seeds whose p50, p90 and p99 are all within issue 46's 25 %, and the median of the loads
    given up."""
    r = np.array([[p[k] / m[k] for k in KEYS] for p in rows.values()])
    return {"seeds": len(r), "median": np.median(r, axis=0).tolist(), "p10": np.percentile(r, 10, axis=0).tolist(),
            "p90": np.percentile(r, 90, axis=0).tolist(), "within_25": float(np.all(np.abs(r - 1) <= 0.25, axis=1).mean()),
            "timeouts_median": float(np.median([p["timeouts"] for p in rows.values()]))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="paper_gpu.py run directories (one R5 run each)")
    ap.add_argument("--fit-run", type=Path, help="the run whose connector trace --fit-loads reads (default: each run itself)")
    ap.add_argument("--prefill-rate", type=float, help="R, tokens/s (default 74000)")
    ap.add_argument("--t0", type=float, help="the connector's fixed seconds a hit (default 0.005)")
    ap.add_argument("--max-batch", type=int, default=1, help="simulate's --max-batch (vLLM batches: 16, say)")
    ap.add_argument("--steps", action="store_true",
                    help="a third row: --fit-loads and --fit-steps (each step's cost besides its tokens, from the same trace)")
    ap.add_argument("--line", action="store_true",
                    help="a row per seed: --steps' fits with --scheduler vllm, --fit-load-spread and --async-overhead --api-s")
    ap.add_argument("--beside", action="store_true",
                    help="--line with --fit-load-beside: a load beside 8k-token steps draws from the trace's loads beside "
                         "such steps, the others from its loads alone")
    ap.add_argument("--api-s", type=float,
                    help="--line: seconds of latency each request spends outside the engine's steps (the API server; "
                         "the unshaped run's p50 over the model's, 2026-12-07; default 0.06)")
    ap.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=list(range(20)),
                    help="--line's seeds (default 0-19: the model's draws of the spread move its tail)")
    ap.add_argument("--calib", type=Path, help="a calibration run directory: R, T0, the API server's seconds and the loads' "
                    "and steps' fits from it alone, in place of --prefill-rate, --t0, --api-s and --fit-run")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    given = [f"--{k.replace('_', '-')}" for k in ("prefill_rate", "t0", "api_s", "fit_run") if getattr(a, k) is not None]
    if a.calib and given:
        ap.error(f"--calib fits {', '.join(given)} on the calibration run: give one or the other")
    for k, v in (("prefill_rate", 74000.0), ("t0", 0.005), ("api_s", 0.06)):
        if getattr(a, k) is None:
            setattr(a, k, v)
    out = {}
    if a.calib:
        fits = calib_fits(a.calib)
        a.prefill_rate, a.t0, a.api_s, a.fit_run = fits["prefill_rate"], fits["t0"], fits["api_s"], a.calib
        out["calib_fits"] = fits
        print(f"calibration {a.calib.name}: R {a.prefill_rate:,.0f} tokens/s, T0 {a.t0 * 1e3:.1f} ms, "
              f"API server {a.api_s * 1e3:.1f} ms ({fits['hits_timed']} hits), loads and steps from {Path(fits['trace']).name}")
    for run in a.runs:
        meta = read_meta(run)
        m = measured(run)
        row = {"measured": m, "bench": simulated(run, meta, a, None), "fit_loads": simulated(run, meta, a, a.fit_run or run)}
        if a.steps:
            row["fit_steps"] = simulated(run, meta, a, a.fit_run or run, a.fit_run or run)
        if a.line:
            row["vllm_line"] = line_rows(run, meta, a)
            row["vllm_line_summary"] = line_summary(row["vllm_line"], m)
        out[run.name] = row
        print(f"{run.name}: measured p50 / p90 / p99 {' / '.join(f'{m[k]:.3f}' for k in KEYS)} s")
        shown = [(label, row[label]) for label in ("bench", "fit_loads", "fit_steps") if label in row]
        for label, p in shown:
            ratios = " / ".join(f"{p[k] / m[k]:.2f}" for k in KEYS)
            more = f", {p['hits']} hits loaded, {p['timeouts']} given up, GPU {p['gpu_utilization_pct']:.0f} %" if "hits" in p else ""
            print(f"  simulate ({label}): {' / '.join(f'{p[k]:.3f}' for k in KEYS)} s, predicted ÷ measured {ratios}, "
                  f"tier ρ {p['tier_rho']:.2f}{more}")
        if "vllm_line_summary" in row:
            sm = row["vllm_line_summary"]
            fmt = lambda v: " / ".join(f"{x:.2f}" for x in v)  # noqa: E731
            print(f"  simulate (vllm_line, {sm['seeds']} seeds): predicted ÷ measured median {fmt(sm['median'])}, "
                  f"10th–90th percentile {fmt(sm['p10'])} – {fmt(sm['p90'])}; all three within 25 % at "
                  f"{sm['within_25']:.0%} of seeds; loads given up, median {sm['timeouts_median']:g}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
