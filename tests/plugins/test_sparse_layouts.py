"""MLA with a sparse-attention indexer (GLM-5, DeepSeek-V3.2): vLLM's own grouping, placement and views, and
kvctl.connector.sparse_mla on them.

The group is vLLM's own (tests/plugins/sparse_groups.py: the specs vLLM builds for these models on CUDA,
grouped, placed and viewed by vLLM's functions on CPU tensors); the caches are filled so every element
encodes its logical position (tests/plugins/kv_fill.py), read as FLASHMLA_SPARSE and the indexer's kernels
read them.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.v1.kv_cache_interface import KVQuantMode, MLAAttentionSpec, UniformTypeKVCacheSpecs  # noqa: E402

from kvctl.connector.kv_views import build_group_caches  # noqa: E402
from kvctl.connector.layouts import KVLayoutError, layout_for, slots_for  # noqa: E402
from kvctl.connector.ownership import chunk_keys  # noqa: E402
from kvctl.connector.sparse_mla import sparse_format, sparse_group, sparse_layout_for  # noqa: E402
from tests.plugins.kv_fill import LAYOUTS, expected_sparse, fill_sparse, int_view, read_back_sparse  # noqa: E402
from tests.plugins.sparse_groups import (  # noqa: E402
    BLOCKS,
    IDX_NAMES,
    LAT_NAMES,
    N_IDX,
    N_LAT,
    indexer_spec,
    latent_spec,
    twin_specs,
    vllm_caches,
    vllm_group,
)

pytestmark = pytest.mark.engine


def test_vllm_puts_the_latent_and_the_indexer_in_one_group_with_one_block_table():
    """The layout fact the connector is built on: one KV cache group (UniformTypeKVCacheSpecs), not two."""
    for fp8 in (False, True):
        (group,) = vllm_group(64, fp8)
        assert isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs)
        assert sorted(group.layer_names) == sorted(LAT_NAMES + IDX_NAMES)
        sg = sparse_group(group.kv_cache_spec, group.layer_names)
        assert (sg.latent_names, sg.indexer_names) == (tuple(LAT_NAMES), tuple(IDX_NAMES))


CASES = [(64, False, None), (64, True, None), (128, False, 64), (128, True, 64)]  # (block, fp8, kernel block)


@pytest.mark.parametrize("indexer_first", [True, False], ids=["indexer-first", "latent-first"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bs,fp8,kbs", CASES, ids=lambda x: str(x))
def test_torch_only_twin_matches_vllm(layout, bs, fp8, kbs, indexer_first):
    """Either order of the two specs (the model runner's is indexer first: models/deepseek_v2.py:1179-1215)."""
    specs = twin_specs(bs, fp8, indexer_first)
    try:
        raw, theirs, _ = vllm_caches(bs, fp8, layout, kbs, indexer_first)
    except ValueError as exc:  # vLLM refuses this layout for mixed page sizes, or cannot split these blocks here
        with pytest.raises(ValueError):
            build_group_caches(specs, layout, BLOCKS, kernel_block_size=kbs)
        assert "mixed page sizes" in str(exc) or "kernel blocks" in str(exc)
        return
    my_raw, views = build_group_caches(specs, layout, BLOCKS, kernel_block_size=kbs)
    idx, lat = views if indexer_first else views[::-1]
    assert my_raw.numel() == raw.numel()
    for a, name in zip(lat + idx, LAT_NAMES + IDX_NAMES, strict=True):
        b = theirs[name]
        assert (a.shape, a.stride(), a.storage_offset(), a.dtype) == (b.shape, b.stride(), b.storage_offset(), b.dtype)


def _layout(views: dict, group, layout: str, **kw):
    sg = sparse_group(group.kv_cache_spec, group.layer_names)
    return sparse_layout_for(sg, [views[n] for n in sg.latent_names], [views[n] for n in sg.indexer_names], layout,
                             kw.pop("backend", "FLASHMLA_SPARSE"), **kw), sg


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "BLHNC", "BLNHC"])
@pytest.mark.parametrize("bs,fp8,kbs", CASES, ids=lambda x: str(x))
def test_extract_and_insert_are_byte_exact(layout, bs, fp8, kbs):
    try:
        raw, views, group = vllm_caches(bs, fp8, layout, kbs)
    except ValueError as exc:
        pytest.skip(f"vLLM: {exc}")
    lat_views, idx_views = [views[n] for n in LAT_NAMES], [views[n] for n in IDX_NAMES]
    fill_sparse(lat_views, idx_views)
    lay, sg = _layout(views, group, layout)
    assert lay.fused
    slots = slots_for([4, 1, 3], bs, 5, 3 * bs - 7)  # partial first and last blocks, blocks out of order
    want_lat, want_idx = expected_sparse(slots, lat_views, idx_views)
    kv = lay.extract(slots)
    assert kv.latent.dtype == lat_views[0].dtype and kv.indexer.dtype == torch.uint8
    assert torch.equal(int_view(kv.latent), want_lat) and torch.equal(kv.indexer, want_idx)
    snapshot = raw.clone()
    raw.zero_()
    lay.insert(slots, kv)
    got_lat, got_idx = read_back_sparse(lat_views, idx_views, slots)
    assert torch.equal(got_lat, want_lat) and torch.equal(got_idx, want_idx)
    written = raw != 0
    assert torch.equal(raw[written], snapshot[written])  # no byte outside those tokens' rows, values and scales
    assert int(written.sum()) <= kv.latent.numel() * kv.latent.element_size() + kv.indexer.numel()
    # the chunk's format and parts, from the specs alone (the scheduler) and from the caches (the worker)
    fmt, parts = sparse_format(sg, 2 * bs)
    assert fmt == lay.fmt(1) == (f"mla{656 if fp8 else 576}-L{N_LAT}-{'fp8_ds_mla' if fp8 else 'bfloat16'}"
                                 f"+idx132-L{N_IDX}-fp8_e4m3")
    assert parts == lay.parts(2 * bs) and parts.nbytes == lay.chunk_shape(2 * bs)[0]
    assert parts.sizes == (N_LAT * 2 * bs * (656 if fp8 else 1152), N_IDX * 2 * bs * 132)


def test_a_chunk_round_trips_between_layouts_and_kernel_block_sizes():
    """Saved from BLHNC with 64-token blocks, loaded into LBNHC with 128-token blocks in 64-token kernel blocks:
    the same bytes through the chunk's canonical form (each token's values then its scale)."""
    _, src, group = vllm_caches(64, True, "BLHNC")
    fill_sparse([src[n] for n in LAT_NAMES], [src[n] for n in IDX_NAMES])
    src_lay, _ = _layout(src, group, "BLHNC")
    _, dst, dgroup = vllm_caches(128, True, "LBNHC", 64)
    dst_lay, _ = _layout(dst, dgroup, "LBNHC")
    src_slots, dst_slots = slots_for([3, 0, 2], 64, 0, 192), slots_for([2, 4], 128, 0, 192)
    chunks = src_lay.chunks_of(src_lay.extract(src_slots), 64)
    assert len(chunks) == 3 and all(c.dtype == torch.uint8 and c.numel() == src_lay.chunk_shape(64)[0] for c in chunks)
    dst_lay.insert(dst_slots[10:], dst_lay.join_chunks(chunks, skip=10))
    got_lat, got_idx = read_back_sparse([dst[n] for n in LAT_NAMES], [dst[n] for n in IDX_NAMES], dst_slots[10:])
    want_lat, want_idx = read_back_sparse([src[n] for n in LAT_NAMES], [src[n] for n in IDX_NAMES], src_slots[10:])
    assert torch.equal(got_lat, want_lat) and torch.equal(got_idx, want_idx)


@pytest.mark.parametrize("backend", ["FLASHINFER_MLA_SPARSE", "FLASH_ATTN_MLA_SPARSE", "FLASHINFER_MLA_SPARSE_SM90",
                                     "ROCM_AITER_MLA_SPARSE", "FLASHMLA"])
def test_other_backends_are_refused_by_name(backend):
    _, views, group = vllm_caches(64, False, "LBHNC")
    with pytest.raises(KVLayoutError, match=f"backend {backend}, layout LBHNC.*is not stored") as err:
        _layout(views, group, "LBHNC", backend=backend)
    assert "FLASHMLA_SPARSE" in str(err.value)
    if backend == "FLASHINFER_MLA_SPARSE":
        assert "SM100" in str(err.value)


def test_refusals_of_the_indexer_and_the_packed_formats():
    _, views, group = vllm_caches(64, False, "LBHNC")
    with pytest.raises(KVLayoutError, match="indexer backend KPOOL_TAIL is not stored"):
        _layout(views, group, "LBHNC", indexer_backend="KPOOL_TAIL")
    with pytest.raises(KVLayoutError, match="shuffled"):
        _layout(views, group, "LBHNC", indexer_shuffled=True)
    # a sparse backend is never read as a plain MLA group (its indexer's keys would be left behind)
    with pytest.raises(KVLayoutError, match="unknown attention backend.*sparse_mla"):
        layout_for([views[n] for n in LAT_NAMES], latent_spec(64, False), "LBHNC", "FLASHMLA_SPARSE")
    nvfp4 = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.uint8,
                             cache_dtype_str="nvfp4_ds_mla", kv_quant_mode=KVQuantMode.NVFP4_DS_MLA,
                             state_content_bytes=352)
    specs = SimpleNamespace(kv_cache_specs={"a": nvfp4, "i": indexer_spec(64)})
    with pytest.raises(KVLayoutError, match="nvfp4_ds_mla"):
        sparse_format(sparse_group(specs, ["a", "i"]), 64)
    gqa = SimpleNamespace(kv_cache_specs={"a": latent_spec(64, False), "g": SimpleNamespace(head_size=8)})
    with pytest.raises(KVLayoutError, match="only MLA with a sparse-attention indexer"):
        sparse_group(gqa, ["a", "g"])


def test_the_two_parts_and_the_two_formats_never_share_a_key():
    """A chunk of the latent part never loads as the indexer's, nor a bf16 chunk as an fp8_ds_mla one, nor as a
    dense MLA chunk: every part has its own key, and the format (in the key's hash) names both parts."""
    tokens = list(range(128))
    keys = set()
    for fp8 in (False, True):
        (group,) = vllm_group(64, fp8)
        fmt, parts = sparse_format(sparse_group(group.kv_cache_spec, group.layer_names), 64)
        (base,) = chunk_keys(tokens[:64], 64, "m", fmt)
        keys |= set(parts.keys(base))
        assert all(k.startswith(f"m@{fmt}/") for k in parts.keys(base))
    (dense,) = chunk_keys(tokens[:64], 64, "m", f"mla576-L{N_LAT}-bfloat16")
    keys.add(dense)
    assert len(keys) == 5
    assert len({k.rsplit("@", 1)[1] for k in keys}) == 3  # one digest a format: the parts differ in name only
