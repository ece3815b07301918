"""The connector's device data path on real GPUs: pinned pool, copy streams, NCCL exchange, paged CUDA caches.

Runs only where CUDA is visible (skipped on CI's CPU machines):
``python -m pytest -m gpu tests/gpu``. The GPU host has no vLLM, so caches
are built by ``kvctl.connector.kv_views.build_caches`` (checked against
vLLM's own ``create_kv_cache_views`` on CPU in tests/plugins) and driven
through :class:`kvctl.connector.datapath.KVDataPath`, the same calls the vLLM
plugin makes, against real valkey-servers on loopback.
"""

from __future__ import annotations

import os
import queue
import tempfile
import time
import traceback

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.engine]

CT, BS, LAYERS = 64, 16, 4


def _need_gpus(n: int) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA device(s)")


def _layout(kind: str, layout: str, device, n_blocks: int = 64):
    from kvctl.connector.layouts import layout_for
    from kvctl.connector.kv_views import CacheSpec, build_caches

    if kind == "mla":
        spec = CacheSpec(block_size=BS, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, head_size_v=0)
        backend = "FLASHMLA"
    else:
        spec = CacheSpec(block_size=BS, num_kv_heads=4, head_size=128, dtype=torch.bfloat16)
        backend = "FLASH_ATTN"
    raw, views = build_caches(spec, layout, LAYERS, n_blocks, device=device)
    return raw, layout_for(views, spec, layout, backend, cache_dtype="auto")


def _path(lay, url, rank, world, device, group=None):
    from kvctl.connector.datapath import KVDataPath
    from kvctl.connector.pinned import PinnedPool
    from kvctl.connector.store import ShardedStore

    shape = lay.chunk_shape(CT, world)
    nbytes = torch.empty((), dtype=lay.dtype).element_size() * int(torch.Size(shape).numel())
    pool = PinnedPool(6 * nbytes, nbytes)
    store = ShardedStore(rank, world, url, 0, shape, lay.dtype, chunk_tokens=CT, model_name="gpu-test",
                         fmt=lay.fmt(world), timeout_s=10.0, device=device, pool=pool, prefetch_batch=2)
    return KVDataPath(store, lay, chunk_tokens=CT, block_size=BS, group=group, device=device), pool


@pytest.fixture
def nccl_world1():
    import torch.distributed as dist

    from kvctl.tier.server import free_port

    _need_gpus(1)
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
    try:
        yield dev
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind,src_layout,dst_layout", [
    ("mla", "LBHNC", "BLNHC"), ("mla", "BLHNC", "LHBNC"), ("gqa", "LBHNC", "BLHNC"), ("gqa", "BHLNC", "LBNHC"),
])
def test_w1_save_and_load_through_pinned_slots_move_exact_bytes(nccl_world1, valkey_server, kind, src_layout, dst_layout):
    from kvctl.connector.datapath import slots_for

    dev = nccl_world1
    url = f"resp://127.0.0.1:{valkey_server.port}"
    _, src = _layout(kind, src_layout, dev)
    _, dst = _layout(kind, dst_layout, dev)
    n = 5  # 5 chunks through a pool of 6 slots taken 2 + 2 at a time: every batch reuses slots
    tokens = list(range(100, 100 + n * CT + 7))
    src_blocks = list(range(40))[::-1]
    dst_blocks = list(range(3, 43))
    kv = torch.randn(src.chunk_shape(len(tokens), 1), device=dev).to(torch.bfloat16)
    src.insert(slots_for(src_blocks, BS, 0, len(tokens)), kv)
    save, pool = _path(src, url, 0, 1, dev)
    assert pool.pinned and save.store.pool is pool
    res = save.store_batch(save.extract(tokens, src_blocks, 0))
    assert (res.l2_chunks, res.l2_error) == (n, None)
    assert pool.free_slots == pool.n_slots  # every slot went back
    load, _ = _path(dst, url, 0, 1, dev)
    out = load.load(tokens, dst_blocks, 0, n, 0)
    assert (out.agreed, out.written) == (n, n)
    got = dst.extract(slots_for(dst_blocks, BS, 0, n * CT))
    assert got.is_cuda and torch.equal(got, kv[:, : n * CT])
    # a missing chunk ends the agreed prefix there
    load.store.client.delete([load.store.keys(tokens)[2]])
    out = load.load(tokens, list(range(43, 63)), 0, n, 0)
    assert (out.agreed, out.written) == (2, 2)
    save.store.close()
    load.store.close()


def _rank(rank, world, port, urls, q):
    try:
        import torch.distributed as dist

        from kvctl.connector.datapath import slots_for

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
        dev = torch.device("cuda", rank)
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
        n = 2 * world + 1
        tokens = list(range(7, 7 + n * CT))
        out = {}
        for kind in ("mla", "gqa"):
            _, src = _layout(kind, "LBHNC", dev)
            _, dst = _layout(kind, "BLNHC", dev)
            g = torch.Generator(device=dev).manual_seed(11 if kind == "mla" else 12)
            if kind == "mla":  # every rank holds the same latent KV
                kv = torch.randn(src.chunk_shape(len(tokens), 1), generator=g, device=dev).to(torch.bfloat16)
                mine = kv
            else:  # each rank holds its own heads of the model's world x 4 heads
                kv = torch.randn(src.chunk_shape(len(tokens), world), generator=g, device=dev).to(torch.bfloat16)
                mine = src.to_local(kv, rank)
            blocks = list(range(n * CT // BS + 1))
            src.insert(slots_for(blocks, BS, 0, len(tokens)), mine.contiguous())
            save, _ = _path(src, urls, rank, world, dev)
            res = save.store_batch(save.extract(tokens, blocks, 0))
            dist.barrier()
            load, _ = _path(dst, urls, rank, world, dev)
            o = load.load(tokens, blocks[::-1], 0, n, 0)
            got = dst.extract(slots_for(blocks[::-1], BS, 0, n * CT))
            out[kind] = (res.l2_chunks, o.agreed, o.written, bool(torch.equal(got, mine[:, : n * CT])))
            save.store.close()
            load.store.close()
        dist.destroy_process_group()
        q.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001
        q.put((rank, "error", traceback.format_exc()))


def test_w2_nccl_load_over_the_device_group_moves_exact_bytes():
    _need_gpus(2)
    import torch.multiprocessing as mp

    from kvctl.tier.server import free_port, start_valkey

    world = 2
    tmp = tempfile.mkdtemp(prefix="kvctl-gpu-w2-")
    servers = [start_valkey(f"{tmp}/v{r}", settings={"maxmemory": "512mb"}) for r in range(world)]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = []
    try:
        urls = [f"resp://127.0.0.1:{s.port}" for s in servers]
        port = free_port()
        procs = [ctx.Process(target=_rank, args=(r, world, port, urls, q)) for r in range(world)]
        for p in procs:
            p.start()
        got = {}
        deadline = time.monotonic() + 240
        while len(got) < world and time.monotonic() < deadline:
            try:
                r, status, payload = q.get(timeout=2)
            except queue.Empty:
                continue
            assert status == "ok", payload
            got[r] = payload
        assert len(got) == world, f"ranks reporting: {sorted(got)}"
        n = 2 * world + 1
        for r in range(world):
            owned = len(range(r, n, world))
            for kind in ("mla", "gqa"):
                assert got[r][kind] == (owned, n, n, True), (r, kind, got[r][kind])
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        for s in servers:
            s.stop()


def test_w1_pipelined_load_batches_units_through_pinned_slots_and_moves_exact_bytes(nccl_world1, valkey_server):
    """The layered load on CUDA (connector/pipeline.py): 10 MLA chunks in 2 layer groups, one connection (one lane),
    so each round trip carries two units of a group in one pinned slot and one copy; the bytes equal the saved
    ones, group by group, and a part deleted in group 1 ends the hit at its chunk."""
    from kvctl.connector.datapath import KVDataPath, slots_for
    from kvctl.connector.layer_groups import Plane, grouped
    from kvctl.connector.ownership import part_key
    from kvctl.connector.pinned import PinnedPool
    from kvctl.connector.pipeline import begin
    from kvctl.connector.store import ShardedStore

    dev = nccl_world1
    url = f"resp://127.0.0.1:{valkey_server.port}"
    _, src = _layout("mla", "LBHNC", dev, n_blocks=48)
    _, dst = _layout("mla", "BLNHC", dev, n_blocks=48)
    n = 10
    tokens = list(range(300, 300 + n * CT))
    blocks = list(range(n * CT // BS))
    kv = torch.randn(src.chunk_shape(len(tokens), 1), device=dev).to(torch.bfloat16)
    src.insert(slots_for(blocks, BS, 0, len(tokens)), kv)
    shape = src.chunk_shape(CT, 1)
    nbytes = 2 * int(torch.Size(shape).numel())
    g = grouped([Plane("", LAYERS, nbytes // (LAYERS * CT))], CT, 2)

    def path(lay):
        store = ShardedStore(0, 1, url, 0, shape, lay.dtype, chunk_tokens=CT, model_name="gpu-pipe", fmt=lay.fmt(1),
                             timeout_s=10.0, device=dev, pool=PinnedPool(6 * nbytes, nbytes), connections=1,
                             parts=g.parts)
        return KVDataPath(store, lay, chunk_tokens=CT, block_size=BS, group=None, device=dev, grouping=g)

    save, load = path(src), path(dst)
    assert save.store_batch(save.extract(tokens, blocks, 0)).l2_chunks == n
    gets = []
    real = load.store.tier.clients[0].batched_get
    load.store.tier.clients[0].batched_get = lambda keys, bufs, **kw: gets.append(len(keys)) or real(keys, bufs, **kw)
    pipe = begin(load, tokens, blocks[::-1], 0, n)
    pipe.ensure(0)
    pipe.ensure(1)
    out = pipe.finish()
    assert (out.agreed, out.written, pipe.state.late_groups) == (n, n, 0)
    assert max(gets) == 2 and len(gets) == n  # 2 groups x 10 chunks in 10 round trips of 2 units
    got = dst.extract(slots_for(blocks[::-1], BS, 0, n * CT))
    assert got.is_cuda and torch.equal(got, kv)
    load.store.client.delete([part_key(load.store.keys(tokens)[5], g.units[1].names[0])])
    pipe = begin(load, tokens, list(range(48 - n * CT // BS, 48)), 0, n)
    pipe.ensure(0)
    pipe.ensure(1)
    out = pipe.finish()
    assert (out.agreed, out.written) == (5, 5)
    assert load.store.pool.free_slots == load.store.pool.n_slots
    save.store.close()
    load.store.close()
    load.close()
