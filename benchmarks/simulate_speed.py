"""Time ``kvctl simulate`` on 1 000 000 Poisson requests (sync loading, 8 instances). Target: ≤ 5 s.

Four timings in one run:

* the whole command, ``kvctl simulate ... --requests 1000000 --json``, as a subprocess (Python start-up,
  imports, workload generation, simulation, JSON output);
* the library call alone (:func:`kvctl.sim.simulate.simulate` on a prepared workload), median of rounds;
* for scale, the same FIFO queue solved by a plain per-request Python loop (Lindley's recursion,
  one iteration per request), on the same arrivals; both give the same waits;
* a fleet with variability (issue 24's target): ``--engines 8`` at the paper's λ each, 80 % hits, GET time
  spread (σ 0.4), throughput against readers (1, 2, 4, 8 clients: 1, 1.08, 1.12, 1.13×) and a T0
  distribution, sync and async, through :func:`kvctl.sim.fleet.simulate_fleet` (workload generation included).

    .venv/bin/python benchmarks/simulate_speed.py [--requests 1000000] [--rounds 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from kvctl.sim.fleet import simulate_fleet
from kvctl.sim.simulate import SimConfig, fifo, simulate
from kvctl.sim.workload import effective_gbps, poisson_workload
from kvctl.sim.variability import Variability

TARGET_S = 5.0
# The paper's setup: λ 1.21/s, 16 310 tokens × 48 437.5 B = 0.79 GB, 8 instances × 1.345 GB/s = 10.76 GB/s.
ARGS = ["--arrival-rate", "1.21", "--prompt-tokens", "16310", "--bytes-per-token", "48437.5", "--prefill-rate", "52200",
        "--t0", "0.33", "--instances", "8", "--instance-gbps", "1.345", "--loading", "sync"]


def loop_fifo(arrival: list[float], hold: list[float]) -> list[float]:
    """Waits of a single-server FIFO queue, one Python iteration per request."""
    waits = [0.0] * len(arrival)
    free = 0.0
    for i, (a, h) in enumerate(zip(arrival, hold)):
        start = a if a > free else free
        waits[i] = start - a
        free = start + h
    return waits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    kvctl = str(Path(sys.executable).with_name("kvctl"))
    cmd = [kvctl if os.path.exists(kvctl) else sys.executable, *([] if os.path.exists(kvctl) else ["-m", "kvctl.cli"]),
           "simulate", *ARGS, "--requests", str(args.requests), "--json"]
    t = time.perf_counter()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    cli_s = time.perf_counter() - t
    res = json.loads(out.stdout)

    w = poisson_workload(1.21, args.requests, 16310, seed=0)
    cfg = SimConfig(48437.5, 52200.0, 0.33, 8, 1.345, "sync")
    bw = effective_gbps(8, 1.345)
    lib = []
    for _ in range(args.rounds):
        t = time.perf_counter()
        simulate(w, cfg, bw)
        lib.append(time.perf_counter() - t)
    lib_s = statistics.median(lib)

    hold = w.tokens * 48437.5 / (bw * 1e9)
    t = time.perf_counter()
    start, _ = fifo(w.arrival_s, hold)
    vec_fifo_s = time.perf_counter() - t
    arr_l, hold_l = w.arrival_s.tolist(), hold.tolist()
    t = time.perf_counter()
    waits = loop_fifo(arr_l, hold_l)
    loop_s = time.perf_counter() - t
    same = bool(np.allclose(np.asarray(waits), start - w.arrival_s, atol=1e-9))

    var = Variability(t0_samples_s=tuple(np.linspace(0.25, 0.5, 64)), get_sigma=0.4,
                      readers_gain={1: 1.0, 2: 1.08, 4: 1.12, 8: 1.13})
    fleet_s: dict[str, float] = {}
    fleet_res: dict[str, dict[str, object]] = {}
    for loading in ("sync", "async"):
        t = time.perf_counter()
        fw = poisson_workload(1.21 * 8, args.requests, 16310, "exponential", seed=0)
        fr = simulate_fleet(fw, SimConfig(48437.5, 52200.0, 0.33, 8, 1.345, loading, hit_fraction=0.8), bw, 8, var)
        fleet_s[loading] = time.perf_counter() - t
        fleet_res[loading] = {"p99_s": round(fr.p99_s, 4), "tier_rho": round(fr.tier_rho or 0, 4), "solver": fr.solver}

    summary = {
        "requests": args.requests,
        "cli_s": round(cli_s, 3),
        "library_median_s": round(lib_s, 4),
        "fifo_vectorised_s": round(vec_fifo_s, 4),
        "fifo_python_loop_s": round(loop_s, 4),
        "loop_over_vectorised": round(loop_s / vec_fifo_s, 1),
        "same_waits": same,
        "target_s": TARGET_S,
        "meets_target": cli_s <= TARGET_S,
        "fleet_e8_variability_s": {k: round(v, 3) for k, v in fleet_s.items()},
        "fleet_meets_target": all(v <= TARGET_S for v in fleet_s.values()),
        "fleet_result": fleet_res,
        "load_average_1min": round(os.getloadavg()[0], 2),
        "result": {k: res[k] for k in ("rho", "p50_s", "p99_s", "stable")},
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(f"kvctl simulate, {args.requests:,} Poisson requests, sync, 8 instances")
    print(f"  whole command (subprocess):  {cli_s:.3f} s   (target ≤ {TARGET_S:g} s: {'met' if cli_s <= TARGET_S else 'MISSED'})")
    print(f"  library call (median of {args.rounds}):  {lib_s:.4f} s")
    print(f"  FIFO queue, numpy closed form: {vec_fifo_s:.4f} s; per-request Python loop: {loop_s:.4f} s "
          f"({loop_s / vec_fifo_s:.0f}× slower; same waits: {same})")
    for loading, secs in fleet_s.items():
        print(f"  fleet, 8 engines, variability, {loading}: {secs:.3f} s (target ≤ {TARGET_S:g} s: "
              f"{'met' if secs <= TARGET_S else 'MISSED'}; {fleet_res[loading]})")
    print(f"  host load average (1 min): {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print(f"  result: ρ = {res['rho']:.4f}, p50 = {res['p50_s']:.4f} s, p99 = {res['p99_s']:.4f} s, stable = {res['stable']}")


if __name__ == "__main__":
    main()
