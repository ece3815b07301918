#!/usr/bin/env python3
"""KvctlConnector's load path against raw batched GETs of the same bytes, one run, W gloo ranks on CPU.

Two real valkey-servers (one per rank, as ``kvctl deploy-valkey up`` makes
them) hold a prompt of ``--chunks`` MLA chunks stored by the connector itself
(chunk c on instance c mod W). Then, alternating, ``--repeats`` times:

* ``connector`` -- the scheduler's lookup (EXISTS on every instance, on rank 0),
  then on every rank the connector's agreed-prefix load (GET of its owned
  chunks, exchange, broadcast from the owners) and the write of every chunk
  into vLLM's paged MLA cache layout (``KvctlConnector``'s worker side, ``conn.worker.load``);
* ``raw``       -- every rank GETs the same bytes the load leaves on it (every
  chunk of the prompt) from the instance that holds it, one pipelined
  batch per instance, into preallocated buffers: what it costs a rank to
  fetch the prompt itself, with no protocol and no cache write;
* ``raw_owned`` -- every rank GETs only its own chunks (shown for reference:
  the network floor of the sharded load).

Times are the slowest rank's, medians over the repeats; the ratio
connector / raw is printed (target <= 1.25).

    python benchmarks/connector_load.py [--chunks 16 --chunk-tokens 256 --layers 8 --repeats 7]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

BS = 16  # vLLM's CPU MLA block size
ROW = 576  # kv_lora_rank 512 + qk_rope_head_dim 64


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", dest="json_path", default=None, help="also write the result JSON here")
    return ap.parse_args(argv)


def _rank_main(rank, args, urls, port, out_q):
    import multiprocessing

    from kvctl.core.procs import die_with

    die_with(multiprocessing.parent_process().pid)  # a killed benchmark leaves no rank behind
    import torch
    import torch.distributed as dist
    from datetime import timedelta

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.world, timeout=timedelta(seconds=120))
    try:
        out_q.put((rank, "ok", _bench(rank, args, urls)))
    except BaseException:  # noqa: BLE001 - report to the parent
        out_q.put((rank, "error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def _bench(rank, args, urls):
    import torch
    import torch.distributed as dist

    from kvctl.connector.resp import RespClient
    from kvctl.plugins.vllm import KvctlConnector, LoadSpec, SaveSpec
    from kvctl.connector.layouts import slots_for
    from kvctl.connector.lookup import TierLookup

    W, ct, n = args.world, args.chunk_tokens, args.chunks
    n_tokens = n * ct + 1  # the last token is always computed: n chunks loadable
    n_blocks = -(-n_tokens // BS) + 4
    g = torch.Generator().manual_seed(0)
    # blocks 0..n_blocks-1 hold the stored prompt; the load writes into the other half, in reverse order
    caches = {f"l{i}": torch.randn(2 * n_blocks, BS, ROW, generator=g).to(torch.bfloat16) for i in range(args.layers)}
    coordinator = SimpleNamespace(rank_in_group=rank, world_size=W, cpu_group=dist.group.WORLD, ranks=list(range(W)))
    conn = KvctlConnector.without_engine(
        {"urls": urls, "chunk_tokens": ct, "timeout_s": 10.0}, world_size=W, layer_names=list(caches),
        spec=SimpleNamespace(head_size=ROW, num_kv_heads=1, dtype=torch.bfloat16), block_size=BS, use_mla=True,
        kv_caches=caches, model_name="bench", coordinator=coordinator)
    tokens = list(range(1000, 1000 + n_tokens))
    block_ids = list(range(n_blocks))
    conn.worker.save(SaveSpec("stored", tokens[: n * ct], block_ids))
    assert conn.worker.saver.wait_idle(120)  # the save is written
    dist.barrier()
    keys = conn.worker.store.keys(tokens)
    lookup = TierLookup(urls, ct, "bench", conn.spec.fmt, 10.0) if rank == 0 else None
    clients = [RespClient(u, timeout_s=10.0, pool_size=1) for u in urls]
    nbytes = conn.worker.store.chunk_nbytes
    bufs = [bytearray(nbytes) for _ in range(n)]
    load_blocks = list(range(2 * n_blocks - 1, n_blocks - 1, -1))

    def slowest(fn):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        return float(dt)

    def connector():
        hit = torch.tensor([lookup.lookup(tokens, 0).hit_chunks if rank == 0 else 0])
        dist.broadcast(hit, src=0)
        conn.worker.load(LoadSpec("b", tokens[: int(hit) * ct], 0, int(hit), 0, load_blocks), conn.worker.group)
        assert int(hit) == n and not conn.get_block_ids_with_load_errors()

    def raw(only_owned=False):
        for o in range(W):
            if only_owned and o != rank:
                continue
            idx = [c for c in range(n) if c % W == o]
            ok = clients[o].batched_get([keys[c] for c in idx], [bufs[c] for c in idx])
            assert all(ok)

    # the connector's parts, timed alone: lookup, agreed-prefix load (GET, exchange, broadcast), cache write
    loaded = conn.worker.store.load(tokens, n * ct)
    slots = [slots_for(load_blocks, BS, c * ct, (c + 1) * ct) for c in range(n)]

    def write():
        for c, chunk in enumerate(loaded.chunks):
            conn.worker.layout.insert(slots[c], chunk)

    fns = {"connector": connector, "raw": raw, "raw_owned": lambda: raw(True),
           "part_lookup": lambda: lookup.lookup(tokens, 0) if rank == 0 else None,
           "part_agreed_load": lambda: conn.worker.store.load(tokens, n * ct), "part_write": write}
    times = {k: [] for k in fns}
    connector()  # warm-up: connections, allocator
    raw()
    for i in range(args.repeats):
        order = list(fns) if i % 2 == 0 else list(reversed(fns))
        for name in order:
            times[name].append(slowest(fns[name]))
    # the loaded cache equals the stored one, slot for slot
    src = conn.worker.layout.extract(slots_for(block_ids, BS, 0, n * ct))
    dst = conn.worker.layout.extract(slots_for(load_blocks, BS, 0, n * ct))
    assert torch.equal(src, dst), "loaded KV differs from the stored KV"
    conn.shutdown()
    if lookup is not None:
        lookup.close()
    for c in clients:
        c.close()
    return {"times": times, "chunk_bytes": nbytes}


def main(argv=None) -> int:
    import multiprocessing as mp

    args = parse_args(argv)
    from kvctl.tier.server import free_port, start_valkey

    tmp = Path(tempfile.mkdtemp(prefix="kvctl-bench-load-"))
    servers = [start_valkey(tmp / f"valkey-{r}", settings={"maxmemory": "1gb"}, die_with_parent=True) for r in range(args.world)]
    try:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_rank_main, args=(r, args, [s.url for s in servers], port, q), daemon=True)
                 for r in range(args.world)]
        for p in procs:
            p.start()
        results = {}
        deadline = time.monotonic() + 600
        while len(results) < args.world and time.monotonic() < deadline:
            try:
                rank, status, payload = q.get(timeout=5)
            except Exception:  # noqa: BLE001 - queue.Empty
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
                continue
            if status != "ok":
                print(payload, file=sys.stderr)
                return 1
            results[rank] = payload
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        if len(results) < args.world:
            print("a rank did not finish", file=sys.stderr)
            return 1
    finally:
        for s in servers:
            s.stop()
    times = results[0]["times"]
    med = {k: statistics.median(v) for k, v in times.items()}
    total_bytes = args.chunks * results[0]["chunk_bytes"]
    out = {
        "world": args.world, "chunks": args.chunks, "chunk_tokens": args.chunk_tokens, "layers": args.layers,
        "chunk_bytes": results[0]["chunk_bytes"], "prompt_bytes": total_bytes, "repeats": args.repeats,
        "median_ms": {k: round(v * 1e3, 2) for k, v in med.items()},
        "ratio_connector_vs_raw": round(med["connector"] / med["raw"], 3),
        "ratio_connector_vs_raw_owned": round(med["connector"] / med["raw_owned"], 3),
    }
    print(f"W={args.world} gloo ranks, {args.chunks} MLA chunks x {args.chunk_tokens} tokens x {args.layers} layers "
          f"({out['chunk_bytes'] / 1e6:.2f} MB each, {total_bytes / 1e6:.1f} MB per prompt), median of {args.repeats}")
    for k in ("connector", "raw", "raw_owned"):
        print(f"  {k:<10} {out['median_ms'][k]:9.2f} ms  ({total_bytes / med[k] / 1e9:.2f} GB/s of prompt)")
    print("  connector's parts alone: " + ", ".join(
        f"{k.removeprefix('part_')} {out['median_ms'][k]:.2f} ms" for k in med if k.startswith("part_")))
    print(f"  connector / raw       = {out['ratio_connector_vs_raw']:.3f}x  (target <= 1.25x)")
    print(f"  connector / raw_owned = {out['ratio_connector_vs_raw_owned']:.3f}x")
    print(json.dumps(out))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
