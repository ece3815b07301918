"""The worker data path (connector/datapath.py), the pinned pool and the protocol's direct staging, on CPU.

KVDataPath runs here on CPU caches built the way vLLM 0.32 builds them
(``plugins/vllm_kv_views.build_caches``, checked against vLLM's own
function in tests/plugins), a one-rank gloo group and a real valkey-server:
a save from one backend and layout and a load into another must move the
exact bytes. The CUDA branch (pinned slots, copy streams, NCCL) cannot run
on this machine: tests/gpu/test_connector_gpu.py runs the same calls on a GPU.
"""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.engine

CT, BS, LAYERS, ROW = 8, 4, 3, 24


@pytest.fixture
def world1(gloo_world1):
    """One gloo rank (tests/conftest.py's ``gloo_world1``)."""
    yield


def _mla(layout, n_blocks=24):
    from kvctl.connector.layouts import layout_for
    from kvctl.connector.kv_views import CacheSpec, build_caches

    spec = CacheSpec(block_size=BS, num_kv_heads=1, head_size=ROW, dtype=torch.bfloat16, head_size_v=0)
    _, views = build_caches(spec, layout, LAYERS, n_blocks)
    return layout_for(views, spec, layout, "FLASHMLA", cache_dtype="auto")


def _gqa(layout, backend, heads=2, head=8, n_blocks=24):
    from kvctl.connector.layouts import layout_for
    from kvctl.connector.kv_views import CacheSpec, build_caches

    spec = CacheSpec(block_size=BS, num_kv_heads=heads, head_size=head, dtype=torch.float16)
    _, views = build_caches(spec, layout, LAYERS, n_blocks)
    return layout_for(views, spec, layout, backend, cache_dtype="auto")


def _path(lay, url, fmt):
    from kvctl.connector.datapath import KVDataPath
    from kvctl.connector.store import ShardedStore

    store = ShardedStore(0, 1, [url], 0, lay.chunk_shape(CT, 1), lay.dtype, chunk_tokens=CT, model_name="m",
                         fmt=fmt, timeout_s=5.0)
    return KVDataPath(store, lay, chunk_tokens=CT, block_size=BS, group=None, device="cpu")


@pytest.mark.parametrize("make_src,make_dst", [
    (lambda: _mla("LBHNC"), lambda: _mla("BLNHC")),
    (lambda: _gqa("LBHNC", "CPU_ATTN"), lambda: _gqa("BLNHC", "FLASH_ATTN")),
])
def test_save_from_one_layout_load_into_another_moves_exact_bytes(world1, valkey_server, make_src, make_dst):
    from kvctl.connector.datapath import slots_for

    src, dst = make_src(), make_dst()
    url = f"resp://127.0.0.1:{valkey_server.port}"
    n_chunks = 3
    tokens = list(range(500, 500 + n_chunks * CT + 3))  # 3 full chunks and a partial one (never stored)
    src_blocks = [5, 1, 9, 2, 7, 3, 11]
    dst_blocks = [4, 8, 0, 12, 6, 10, 13]
    kv = torch.randn(src.chunk_shape(len(tokens), 1)).to(src.dtype)
    src.insert(slots_for(src_blocks, BS, 0, len(tokens)), kv)
    fmt = src.fmt(1)
    assert fmt == dst.fmt(1)
    save = _path(src, url, fmt)
    batch = save.extract(tokens, src_blocks, 0)
    assert [c is not None for c in batch.chunks] == [True] * n_chunks
    res = save.store_batch(batch)
    assert (res.l2_chunks, res.l2_error) == (n_chunks, None)

    load = _path(dst, url, fmt)
    out = load.load(tokens, dst_blocks, 0, n_chunks, skip_tokens=2)
    assert (out.agreed, out.written, out.interrupted) == (n_chunks, n_chunks, None)
    got = dst.extract(slots_for(dst_blocks, BS, 0, n_chunks * CT))
    want = kv[:, : n_chunks * CT].clone()
    want[:, :2] = 0  # tokens before skip_tokens are the engine's own: never written
    assert torch.equal(got, want)
    save.store.close()
    load.store.close()


def test_load_of_a_missing_chunk_agrees_on_the_prefix_before_it(world1, valkey_server):
    from kvctl.connector.datapath import slots_for

    lay = _mla("LBHNC")
    url = f"resp://127.0.0.1:{valkey_server.port}"
    tokens = list(range(3 * CT))
    kv = torch.randn(lay.chunk_shape(len(tokens), 1)).to(lay.dtype)
    blocks = list(range(6))
    lay.insert(slots_for(blocks, BS, 0, len(tokens)), kv)
    path = _path(lay, url, lay.fmt(1))
    path.store_batch(path.extract(tokens, blocks, 0))
    path.store.client.delete([path.store.keys(tokens)[1]])
    other = list(range(6, 12))
    out = path.load(tokens, other, 0, 3)
    assert (out.agreed, out.written) == (1, 1)
    assert torch.equal(lay.extract(slots_for(other, BS, 0, CT)), kv[:, :CT])
    path.store.close()


def test_a_failed_insert_is_a_load_error_not_an_exception(world1, valkey_server, caplog):
    lay = _mla("LBHNC")
    url = f"resp://127.0.0.1:{valkey_server.port}"
    tokens = list(range(2 * CT))
    path = _path(lay, url, lay.fmt(1))
    path.store_batch(path.extract(tokens, [0, 1, 2, 3], 0))
    with caplog.at_level(logging.ERROR, logger="kvctl.connector.datapath"):
        out = path.load(tokens, [999, 1000, 1001, 1002], 0, 2)  # blocks beyond the cache: the write fails
    assert (out.agreed, out.written) == (2, 0)
    assert "load of 2 chunk(s)" in caplog.text
    path.store.close()


# ------------------------------------------------------------------ the pinned pool
def test_pool_falls_back_to_pageable_memory_with_one_warning(caplog):
    from kvctl.connector.pinned import PinnedPool

    if torch.cuda.is_available():
        pytest.skip("pinning works on a CUDA host")
    with caplog.at_level(logging.WARNING, logger="kvctl.connector.pinned"):
        pool = PinnedPool(4 * 100, 100)
    assert not pool.pinned and pool.n_slots == 4
    assert sum("pageable" in r.message for r in caplog.records) == 1
    pool.view(0)[:] = b"x" * 100
    pool.view(1)[:3] = b"abc"
    assert bytes(pool.tensor(1)[:3].tolist()) == b"abc"  # the view and the tensor are the same memory
    assert bytes(pool.tensor(0).tolist()) == b"x" * 100  # and slots do not overlap


def test_pool_refuses_fewer_than_two_slots():
    from kvctl.connector.pinned import PinnedPool

    with pytest.raises(ValueError, match="at least 2"):
        PinnedPool(150, 100, pin=False)


def test_pool_slots_are_taken_together_and_waited_for():
    import threading

    from kvctl.connector.pinned import PinnedPool

    pool = PinnedPool(4 * 10, 10, pin=False)
    a = pool.acquire(3)
    assert len(a) == 3 and pool.free_slots == 1
    with pytest.raises(TimeoutError):
        pool.acquire(2, timeout_s=0.05)
    got = []
    t = threading.Thread(target=lambda: got.append(pool.acquire(2, timeout_s=5)))
    t.start()
    pool.release(a)
    t.join(5)
    assert len(got) == 1 and len(got[0]) == 2 and pool.free_slots == 2
    pool.release(got[0])
    assert sorted(pool.acquire(99, timeout_s=5)) == [0, 1, 2, 3]  # capped at what the pool holds


# ------------------------------------------------------------ protocol: direct staging
def test_stage_owned_writes_slots_and_a_failure_shortens_the_prefix(world1):
    from kvctl.connector.protocol import load_agreed_prefix

    shape, n = (4,), 5
    data = [torch.full(shape, float(c)) for c in range(n)]

    def stage(owned, slot):
        for j, c in enumerate(owned):
            if c == 3:
                return j
            slot(j).copy_(data[c].view(torch.uint8))
        return len(owned)

    res = load_agreed_prefix(None, [f"k{c}" for c in range(n)], None, shape, torch.float32, stage_owned=stage)
    assert res.prefix == 3
    assert [float(t[0]) for t in res.chunks] == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("bad", [lambda owned, slot: 1 / 0, lambda owned, slot: 99, lambda owned, slot: -1])
def test_stage_owned_errors_are_local_failures(world1, bad):
    from kvctl.connector.protocol import load_agreed_prefix

    res = load_agreed_prefix(None, ["a", "b"], None, (2,), torch.float32, stage_owned=bad)
    assert res.prefix == 0 and res.chunks == []
