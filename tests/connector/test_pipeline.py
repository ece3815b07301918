"""The pipelined load (connector/pipeline.py) and the layer groups it reads (connector/layer_groups.py), on CPU.

Real caches built the way vLLM 0.32 builds them (``kvctl.connector.kv_views``), a real valkey-server and
one- and two-rank gloo groups: a chunk saved in layer groups and loaded group by group must land as the exact
bytes a serial load writes, a group is written only when asked for (so the forward's earlier layers run while
the rest is on the wire), and a chunk missing in a later group ends the hit at the same prefix on every rank.
The CUDA branch (pinned slots, copy streams) runs in tests/gpu/test_connector_gpu.py on a GPU host.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.engine

CT, BS, LAYERS, ROW = 8, 4, 5, 24


def _mla(n_blocks=24):
    from kvctl.connector.kv_views import CacheSpec, build_caches
    from kvctl.connector.layouts import layout_for

    spec = CacheSpec(block_size=BS, num_kv_heads=1, head_size=ROW, dtype=torch.bfloat16, head_size_v=0)
    _, views = build_caches(spec, "LBHNC", LAYERS, n_blocks)
    return layout_for(views, spec, "LBHNC", "FLASHMLA", cache_dtype="auto")


def _gqa(n_blocks=24, heads=2, head=8):
    from kvctl.connector.kv_views import CacheSpec, build_caches
    from kvctl.connector.layouts import layout_for

    spec = CacheSpec(block_size=BS, num_kv_heads=heads, head_size=head, dtype=torch.float16)
    _, views = build_caches(spec, "BLNHC", LAYERS, n_blocks)
    return layout_for(views, spec, "BLNHC", "FLASH_ATTN", cache_dtype="auto")


def _grouping(lay, groups):
    from kvctl.connector.layer_groups import Plane, grouped

    row_bytes = torch.Size(lay.chunk_shape(1, 1)[2:]).numel() * lay.dtype.itemsize
    return grouped([Plane("", lay.num_layers, row_bytes)], CT, groups)


def _path(lay, url, groups, rank=0, world=1):
    from kvctl.connector.datapath import KVDataPath
    from kvctl.connector.store import ShardedStore

    g = _grouping(lay, groups)
    store = ShardedStore(rank, world, [url] * world if world > 1 else [url], 0, lay.chunk_shape(CT, world), lay.dtype,
                         chunk_tokens=CT, model_name="m", fmt=lay.fmt(world), timeout_s=5.0, parts=g.parts)
    return KVDataPath(store, lay, chunk_tokens=CT, block_size=BS, group=None, device="cpu", grouping=g)


def _filled(lay, tokens, blocks):
    from kvctl.connector.datapath import slots_for

    kv = torch.randn(lay.chunk_shape(len(tokens), 1)).to(lay.dtype)
    lay.insert(slots_for(blocks, BS, 0, len(tokens)), kv)
    return kv


def test_groups_tile_the_chunk_and_one_group_keeps_todays_parts():
    from kvctl.connector.layer_groups import Plane, grouped, spans

    assert spans(27, 4) == ((0, 7), (7, 14), (14, 21), (21, 27))
    assert spans(3, 8) == ((0, 1), (1, 2), (2, 3))
    dense = grouped([Plane("", 27, 1152)], 256, 4)
    assert dense.parts.names == ("L0-6", "L7-13", "L14-20", "L21-26")
    assert dense.parts.nbytes == 27 * 1152 * 256 and dense.groups == 4
    sparse = grouped([Plane("mla", 78, 656), Plane("idx", 78, 132)], 256, 4)
    assert sparse.parts.names[:2] == ("mla.L0-19", "idx.L0-19")
    # each part is its layers' range of the layer-major chunk: the latent rows first, the indexer's after
    assert sparse.parts.offsets[:2] == (0, 78 * 656 * 256)
    assert [u.names for u in sparse.units][1] == ("mla.L20-39", "idx.L20-39")
    assert grouped([Plane("", 27, 1152)], 256, 1).parts is None  # a dense chunk stays one value
    one = grouped([Plane("mla", 78, 656), Plane("idx", 78, 132)], 256, 1).parts
    assert (one.names, one.sizes) == (("mla", "idx"), (78 * 656 * 256, 78 * 132 * 256))


def test_chunk_parts_refuse_offsets_that_do_not_tile():
    from kvctl.connector.ownership import ChunkParts

    with pytest.raises(ValueError, match="do not tile"):
        ChunkParts(("a", "b"), (4, 4), (0, 2))
    parts = ChunkParts(("b", "a"), (4, 2), (2, 0))
    buf = bytearray(b"AABBBB")
    assert [bytes(v) for v in parts.views(buf)] == [b"BBBB", b"AA"]


@pytest.mark.parametrize("make", [_mla, _gqa], ids=["mla", "gqa"])
def test_a_pipelined_load_writes_each_group_when_asked_and_the_same_bytes_as_a_serial_one(gloo_world1, valkey_server,
                                                                                           make):
    from kvctl.connector.datapath import slots_for
    from kvctl.connector.pipeline import begin

    src, dst = make(), make()
    url = f"resp://127.0.0.1:{valkey_server.port}"
    n = 3
    tokens = list(range(700, 700 + n * CT + 2))
    kv = _filled(src, tokens, [5, 1, 9, 2, 7, 3, 11])
    save = _path(src, url, 3)
    assert save.store_batch(save.extract(tokens, [5, 1, 9, 2, 7, 3, 11], 0)).l2_chunks == n
    load = _path(dst, url, 3)
    blocks = [4, 8, 0, 12, 6, 10, 13]
    pipe = begin(load, tokens, blocks, 0, n, skip_tokens=2)
    want = kv[:, : n * CT].clone()
    want[:, :2] = 0  # the engine's own tokens: never written
    got = lambda: dst.extract(slots_for(blocks, BS, 0, n * CT))  # noqa: E731
    assert torch.count_nonzero(got()) == 0  # nothing written before a group is asked for
    pipe.ensure(0)  # layers 0..1: group 0 only
    lo, hi = load.grouping.units[0].lo, load.grouping.units[0].hi
    assert torch.equal(got()[lo:hi], want[lo:hi])
    assert torch.count_nonzero(got()[hi:]) == 0
    pipe.ensure(2)
    out = pipe.finish()
    assert (out.agreed, out.written, out.interrupted) == (n, n, None)
    assert pipe.state.late_groups == 0
    assert torch.equal(got(), want)
    assert out.timing.get_bytes == n * save.store.chunk_nbytes
    assert load.store.l2_get_bytes == n * save.store.chunk_nbytes  # counted for the engine's kvctl:l2_get_bytes
    save.store.close()
    load.store.close()
    load.close()


def test_a_chunk_missing_in_a_later_group_ends_the_hit_there(gloo_world1, valkey_server):
    from kvctl.connector.ownership import part_key
    from kvctl.connector.pipeline import begin

    lay = _mla()
    url = f"resp://127.0.0.1:{valkey_server.port}"
    tokens = list(range(4 * CT))
    _filled(lay, tokens, list(range(8)))
    path = _path(lay, url, 3)
    path.store_batch(path.extract(tokens, list(range(8)), 0))
    last = path.grouping.units[2].names[0]
    path.store.client.delete([part_key(path.store.keys(tokens)[2], last)])  # chunk 2's last group
    pipe = begin(path, tokens, list(range(8, 16)), 0, 4)
    for g in range(3):
        pipe.ensure(g)
    out = pipe.finish()
    assert (out.agreed, out.written) == (2, 2)  # group 2 agreed on 2: the blocks of chunks 2..3 are recomputed
    path.store.close()
    path.close()


def test_a_lane_gets_a_chunks_worth_of_units_per_round_trip_and_a_miss_inside_one_ends_the_hit_there(gloo_world1,
                                                                                                      valkey_server):
    """One lane, 6 chunks in 3 groups: it GETs each group's units three at a time (one chunk's bytes, as a serial
    load's GET: 6 round trips, not 18), on its own connection; chunk 4's group-1 part deleted: group 1 agrees on 4
    (the batch's first unit staged, its second the first miss), and the bytes of chunks 0..3 are the saved ones."""
    from kvctl.connector.datapath import slots_for
    from kvctl.connector.ownership import part_key
    from kvctl.connector.pipeline import begin

    lay, dst = _mla(), _mla()
    url = f"resp://127.0.0.1:{valkey_server.port}"
    n = 6
    tokens = list(range(900, 900 + n * CT))
    kv = _filled(lay, tokens, list(range(12)))
    save = _path(lay, url, 3)
    save.store_batch(save.extract(tokens, list(range(12)), 0))
    path = _path(dst, url, 3)
    path.store.client.delete([part_key(path.store.keys(tokens)[4], path.grouping.units[1].names[0])])
    path.store.lanes_per_instance = 1
    client = path.store.tier.clients[0]
    calls, real = [], client.batched_get

    def spy(keys, buffers, **kw):  # the real call, its keys and options noted
        calls.append((len(keys), kw))
        return real(keys, buffers, **kw)

    client.batched_get = spy
    blocks = list(range(12, 24))
    pipe = begin(path, tokens, blocks, 0, n)
    for g in range(3):
        pipe.ensure(g)
    out = pipe.finish()
    assert (out.agreed, out.written) == (4, 4)
    assert calls[:4] == [(3, {"split": False})] * 4  # group 0 (2 batches), group 1 (2 batches: the miss in the 2nd)
    assert len(calls) <= 6
    got = dst.extract(slots_for(blocks, BS, 0, 4 * CT))
    assert torch.equal(got, kv[:, : 4 * CT])
    save.store.close()
    path.store.close()
    path.close()


def test_groups_left_for_finish_report_the_hit_failed(gloo_world1, valkey_server):
    """A forward that never asked for its layers (vLLM's FULL CUDA graph replays run no hook) read stale KV."""
    from kvctl.connector.pipeline import begin

    lay = _mla()
    url = f"resp://127.0.0.1:{valkey_server.port}"
    tokens = list(range(2 * CT))
    _filled(lay, tokens, list(range(4)))
    path = _path(lay, url, 2)
    path.store_batch(path.extract(tokens, list(range(4)), 0))
    pipe = begin(path, tokens, list(range(4, 8)), 0, 2)
    pipe.ensure(0)
    out = pipe.finish()
    assert (out.agreed, out.written, pipe.state.late_groups) == (2, 0, 1)
    path.store.close()
    path.close()


def test_a_dead_instance_is_a_miss_not_a_hang(gloo_world1, valkey_factory):
    from kvctl.connector.pipeline import begin

    server = valkey_factory()
    lay = _mla()
    url = f"resp://127.0.0.1:{server.port}"
    tokens = list(range(2 * CT))
    _filled(lay, tokens, list(range(4)))
    path = _path(lay, url, 2)
    path.store_batch(path.extract(tokens, list(range(4)), 0))
    server.stop()
    pipe = begin(path, tokens, list(range(4, 8)), 0, 2)
    pipe.ensure(1)
    out = pipe.finish()
    assert (out.agreed, out.written) == (0, 0)
    path.store.close()
    path.close()


def _two_rank_worker(rank, world, urls, delete_chunk):
    """Rank ``rank`` of a pipelined load over gloo: save the owned chunks, delete one part, load group by group."""
    import torch.distributed as dist

    from kvctl.connector.datapath import slots_for
    from kvctl.connector.ownership import part_key
    from kvctl.connector.pipeline import begin

    torch.manual_seed(7)  # every rank holds the same latent KV (MLA)
    lay = _mla()
    tokens = list(range(900, 900 + 5 * CT))
    kv = _filled(lay, tokens, list(range(10)))
    path = _path(lay, urls[rank], 3, rank=rank, world=world)
    path.store_batch(path.extract(tokens, list(range(10)), 0))
    dist.barrier()
    if delete_chunk % world == rank:  # its owner deletes the middle group of one chunk
        key = path.store.keys(tokens)[delete_chunk]
        path.store.tier.clients[0].delete([part_key(key, path.grouping.units[1].names[0])])
    dist.barrier()
    other = list(range(10, 20))
    pipe = begin(path, tokens, other, 0, 5)
    for g in range(3):
        pipe.ensure(g)
    out = pipe.finish()
    got = lay.extract(slots_for(other, BS, 0, out.written * CT))
    ok = bool(torch.equal(got, kv[:, : out.written * CT]))
    path.store.close()
    path.close()
    return out.agreed, out.written, ok


def test_two_ranks_agree_group_by_group(valkey_factory, rank_pool):

    servers = [valkey_factory(), valkey_factory()]
    out = rank_pool(2).run(_two_rank_worker, ([f"resp://127.0.0.1:{s.port}" for s in servers], 3), timeout_s=120)
    assert out == [(3, 3, True), (3, 3, True)]  # chunk 3 (rank 1's) lost its middle group: both stop there


def test_every_group_part_name_reads_back_as_its_layers():
    """The names grouped() gives (a dense chunk's, a sparse one's two planes) read back by part_span, which doctor
    uses on the tier's keys; the sparse one-group parts are no group's."""
    from kvctl.connector.layer_groups import Plane, grouped, part_span, spans

    for planes in ([Plane("", 27, 1152)], [Plane("mla", 78, 656), Plane("idx", 78, 132)]):
        for groups in (2, 3, 4):
            g = grouped(planes, 64, groups)
            want = {(lo, hi - 1) for lo, hi in spans(planes[0].layers, groups)}
            assert {part_span(n) for n in g.parts.names} == want
    assert part_span("mla") is None and part_span("idx") is None
