"""vLLM's paged KV cache <-> kvctl chunks, for the MLA and the GQA/MHA layouts (torch only).

A slot is ``block_id * block_size + offset``. A stored chunk holds every
layer's KV for ``chunk_tokens`` consecutive tokens, the same bytes whatever
rank built it:

* MLA: each layer's cache is ``(num_blocks, block_size, kv_lora_rank +
  rope_dim)`` in memory (row per slot; vLLM may add a unit head dim). Every TP
  rank holds the same latent KV, so the chunk is ``(layers, tokens, 576)``.
* GQA/MHA on vLLM's CPU backend: ``(num_blocks, heads, 2, block_size,
  head_size)`` in memory (per block and head, K rows then V rows). A TP rank
  holds ``heads`` of the model's KV heads; the chunk holds all of them,
  ``(layers, tokens, W * heads, 2, head_size)``, gathered from the W ranks
  at store time, and a rank writes back only its own ``heads`` slice.

Chunks live in host memory (the tier and the gloo protocol work there); the
caches may live on any device: slots and data move to the cache's device for
a write, and extracted KV comes back to the host.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["GQALayout", "MLALayout", "slots_for"]


def slots_for(block_ids: Sequence[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """Slots of tokens ``start..end-1`` of a request whose blocks are ``block_ids``."""
    if end <= start:
        return torch.empty(0, dtype=torch.long)
    tok = torch.arange(start, end, dtype=torch.long)
    blocks = torch.as_tensor(list(block_ids), dtype=torch.long)
    return blocks[tok // block_size] * block_size + tok % block_size


class MLALayout:
    """Latent KV rows, one per slot, in each layer's cache."""

    mla = True

    def __init__(self, caches: Sequence[torch.Tensor], block_size: int, row: int) -> None:
        self.block_size, self.row = block_size, row
        self.rows = []
        for t in caches:
            if not t.is_contiguous() or t.numel() % (block_size * row):
                raise ValueError(f"MLA cache of shape {tuple(t.shape)} is not (blocks, {block_size}, {row})")
            self.rows.append(t.view(-1, row))
        self.dtype = caches[0].dtype
        self.num_layers = len(self.rows)

    def chunk_shape(self, tokens: int, world_size: int = 1) -> tuple[int, ...]:
        return (self.num_layers, tokens, self.row)

    def fmt(self, world_size: int) -> str:
        return f"mla{self.row}-L{self.num_layers}-{str(self.dtype).removeprefix('torch.')}"

    def extract(self, slots: torch.Tensor) -> torch.Tensor:
        """``(layers, len(slots), row)`` on the host: a copy of those slots' KV."""
        idx = slots.to(self.rows[0].device)
        return torch.stack([r.index_select(0, idx) for r in self.rows]).cpu()

    def insert(self, slots: torch.Tensor, data: torch.Tensor, rank: int = 0) -> None:
        """Write ``data`` (layers, tokens, row), token i into slot ``slots[i]``."""
        dev = self.rows[0].device
        idx = slots.to(dev)
        for layer, r in enumerate(self.rows):
            r.index_copy_(0, idx, data[layer].to(dev, non_blocking=True))

    def to_local(self, chunk: torch.Tensor, rank: int) -> torch.Tensor:
        return chunk


class GQALayout:
    """vLLM CPU attention caches: per block and KV head, K rows then V rows."""

    mla = False

    def __init__(self, caches: Sequence[torch.Tensor], block_size: int, heads: int, head_size: int) -> None:
        self.block_size, self.heads, self.head_size = block_size, heads, head_size
        per_block = heads * 2 * block_size * head_size
        self.views = []
        for t in caches:
            if not t.is_contiguous() or t.numel() % per_block:
                raise ValueError(f"KV cache of shape {tuple(t.shape)} is not (blocks, {heads}, 2, {block_size}, {head_size})")
            self.views.append(t.view(-1, heads, 2, block_size, head_size))
        self.dtype = caches[0].dtype
        self.num_layers = len(self.views)

    def chunk_shape(self, tokens: int, world_size: int = 1) -> tuple[int, ...]:
        return (self.num_layers, tokens, world_size * self.heads, 2, self.head_size)

    def fmt(self, world_size: int) -> str:
        return (f"gqa{world_size * self.heads}x{self.head_size}-L{self.num_layers}-"
                f"{str(self.dtype).removeprefix('torch.')}")

    def extract(self, slots: torch.Tensor) -> torch.Tensor:
        """``(layers, len(slots), heads, 2, head_size)`` on the host: this rank's heads for those slots."""
        slots = slots.to(self.views[0].device)
        b, o = slots // self.block_size, slots % self.block_size
        return torch.stack([v[b, :, :, o, :] for v in self.views]).cpu()

    def to_local(self, chunk: torch.Tensor, rank: int) -> torch.Tensor:
        """This rank's head slice of a full-heads chunk."""
        return chunk[:, :, rank * self.heads : (rank + 1) * self.heads]

    def insert(self, slots: torch.Tensor, data: torch.Tensor, rank: int = 0) -> None:
        """Write ``data`` (layers, tokens, heads, 2, head_size) -- this rank's heads -- into the slots."""
        dev = self.views[0].device
        slots = slots.to(dev)
        b, o = slots // self.block_size, slots % self.block_size
        for layer, v in enumerate(self.views):
            v[b, :, :, o, :] = data[layer].to(dev, non_blocking=True)
