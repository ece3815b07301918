"""The two-part chunk of MLA with a sparse-attention indexer through the real tier (connector/sparse_mla.py).

Caches of a sparse-MLA group built the way vLLM 0.32 builds them (``kv_views.build_group_caches``,
checked against vLLM's own functions in tests/plugins/test_sparse_layouts.py), real valkey-servers, gloo
groups: a save stores each chunk as two values, the latent part and the indexer part, under two keys; a load
into another layout moves the exact bytes; a chunk with one part missing is a miss for the scheduler's
lookup, the store's lookup, its prefetch and the agreed-prefix load, which stops there on every rank.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvctl.connector.kv_views import CacheSpec, build_group_caches  # noqa: E402
from kvctl.connector.ownership import part_key  # noqa: E402
from kvctl.connector.sparse_mla import INDEXER_PART, LATENT_PART, SparseGroup, sparse_format, sparse_layout_for  # noqa: E402
from tests.plugins.kv_fill import fill_sparse, read_back_sparse  # noqa: E402

pytestmark = pytest.mark.engine

BS, CT, N_LAT, N_IDX = 16, 32, 3, 2
MODEL = "glm"


def specs(fp8: bool) -> tuple[CacheSpec, CacheSpec]:
    lat = (CacheSpec(BS, 1, 576, torch.uint8, head_size_v=0, cache_dtype_str="fp8_ds_mla", state_content_bytes=656)
           if fp8 else CacheSpec(BS, 1, 576, torch.bfloat16, head_size_v=0, block_stride_alignment=1152,
                                 cache_dtype_str="auto"))
    return lat, CacheSpec(BS, 1, 132, torch.uint8, head_size_v=0)


def group(fp8: bool = False) -> SparseGroup:
    lat, idx = specs(fp8)
    return SparseGroup(tuple(f"a{i}" for i in range(N_LAT)), tuple(f"i{i}" for i in range(N_IDX)), lat, idx)


def caches(layout: str, fp8: bool = False, n_blocks: int = 16, kernel_block_size: int | None = None):
    """(layout object, latent views, indexer views) of a fresh sparse-MLA group."""
    lat, idx = specs(fp8)
    _, (lv, iv) = build_group_caches([(lat, N_LAT), (idx, N_IDX)], layout, n_blocks, kernel_block_size=kernel_block_size)
    return sparse_layout_for(group(fp8), lv, iv, layout, "FLASHMLA_SPARSE"), lv, iv


def path(lay, urls, fmt, rank=0, world=1, group_=None):
    from kvctl.connector.datapath import KVDataPath
    from kvctl.connector.store import ShardedStore

    store = ShardedStore(rank, world, [urls] if isinstance(urls, str) else urls, 0, lay.chunk_shape(CT), lay.dtype,
                         chunk_tokens=CT, model_name=MODEL, fmt=fmt, timeout_s=5.0, parts=lay.parts(CT))
    return KVDataPath(store, lay, chunk_tokens=CT, block_size=BS, group=group_, device="cpu")


def saved(valkey_url, fp8=False, n_chunks=3, extra_tokens=5, layout="BLHNC"):
    """A prompt computed into a fresh cache and saved: (tokens, its blocks, the source caches, the path)."""
    src, lv, iv = caches(layout, fp8)
    fill_sparse(lv, iv)
    tokens = list(range(700, 700 + n_chunks * CT + extra_tokens))
    blocks = [9, 2, 14, 5, 0, 11, 7, 13, 3, 12]
    fmt, _ = sparse_format(group(fp8), CT)
    save = path(src, valkey_url, fmt)
    batch = save.extract(tokens, blocks, 0)
    res = save.store_batch(batch)
    assert (res.l2_chunks, res.l2_error) == (n_chunks, None)
    return tokens, blocks, (lv, iv), save


@pytest.mark.parametrize("fp8", [False, True])
def test_save_stores_two_parts_a_chunk_and_a_load_into_another_layout_moves_the_exact_bytes(gloo_world1, valkey_server, fp8):
    import redis

    from kvctl.connector.datapath import slots_for

    tokens, blocks, (lv, iv), save = saved(valkey_server.url, fp8)
    r = redis.Redis(host="127.0.0.1", port=valkey_server.port)
    keys = save.store.keys(tokens)
    row = 656 if fp8 else 1152
    for k in keys:
        assert not r.exists(k)  # the chunk's own key holds nothing: its parts do
        assert r.strlen(part_key(k, LATENT_PART)) == N_LAT * CT * row
        assert r.strlen(part_key(k, INDEXER_PART)) == N_IDX * CT * 132
    assert r.dbsize() == 2 * len(keys)

    dst, dlv, div = caches("LBNHC", fp8, n_blocks=24, kernel_block_size=8)
    load = path(dst, valkey_server.url, save.store.fmt)
    dst_blocks = [20, 3, 17, 8, 1, 12, 6]
    out = load.load(tokens, dst_blocks, 0, 3, skip_tokens=BS)  # the first block is the engine's own already
    assert (out.agreed, out.written, out.interrupted) == (3, 3, None)
    src_slots = slots_for(blocks, BS, BS, 3 * CT)
    dst_slots = slots_for(dst_blocks, BS, BS, 3 * CT)
    assert all(torch.equal(a, b) for a, b in zip(read_back_sparse(dlv, div, dst_slots), read_back_sparse(lv, iv, src_slots)))
    before = read_back_sparse(dlv, div, slots_for(dst_blocks, BS, 0, BS))
    assert all(int(t.count_nonzero()) == 0 for t in before)  # tokens before skip_tokens: never written
    save.store.close()
    load.store.close()


def test_a_chunk_whose_indexer_part_was_deleted_is_a_miss_and_the_load_stops_there(gloo_world1, valkey_server):
    from kvctl.connector.datapath import slots_for
    from kvctl.connector.resp import RespClient

    tokens, blocks, (lv, iv), save = saved(valkey_server.url, n_chunks=4)
    keys = save.store.keys(tokens)
    with RespClient(valkey_server.url) as cl:
        assert cl.delete([part_key(keys[2], INDEXER_PART)]) == 1  # evicted, or deleted: the latent part stays
    dst, dlv, div = caches("BLHNC")
    load = path(dst, valkey_server.url, save.store.fmt)
    assert load.store.lookup(tokens) == 2 * CT  # the store's own lookup: present only when both parts are
    dst_blocks = list(range(8))
    out = load.load(tokens, dst_blocks, 0, 4)
    assert (out.agreed, out.written) == (2, 2)
    got = read_back_sparse(dlv, div, slots_for(dst_blocks, BS, 0, 2 * CT))
    want = read_back_sparse(lv, iv, slots_for(blocks, BS, 0, 2 * CT))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # nothing of chunk 2 (its latent part was there) nor after it was written
    assert all(int(t.count_nonzero()) == 0 for t in read_back_sparse(dlv, div, slots_for(dst_blocks, BS, 2 * CT, 4 * CT)))
    # the async path: the prefetch stops at the same chunk
    req = load.store.prefetch(tokens)
    assert load.store.lookup_async(req, timeout_s=5.0) == 2 * CT
    save.store.close()
    load.store.close()


@pytest.mark.parametrize("vector", [False, True])
def test_the_schedulers_lookup_counts_a_chunk_only_when_both_parts_are_there(valkey_factory, vector):
    """Two ranks' instances (W = 2: chunk c on rank c % 2), the scheduler's EXISTS lookup, sync and async."""
    from kvctl.connector.lookup import TierLookup
    from kvctl.connector.ownership import chunk_keys
    from kvctl.connector.resp import RespClient

    servers = [valkey_factory(), valkey_factory()]
    fmt, parts = sparse_format(group(), CT)
    tokens = list(range(5 * CT + 1))
    keys = chunk_keys(tokens[: 5 * CT], CT, MODEL, fmt)
    for c, k in enumerate(keys):
        with RespClient(servers[c % 2].url) as cl:
            cl.batched_set(parts.keys(k), [b"x" * n for n in parts.sizes])
    lk = TierLookup([s.url for s in servers], CT, MODEL, fmt, timeout_s=2.0, parts=parts)
    plain = TierLookup([s.url for s in servers], CT, MODEL, fmt, timeout_s=2.0)  # no parts: the chunk key itself
    try:
        assert lk.lookup(tokens, 0, vector).hit_chunks == 5
        assert plain.lookup(tokens, 0, vector).hit_chunks == 0  # a two-part chunk never hits as a one-part one
        with RespClient(servers[1].url) as cl:
            cl.delete([part_key(keys[3], INDEXER_PART)])  # chunk 3: its latent part stays on rank 1's instance
        assert lk.lookup(tokens, 0, vector).hit_chunks == 3
        with RespClient(servers[0].url) as cl:
            cl.delete([part_key(keys[0], LATENT_PART)])
        assert lk.lookup(tokens, 0, vector).hit_chunks == 0
    finally:
        lk.close()
        plain.close()


def test_an_fp8_ds_mla_chunk_never_loads_into_a_bf16_cache(gloo_world1, valkey_server):
    tokens, _, _, save = saved(valkey_server.url, fp8=True, n_chunks=2)
    dst, _, _ = caches("BLHNC", fp8=False)
    fmt, _ = sparse_format(group(False), CT)
    assert fmt != save.store.fmt
    load = path(dst, valkey_server.url, fmt)
    assert load.store.lookup(tokens) == 0
    assert load.load(tokens, list(range(8)), 0, 2).agreed == 0
    save.store.close()
    load.store.close()


def two_rank_worker(rank: int, world: int, urls: list[str]) -> dict:
    """Rank r saves its owned chunks of one prompt; rank 1's chunk 3 loses its indexer part; both load."""
    import torch.distributed as dist

    from kvctl.connector.datapath import slots_for
    from kvctl.connector.resp import RespClient

    src, lv, iv = caches("LBHNC")
    torch.manual_seed(5)
    for v in lv + iv:  # the same KV on both ranks (MLA): every rank holds the whole latent and indexer
        u = v.view(torch.uint8)
        u.copy_(torch.randint(0, 256, u.shape, dtype=torch.uint8))
    tokens = list(range(5 * CT + 3))
    blocks = list(range(11))
    fmt, _ = sparse_format(group(), CT)
    p = path(src, urls, fmt, rank, world, dist.group.WORLD)
    p.store_batch(p.extract(tokens, blocks, 0))
    dist.barrier()
    if rank == 1:
        with RespClient(urls[1]) as cl:
            cl.delete([part_key(p.store.keys(tokens)[3], INDEXER_PART)])
    dist.barrier()
    dst, dlv, div = caches("BLNHC")
    q = path(dst, urls, fmt, rank, world, dist.group.WORLD)
    out = q.load(tokens, list(range(11)), 0, 5)
    same = all(torch.equal(a, b) for a, b in zip(read_back_sparse(dlv, div, slots_for(blocks, BS, 0, 3 * CT)),
                                                 read_back_sparse(lv, iv, slots_for(blocks, BS, 0, 3 * CT))))
    p.store.close()
    q.store.close()
    return {"agreed": out.agreed, "written": out.written, "same": same}


def test_the_agreed_prefix_stops_on_every_rank_at_a_chunk_one_owner_has_half_of(valkey_factory, rank_pool):

    servers = [valkey_factory(), valkey_factory()]
    out = rank_pool(2).run(two_rank_worker, ([s.url for s in servers],), timeout_s=120)
    assert out == [{"agreed": 3, "written": 3, "same": True}] * 2


def test_the_parts_of_a_logged_format_are_the_layouts():
    """Tools outside the engine (the GPU benchmark, the fault hooks) rebuild the parts from the format it logs."""
    from kvctl.connector.formats import format_parts

    for fp8 in (False, True):
        lay, _, _ = caches("LBHNC", fp8)
        assert format_parts(lay.fmt(1), CT) == lay.parts(CT) == sparse_format(group(fp8), CT)[1]
    assert format_parts("mla576-L3-bfloat16", CT) is None
    with pytest.raises(ValueError, match="not a sparse-MLA chunk format"):
        format_parts("mla576-L3-int4+idx132-L2-fp8_e4m3", CT)
