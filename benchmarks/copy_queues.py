"""Do the connector's copy lanes wait for the engine's step? A torch-only test of issue 46's two candidates.

In the saturated decision runs (benchmarks/README.md, 2026-12-07, fourth) loads beside a 16k prefill step stalled
about one step, in their GETs or in their copies' tail. This measures the two candidates without vLLM, on one GPU:

* ``gpu-step``: the main thread queues a "step" (``--step-ms`` of matrix products on its current stream, as vLLM's
  forward does) and then waits for it off the GIL; meanwhile ``--lanes`` threads, each with its own copy stream as
  the connector's lanes (``connector/fetch.py``), copy ``--mb`` MB from pinned host memory to the device, one copy at
  a time, and time each from its enqueue to its event. The question: does a copy whose stream shares the CUDA driver's
  hardware work queue with the step's stream wait for the step's kernels queued ahead of it? (On an H100, 2026-12-07
  fifth: no copy waited more than 22 ms beside a 0.26-0.29 s step, with 8 queues or 32; benchmarks/README.md.)
* ``gpu-step-io``: the same step with the engine's own copies queued in its middle, as vLLM's asynchronous
  scheduling queues them: half the products, a small device-to-host copy (the sampled tokens) and a small
  host-to-device copy (the next step's inputs), both from pinned memory, then the other half. The engine's copies wait
  for the first half on the device; a lane copy that shares their copy queue waits with them (vLLM issue 22754 saw
  KV copies on other streams wait for the engine's output copy).
* ``python-step``: the main thread holds the GIL in a pure Python loop for ``--step-ms`` instead: the lanes' copies
  then wait for the GIL (up to ``sys.getswitchinterval()`` a take) and not for the device.

Each mode runs in a child process per ``CUDA_DEVICE_MAX_CONNECTIONS`` value of ``--connections`` (the driver reads it
when the process first touches CUDA; "default" leaves it unset: 8), ``--rounds`` times. Printed: each lane's copies
alone (median) and the worst copy of each lane beside the step; a lane "waited" when its worst copy took more than
``--waited-ms``.

    python3 benchmarks/copy_queues.py [--lanes 12] [--mb 8] [--step-ms 250] [--rounds 3] [--json OUT]

Needs only torch with CUDA (the GPU host's own python3 has it); exits 2 with one line without a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

MODES = ("gpu-step", "gpu-step-io", "python-step")


def child(mode: str, lanes: int, mb: float, step_ms: float, rounds: int) -> dict:
    """One process's measurements (CUDA_DEVICE_MAX_CONNECTIONS is whatever this process was started with)."""
    import torch  # noqa: PLC0415 - the parent needs no torch

    dev = torch.device("cuda")
    n = int(mb * (1 << 20))
    hosts = [torch.empty(n, dtype=torch.uint8).pin_memory() for _ in range(lanes)]
    dsts = [torch.empty(n, dtype=torch.uint8, device=dev) for _ in range(lanes)]
    streams = [torch.cuda.Stream(dev) for _ in range(lanes)]
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    io_host = (torch.empty(1 << 20, dtype=torch.uint8).pin_memory(), torch.empty(1 << 20, dtype=torch.uint8).pin_memory())
    io_dev = torch.empty(1 << 20, dtype=torch.uint8, device=dev)
    for _ in range(3):  # cuBLAS's first product sets it up (~0.1 s): timed with it, a "step" was 7 ms (2026-12-07)
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    per_mm = (time.perf_counter() - t) / 20
    n_mm = max(1, int(step_ms / 1e3 / per_mm))

    def copy_once(i: int) -> float:
        t0 = time.perf_counter()
        with torch.cuda.stream(streams[i]):
            dsts[i].copy_(hosts[i], non_blocking=True)
            ev = streams[i].record_event()
        ev.synchronize()
        return time.perf_counter() - t0

    alone = [statistics.median(copy_once(i) for _ in range(5)) for i in range(lanes)]
    out_rounds = []
    for _ in range(rounds):
        go, stop = threading.Event(), threading.Event()
        worst = [0.0] * lanes
        count = [0] * lanes

        def lane(i: int) -> None:
            go.wait(10)
            deadline = time.monotonic() + 10 * step_ms / 1e3 + 5  # bounded: at most this long whatever the step does
            while not stop.is_set() and time.monotonic() < deadline:
                worst[i] = max(worst[i], copy_once(i))
                count[i] += 1

        threads = [threading.Thread(target=lane, args=(i,), daemon=True) for i in range(lanes)]
        for th in threads:
            th.start()
        t0 = time.perf_counter()
        if mode in ("gpu-step", "gpu-step-io"):
            for k in range(n_mm):
                a @ b  # queued on this thread's current stream, as a forward's kernels
                if mode == "gpu-step-io" and k == n_mm // 2:  # the engine's output and next inputs, behind half
                    io_host[0].copy_(io_dev, non_blocking=True)
                    io_dev.copy_(io_host[1], non_blocking=True)
            go.set()
            torch.cuda.synchronize()  # waits off the GIL
        else:
            go.set()
            end = time.perf_counter() + step_ms / 1e3
            x = 0
            while time.perf_counter() < end:  # holds the GIL but for the interpreter's switches
                x += 1
        step_s = time.perf_counter() - t0
        stop.set()
        for th in threads:
            th.join(15)
        out_rounds.append({"step_s": step_s, "worst_s": worst, "copies": count})
    return {"mode": mode, "lanes": lanes, "mb": mb, "step_ms": step_ms, "matmuls": n_mm,
            "switch_interval_s": sys.getswitchinterval(), "device": torch.cuda.get_device_name(dev),
            "connections_env": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"), "alone_s": alone, "rounds": out_rounds}


def summarize(res: dict, waited_ms: float) -> dict:
    """Per round: the lanes whose worst copy beside the step took more than ``waited_ms``, and the worst of all."""
    rounds = []
    for r in res["rounds"]:
        waited = [i for i, w in enumerate(r["worst_s"]) if w * 1e3 > waited_ms]
        rounds.append({"step_s": round(r["step_s"], 4), "waited_lanes": waited,
                       "worst_ms": round(max(r["worst_s"], default=0.0) * 1e3, 2),
                       "copies": sum(r["copies"])})
    return {"connections": res["connections_env"] or "default (8)", "mode": res["mode"],
            "alone_median_ms": round(statistics.median(res["alone_s"]) * 1e3, 3), "rounds": rounds}


def render(summaries: list[dict], lanes: int) -> str:
    out = [f"{'mode':<12} {'connections':<12} {'alone ms':>8}  per round: lanes that waited (of {lanes}), worst ms, step s"]
    for s in summaries:
        rounds = "; ".join(f"{len(r['waited_lanes'])} {r['waited_lanes']} {r['worst_ms']:.1f} {r['step_s']:.3f}"
                           for r in s["rounds"])
        out.append(f"{s['mode']:<12} {s['connections']:<12} {s['alone_median_ms']:>8.3f}  {rounds}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lanes", type=int, default=12, help="copy lanes, a stream each (12: 3 connections x 4 instances)")
    ap.add_argument("--mb", type=float, default=8.0, help="MB a copy (8: a 256-token chunk of the 32k runs' shape)")
    ap.add_argument("--step-ms", type=float, default=250.0, help="the step's length (a 16k prefill: 0.22-0.36 s)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--connections", default="default,32", help="CUDA_DEVICE_MAX_CONNECTIONS values, comma-separated")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--waited-ms", type=float, default=20.0, help="a lane waited when its worst copy took longer")
    ap.add_argument("--json", metavar="OUT", help="also write every measurement as JSON")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a.lanes, a.mb, a.step_ms, a.rounds)))
        return 0
    modes = [m for m in a.modes.split(",") if m]
    conns = [c for c in a.connections.split(",") if c]
    bad = [m for m in modes if m not in MODES] + [c for c in conns if c != "default" and not c.isdigit()]
    if bad or not 1 <= a.lanes <= 64 or not a.mb > 0 or not 1 <= a.step_ms <= 5000 or not 1 <= a.rounds <= 20:
        print(f"copy_queues: bad arguments {bad or ''} (lanes 1-64, mb > 0, step-ms 1-5000, rounds 1-20)", file=sys.stderr)
        return 2
    try:
        probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                               capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        probe = None
    if probe is None or probe.stdout.strip() != "True":
        print("copy_queues: needs torch with a CUDA device (none here)", file=sys.stderr)
        return 2
    results, summaries = [], []
    for conn in conns:
        for mode in modes:
            env = dict(os.environ)
            env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
            if conn != "default":
                env["CUDA_DEVICE_MAX_CONNECTIONS"] = conn
            try:
                r = subprocess.run([sys.executable, __file__, "--child", mode, "--lanes", str(a.lanes), "--mb",
                                    str(a.mb), "--step-ms", str(a.step_ms), "--rounds", str(a.rounds)],
                                   capture_output=True, text=True, env=env, timeout=300)
                res = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else None
            except (subprocess.TimeoutExpired, ValueError, IndexError):
                r, res = None, None
            if res is None:
                why = r.stderr.strip().replace("\n", " ")[-300:] if r is not None else "no result within 300 s"
                print(f"copy_queues: the {mode} child with connections {conn} failed: {why}", file=sys.stderr)
                return 1
            results.append(res)
            summaries.append(summarize(res, a.waited_ms))
            print(render(summaries[-1:], a.lanes).splitlines()[-1], flush=True)
    print()
    print(render(summaries, a.lanes))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"summaries": summaries, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
