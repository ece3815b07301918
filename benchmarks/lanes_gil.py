"""GET lanes beside a busy Python thread: what a layered load's lanes lose to vLLM's forward (issue 45).

On an H200 (2026-12-05, ``results/engine_gpu_layered-h200-2026-12-05.json``) a hit loaded layer group by layer group
took 2.4x as long for its GETs as the serial hit of the same bytes (126 against 53 ms at 16k tokens). The two differ
in what the engine's main thread does while the lanes run: in the serial load it waits (no GIL), in the layered
load it runs the forward, launching kernels in Python between the attention layers. A lane's reply is read in
several ``recv_into`` calls, each one giving up the GIL and taking it back; beside a thread that holds the GIL, each
take-back can wait up to ``sys.getswitchinterval()`` (5 ms by default).

This measures that mechanism without a GPU: ``--lanes`` threads, each with its own RespClient connection to one real
local Valkey, GET ``--value-mb`` values one per round trip (a pipelined load's unit) while the main thread is
(a) waiting, (b) busy in Python, (c) busy in Python with the switch interval at ``--switch-ms``, (d) as busy a core
without holding the GIL (what (b) costs in CPU alone, on a machine of few cores). Each of these reads a value's
payload as the connection does (``MSG_WAITALL`` in one ``recv`` where the platform has it, ``resp_conn.WAITALL_OK``);
(e) is (b) with the old reader, a ``recv_into`` per arrival, on connections of their own (and ``idle-recvloop``
(a) with it: what the new reader changes for a serial load); (f) is (b) with each lane
in a process of its own (its own GIL) GETting into one shared-memory buffer, the main process told once a round
per lane over a pipe: a reader off the engine's GIL, as issue 45's gap asks. The modes alternate round by round so
machine noise hits all alike; it prints GB/s per mode and the ratios to (a).

    .venv/bin/python benchmarks/lanes_gil.py [--seconds 12] [--value-mb 2] [--lanes 8] [--switch-ms 0.5]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import shared_memory

from kvctl.connector import resp_conn
from kvctl.connector.resp import RespClient
from kvctl.tier.server import start_valkey

MODES = ("idle", "busy", "busy+switch", "busy-nogil", "busy-recvloop", "busy-procs", "idle-recvloop")


def _busy(stop: threading.Event) -> int:
    """Pure-Python work until ``stop``: the forward's host side, as far as the GIL sees it."""
    n = 0
    while not stop.is_set():
        for i in range(2000):
            n += i * i % 7
    return n


_BLOB = bytes(1 << 20)


def _busy_nogil(stop: threading.Event) -> int:
    """As busy a core, without the GIL (hashlib releases it on large buffers): the CPU share alone."""
    n = 0
    while not stop.is_set():
        n += hashlib.sha256(_BLOB).digest()[0]
    return n


def _proc_lane(url: str, keys: list[str], shm_name: str, offset: int, size: int, pipe) -> None:
    """A lane in its own process: on each "go" GET ``keys`` one per round trip into its part of the shared buffer."""
    shm = shared_memory.SharedMemory(name=shm_name)
    view = shm.buf[offset : offset + size]
    client = RespClient(url, timeout_s=30.0, pool_size=1, parallel_gets=1)
    try:
        while pipe.recv() == "go":
            got = 0
            for k in keys:
                if client.batched_get([k], [view])[0]:
                    got += size
            pipe.send(got)
    finally:
        client.close()
        del view
        shm.close()


def run(seconds: float, value_mb: float, lanes: int, keys_per_lane: int, switch_ms: float) -> dict:
    size = int(value_mb * 1e6)
    with tempfile.TemporaryDirectory() as tmp:
        maxmem = int(lanes * keys_per_lane * size * 1.5 / 1e6) + 64
        server = start_valkey(tmp, settings={"maxmemory": f"{maxmem}mb", "io-threads": 2}, die_with_parent=True)
        try:
            clients = [RespClient(server.url, timeout_s=30.0, pool_size=1, parallel_gets=1) for _ in range(lanes)]
            waitall, resp_conn.WAITALL_OK = resp_conn.WAITALL_OK, False
            try:  # (e): connections that read a payload a recv_into at a time (the reader before MSG_WAITALL)
                loop_clients = [RespClient(server.url, timeout_s=30.0, pool_size=1, parallel_gets=1)
                                for _ in range(lanes)]
                for c in loop_clients:
                    c.ping()
            finally:
                resp_conn.WAITALL_OK = waitall
            keys = [[f"lane{li}:{k}" for k in range(keys_per_lane)] for li in range(lanes)]
            for li, c in enumerate(clients):
                c.batched_set(keys[li], [bytes([li]) * size] * keys_per_lane)
            bufs = [bytearray(size) for _ in range(lanes)]
            pool = ThreadPoolExecutor(lanes)
            shm = shared_memory.SharedMemory(create=True, size=lanes * size)
            pipes, procs = [], []
            try:
                ctx = mp.get_context("fork")
                for li in range(lanes):
                    mine, theirs = ctx.Pipe()
                    p = ctx.Process(target=_proc_lane, args=(server.url, keys[li], shm.name, li * size, size, theirs),
                                    daemon=True)
                    p.start()
                    pipes.append(mine)
                    procs.append(p)

                def lane(li: int, loop: bool = False) -> int:
                    got = 0
                    client = (loop_clients if loop else clients)[li]
                    for k in keys[li]:  # one value per round trip, as a pipelined load's unit
                        if client.batched_get([k], [bufs[li]])[0]:
                            got += size
                    return got

                def one_round(mode: str) -> float:
                    stop = threading.Event()
                    old = sys.getswitchinterval()
                    if mode == "busy+switch":
                        sys.setswitchinterval(switch_ms / 1000)
                    try:
                        t0 = time.perf_counter()
                        if mode == "busy-procs":
                            for pp in pipes:
                                pp.send("go")
                            futs = [pool.submit(pp.recv) for pp in pipes]  # a pipe's wait gives the GIL up
                        else:
                            futs = [pool.submit(lane, li, mode.endswith("recvloop")) for li in range(lanes)]
                        if mode.startswith("idle"):
                            got = sum(f.result() for f in futs)
                        else:
                            waiter = threading.Thread(target=lambda: [f.result() for f in futs] and stop.set())
                            waiter.start()
                            (_busy_nogil if mode == "busy-nogil" else _busy)(stop)  # the main thread, as vLLM's, works
                            waiter.join()
                            got = sum(f.result() for f in futs)
                        return got / (time.perf_counter() - t0) / 1e9
                    finally:
                        sys.setswitchinterval(old)

                results: dict[str, list[float]] = {m: [] for m in MODES}
                one_round("idle")  # warm-up
                deadline = time.monotonic() + seconds
                while time.monotonic() < deadline:
                    for m in MODES:
                        results[m].append(one_round(m))
                pool.shutdown()
                for c in clients + loop_clients:
                    c.close()
            finally:  # the lane processes and the shared segment this run made, also on an error or Ctrl-C
                for pp, p in zip(pipes, procs):
                    try:
                        pp.send("stop")
                    except OSError:
                        pass
                    p.join(timeout=10)
                    if p.is_alive():
                        p.kill()
                shm.close()
                shm.unlink()
        finally:
            server.stop()
    med = {m: statistics.median(v) for m, v in results.items()}
    return {"waitall": resp_conn.WAITALL_OK, "value_mb": value_mb, "lanes": lanes, "keys_per_lane": keys_per_lane, "switch_ms": switch_ms,
            "rounds": len(results["idle"]), "gbps": med,
            "vs_idle": {m: med[m] / med["idle"] for m in MODES}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--value-mb", type=float, default=2.0, help="one unit: a 256-token chunk's quarter of the Lite shape")
    ap.add_argument("--lanes", type=int, default=8)
    ap.add_argument("--keys-per-lane", type=int, default=16)
    ap.add_argument("--switch-ms", type=float, default=0.5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    out = run(a.seconds, a.value_mb, a.lanes, a.keys_per_lane, a.switch_ms)
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"{a.lanes} lanes x {a.keys_per_lane} GETs of {a.value_mb} MB, {out['rounds']} rounds per mode, medians:")
        for m in MODES:
            print(f"  main thread {m:<12} {out['gbps'][m]:6.2f} GB/s  ({out['vs_idle'][m]:.2f}x idle)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
