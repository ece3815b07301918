"""vLLM's own KV cache group of a sparse-MLA model (GLM-5, DeepSeek-V3.2), on CPU tensors (torch and vLLM only).

Shared by tests/plugins/test_sparse_layouts.py and test_vllm_sparse.py. The specs are the ones vLLM builds for
these models on CUDA (its Python code is the CPU build's): the latent layer's ``MLAAttentionSpec``
(mla_attention.py:1350-1381) after FLASHMLA_SPARSE's ``customize_spec`` (flashmla_sparse.py:168-175: bf16
blocks aligned to one 1152-byte row; a quantised cache to 64-token pages), and the indexer's
(deepseek_v2.py:658-667) after ``customize_attention_spec`` (v1/worker/utils.py:477-486: its fixed 64-token
kernel blocks). vLLM groups them, places them and views them (get_kv_cache_groups,
get_kv_cache_config_from_groups: tests/vllm_placement.py; create_kv_cache_views). The line numbers are
0.32's. Import it after checking that torch and vLLM import.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from vllm.v1.attention.backend import MultipleOf
from vllm.v1.kv_cache_interface import KVQuantMode, MLAAttentionSpec, SparseCacheRole, create_kv_cache_views
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvctl.connector.kv_views import CacheSpec
from tests.vllm_placement import placement

N_LAT, N_IDX, BLOCKS = 3, 2, 5  # fewer indexer layers than latent ones (index_topk_freq skips some)
LAT_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(N_LAT)]
IDX_NAMES = [f"model.layers.{i}.self_attn.indexer.k_cache" for i in range(N_IDX)]


def latent_spec(bs: int, fp8: bool) -> MLAAttentionSpec:
    if fp8:
        return MLAAttentionSpec(block_size=bs, num_kv_heads=1, max_tp_shards=1, head_size=576, dtype=torch.uint8,
                                cache_dtype_str="fp8_ds_mla", kv_quant_mode=KVQuantMode.FP8_PER_TENSOR,
                                state_content_bytes=656, is_index_group_leader=True,
                                block_stride_alignment=MultipleOf(64))
    return MLAAttentionSpec(block_size=bs, num_kv_heads=1, max_tp_shards=1, head_size=576, dtype=torch.bfloat16,
                            cache_dtype_str="auto", is_index_group_leader=True, block_stride_alignment=1152)


def indexer_spec(bs: int) -> MLAAttentionSpec:
    return MLAAttentionSpec(block_size=bs, num_kv_heads=1, max_tp_shards=1, head_size=132, dtype=torch.uint8,
                            cache_role=SparseCacheRole.INDEXER, block_stride_alignment=MultipleOf(64))


def layer_specs(bs: int, fp8: bool, indexer_first: bool = True) -> dict:
    """The runner's per-layer specs, in its order: a layer's indexer cache, then its latent cache, as
    ``DeepseekV2MLAAttention`` builds its ``Indexer`` before its MLA attention (models/deepseek_v2.py:1179-1215);
    ``indexer_first=False`` puts each latent first (a model that builds them the other way)."""
    out = {}
    for i in range(N_LAT):
        if i < N_IDX and indexer_first:
            out[IDX_NAMES[i]] = indexer_spec(bs)
        out[LAT_NAMES[i]] = latent_spec(bs, fp8)
        if i < N_IDX and not indexer_first:
            out[IDX_NAMES[i]] = indexer_spec(bs)
    return out


def vllm_group(bs: int, fp8: bool, indexer_first: bool = True):
    cfg = SimpleNamespace(scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=True),
                          attention_config=SimpleNamespace(hisparse_config=None), speculative_config=None,
                          model_config=None, parallel_config=SimpleNamespace(decode_context_parallel_size=1))
    return placement.get_kv_cache_groups(cfg, layer_specs(bs, fp8, indexer_first))


def vllm_caches(bs: int, fp8: bool, layout: str, kernel_block_size: int | None = None, indexer_first: bool = True):
    """vLLM's placement and views of the group: (raw, {layer: view}, group)."""
    raw, views, group, _ = vllm_placement(bs, fp8, layout, kernel_block_size, indexer_first)
    return raw, views, group


def vllm_placement(bs: int, fp8: bool, layout: str, kernel_block_size: int | None = None, indexer_first: bool = True):
    """(raw, {layer: view}, group, vLLM's KVCacheConfig): the workers' config, whose scheduler copy is
    ``kv_cache_utils.generate_scheduler_kv_cache_config([config])``."""
    (group,) = vllm_group(bs, fp8, indexer_first)
    lay = KVCacheLayout[layout]
    cfg = SimpleNamespace(
        attention_config=SimpleNamespace(hisparse_config=None),
        cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: lay, num_gpu_blocks_override=BLOCKS,
                                     prefix_cache_retention_interval=None))
    kc = placement.get_kv_cache_config_from_groups(cfg, [group], available_memory=1 << 30)
    raw = torch.zeros(kc.kv_cache_tensors[0].size, dtype=torch.int8)
    views = {}
    for tensor in kc.kv_cache_tensors:
        spec = group.kv_cache_spec.kv_cache_specs[tensor.layers[0]]
        views.update(zip(tensor.layers, create_kv_cache_views(raw, spec, kc.num_blocks, lay, tensor,
                                                              kernel_block_size=kernel_block_size)))
    return raw, views, group, kc


def twin_specs(bs: int, fp8: bool, indexer_first: bool = True) -> list[tuple[CacheSpec, int]]:
    """The torch-only twin's ``(spec, layers)`` pairs of one group, in vLLM's placement order (the runner's)."""
    lat, idx = latent_spec(bs, fp8), indexer_spec(bs)
    pairs = [(CacheSpec(bs, 1, 576, lat.dtype, head_size_v=0, block_stride_alignment=lat.get_block_stride_alignment(),
                       cache_dtype_str=lat.cache_dtype_str, state_content_bytes=lat.state_content_bytes), N_LAT),
            (CacheSpec(bs, 1, 132, torch.uint8, head_size_v=0,
                       block_stride_alignment=idx.get_block_stride_alignment()), N_IDX)]
    return pairs[::-1] if indexer_first else pairs
