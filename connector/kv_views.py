"""vLLM-shaped KV caches without vLLM (torch only): for tests and benchmarks on hosts that lack vLLM.

:func:`build_caches` allocates one flat int8 buffer and returns the per-layer
logical views ``[B, H, N, C]`` that vLLM 0.32's runner would register with a
connector for one KV cache group: placement as
``vllm/v1/core/kv_cache_utils.py:get_kv_cache_config_from_groups`` computes it
(layer-outer or block-outer, padded pages, block-stride alignment), strides as
``vllm/v1/kv_cache_interface.py:compute_layout_strides`` and the views as
``create_kv_cache_views`` (kernel-block splitting included). A CPU test
checks shapes, strides and storage offsets against vLLM's own functions for
every layout.

:func:`build_group_caches` does the same for a group whose layers have
several specs (vLLM's ``UniformTypeKVCacheSpecs``: MLA with a sparse-attention
indexer puts the latent layers and the indexer's K caches in one group, one
block table): one tensor of layers per spec, in the order given, each after
the one before (``get_kv_cache_config_from_groups``, ``byte_offset``), in one
allocation; only block-compact layouts can hold mixed page sizes
(``validate_kv_cache_layout``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

__all__ = ["CacheSpec", "build_caches", "build_group_caches", "layout_order"]

# [L, B, H, N, C] stride permutations of vllm/v1/kv_cache_layout.py:KVCacheLayout
_ORDERS = {
    "LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4),
}
_L, _B = 0, 1


def layout_order(layout: Any) -> tuple[int, ...]:
    """The stride permutation of a layout (a ``KVCacheLayout`` or its name)."""
    return _ORDERS[str(getattr(layout, "name", layout))]


@dataclass(frozen=True)
class CacheSpec:
    """The fields of vLLM's ``FullAttentionSpec`` / ``MLAAttentionSpec`` that shape a cache (duck-typed twin).

    MLA: ``num_kv_heads`` 1, ``head_size_v`` 0 (one latent row per token).
    ``block_stride_alignment`` is in bytes (vLLM's resolved
    ``get_block_stride_alignment()``).
    """

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    head_size_v: int | None = None
    page_size_padded: int | None = None
    block_stride_alignment: int = 1
    cache_dtype_str: str | None = None
    state_content_bytes: int | None = None  # C in bytes when the backend packs its cells (fp8_ds_mla: 656)

    @property
    def mla(self) -> bool:
        return self.head_size_v == 0

    @property
    def content_bytes(self) -> int:
        if self.state_content_bytes is not None:
            return self.state_content_bytes
        hv = self.head_size if self.head_size_v is None else self.head_size_v
        return (self.head_size + hv) * torch.empty((), dtype=self.dtype).element_size()

    @property
    def unpadded_page_size_bytes(self) -> int:
        return self.num_kv_heads * self.block_size * self.content_bytes

    @property
    def page_size_bytes(self) -> int:
        return self.page_size_padded or self.unpadded_page_size_bytes


def _shape(spec: CacheSpec, num_blocks: int, kernel_block_size: int | None) -> tuple[int, int, int, int]:
    bs = kernel_block_size or spec.block_size
    if spec.block_size % bs:
        raise ValueError(f"kernel block size {bs} does not divide block size {spec.block_size}")
    return (num_blocks * (spec.block_size // bs), spec.num_kv_heads, bs, spec.content_bytes)


def _strides(spec: CacheSpec, num_blocks: int, num_layers: int, order: tuple[int, ...],
             kernel_block_size: int | None, fixed: tuple[int | None, ...]) -> tuple[int, ...]:
    """Byte strides in logical [L, B, H, N, C] order (vLLM's compute_layout_strides)."""
    shape = (num_layers, *_shape(spec, num_blocks, kernel_block_size))
    padded = spec.page_size_padded
    grid_end = max(order.index(_L), order.index(_B)) + 1
    if padded is not None:
        if kernel_block_size not in (None, spec.block_size):
            raise ValueError("padded pages cannot be split into kernel blocks")
        if math.prod(shape[d] for d in order[:grid_end]) != num_layers * num_blocks:
            raise ValueError("padded pages need L and B (or singletons) outside the page")
    strides = [0] * 5
    cur = 1
    for phys, dim in reversed(tuple(enumerate(order))):
        if padded is not None and phys == grid_end - 1:
            cur = max(cur, padded)
        strides[dim] = fixed[dim] or cur
        cur = strides[dim] * shape[dim]
    return tuple(strides)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def build_caches(spec: CacheSpec, layout: Any, num_layers: int, num_blocks: int, *, device: Any = "cpu",
                 kernel_block_size: int | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(raw int8 buffer, per-layer [B, H, N, C] views of spec.dtype)`` for one group of identical layers."""
    raw, (views,) = build_group_caches([(spec, num_layers)], layout, num_blocks, device=device,
                                       kernel_block_size=kernel_block_size)
    return raw, views


def build_group_caches(specs: Sequence[tuple[CacheSpec, int]], layout: Any, num_blocks: int, *, device: Any = "cpu",
                       kernel_block_size: int | None = None) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """``(raw int8 buffer, [views of each spec's layers])`` for one KV cache group of ``(spec, layers)`` pairs.

    One kernel block size for the whole group, as vLLM picks one per group.
    """
    order = layout_order(layout)
    name = str(getattr(layout, "name", layout))
    block_outermost = order[0] == _B
    block_compact = set(order[:2]) == {_L, _B}
    if len({s.page_size_bytes for s, _ in specs}) > 1 and not block_compact:
        raise ValueError(f"KV cache layout {name} cannot express this model's mixed page sizes")  # vLLM's own rule
    # placement: get_kv_cache_config_from_groups (_get_kv_cache_bytes_per_block, then one tensor per spec)
    if block_outermost:
        align = math.lcm(*(s.block_stride_alignment for s, _ in specs))
        bytes_per_block = _round_up(sum(n * s.page_size_bytes for s, n in specs), align)
    else:
        bytes_per_block = sum(n * _round_up(s.page_size_bytes, s.block_stride_alignment) for s, n in specs)
    raw = torch.zeros(bytes_per_block * num_blocks, dtype=torch.int8, device=device)
    out, offset = [], 0
    for spec, num_layers in specs:
        views, layer_stride = _tensor_views(raw, spec, name, num_layers, num_blocks, offset,
                                            bytes_per_block if block_outermost else None, kernel_block_size)
        out.append(views)
        offset += num_layers * (spec.page_size_bytes if block_outermost else layer_stride)
    return raw, out


def _tensor_views(raw: torch.Tensor, spec: CacheSpec, layout: str, num_layers: int, num_blocks: int, offset: int,
                  block_stride: int | None, kernel_block_size: int | None) -> tuple[list[torch.Tensor], int]:
    """One KVCacheTensor's views (create_kv_cache_views) and its layer stride, at byte ``offset`` of ``raw``."""
    order = layout_order(layout)
    block_compact = set(order[:2]) == {_L, _B}
    padded_page = _round_up(spec.page_size_bytes, spec.block_stride_alignment)
    if block_stride is None and padded_page != spec.page_size_bytes:
        if not block_compact:
            raise ValueError(f"{layout} cannot pad pages")
        block_stride = padded_page
    layer_stride, block_stride = _strides(spec, num_blocks, num_layers, order, None,
                                          (None, block_stride, None, None, None))[:2]
    shape = _shape(spec, num_blocks, kernel_block_size)
    ratio = shape[0] // num_blocks
    if ratio > 1:
        dense = math.prod(_shape(spec, 1, None)[1:])
        if block_stride != dense:
            raise ValueError(f"{layout}: block stride {block_stride} != dense page {dense}: no kernel-block split")
        block_stride //= ratio
    strides = _strides(spec, num_blocks, num_layers, order, kernel_block_size,
                       (layer_stride, block_stride, None, None, None))
    view5 = torch.as_strided(raw, (num_layers, *shape), strides, raw.storage_offset() + offset)
    return [view5[layer].view(spec.dtype) for layer in range(num_layers)], layer_stride
