"""How KvctlConnector's worker reads the engine's paged caches (see :mod:`kvctl.plugins.vllm`).

The layout of a KV cache group is read from the engine, never guessed: vLLM's resolved KV cache layout and
the attention backend of the group's layers (one backend a group), and for a sparse-MLA group the indexer's
backend and whether its caches are shuffled. Outside an engine (``KvctlConnector.without_engine``: tests,
benchmarks) the same names are given. :func:`read_layout` turns the registered views into the layout object
the data path copies through (:mod:`kvctl.connector.layouts`, :mod:`kvctl.connector.sparse_mla`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from kvctl.connector.layouts import KVLayoutError, layout_for
from kvctl.connector.sparse_mla import sparse_layout_for

from .vllm_spec import ConnectorSpec

__all__ = ["CacheReading", "layer_calls_hooks", "read_layout"]


@dataclass(frozen=True)
class CacheReading:
    """Where the caches' layout and backends come from: ``vllm_config`` (an engine), else the names given."""

    vllm_config: Any = None
    layout: str = "LBHNC"  # a KVCacheLayout name
    backend: str = "CPU_ATTN"  # the latent (MLA) or attention backend
    indexer_backend: str = "DEEPSEEK_V32_INDEXER"

    def of(self, layer_names: Sequence[str], spec: Any, indexer: bool = False) -> tuple[str, str]:
        """(resolved KVCacheLayout name, attention backend name) of these layers of the group."""
        if self.vllm_config is None:
            return (self.layout, self.indexer_backend if indexer else self.backend)
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        layout = self.vllm_config.cache_config.get_resolved_kv_cache_layout().name
        names = sorted({b.get_name() for b in get_current_attn_backends(self.vllm_config, list(layer_names))})
        if len(names) != 1:
            raise KVLayoutError(f"KvctlConnector: the KV cache group's layers use {len(names)} attention backends "
                                f"({', '.join(names)}), layout {layout}, spec {spec}: one is supported")
        return layout, names[0]

    def without_layer_hooks(self, layer_names: Sequence[str]) -> list[str]:
        """The layers whose forward calls no ``wait_for_layer_load`` (:func:`layer_calls_hooks`); none outside an engine."""
        if self.vllm_config is None:
            return []
        ctx = self.vllm_config.compilation_config.static_forward_context
        return [n for n in layer_names if not layer_calls_hooks(ctx.get(n))]

    def indexer_shuffled(self, layer_names: Sequence[str]) -> bool:
        """Whether the engine's indexer caches are in the shuffled (tiled) layout (ROCm's readers)."""
        if self.vllm_config is None:
            return False
        ctx = self.vllm_config.compilation_config.static_forward_context
        return any(bool(getattr(ctx.get(n), "uses_shuffled_layout", False)) for n in layer_names)


def layer_calls_hooks(layer: Any) -> bool:
    """Whether vLLM calls the connector's ``wait_for_layer_load`` before this attention layer runs.

    vLLM 0.32 calls it from its attention ops only (``maybe_transfer_kv_layer`` on ``unified_attention_with_output``
    and ``unified_mla_attention_with_output``, model_executor/layers/attention/kv_transfer_utils.py): an
    ``Attention`` reaches them from its own ``forward`` (attention.py:488, directly or as a custom op), an
    ``MLAAttention`` only as a custom op (mla_attention.py:813; its direct-call path skips them). A layer class
    that replaces ``forward`` may never reach them: DeepSeek-V3.2's and GLM-5's sparse MLA
    (``DeepseekV32Attention``, models/deepseek_v32/attention.py:298) runs its indexer and attention itself, so
    no hook runs for those layers (seen on an H200, 2026-12-05). Anything else, or a vLLM without these classes:
    False, and hits load before the forward.
    """
    try:
        from vllm.model_executor.layers.attention.attention import Attention
        from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    except ImportError:
        return False
    if isinstance(layer, MLAAttention):
        return type(layer).forward is MLAAttention.forward and not getattr(layer, "use_direct_call", True)
    if isinstance(layer, Attention):
        return type(layer).forward is Attention.forward
    return False


def read_layout(spec: ConnectorSpec, reading: CacheReading, kv_caches: dict[str, torch.Tensor]) -> tuple[Any, str, str]:
    """(layout object, layout name, backend) of the group from its registered views (sparse MLA: both kinds)."""
    names = spec.layer_names
    caches = [kv_caches[n] for n in names if n in kv_caches]
    if len(caches) != len(names):
        raise RuntimeError(f"KvctlConnector: {len(names)} attention layers but {len(caches)} KV caches registered")
    sg = spec.sparse
    if sg is None:
        layout, backend = reading.of(names, spec.kv_cache_spec)
        return layout_for(caches, spec.kv_cache_spec, layout, backend, cache_dtype=spec.cache_dtype), layout, backend
    layout, backend = reading.of(sg.latent_names, spec.kv_cache_spec)
    _, indexer_backend = reading.of(sg.indexer_names, spec.kv_cache_spec, indexer=True)
    lay = sparse_layout_for(sg, [kv_caches[n] for n in sg.latent_names], [kv_caches[n] for n in sg.indexer_names],
                            layout, backend, indexer_backend, cache_dtype=spec.cache_dtype,
                            indexer_shuffled=reading.indexer_shuffled(sg.indexer_names))
    if lay.parts(spec.chunk_tokens) != spec.sparse_parts:
        raise KVLayoutError(f"KvctlConnector: backend {backend}, layout {layout}: chunk parts "
                            f"{lay.parts(spec.chunk_tokens)}, the scheduler's {spec.sparse_parts}")
    return lay, layout, backend
