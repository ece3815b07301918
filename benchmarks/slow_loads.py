"""Where a slow async load's time went, from a connector trace's ``load`` events (issue 46's loads beside big steps).

A load's GETs run in lanes, several per instance; since 93f1c42 each ``load`` event carries what its lanes summed:
seconds in GETs, one sum per instance (``recv_s_by_instance``), and seconds waiting for a pinned slot's copy to the
device (``slot_wait_s``). Each instance serves an even share of a load's bytes, so an instance's GET seconds per byte
say how fast it was for that load. Against the median load, a slow one (its GET time ``--slow`` or more times the
median's for its bytes) is then slow

* on every instance: the client side (the process that runs the GETs: its GIL, its copies into host memory);
* on one or some instances: those instances (their links, their CPU);
* in its slot waits: the copies to the device.

Each load's ``copy_tail_s`` (from its last GET to its last copy's end: a few tenths of a millisecond when the copies
keep up) is counted too: a tail of ``TAIL_S`` or more is a copy that waited on the device.

Loads are split as ``kvctl simulate --fit-load-beside`` splits them (:func:`kvctl.sim.variability.trace_loads`):
beside a step of ``BESIDE_STEP_TOKENS`` or more for at least half their GET time, or not.

    .venv/bin/python benchmarks/slow_loads.py RUN/R5.connector-trace.jsonl [--slow 1.2] [--json OUT]

Exits 2 with one line on a trace without loads; a trace from before the lanes' sums prints the GET ratios only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvctl.core.errors import InvalidInput  # noqa: E402
from kvctl.core.thresholds import BESIDE_STEP_TOKENS  # noqa: E402
from kvctl.records.connector_trace import read_events  # noqa: E402
from kvctl.sim.variability import TraceLoad, trace_loads  # noqa: E402

# an instance counts as slow for a load when its GET seconds per byte are this many times the median load's
INSTANCE_SLOW = 1.15
# a copy tail this long is a copy that waited on the device (the copies keep up with the GETs in ~0.3 ms)
TAIL_S = 0.05


def _lane_sums(x: TraceLoad) -> tuple[list[float], float] | None:
    """The load's per-instance GET seconds and slot-wait seconds, or None where its event predates them."""
    per = x.event.get("recv_s_by_instance")
    wait = x.event.get("slot_wait_s")
    if not isinstance(per, list) or not per or not all(isinstance(v, (int, float)) and v >= 0 for v in per):
        return None
    return [float(v) for v in per], float(wait) if isinstance(wait, (int, float)) and wait >= 0 else 0.0


def _wait_share(per: list[float], wait: float) -> float:
    """The share of a load's lanes' time that went to slot waits."""
    return wait / max(1e-12, sum(per) + wait)


def _long_tail(row: dict, tail_s: float) -> bool:
    """Whether a load's copies ended ``tail_s`` or more after its last GET (a copy that waited on the device)."""
    return (row["copy_tail_s"] or 0) >= tail_s


def analyse(loads: list[TraceLoad], slow: float = 1.2) -> dict:
    """Each load's GET slowness (its seconds a byte over the median load's) and, for the slow ones with lane sums,
    which instances were slow and what share of its lanes' time went to slot waits; counts by group."""
    if not loads:
        raise InvalidInput("the trace has no load that read something (its `load` events need bytes, get_s, total_s)")
    s_per_b = statistics.median(x.get_s / x.bytes for x in loads)
    sums = [(x, _lane_sums(x)) for x in loads]
    with_sums = [(x, ls) for x, ls in sums if ls is not None]
    k = statistics.median(len(ls[0]) for _, ls in with_sums) if with_sums else 0
    # the median load's seconds a byte on each instance (each instance serves bytes / K of a load)
    inst_med = [statistics.median(ls[0][i] / (x.bytes / len(ls[0])) for x, ls in with_sums if len(ls[0]) > i)
                for i in range(int(k))]
    wait_med = statistics.median(_wait_share(*ls) for _, ls in with_sums) if with_sums else 0.0
    rows = []
    for x, ls in sums:
        row = {"t": x.event.get("t"), "req": x.event.get("req"), "rank": x.rank, "beside": x.beside,
               "given_up": x.given_up, "bytes": x.bytes, "get_s": x.get_s,
               "slowness": round(x.get_s / x.bytes / s_per_b, 3),
               "copy_tail_s": x.event.get("copy_tail_s") if isinstance(x.event.get("copy_tail_s"), (int, float)) else None}
        if ls is not None:
            per, wait = ls
            row["instance_slowness"] = [round(per[i] / (x.bytes / len(per)) / inst_med[i], 3) if i < len(inst_med)
                                        and inst_med[i] > 0 else None for i in range(len(per))]
            row["slot_wait_share"] = round(_wait_share(per, wait), 4)
            row["lanes"] = x.event.get("lanes")
        rows.append(row)
    groups = {}
    for name, sel in (("beside", True), ("alone", False)):
        g = [r for r in rows if r["beside"] is sel]
        slow_rows = [r for r in g if r["slowness"] >= slow or r["given_up"]]
        where = {"every_instance": 0, "some_instances": 0, "slot_waits": 0, "none_of_these": 0, "no_lane_sums": 0}
        for r in slow_rows:
            where[_where(r, wait_med)] += 1
        groups[name] = {"loads": len(g), "slow_or_given_up": len(slow_rows),
                        "long_copy_tail": sum(_long_tail(r, TAIL_S) for r in g),
                        "median_slowness": round(statistics.median(r["slowness"] for r in g), 3) if g else None,
                        "where": where}
    return {"slow": slow, "instance_slow": INSTANCE_SLOW, "tail_s": TAIL_S, "beside_step_tokens": BESIDE_STEP_TOKENS,
            "median_slot_wait_share": round(wait_med, 4), "lane_sums": len(with_sums), "groups": groups, "loads": rows}


def _where(r: dict, wait_med: float) -> str:
    """Where a slow load's extra time went: its slot waits (twice the median load's share and over 10 % of its
    lanes' time), every instance, some of them, or none of these."""
    if "instance_slowness" not in r:
        return "no_lane_sums"
    if r["slot_wait_share"] >= max(0.10, 2 * wait_med):
        return "slot_waits"
    inst = [v for v in r["instance_slowness"] if v is not None]
    n_slow = sum(v >= INSTANCE_SLOW for v in inst)
    if inst and n_slow == len(inst):
        return "every_instance"
    return "some_instances" if n_slow else "none_of_these"


def render(res: dict) -> str:
    out = [f"loads slow at {res['slow']}x the median GET seconds a byte (or given up); an instance slow at "
           f"{res['instance_slow']}x; beside = half its GETs beside a step of {res['beside_step_tokens']} tokens or more",
           f"lane sums in {res['lane_sums']} of {len(res['loads'])} loads; median slot-wait share "
           f"{res['median_slot_wait_share']:.3f}", ""]
    out.append(f"{'group':<8} {'loads':>5} {'slow':>5} {'median':>7}  every-inst  some-inst  slot-waits  none  no-sums"
               f"  tail>={res['tail_s'] * 1e3:.0f}ms")
    for name, g in res["groups"].items():
        w = g["where"]
        med = f"{g['median_slowness']:.3f}" if g["median_slowness"] is not None else "-"
        out.append(f"{name:<8} {g['loads']:>5} {g['slow_or_given_up']:>5} {med:>7}  {w['every_instance']:>10} "
                   f"{w['some_instances']:>10} {w['slot_waits']:>11} {w['none_of_these']:>5} {w['no_lane_sums']:>8}"
                   f"  {g['long_copy_tail']:>10}")
    slow_rows = [r for r in res["loads"] if r["slowness"] >= res["slow"] or r["given_up"]
                 or _long_tail(r, res["tail_s"])]
    if slow_rows:
        out += ["", "the slow loads (and long copy tails): t, rank, beside, slowness, per-instance slowness, "
                    "slot-wait share, copy tail ms"]
        for r in slow_rows:
            inst = " ".join("-" if v is None else f"{v:.2f}" for v in r.get("instance_slowness", []))
            wait = f"{r['slot_wait_share']:.3f}" if "slot_wait_share" in r else "-"
            tail = f"{r['copy_tail_s'] * 1e3:.1f}" if r["copy_tail_s"] is not None else "-"
            out.append(f"  {r['t']:.3f} r{r['rank']} {'beside' if r['beside'] else 'alone':<6} {r['slowness']:.2f}"
                       f"{' given up' if r['given_up'] else ''}  [{inst}]  {wait}  {tail}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="a connector trace (paper_gpu.py's R5.connector-trace.jsonl)")
    ap.add_argument("--slow", type=float, default=1.2, help="a load is slow at this many times the median (1.2)")
    ap.add_argument("--json", metavar="OUT", help="also write the analysis, every load's row, as JSON")
    a = ap.parse_args(argv)
    try:
        if not a.slow > 1:
            raise InvalidInput(f"--slow: a ratio above 1, not {a.slow}")
        events, _ = read_events(a.trace, "trace")
        res = analyse(trace_loads(events), a.slow)
    except InvalidInput as e:
        print(f"slow_loads: {e}", file=sys.stderr)
        return 2
    print(render(res))
    if a.json:
        try:
            Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
        except OSError as e:
            print(f"slow_loads: --json {a.json}: {e.strerror or e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
