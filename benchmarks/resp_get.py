"""GET bandwidth of kvctl's RespClient vs redis-py + hiredis, side by side in one run.

Starts one real local Valkey (embedded binary), stores ``--batch`` values of
``--value-mb`` MB (default 8 x 12.4 MB, one GLM-5.3 FP8 MLA chunk each, as in
the paper), then alternates timed rounds of each client's batched GET
(kvctl: ``batched_get`` into preallocated buffers; redis-py: a non-transactional
pipeline of GETs) so machine noise hits both alike. Prints GB/s per client and
the ratio kvctl / redis-py. LMCache's native client is measured too when it is
importable (it is optional and never installed by this script).

    .venv/bin/python benchmarks/resp_get.py [--seconds 20] [--value-mb 12.4] [--batch 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Callable

from kvctl.connector.resp import RespClient
from kvctl.tier.server import start_valkey


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
        server = start_valkey(tmp, settings={"maxmemory": f"{maxmem}mb"})
        try:
            ours = RespClient(server.url, timeout_s=30.0, pool_size=1)
            ours.batched_set(keys, [bytes([i % 256]) * size for i in range(batch)])
            buffers = [bytearray(size) for _ in keys]

            def kvctl_get() -> None:
                if not all(ours.batched_get(keys, buffers)):
                    raise RuntimeError("kvctl batched_get missed a key")

            clients: dict[str, Callable[[], None]] = {"kvctl RespClient": kvctl_get}

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
            lmcache_note = _lmcache_note()

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
            rpy.close()
        finally:
            server.stop()
    base = results[1].get_gbps
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "params": {"seconds": seconds, "value_mb": value_mb, "batch": batch, "rounds": rounds},
        "results": [asdict(r) for r in results],
        "ratio_kvctl_over_redis_py": results[0].get_gbps / base if base else float("nan"),
        "ratio_median_rounds": results[0].median_round_gbps / results[1].median_round_gbps,
        "lmcache": lmcache_note,
    }


def _lmcache_note() -> str:
    """LMCache's native RESP client is compared only when installed; say why it was skipped."""
    try:
        import lmcache  # noqa: F401, PLC0415
    except ImportError:
        return "not installed: skipped"
    return "installed, but no stable public batched-GET entry point is wired here: skipped"


def render(summary: dict) -> str:
    """Human-readable table of a :func:`run` summary."""
    p = summary["params"]
    lines = [
        f"batched GET of {p['batch']} x {p['value_mb']} MB values, one local Valkey, "
        f"{p['rounds']} alternating rounds, ~{p['seconds']:g} s total",
        f"{'client':<26} {'batches':>8} {'GB':>8} {'GB/s':>8} {'median GB/s':>12}",
    ]
    for r in summary["results"]:
        lines.append(
            f"{r['client']:<26} {r['batches']:>8} {r['gbytes']:>8.1f} {r['get_gbps']:>8.2f} {r['median_round_gbps']:>12.2f}"
        )
    lines.append(f"LMCache native client: {summary['lmcache']}")
    lines.append(
        f"ratio kvctl / redis-py: {summary['ratio_kvctl_over_redis_py']:.2f}x "
        f"(median of rounds: {summary['ratio_median_rounds']:.2f}x; target >= 1.2x)"
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
