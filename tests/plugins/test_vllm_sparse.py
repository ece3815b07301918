"""KvctlConnector on a sparse-MLA model's KV cache group: both roles, vLLM's own specs and views, a real tier.

The group is the one vLLM 0.32 builds for GLM-5 / DeepSeek-V3.2 (tests/plugins/test_sparse_layouts.py:
get_kv_cache_groups gives one UniformTypeKVCacheSpecs of latent and indexer layers). The scheduler keys and
looks up two-part chunks from the specs alone; the worker saves and loads them through one block table; a
chunk whose indexer part is gone is a miss for the lookup and stops the load, whose blocks after it are
reported to vLLM as failed (it recomputes them).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from kvctl.connector.layouts import slots_for  # noqa: E402
from kvctl.connector.ownership import part_key  # noqa: E402
from kvctl.connector.resp import RespClient  # noqa: E402
from kvctl.connector.sparse_mla import INDEXER_PART  # noqa: E402
from tests.plugins.kv_fill import fill_sparse, read_back_sparse  # noqa: E402
from tests.plugins.sparse_groups import IDX_NAMES, LAT_NAMES, vllm_caches, vllm_placement  # noqa: E402

pytestmark = pytest.mark.engine

BS = 64  # CUDA's: the indexer's kernel blocks are 64 tokens (indexer.py:284-285), FLASHMLA_SPARSE a multiple of 64
CT = 64  # one block a chunk: the 5 blocks of the cache hold the 4 chunks of the prompt
TOKENS = list(range(900, 900 + 4 * CT + 9))  # 4 full chunks, all loadable


def connector(url, role, fp8=False, layout="BLHNC", backend="FLASHMLA_SPARSE", indexer_first=True, **extra):
    """One role on vLLM's own config: the worker on the workers' KVCacheConfig, the scheduler on the copy vLLM's
    engine core gives its scheduler (generate_scheduler_kv_cache_config: the group's first layer's spec only)."""
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config

    from kvctl.plugins.vllm import KvctlConnector

    raw, views, group, kc = vllm_placement(BS, fp8, layout, indexer_first=indexer_first)
    kw = {"kv_cache_config": generate_scheduler_kv_cache_config([kc])}
    if role == KVConnectorRole.WORKER:
        kw = {"kv_caches": views, "coordinator": SimpleNamespace(rank_in_group=0, world_size=1, cpu_group=None,
                                                                 ranks=[0]), "kv_cache_config": kc}
    conn = KvctlConnector.without_engine(
        {"urls": [url], "chunk_tokens": CT, "timeout_s": 2.0, **extra}, world_size=1, layer_names=group.layer_names,
        spec=group.kv_cache_spec, block_size=BS, use_mla=True, model_name="glm", role=role, layout=layout,
        backend=backend, cache_dtype="fp8" if fp8 else "auto", **kw)
    return conn, views


def _latent_and_indexer(views):
    return [views[n] for n in LAT_NAMES], [views[n] for n in IDX_NAMES]


@pytest.mark.parametrize("fp8", [False, True])
def test_save_lookup_and_load_through_the_connector(gloo_world1, valkey_server, fp8):
    from kvctl.plugins.vllm import LoadSpec, SaveSpec

    sched, _ = connector(valkey_server.url, KVConnectorRole.SCHEDULER, fp8)
    worker, views = connector(valkey_server.url, KVConnectorRole.WORKER, fp8)
    try:
        assert sched.spec.fmt == worker.spec.fmt == worker.worker.layout.fmt(1)
        assert sched.spec.fmt.endswith("+idx132-L2-fp8_e4m3") and ("fp8_ds_mla" in sched.spec.fmt) == fp8
        # chunk_bytes (what a hit moves) counts both parts
        assert sched.spec.chunk_bytes == sched.spec.parts.nbytes == worker.worker.store.chunk_nbytes
        lat, idx = _latent_and_indexer(views)
        fill_sparse(lat, idx)
        blocks = [3, 0, 4, 1, 2]
        worker.worker.save(SaveSpec("a", TOKENS[: 4 * CT], blocks[: 4 * CT // BS]))
        assert worker.worker.saver.wait_idle(20)
        request = SimpleNamespace(request_id="r", prompt_token_ids=TOKENS, num_preemptions=0)
        assert sched.get_num_new_matched_tokens(request, 0) == (4 * CT, False)

        want = read_back_sparse(lat, idx, slots_for(blocks, BS, 0, 4 * CT))
        keys = worker.worker.store.keys(TOKENS)
        with RespClient(valkey_server.url) as cl:
            cl.delete([part_key(keys[2], INDEXER_PART)])  # the indexer part of chunk 2 is gone; its latent part stays
        sched.scheduler.sync_answers.drop("r")
        assert sched.get_num_new_matched_tokens(request, 0) == (2 * CT, False)  # a half chunk is a miss

        for t in lat + idx:
            t.zero_()
        dst = [4, 2, 0, 3, 1]
        # a load planned before the part went (the scheduler saw 4 chunks): it agrees on 2, the rest is recomputed
        worker.worker.load(LoadSpec("b", TOKENS[: 4 * CT], first_chunk=0, end_chunk=4, skip_tokens=0, block_ids=dst),
                           worker.worker.group)
        got = read_back_sparse(lat, idx, slots_for(dst, BS, 0, 2 * CT))
        assert all(torch.equal(a, b[:, : 2 * CT]) for a, b in zip(got, want))
        assert sorted(worker.get_block_ids_with_load_errors()) == sorted(dst[2 * CT // BS : 4 * CT // BS])
        rest = read_back_sparse(lat, idx, slots_for(dst, BS, 2 * CT, 4 * CT))
        assert all(int(t.count_nonzero()) == 0 for t in rest)
    finally:
        sched.shutdown()
        worker.shutdown()


def test_a_layered_sparse_hit_writes_each_layer_before_its_indexer_reads_it(gloo_world1, valkey_server):
    """layer_groups 2 on the group of 3 latent layers whose indexer skips layer 2: group 0 (layers 0-1's latent rows
    and indexer keys) is written before the forward, since layer 0's indexer reads its cache before vLLM's first
    hook; group 1 (layer 2's latent rows) by layer 1's hook, one layer ahead as a sparse layer needs."""
    from kvctl.plugins.vllm import KvctlConnectorMetadata, LoadSpec, SaveSpec

    sched, _ = connector(valkey_server.url, KVConnectorRole.SCHEDULER, layer_groups=2)
    worker, views = connector(valkey_server.url, KVConnectorRole.WORKER, layer_groups=2)
    try:
        assert sched.spec.parts == worker.worker.store.parts
        assert sched.spec.parts.names == ("mla.L0-1", "idx.L0-1", "mla.L2-2")
        lat, idx = _latent_and_indexer(views)
        fill_sparse(lat, idx)
        blocks = [3, 0, 4, 1, 2]
        worker.worker.save(SaveSpec("a", TOKENS[: 4 * CT], blocks[: 4 * CT // BS]))
        assert worker.worker.saver.wait_idle(20)
        request = SimpleNamespace(request_id="r", prompt_token_ids=TOKENS, num_preemptions=0)
        assert sched.get_num_new_matched_tokens(request, 0) == (4 * CT, False)
        want = read_back_sparse(lat, idx, slots_for(blocks, BS, 0, 4 * CT))
        for t in lat + idx:
            t.zero_()
        dst = [4, 2, 0, 3, 1]

        def written():
            got_lat, got_idx = read_back_sparse(lat, idx, slots_for(dst, BS, 0, 4 * CT))
            return [bool(t.count_nonzero()) for t in got_lat], [bool(t.count_nonzero()) for t in got_idx]

        worker.bind_connector_metadata(KvctlConnectorMetadata(loads=[LoadSpec("b", TOKENS[: 4 * CT], 0, 4, 0, dst)]))
        worker.start_load_kv(SimpleNamespace(attn_metadata=object()))
        assert written() == ([True, True, False], [True, True])  # group 0 before the forward
        worker.wait_for_layer_load(LAT_NAMES[0])
        assert written() == ([True, True, False], [True, True])
        worker.wait_for_layer_load(LAT_NAMES[1])  # layer 2's group, one layer ahead
        assert written() == ([True, True, True], [True, True])
        worker.wait_for_layer_load(LAT_NAMES[2])
        worker.finish_forward()
        assert worker.get_block_ids_with_load_errors() == set()
        got = read_back_sparse(lat, idx, slots_for(dst, BS, 0, 4 * CT))
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    finally:
        sched.shutdown()
        worker.shutdown()


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
@pytest.mark.parametrize("indexer_first", [True, False])
def test_the_schedulers_copy_of_the_config_keys_what_the_worker_stores(valkey_server, fp8, layout, indexer_first):
    """vLLM's scheduler holds one spec of the group (the indexer's, for DeepSeek-V3.2 and GLM-5), and the
    placement: the format the scheduler looks up is the worker's (on the H200, before, it was not: no hits)."""
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config

    from kvctl.connector.sparse_mla import INDEXER_PART, LATENT_PART

    _, _, group, kc = vllm_placement(BS, fp8, layout, indexer_first=indexer_first)
    flat = generate_scheduler_kv_cache_config([kc]).kv_cache_groups[0].kv_cache_spec
    assert not hasattr(flat, "kv_cache_specs")  # vLLM did flatten the group
    assert (str(flat.cache_role.name) == "INDEXER") == indexer_first
    sched, _ = connector(valkey_server.url, KVConnectorRole.SCHEDULER, fp8, layout, indexer_first=indexer_first)
    worker, _ = connector(valkey_server.url, KVConnectorRole.WORKER, fp8, layout, indexer_first=indexer_first)
    try:
        assert sched.spec.fmt == worker.spec.fmt == worker.worker.layout.fmt(1)
        assert sched.spec.parts == worker.spec.parts and sched.spec.parts.names == (LATENT_PART, INDEXER_PART)
        sparse = sched.spec.sparse
        assert sparse.latent_names == tuple(LAT_NAMES) and sparse.indexer_names == tuple(IDX_NAMES)
    finally:
        sched.shutdown()
        worker.shutdown()


def test_a_worker_whose_scheduler_would_key_other_chunks_is_refused_at_start(valkey_server):
    """The worker derives the scheduler's format from vLLM's scheduler copy of its own config; a placement the
    scheduler would read as other rows (fp8_ds_mla latent pages claimed to be 1152-byte bf16 rows) stops the start."""
    import dataclasses

    from kvctl.plugins.vllm import ConnectorConfigError, KvctlConnector

    raw, views, group, kc = vllm_placement(BS, True, "LBHNC")
    idx = next(i for i, t in enumerate(kc.kv_cache_tensors) if t.layers[0] not in IDX_NAMES)
    t = kc.kv_cache_tensors[idx]
    assert t.block_stride % (656 * BS) == 0
    kc.kv_cache_tensors[idx] = dataclasses.replace(t, block_stride=t.block_stride // 656 * 1152,
                                                   layer_stride=t.layer_stride // 656 * 1152)
    with pytest.raises(ConnectorConfigError, match="the scheduler's copy of vLLM's KV cache config gives chunk format"):
        KvctlConnector.without_engine(
            {"urls": [valkey_server.url], "chunk_tokens": CT}, world_size=1, layer_names=group.layer_names,
            spec=group.kv_cache_spec, block_size=BS, use_mla=True, role=KVConnectorRole.WORKER, layout="LBHNC",
            backend="FLASHMLA_SPARSE", cache_dtype="fp8", kv_caches=views, kv_cache_config=kc,
            coordinator=SimpleNamespace(rank_in_group=0, world_size=1, cpu_group=None, ranks=[0]))


@pytest.mark.parametrize("backend", ["FLASH_ATTN_MLA_SPARSE", "FLASHINFER_MLA_SPARSE"])
def test_another_sparse_backend_is_refused_at_start_by_name(valkey_server, backend):
    from kvctl.plugins.vllm import ConnectorConfigError

    with pytest.raises(ConnectorConfigError, match=f"sparse MLA backend {backend} is not stored"):
        connector(valkey_server.url, KVConnectorRole.WORKER, backend=backend)


def test_a_group_of_mixed_specs_that_is_not_sparse_mla_is_refused(valkey_server):
    from kvctl.plugins.vllm import ConnectorConfigError, KvctlConnector

    _, _, group = vllm_caches(BS, False, "LBHNC")
    specs = dict(group.kv_cache_spec.kv_cache_specs)
    specs[IDX_NAMES[0]] = SimpleNamespace(head_size=8, cache_role=None)
    with pytest.raises(ConnectorConfigError, match="only MLA with a sparse-attention indexer is stored"):
        KvctlConnector.without_engine(
            {"urls": [valkey_server.url], "chunk_tokens": CT}, world_size=1, layer_names=list(specs),
            spec=SimpleNamespace(kv_cache_specs=specs), block_size=BS, use_mla=True, role=KVConnectorRole.SCHEDULER)
