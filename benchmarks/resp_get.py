"""GET bandwidth of kvctl's RespClient vs redis-py + hiredis, side by side in one run.

Starts one real local Valkey (embedded binary), stores ``--batch`` values of
``--value-mb`` MB (default 8 x 12.4 MB, one GLM-5.3 FP8 MLA chunk each, as in
the paper), then alternates timed rounds of each client's batched GET
(kvctl: ``batched_get`` into preallocated buffers, default pool of 4 connections
that a batch this large is spread over; redis-py: a non-transactional
pipeline of GETs) so machine noise hits both alike. Prints GB/s per client and
the ratio kvctl / redis-py. When LMCache is importable (run it with the LMCache
venv, ``make lmcache-venv``), LMCache's native RESP client is measured in the
same rounds: the client of its ``resp://`` connector (``RESPClient`` over the
``lmcache_redis`` extension, 8 worker threads, its default ``resp_num_threads``),
awaited on an asyncio loop thread as the connector does, reading into
preallocated buffers like kvctl's.

    .venv/bin/python benchmarks/resp_get.py [--seconds 20] [--value-mb 12.4] [--batch 8]
    .venv-lmcache/bin/python benchmarks/resp_get.py      # + LMCache's native client
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Callable

from kvctl.connector.resp import RespClient
from kvctl.tier.server import start_valkey


SPLIT = 4  # connections for the split variant


@dataclass(frozen=True)
class ClientResult:
    """One client's measured GET bandwidth over all its rounds."""

    client: str
    batches: int
    gbytes: float
    seconds: float
    get_gbps: float
    median_round_gbps: float


def _timed_rounds(fn: Callable[[], None], batch_bytes: int, seconds: float) -> tuple[int, float]:
    """Run ``fn`` repeatedly for about ``seconds``; (batches, elapsed)."""
    n = 0
    t0 = time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return n, elapsed


def run(seconds: float, value_mb: float, batch: int, rounds: int) -> dict:
    """Measure every available client; returns a JSON-able summary."""
    size = int(value_mb * 1_000_000)
    keys = [f"bench-chunk-{i}" for i in range(batch)]
    batch_bytes = size * batch
    with tempfile.TemporaryDirectory(prefix="kvctl-bench-") as tmp:
        maxmem = max(256, int(batch_bytes * 3 / 1_000_000))
        server = start_valkey(tmp, settings={"maxmemory": f"{maxmem}mb"}, die_with_parent=True)
        try:
            # the default pool (4 connections): batched_get spreads a batch this large over all of them
            ours = RespClient(server.url, timeout_s=30.0)
            ours.batched_set(keys, [bytes([i % 256]) * size for i in range(batch)])
            buffers = [bytearray(size) for _ in keys]

            def kvctl_get() -> None:
                if not all(ours.batched_get(keys, buffers)):
                    raise RuntimeError("kvctl batched_get missed a key")
                if any(b[0] != i % 256 or b[-1] != i % 256 for i, b in enumerate(buffers)):
                    raise RuntimeError("kvctl batched_get read wrong bytes")

            clients: dict[str, Callable[[], None]] = {"kvctl RespClient": kvctl_get}

            # the batch spread by hand over 4 pooled connections, one thread each, each sub-call on one
            # connection (parallel_gets=1): what batched_get's own split is compared with
            pooled = RespClient(server.url, timeout_s=30.0, pool_size=SPLIT, parallel_gets=1)
            splitter = ThreadPoolExecutor(SPLIT, thread_name_prefix="kvctl-bench-split")

            def kvctl_split_get() -> None:
                parts = [splitter.submit(pooled.batched_get, keys[i::SPLIT], buffers[i::SPLIT]) for i in range(SPLIT)]
                if not all(all(p.result()) for p in parts):
                    raise RuntimeError("kvctl split batched_get missed a key")

            clients[f"kvctl RespClient x{SPLIT} conns"] = kvctl_split_get

            import redis  # noqa: PLC0415

            try:
                import hiredis  # noqa: F401, PLC0415

                parser = "hiredis"
            except ImportError:
                parser = "python parser"
            rpy = redis.Redis(host=server.host, port=server.port, socket_timeout=30)

            def redis_get() -> None:
                pipe = rpy.pipeline(transaction=False)
                for k in keys:
                    pipe.get(k)
                vals = pipe.execute()
                if any(v is None or len(v) != size for v in vals):
                    raise RuntimeError("redis-py missed a key")

            clients[f"redis-py + {parser}"] = redis_get
            lmcache_note, lmcache_get, lmcache_close = _lmcache_client(server.host, server.port, keys, size)
            if lmcache_get is not None:
                clients["LMCache native RESP"] = lmcache_get

            for fn in clients.values():  # warm-up: connections, page faults in buffers
                fn()
            per_round = seconds / (rounds * len(clients))
            totals = {name: [0, 0.0] for name in clients}
            round_gbps: dict[str, list[float]] = {name: [] for name in clients}
            for _ in range(rounds):
                for name, fn in clients.items():
                    n, el = _timed_rounds(fn, batch_bytes, per_round)
                    totals[name][0] += n
                    totals[name][1] += el
                    round_gbps[name].append(n * batch_bytes / el / 1e9)
            results = []
            for name, (n, el) in totals.items():
                gb = n * batch_bytes / 1e9
                results.append(ClientResult(name, n, gb, el, gb / el, statistics.median(round_gbps[name])))
            ours.close()
            pooled.close()
            splitter.shutdown()
            rpy.close()
            if lmcache_close is not None:
                lmcache_close()
        finally:
            server.stop()
    by_name = {r.client: r for r in results}
    rpy_r = next(r for r in results if r.client.startswith("redis-py"))
    split_r = by_name[f"kvctl RespClient x{SPLIT} conns"]
    base = rpy_r.get_gbps
    lmc = by_name.get("LMCache native RESP")
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "params": {"seconds": seconds, "value_mb": value_mb, "batch": batch, "rounds": rounds},
        "results": [asdict(r) for r in results],
        "ratio_kvctl_over_redis_py": results[0].get_gbps / base if base else float("nan"),
        "ratio_median_rounds": results[0].median_round_gbps / rpy_r.median_round_gbps,
        "lmcache": lmcache_note,
        "ratio_kvctl_over_lmcache": results[0].get_gbps / lmc.get_gbps if lmc else None,
        "ratio_median_rounds_over_lmcache": results[0].median_round_gbps / lmc.median_round_gbps if lmc else None,
        "ratio_split_over_lmcache": split_r.get_gbps / lmc.get_gbps if lmc else None,
        "ratio_split_over_redis_py": split_r.get_gbps / base if base else float("nan"),
    }


def _lmcache_client(host: str, port: int, keys: list[str], size: int):
    """(note, get function or None, close function or None) for LMCache's native RESP client."""
    try:
        from importlib.metadata import version  # noqa: PLC0415

        from lmcache.v1.storage_backend.native_clients.resp_client import RESPClient  # noqa: PLC0415
    except ImportError:
        return "not installed: skipped (run with the LMCache venv, make lmcache-venv)", None, None
    import asyncio  # noqa: PLC0415
    import threading  # noqa: PLC0415

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True, name="lmcache-bench-loop")
    thread.start()
    client = RESPClient(host, port, 8, loop)  # LMCache's resp:// connector default: resp_num_threads 8
    bufs = [memoryview(bytearray(size)) for _ in keys]

    def lmcache_get() -> None:
        asyncio.run_coroutine_threadsafe(client.batch_get(keys, bufs), loop).result(60)
        if any(b[0] != i % 256 or b[-1] != i % 256 for i, b in enumerate(bufs)):
            raise RuntimeError("LMCache native client read wrong bytes")

    def close() -> None:
        client.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)

    return f"lmcache {version('lmcache')}: RESPClient.batch_get (8 workers) on an asyncio loop", lmcache_get, close


def render(summary: dict) -> str:
    """Human-readable table of a :func:`run` summary."""
    p = summary["params"]
    lines = [
        f"batched GET of {p['batch']} x {p['value_mb']} MB values, one local Valkey, "
        f"{p['rounds']} alternating rounds, ~{p['seconds']:g} s total",
        f"{'client':<28} {'batches':>8} {'GB':>8} {'GB/s':>8} {'median GB/s':>12}",
    ]
    for r in summary["results"]:
        lines.append(
            f"{r['client']:<28} {r['batches']:>8} {r['gbytes']:>8.1f} {r['get_gbps']:>8.2f} {r['median_round_gbps']:>12.2f}"
        )
    lines.append(f"LMCache native client: {summary['lmcache']}")
    lines.append(
        f"ratio kvctl / redis-py: {summary['ratio_kvctl_over_redis_py']:.2f}x "
        f"(median of rounds: {summary['ratio_median_rounds']:.2f}x; target >= 1.2x)"
    )
    lines.append(f"ratio kvctl x{SPLIT} conns / redis-py: {summary['ratio_split_over_redis_py']:.2f}x")
    if summary.get("ratio_kvctl_over_lmcache") is not None:
        lines.append(
            f"ratio kvctl / LMCache native: {summary['ratio_kvctl_over_lmcache']:.2f}x "
            f"(median of rounds: {summary['ratio_median_rounds_over_lmcache']:.2f}x; target >= 1.0x); "
            f"kvctl x{SPLIT} conns / LMCache native: {summary['ratio_split_over_lmcache']:.2f}x"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="total timed seconds over all clients")
    ap.add_argument("--value-mb", type=float, default=12.4, help="value size in MB (1e6 bytes)")
    ap.add_argument("--batch", type=int, default=8, help="values per batched GET")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds per client")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = ap.parse_args(argv)
    summary = run(args.seconds, args.value_mb, args.batch, args.rounds)
    print(json.dumps(summary, indent=2) if args.json else render(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
