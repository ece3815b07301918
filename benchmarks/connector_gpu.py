#!/usr/bin/env python3
"""The connector's device data path on CUDA, side by side with raw copies and raw GET/SET (issue 20).

Drives :class:`kvctl.connector.datapath.KVDataPath` -- the function the vLLM
plugin calls -- on paged CUDA caches built the way vLLM 0.32 builds them
(``kvctl.connector.kv_views.build_caches``; the GPU host has no vLLM) and
real valkey-servers on loopback. One prompt of ``--chunks`` MLA chunks of
``--layers`` x ``--chunk-tokens`` x 576 (12.4 MB at the defaults, the
paper's chunk). Every figure is the median of ``--repeats`` runs, and each
pair is measured alternately in the same run:

* copies (W=1): ``insert`` of the whole prompt from pinned host memory vs a
  raw pinned H2D copy of the same bytes; ``extract`` into pinned memory vs a
  raw D2H copy (target: each >= 0.7x the raw bandwidth);
* load (W=1): ``KVDataPath.load`` from a local valkey-server into the paged
  cache vs a raw ``batched_get`` of the same keys into pinned memory, the
  faster of one batch of every key and batches of 4 (target <= 1.1x);
* save (W=1): ``KVDataPath.extract`` + ``store_batch`` vs a raw
  ``batched_set`` of the same bytes from pinned memory (target <= 1.1x);
* load (W=2, when two GPUs are visible): the whole load on each rank vs that
  rank's owned GETs + a raw NCCL all-gather of the same slots (target <= 1.2x);
* the pinned pool's size and setup time.

Every load is checked byte for byte against the stored chunks.

    python benchmarks/connector_gpu.py [--chunks 64 --layers 42 --repeats 5 --layouts LBHNC,BLNHC --json out.json]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback

ROW = 576  # kv_lora_rank 512 + qk_rope_head_dim 64
BACKEND = "FLASHMLA"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--layers", type=int, default=42)
    ap.add_argument("--block-size", type=int, default=64, help="vLLM's block size (FlashMLA: 64)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--layouts", default="LBHNC,BLNHC", help="KV cache layouts to run the W=1 load/save in")
    ap.add_argument("--world", type=int, default=0, help="ranks for the W>1 load (0: every visible GPU, if 2+)")
    ap.add_argument("--pool-mb", type=float, default=256.0, help="pinned pool per rank (kv_connector_extra_config.pinned_pool_bytes)")
    ap.add_argument("--io-threads", type=int, default=4, help="valkey-server io-threads")
    ap.add_argument("--get-batches", default="4,8", help="GET batch sizes of the store's device path to run the W=1 load with")
    ap.add_argument("--json", dest="json_path", default=None, help="also write the result JSON here")
    return ap.parse_args(argv)


def _median(xs):
    return statistics.median(xs)


def _cuda_time(fn, sync):
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def _make_caches(args, layout, device, n_prompts=2):
    import torch

    from kvctl.connector.layouts import layout_for
    from kvctl.connector.kv_views import CacheSpec, build_caches

    spec = CacheSpec(block_size=args.block_size, num_kv_heads=1, head_size=ROW, dtype=torch.bfloat16, head_size_v=0)
    blocks_per_prompt = -(-args.chunks * args.chunk_tokens // args.block_size)
    raw, views = build_caches(spec, layout, args.layers, n_prompts * blocks_per_prompt + 2, device=device)
    lay = layout_for(views, spec, layout, BACKEND, cache_dtype="auto")
    return raw, lay, blocks_per_prompt


def _store(rank, world, urls, args, device, pool, group):
    import torch

    from kvctl.connector.store import ShardedStore

    shape = (args.layers, args.chunk_tokens, ROW)
    return ShardedStore(rank, world, list(urls), 0, shape, torch.bfloat16, chunk_tokens=args.chunk_tokens,
                        model_name="bench", fmt=f"mla{ROW}-L{args.layers}-bfloat16", group=group, device=device,
                        timeout_s=30.0, pool=pool)


def _chunks_for(prompt_seed, args, device):
    import torch

    g = torch.Generator(device=device).manual_seed(prompt_seed)
    return torch.randn((args.chunks, args.layers, args.chunk_tokens, ROW), generator=g, device=device).to(torch.bfloat16)


def bench_w1(args, urls):
    import torch
    import torch.distributed as dist

    from kvctl.connector.datapath import KVDataPath, slots_for
    from kvctl.connector.pinned import PinnedPool
    from kvctl.connector.resp import RespClient
    from kvctl.tier.server import free_port

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
    sync = torch.cuda.synchronize
    ct, n, R = args.chunk_tokens, args.chunks, args.repeats
    chunk_nbytes = args.layers * ct * ROW * 2
    total = n * chunk_nbytes
    out = {"chunk_bytes": chunk_nbytes, "prompt_bytes": total}

    t0 = time.perf_counter()
    pool = PinnedPool(int(args.pool_mb * 2**20), chunk_nbytes)
    out["pool"] = {"bytes": pool.nbytes, "slots": pool.n_slots, "pinned": pool.pinned,
                   "setup_s": round(pool.setup_s, 4), "setup_incl_first_touch_s": round(time.perf_counter() - t0, 4)}

    src = _chunks_for(1, args, dev)  # (n, L, ct, ROW) on the GPU
    tokens = list(range(1000, 1000 + n * ct))
    results = {}

    # -- copies: insert from pinned / extract to pinned vs raw copies of the same bytes
    raw_buf, lay, bpp = _make_caches(args, "LBHNC", dev)
    blocks = list(range(1, 1 + bpp))[::-1]  # reversed block order: a paged cache, not a contiguous one
    slots = slots_for(blocks, args.block_size, 0, n * ct)
    host = torch.empty((args.layers, n * ct, ROW), dtype=torch.bfloat16, pin_memory=True)
    host.copy_(src.permute(1, 0, 2, 3).reshape(args.layers, n * ct, ROW))
    dev_flat = torch.empty(total, dtype=torch.uint8, device=dev)
    host_flat = host.view(-1).view(torch.uint8)
    t_raw_h2d, t_ins, t_raw_d2h, t_ext = [], [], [], []
    for _ in range(R):
        t_raw_h2d.append(_cuda_time(lambda: dev_flat.copy_(host_flat, non_blocking=True), sync))
        t_ins.append(_cuda_time(lambda: lay.insert(slots, host), sync))
        t_raw_d2h.append(_cuda_time(lambda: host_flat.copy_(dev_flat, non_blocking=True), sync))
        t_ext.append(_cuda_time(lambda: host.copy_(lay.extract(slots), non_blocking=True), sync))
    ok = torch.equal(lay.extract(slots).cpu(), host.cpu())
    results["copies"] = {
        "raw_h2d_gbps": total / _median(t_raw_h2d) / 1e9, "insert_from_pinned_gbps": total / _median(t_ins) / 1e9,
        "raw_d2h_gbps": total / _median(t_raw_d2h) / 1e9, "extract_to_pinned_gbps": total / _median(t_ext) / 1e9,
        "exact": ok,
    }
    c = results["copies"]
    c["insert_vs_raw"] = c["insert_from_pinned_gbps"] / c["raw_h2d_gbps"]
    c["extract_vs_raw"] = c["extract_to_pinned_gbps"] / c["raw_d2h_gbps"]

    # -- load and save per layout, against raw GET/SET of the same bytes
    client = RespClient(urls[0], timeout_s=30.0)
    keys_raw = [f"raw-{i}" for i in range(n)]
    pin_chunks = torch.empty((n, chunk_nbytes), dtype=torch.uint8, pin_memory=True)
    pin_chunks.copy_(src.reshape(n, -1).view(torch.uint8))
    views = [memoryview(pin_chunks[i].numpy()) for i in range(n)]
    client.batched_set(keys_raw, views)
    runs = [(lay_name, int(b)) for lay_name in [x.strip() for x in args.layouts.split(",") if x.strip()]
            for b in args.get_batches.split(",")]
    for layout, get_batch in runs:
        raw_buf, lay, bpp = _make_caches(args, layout, dev)
        store = _store(0, 1, urls, args, dev, pool, None)
        store.prefetch_batch = get_batch
        path = KVDataPath(store, lay, chunk_tokens=ct, block_size=args.block_size, group=None, device=dev)
        save_blocks = list(range(1, 1 + bpp))
        load_blocks = list(range(1 + bpp, 1 + 2 * bpp))[::-1]
        lay.insert(slots_for(save_blocks, args.block_size, 0, n * ct),
                   src.permute(1, 0, 2, 3).reshape(args.layers, n * ct, ROW))
        sync()
        t_save, t_set, t_load, t_get, t_get4, t_stage = [], [], [], [], [], []
        exact = True
        for rep in range(R):
            client.delete(store.keys(tokens))

            def save():
                batch = path.extract(tokens, save_blocks, 0)
                res = path.store_batch(batch)
                assert res.l2_chunks == n and res.l2_error is None, res

            t_save.append(_cuda_time(save, sync))
            t_set.append(_cuda_time(lambda: client.batched_set(keys_raw, views), sync))
            lay.insert(slots_for(load_blocks, args.block_size, 0, n * ct),
                       torch.zeros((args.layers, n * ct, ROW), dtype=torch.bfloat16, device=dev))

            def load():
                o = path.load(tokens, load_blocks, 0, n, 0)
                assert o.agreed == n and o.written == n, o

            t_load.append(_cuda_time(load, sync))
            # the same minus the insert: GETs into pinned slots, copies to the GPU, the exchange
            t_stage.append(_cuda_time(lambda: store.load(tokens, n * ct, 0), sync))
            t_get.append(_cuda_time(lambda: client.batched_get(keys_raw, views), sync))
            t_get4.append(_cuda_time(lambda: [client.batched_get(keys_raw[i : i + 4], views[i : i + 4])
                                              for i in range(0, n, 4)], sync))
            if rep == 0:
                got = lay.extract(slots_for(load_blocks, args.block_size, 0, n * ct))
                exact = exact and torch.equal(got, src.permute(1, 0, 2, 3).reshape(args.layers, n * ct, ROW))
        results[f"load_save_{layout}_get{get_batch}"] = {
            "store_load_without_insert_s": _median(t_stage),
            # raw GET: the faster of one batch of every key and batches of 4 (what the store sends)
            "raw_get_one_batch_s": _median(t_get), "raw_get_batches_of_4_s": _median(t_get4),
            "load_s": _median(t_load), "raw_get_s": min(_median(t_get), _median(t_get4)),
            "load_vs_raw_get": _median(t_load) / min(_median(t_get), _median(t_get4)),
            "save_s": _median(t_save), "raw_set_s": _median(t_set), "save_vs_raw_set": _median(t_save) / _median(t_set),
            "load_gbps": total / _median(t_load) / 1e9,
            "raw_get_gbps": total / min(_median(t_get), _median(t_get4)) / 1e9,
            "exact": exact,
        }
        store.close()
    client.close()
    dist.destroy_process_group()
    out["results"] = results
    return out


def _rank_w(rank, world, args, urls, port, q):
    import multiprocessing

    from kvctl.core.procs import die_with

    die_with(multiprocessing.parent_process().pid)  # a killed benchmark leaves no rank (and no GPU memory) behind
    try:
        import torch
        import torch.distributed as dist

        from kvctl.connector.datapath import KVDataPath, slots_for
        from kvctl.connector.pinned import PinnedPool

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
        dev = torch.device("cuda", rank)
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
        sync = torch.cuda.synchronize
        ct, n = args.chunk_tokens, args.chunks
        chunk_nbytes = args.layers * ct * ROW * 2
        pool = PinnedPool(int(args.pool_mb * 2**20), chunk_nbytes)
        raw_buf, lay, bpp = _make_caches(args, "LBHNC", dev, n_prompts=1)
        store = _store(rank, world, urls, args, dev, pool, None)
        path = KVDataPath(store, lay, chunk_tokens=ct, block_size=args.block_size, group=None, device=dev)
        src = _chunks_for(7, args, dev)
        tokens = list(range(5000, 5000 + n * ct))
        keys = store.keys(tokens)
        mine = list(store.owned(n))
        pin = torch.empty((len(mine), chunk_nbytes), dtype=torch.uint8, pin_memory=True)
        pin.copy_(src[mine].reshape(len(mine), -1).view(torch.uint8))
        views = [memoryview(pin[i].numpy()) for i in range(len(mine))]
        store.client.batched_set([keys[c] for c in mine], views)
        dist.barrier()
        blocks = list(range(1, 1 + bpp))[::-1]
        kmax = -(-n // world)
        send = torch.empty(kmax * chunk_nbytes, dtype=torch.uint8, device=dev)
        recv = torch.empty(world * kmax * chunk_nbytes, dtype=torch.uint8, device=dev)
        t_load, t_raw = [], []
        exact = True

        def timed(fn):
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            return time.perf_counter() - t0

        def raw():
            store.client.batched_get([keys[c] for c in mine], views)
            send[: len(mine) * chunk_nbytes].copy_(pin.view(-1), non_blocking=True)
            dist.all_gather_into_tensor(recv, send)

        for rep in range(args.repeats):
            def load():
                o = path.load(tokens, blocks, 0, n, 0)
                assert o.agreed == n and o.written == n, o

            t_load.append(timed(load))
            t_raw.append(timed(raw))
            if rep == 0:
                got = lay.extract(slots_for(blocks, args.block_size, 0, n * ct))
                exact = torch.equal(got, src.permute(1, 0, 2, 3).reshape(args.layers, n * ct, ROW))
        store.close()
        dist.destroy_process_group()
        q.put((rank, "ok", {"load_s": _median(t_load), "raw_owned_get_plus_all_gather_s": _median(t_raw),
                            "exact": exact, "pool_setup_s": pool.setup_s, "pinned": pool.pinned}))
    except BaseException:  # noqa: BLE001
        q.put((rank, "error", traceback.format_exc()))


def bench_w(args, world, urls):
    import torch.multiprocessing as mp

    from kvctl.tier.server import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_w, args=(r, world, args, urls, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    res = {}
    deadline = time.monotonic() + 400
    while len(res) < world and time.monotonic() < deadline:
        try:
            r, status, payload = q.get(timeout=5)
        except Exception:  # noqa: BLE001 - queue.Empty
            if not any(p.is_alive() for p in procs):
                break
            continue
        if status != "ok":
            raise RuntimeError(f"rank {r}:\n{payload}")
        res[r] = payload
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
    if len(res) < world:
        raise RuntimeError(f"W={world}: only ranks {sorted(res)} reported")
    load = max(v["load_s"] for v in res.values())
    raw = max(v["raw_owned_get_plus_all_gather_s"] for v in res.values())
    return {"world": world, "ranks": res, "load_s": load, "raw_s": raw, "load_vs_raw": load / raw,
            "exact": all(v["exact"] for v in res.values())}


def main(argv=None):
    args = parse_args(argv)
    import torch

    from kvctl.tier.server import start_valkey

    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count()
    world = args.world or (gpus if gpus >= 2 else 1)
    chunk_nbytes = args.layers * args.chunk_tokens * ROW * 2
    mem = f"{max(512, int(3.5 * args.chunks * chunk_nbytes / 2**20))}mb"
    tmp = tempfile.mkdtemp(prefix="kvctl-gpu-bench-")
    servers = []
    try:
        for r in range(max(1, world)):
            servers.append(start_valkey(f"{tmp}/v{r}", settings={"maxmemory": mem, "io-threads": args.io_threads}, die_with_parent=True))
        urls = [f"resp://127.0.0.1:{s.port}" for s in servers]
        report = {"benchmark": "connector_gpu", "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                  "host": platform.node(), "gpu": torch.cuda.get_device_name(0), "gpus": gpus, "torch": torch.__version__,
                  "args": vars(args)}
        report["w1"] = bench_w1(args, urls[:1])
        if world >= 2:
            report["w"] = bench_w(args, world, urls[:world])
        else:
            report["w"] = {"skipped": f"{gpus} GPU visible: the W>1 load needs 2"}
    finally:
        for s in servers:
            s.stop()
    w1 = report["w1"]
    c = w1["results"]["copies"]
    print(f"pinned pool: {w1['pool']['bytes'] / 2**20:.0f} MiB, {w1['pool']['slots']} slots, pinned={w1['pool']['pinned']}, "
          f"setup {w1['pool']['setup_s'] * 1e3:.1f} ms")
    print(f"{'what':44s} {'kvctl':>12s} {'raw':>12s} {'ratio':>7s} target")
    print(f"{'insert from pinned vs raw H2D (GB/s)':44s} {c['insert_from_pinned_gbps']:12.1f} {c['raw_h2d_gbps']:12.1f} "
          f"{c['insert_vs_raw']:7.2f} >= 0.7  exact={c['exact']}")
    print(f"{'extract to pinned vs raw D2H (GB/s)':44s} {c['extract_to_pinned_gbps']:12.1f} {c['raw_d2h_gbps']:12.1f} "
          f"{c['extract_vs_raw']:7.2f} >= 0.7")
    for k, v in w1["results"].items():
        if not k.startswith("load_save_"):
            continue
        lay = k.removeprefix("load_save_").replace("_get", " GETx")
        print(f"{'W=1 load ' + lay + ' vs raw GET (s)':44s} {v['load_s']:12.4f} {v['raw_get_s']:12.4f} "
              f"{v['load_vs_raw_get']:7.2f} <= 1.1  exact={v['exact']} ({v['load_gbps']:.2f} GB/s; "
              f"without the insert {v['store_load_without_insert_s']:.4f} s)")
        print(f"{'W=1 save ' + lay + ' vs raw SET (s)':44s} {v['save_s']:12.4f} {v['raw_set_s']:12.4f} "
              f"{v['save_vs_raw_set']:7.2f} <= 1.1")
    w = report["w"]
    if "skipped" in w:
        print(f"W>1: skipped ({w['skipped']})")
    else:
        print(f"{'W=%d load vs owned GET + raw all-gather (s)' % w['world']:44s} {w['load_s']:12.4f} {w['raw_s']:12.4f} "
              f"{w['load_vs_raw']:7.2f} <= 1.2  exact={w['exact']}")
    line = json.dumps(report, default=str)
    print(line)
    if args.json_path:
        with open(args.json_path, "w") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
