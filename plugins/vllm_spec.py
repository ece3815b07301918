"""KvctlConnector's spec: what both halves read, built once from vLLM's config (see :mod:`kvctl.plugins.vllm`).

The facade builds one :class:`ConnectorSpec` (:func:`spec_from_vllm` in an engine, :func:`build_spec` outside
one) and hands it to the half it runs, the scheduler side or the worker side, as vLLM's OffloadingConnector
hands its spec to ``offloading/scheduler.py`` and ``worker.py``. Both roles derive the chunk format, the
parts and the layer groups here from the same description, so the scheduler looks up what the workers store.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from kvctl.connector.layer_groups import Grouping, Plane, grouped, layer_ids
from kvctl.connector.layouts import chunk_fmt
from kvctl.connector.ownership import ChunkParts
from kvctl.connector.settings import ConnectorConfigError, ConnectorSettings, parse_settings
from kvctl.connector.sparse_mla import SparseGroup, flattened_sparse_group, sparse_format, sparse_group

from .vllm_meta import shard_group

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["ConnectorSpec", "build_spec", "check_scheduler_copy", "key_model_name", "spec_from_vllm", "stand_in_config"]


@dataclass(frozen=True)
class ConnectorSpec:
    """One connector's description, the same on the scheduler and on every worker of an engine."""

    settings: ConnectorSettings  # kv_connector_extra_config, parsed
    group_kind: str  # the vLLM group the chunks are sharded over: "tp" or "pcp"
    world_size: int  # W, that group's size
    block_size: int  # vLLM's, tokens a block
    model_name: str  # as the keys cover it (key_model_name)
    use_mla: bool
    cache_dtype: str  # vLLM's --kv-cache-dtype
    async_scheduling: bool  # vLLM's scheduler_config.async_scheduling
    kv_cache_config: Any  # vLLM's KVCacheConfig (one group), or a stand-in outside an engine
    kv_cache_spec: Any  # the group's spec (head_size, num_kv_heads, dtype; a sparse-MLA group's kv_cache_specs)
    layer_names: tuple[str, ...]  # the group's layers, in vLLM's order
    sparse: SparseGroup | None  # MLA with a sparse-attention indexer: the group's two kinds of layers
    sparse_parts: ChunkParts | None  # a sparse-MLA chunk's two parts, before any grouping by layers
    fmt: str  # the chunk format, part of every key
    grouping: Grouping  # what the tier holds of a chunk: one value, or one per part and group of layers
    chunk_bytes: int  # a whole chunk, every rank's share of it: what a hit moves per chunk
    graph_tokens: int = 0  # vLLM's largest CUDA graph, in tokens (max_cudagraph_capture_size; 0: eager, no graphs)
    # vLLM's workers run Model Runner V2 (its default on CUDA): a request rewound after a short load on the step
    # path keeps its old position on the GPU there (vllm#49250), so sync loads take the receive path (settings)
    v2_runner: bool = False
    step_budget: int = 0  # vLLM's token budget a step (scheduler_config.max_num_batched_tokens; 0: not known)

    @property
    def chunk_tokens(self) -> int:
        return self.settings.chunk_tokens

    @property
    def parts(self) -> ChunkParts | None:
        return self.grouping.parts


def key_model_name(vllm_config: "VllmConfig") -> str:
    """The model name the chunk keys cover: the first name vLLM serves the model under, else its path.

    Given whole: :func:`kvctl.connector.ownership.chunk_keys` escapes it injectively (a name that a lossy
    mapping folded, ``llama@prod`` into ``llama_prod``, shared every chunk with the other engine). Both roles
    take it from the same config through this function, so the scheduler looks up what the workers store.
    """
    mc = vllm_config.model_config
    served = getattr(mc, "served_model_name", None)
    if isinstance(served, (list, tuple)):  # vLLM keeps the first of several --served-model-name
        served = served[0] if served else None
    return str(served or mc.model)


def spec_from_vllm(vllm_config: "VllmConfig", kv_cache_config: Any) -> ConnectorSpec:
    """The spec of a connector vLLM builds (either role), from its config."""
    kind, world_size = shard_group(vllm_config.parallel_config)
    scheduler_config = getattr(vllm_config, "scheduler_config", None)
    return build_spec(vllm_config.kv_transfer_config.kv_connector_extra_config, group_kind=kind,
                      world_size=world_size, kv_cache_config=kv_cache_config,
                      block_size=vllm_config.cache_config.block_size, use_mla=bool(vllm_config.model_config.use_mla),
                      model_name=key_model_name(vllm_config), cache_dtype=str(vllm_config.cache_config.cache_dtype),
                      async_scheduling=getattr(scheduler_config, "async_scheduling", False) is True,
                      graph_tokens=graph_tokens(vllm_config),
                      v2_runner=getattr(vllm_config, "use_v2_model_runner", False) is True,
                      step_budget=_int_or_0(getattr(scheduler_config, "max_num_batched_tokens", 0)))


def _int_or_0(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def graph_tokens(vllm_config: "VllmConfig") -> int:
    """The most tokens a step vLLM runs as a CUDA graph: ``max_cudagraph_capture_size``, which vLLM sets to 0 when
    it captures none (eager, or CPU); a step above it runs the model op by op (Calibration fits what that costs)."""
    cc = getattr(vllm_config, "compilation_config", None)
    if getattr(getattr(cc, "cudagraph_mode", None), "name", "") == "NONE":
        return 0
    size = getattr(cc, "max_cudagraph_capture_size", 0)
    return int(size) if isinstance(size, int) and size > 0 else 0


def build_spec(extra_config: Any, *, group_kind: str, world_size: int, kv_cache_config: Any, block_size: int,
               use_mla: bool, model_name: str, cache_dtype: str = "auto",
               async_scheduling: bool = False, graph_tokens: int = 0, v2_runner: bool = False,
               step_budget: int = 0) -> ConnectorSpec:
    """The spec from its parts; refuses what the connector cannot store, each with one clear message."""
    settings = parse_settings(extra_config, world_size)
    ct = settings.chunk_tokens
    if ct % block_size:
        raise ConnectorConfigError(
            f"kv_connector_extra_config.chunk_tokens: {ct} is not a multiple of vLLM's block size {block_size}")
    if len(kv_cache_config.kv_cache_groups) != 1:
        raise ConnectorConfigError(
            f"KvctlConnector: models with several KV cache groups ({len(kv_cache_config.kv_cache_groups)}: hybrid "
            "attention, e.g. sliding window beside full attention, or HiSparse) are not supported (docs/gpu.md, "
            "Supported layouts)")
    group = kv_cache_config.kv_cache_groups[0]
    spec, names = group.kv_cache_spec, tuple(group.layer_names)
    # MLA with a sparse-attention indexer: one group of two kinds of layers, a chunk of two parts
    # (kvctl.connector.sparse_mla); the worker reads both specs, vLLM's scheduler holds one of them and
    # the group's placement (flattened_sparse_group): both must come to the same format
    tensors = getattr(kv_cache_config, "kv_cache_tensors", None) or []
    sparse = sparse_group(spec, names) or flattened_sparse_group(spec, names, tensors)
    sparse_parts = None
    if sparse is not None:
        if not use_mla:
            raise ConnectorConfigError("KvctlConnector: a sparse-MLA KV cache group in a model vLLM runs without MLA")
        fmt, sparse_parts = sparse_format(sparse, ct, cache_dtype)
        chunk_bytes = sparse_parts.nbytes  # the latent rows and the indexer's keys: what a hit moves
        lat, idx = sparse_parts.sizes
        n_lat, n_idx = len(sparse.latent_names), len(sparse.indexer_names)
        planes = [Plane(sparse_parts.names[0], n_lat, lat // (n_lat * ct), layer_ids(sparse.latent_names)),
                  Plane(sparse_parts.names[1], n_idx, idx // (n_idx * ct), layer_ids(sparse.indexer_names))]
    else:
        fmt = chunk_fmt(spec, len(names), world_size, use_mla, cache_dtype)
        elem = torch.empty((), dtype=spec.dtype).element_size()
        per_tok = spec.head_size if use_mla else 2 * spec.num_kv_heads * world_size * spec.head_size
        chunk_bytes = len(names) * per_tok * elem * ct
        planes = [Plane("", len(names), chunk_bytes // (len(names) * ct))]
    # both roles build the grouping from the same description, so the scheduler looks up the values the workers store
    return ConnectorSpec(settings, group_kind, world_size, block_size, model_name, use_mla, cache_dtype,
                         async_scheduling, kv_cache_config, spec, names, sparse, sparse_parts, fmt,
                         grouped(planes, ct, settings.layer_groups), chunk_bytes, graph_tokens, v2_runner, step_budget)


def stand_in_config(layer_names, spec) -> SimpleNamespace:
    """A KVCacheConfig of one group of ``layer_names`` and ``spec``, for a connector outside an engine."""
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=list(layer_names), kv_cache_spec=spec)])


def check_scheduler_copy(spec: ConnectorSpec) -> None:
    """Refuse a sparse-MLA worker unless the scheduler's copy of its config keys the chunks it stores.

    vLLM's scheduler gets ``generate_scheduler_kv_cache_config`` of the
    workers' configs (one spec for a group of several); run the same on
    this worker's config and derive the format from it as the scheduler
    will. Where they differed, every lookup missed what the worker saved."""
    kv_cache_config = spec.kv_cache_config
    if spec.sparse is None or not getattr(kv_cache_config, "kv_cache_tensors", None):
        return  # not sparse, or a config built outside vLLM (without_engine): no placement to flatten
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config

    flat = generate_scheduler_kv_cache_config([kv_cache_config])
    g = flat.kv_cache_groups[0]
    try:
        seen = sparse_group(g.kv_cache_spec, g.layer_names) or flattened_sparse_group(
            g.kv_cache_spec, g.layer_names, flat.kv_cache_tensors)
        theirs = sparse_format(seen, spec.chunk_tokens, spec.cache_dtype)[0] if seen is not None else None
        why = ""
    except ConnectorConfigError as exc:
        theirs, why = None, f" ({exc})"
    if theirs != spec.fmt:
        raise ConnectorConfigError(
            f"KvctlConnector: the scheduler's copy of vLLM's KV cache config gives chunk format {theirs}{why}, "
            f"this worker stores {spec.fmt}: every lookup would miss (docs/gpu.md, MLA with a sparse-attention "
            "indexer)")
