"""`kvctl bench` (1 instance × 1 client) vs `redis-benchmark -t get -d <chunk>`, same server, one run.

Starts one real local Valkey (embedded binary; or ``--url``), stores a
chunk-sized value under the key redis-benchmark GETs (``key:__rand_int__``),
then alternates rounds: kvctl's bench library (one client process, batches of
``--batch`` pipelined GETs into preallocated buffers) and redis-benchmark with
one connection pipelining the same depth (``-c 1 -P <batch>``). Prints GB/s of
each (median of the rounds) and the ratio kvctl / redis-benchmark. Target:
≥ 0.95× — the bench client must not be the bottleneck.

redis-benchmark comes from Debian's ``redis-tools`` (``apt-get install -y redis-tools``);
a ``valkey-benchmark`` on PATH or next to the embedded valkey-server is used first.

    .venv/bin/python benchmarks/bench_vs_redis_benchmark.py [--chunk-bytes 12.4e6] [--batch 8] [--seconds 5] [--rounds 3]
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from kvctl.bench.runner import run_bench
from kvctl.bench.spec import BenchSpec
from kvctl.connector.resp import RespClient
from kvctl.connector.urls import parse_resp_url
from kvctl.tier.server import find_valkey_server, start_valkey
from kvctl.tier.targets import Target


def find_benchmark_binary() -> str | None:
    """valkey-benchmark next to valkey-server or on PATH, else redis-benchmark."""
    try:
        sibling = Path(find_valkey_server()).parent / "valkey-benchmark"
        if sibling.exists():
            return str(sibling)
    except Exception:  # noqa: BLE001
        pass
    return shutil.which("valkey-benchmark") or shutil.which("redis-benchmark")


def redis_benchmark_gbps(binary: str, host: str, port: int, chunk: int, batch: int, seconds: float, est_gbps: float) -> float:
    """GET GB/s of one redis-benchmark run sized to last about ``seconds``."""
    n = max(batch * 4, int(seconds * est_gbps * 1e9 / chunk) // batch * batch)
    cmd = [binary, "-h", host, "-p", str(port), "-t", "get", "-d", str(chunk), "-c", "1", "-P", str(batch), "-n", str(n), "--csv"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds * 10 + 60, check=True).stdout
    rows = [r for r in csv.reader(io.StringIO(out)) if r and r[0].upper().startswith("GET")]
    if not rows:
        raise RuntimeError(f"no GET line in redis-benchmark output: {out!r}")
    return float(rows[-1][1]) * chunk / 1e9


def kvctl_gbps(target: Target, chunk: int, batch: int, seconds: float, keys: int | None) -> float:
    spec = BenchSpec(chunk_bytes=chunk, batch=batch, clients=1, duration_s=seconds, keys=keys)
    report = run_bench([target], spec)
    run = report.runs[0]
    if run.errors:
        raise RuntimeError(f"kvctl bench reported {run.errors} errors: {run.per_instance[0].first_error}")
    return run.aggregate_gbps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk-bytes", type=float, default=12.4e6, help="value size (default 12.4e6)")
    ap.add_argument("--batch", type=int, default=8, help="GETs per pipelined batch (kvctl --batch, redis-benchmark -P)")
    ap.add_argument("--seconds", type=float, default=5.0, help="seconds per round of each tool")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    ap.add_argument("--keys", type=int, help="kvctl distinct keys (default: automatic, ~1 GB within maxmemory)")
    ap.add_argument("--url", help="bench this server instead of starting an embedded one")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args()
    chunk = int(args.chunk_bytes)
    binary = find_benchmark_binary()
    if binary is None:
        print("no valkey-benchmark/redis-benchmark: apt-get install -y redis-tools", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="kvctl-bvr-") as tmp:
        proc = None
        if args.url:
            u = parse_resp_url(args.url)
            target = Target(0, u.host, u.port, args.url, u.password)
        else:
            proc = start_valkey(tmp, settings={"maxmemory": "3gb"}, die_with_parent=True)
            target = Target(0, proc.host, proc.port, proc.url)
        try:
            with RespClient(target.url, timeout_s=30) as c:  # the key redis-benchmark's GET test reads
                c.batched_set([b"key:__rand_int__"], [bytes(chunk)])
            kv, rb = [], []
            for i in range(args.rounds):
                kv.append(kvctl_gbps(target, chunk, args.batch, args.seconds, args.keys))
                rb.append(redis_benchmark_gbps(binary, target.host, target.port, chunk, args.batch, args.seconds, kv[-1]))
                print(f"round {i + 1}: kvctl bench {kv[-1]:.3f} GB/s   {Path(binary).name} {rb[-1]:.3f} GB/s", file=sys.stderr)
            with RespClient(target.url, timeout_s=30) as c:
                c.delete([b"key:__rand_int__"])
        finally:
            if proc is not None:
                proc.stop()
    kv_med, rb_med = statistics.median(kv), statistics.median(rb)
    result = {
        "chunk_bytes": chunk, "batch": args.batch, "seconds_per_round": args.seconds, "rounds": args.rounds,
        "tool": Path(binary).name, "kvctl_gbps": kv_med, "benchmark_gbps": rb_med, "ratio": kv_med / rb_med,
        "kvctl_rounds_gbps": kv, "benchmark_rounds_gbps": rb,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"kvctl bench 1×1 (batch {args.batch}): {kv_med:.3f} GB/s")
        print(f"{Path(binary).name} -t get -d {chunk} -c 1 -P {args.batch}: {rb_med:.3f} GB/s")
        print(f"ratio kvctl / {Path(binary).name}: {result['ratio']:.3f}× (target ≥ 0.95×)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
