"""KvctlConnector's worker loading a sync hit layer group by layer group, as vLLM's forward asks for each layer.

Real gloo ranks, real Valkey instances and the worker half around real paged caches (tests/plugins/test_vllm_worker.py
builds them); the step is driven the way vLLM 0.32 drives a connector: ``start_load_kv`` with the step's forward
context, ``wait_for_layer_load`` before each attention layer, ``finish_forward`` and ``wait_for_save`` after.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from tests.plugins.worker_rig import BS, fill, make_worker, token_value  # noqa: E402

pytestmark = pytest.mark.engine


def _step(conn, spec, attn=True):
    from kvctl.plugins.vllm import KvctlConnectorMetadata

    conn.bind_connector_metadata(KvctlConnectorMetadata(loads=[spec]))
    conn.start_load_kv(SimpleNamespace(attn_metadata=object() if attn else None))


def _layers_written(conn, blocks):
    from kvctl.connector.layouts import slots_for

    got = conn.worker.layout.extract(slots_for(blocks, BS, 0, 16))
    return [bool(torch.count_nonzero(got[layer, 4:])) for layer in range(got.shape[0])]


def layered_worker(rank, world, urls):
    from kvctl.connector.ownership import part_key
    from kvctl.connector.resp import RespClient
    from kvctl.plugins.vllm import LoadSpec, SaveSpec

    import sys

    conn, caches = make_worker(rank, world, urls, "tp", True, layer_groups=2, layered_switch_ms=0.5)
    before_switch = sys.getswitchinterval()
    assert [u.names for u in conn.spec.grouping.units] == [("L0-0",), ("L1-1",)]
    tokens = list(range(500, 518))
    blocks_a = [15, 3, 8, 1, 12, 6, 9, 0, 4]
    fill(conn, blocks_a, rank)
    conn.worker.save(SaveSpec("a", tokens[:16], blocks_a[:8]))
    assert conn.worker.saver.wait_idle(20)
    torch.distributed.barrier()
    blocks_b = [2, 5, 7, 10, 11, 13, 14, 4, 9]
    out = {}

    def zero():
        for t in caches.values():
            t.zero_()

    # a step whose forward asks for each layer: nothing before it asks, each group when its layer does
    zero()
    _step(conn, LoadSpec("b", tokens[:16], first_chunk=1, end_chunk=4, skip_tokens=4, block_ids=blocks_b))
    out["before"] = _layers_written(conn, blocks_b)
    out["switch_in_step"] = sys.getswitchinterval()  # layered_switch_ms while the lanes run beside the forward
    conn.wait_for_layer_load("l0")
    out["after_l0"] = _layers_written(conn, blocks_b)
    conn.wait_for_layer_load("l1")
    conn.finish_forward()
    conn.wait_for_save()
    out["switch_after"] = sys.getswitchinterval() == before_switch
    out["after_l1"] = _layers_written(conn, blocks_b)
    out["errors_b"] = sorted(conn.get_block_ids_with_load_errors())
    from kvctl.connector.layouts import slots_for

    got = conn.worker.layout.extract(slots_for(blocks_b, BS, 0, 16))
    out["exact"] = all(float(got[layer, t, 0]) == token_value(t, layer, 0)
                       for layer in range(2) for t in range(4, 16))

    # chunk 3 loses its second group between lookup and load: the hit ends at chunk 3 on every rank
    if rank == 3 % world:
        key = conn.worker.store.keys(tokens[:16])[3]
        with RespClient(urls[rank]) as cl:
            cl.delete([part_key(key, "L1-1")])
    torch.distributed.barrier()
    zero()
    _step(conn, LoadSpec("c", tokens[:16], first_chunk=1, end_chunk=4, skip_tokens=4, block_ids=blocks_b))
    conn.wait_for_layer_load("l0")
    conn.wait_for_layer_load("l1")
    conn.finish_forward()
    out["errors_c"] = sorted(conn.get_block_ids_with_load_errors())

    # a step with no attention metadata (a FULL CUDA graph replay runs no hook): the hit loads before the forward
    zero()
    _step(conn, LoadSpec("d", tokens[:12], first_chunk=1, end_chunk=3, skip_tokens=4, block_ids=blocks_b), attn=False)
    out["serial"] = _layers_written(conn, blocks_b)
    conn.wait_for_save()
    out["errors_d"] = sorted(conn.get_block_ids_with_load_errors())

    # a forward that asks for no layer (an attention class that calls no hook: vLLM 0.32's sparse MLA): that hit
    # is lost and recomputed, and every later hit loads before the forward
    zero()
    _step(conn, LoadSpec("e", tokens[:12], first_chunk=1, end_chunk=3, skip_tokens=4, block_ids=blocks_b))
    conn.finish_forward()
    conn.wait_for_save()
    out["errors_e"] = sorted(conn.get_block_ids_with_load_errors())
    zero()
    _step(conn, LoadSpec("f", tokens[:12], first_chunk=1, end_chunk=3, skip_tokens=4, block_ids=blocks_b))
    out["after_unhooked"] = _layers_written(conn, blocks_b)
    conn.finish_forward()
    conn.wait_for_save()
    out["errors_f"] = sorted(conn.get_block_ids_with_load_errors())
    conn.shutdown()
    return out


def test_a_sync_hit_is_written_group_by_group_as_the_forward_asks(valkey_factory, rank_pool):
    servers = [valkey_factory(), valkey_factory()]
    out = rank_pool(2).run(layered_worker, ([s.url for s in servers],), timeout_s=120)
    for res in out:
        assert res["before"] == [False, False]
        assert res["switch_in_step"] == pytest.approx(0.0005) and res["switch_after"]
        assert res["after_l0"] == [True, False]  # layer 1 still on the wire while layer 0 computes
        assert res["after_l1"] == [True, True]
        assert res["errors_b"] == [] and res["exact"]
        # chunk 3 = tokens 12..15 = blocks_b[6:8]: failed on both ranks, recomputed
        assert res["errors_c"] == sorted([14, 4])
        assert res["serial"] == [True, True] and res["errors_d"] == []
        assert res["errors_e"] == sorted([7, 10, 11, 13])  # chunks 1-2 = tokens 4..11 = blocks_b[2:6]
        assert res["after_unhooked"] == [True, True] and res["errors_f"] == []
