"""KvctlConnector's worker side: the paged caches, loads and saves on one rank (see :mod:`kvctl.plugins.vllm`).

The half :class:`kvctl.plugins.vllm.KvctlConnector` (the facade vLLM loads) builds for the worker role and forwards
vLLM's worker calls to, from the connector's spec (:mod:`kvctl.plugins.vllm_spec`); it shares the spec, the counters
and the trace with the facade, nothing else. It reads the engine's caches and groups, builds the rank's
:class:`~kvctl.connector.store.ShardedStore` and :class:`~kvctl.connector.datapath.KVDataPath`, runs the agreed-prefix
loads the scheduler planned (on the step's thread or the async loader's) and hands saves to the background saver.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from vllm.logger import init_logger

from kvctl.connector import metric_names as M
from kvctl.connector.datapath import KVDataPath, LoadOutcome
from kvctl.connector.layouts import KVLayoutError
from kvctl.connector.pinned import PinnedPool
from kvctl.connector.policy import DEADLINE, GIVEN_UP
from kvctl.connector.protocol import member_group
from kvctl.connector.saver import Saver
from kvctl.connector.settings import ConnectorConfigError
from kvctl.connector.store import ShardedStore
from kvctl.connector.switch import lowered
from kvctl.connector.trace import Trace

from .hooks import hook_from_env
from .vllm_caches import CacheReading, read_layout
from .vllm_layered import LayeredLoads
from .vllm_meta import KvctlConnectorMetadata, LoadSpec, SaveSpec
from .vllm_policy import chunk0_tags
from .vllm_spec import ConnectorSpec, check_scheduler_copy
from .vllm_stats import KvctlConnectorStats, StatsCollector
from .vllm_timing import StepTimer, count_load, trace_inserts

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext

__all__ = ["BEFORE_LOAD_HOOK_ENV", "WorkerSide"]

logger = init_logger("vllm.kvctl.plugins.vllm")  # the facade's logger: one name in the engine's log

_POLL_S = 0.005  # how long one worker step waits for a background load
# test hook: "module:function", called on every rank as fn(rank, keys, first_chunk, url) just
# before a load fetches its chunks (tests delete a chunk there, between lookup and load); url: the
# rank's first instance, credentials included
BEFORE_LOAD_HOOK_ENV = "KVCTL_CONNECTOR_BEFORE_LOAD_HOOK"


class WorkerSide:
    """The worker role of KvctlConnector on one rank: built from the connector's spec, holding its own state.

    ``reading``: how the engine's caches are read (:mod:`kvctl.plugins.vllm_caches`); ``coordinator`` stands
    for vLLM's group coordinator of the shard group (None: vLLM's own TP or PCP group).
    """

    def __init__(self, spec: ConnectorSpec, stats: StatsCollector, trace: Trace, reading: CacheReading,
                 coordinator: Any = None) -> None:
        check_scheduler_copy(spec)
        self.spec, self.stats, self.trace = spec, stats, trace
        self.reading, self.coordinator = reading, coordinator
        # the rank's store, layout, data path and groups: built by register_kv_caches
        self.store: ShardedStore | None = None
        self.layout = self.datapath = self.group = self._meta_group = self._async_meta_group = None
        self.rank = 0
        self._get_seen = (0, 0.0)  # the store's GET bytes and seconds counted so far
        self._load_errors: set[int] = set()
        self.loaded_end: dict[str, int] = {}  # req -> where its save starts (_settle; identical on every rank)
        self._finished_recving: set[str] = set()
        self._async_pending = 0  # async loads queued or running
        self._lock = threading.Lock()
        self._load_done = threading.Condition(self._lock)
        # bounded: extracted chunks are device memory on CUDA, outside vLLM's KV-cache sizing (save_queue_bytes)
        self.saver = Saver(self._store_chunks, name="kvctl-save", max_bytes=spec.settings.save_queue_bytes)
        self._drop_logged = False
        self._insert_events: list = []  # (start, end, req) of queued inserts, timed once they ran (trace only)
        self._pending_reported = False
        self._async_q: queue.SimpleQueue | None = None
        self._async_thread: threading.Thread | None = None
        self._async_stream = None  # the loader's CUDA stream (async loading on CUDA)
        self._async_group = None
        self._layered: LayeredLoads | None = None  # this step's sync hits loaded layer by layer
        self._steps = StepTimer(False)  # rank 0 times the steps with prefill (register_kv_caches turns it on)
        self._late_warned = False
        self._hook = hook_from_env(BEFORE_LOAD_HOOK_ENV)

    def _shard_group(self):
        if self.coordinator is not None:
            return self.coordinator
        from vllm.distributed import parallel_state as ps

        return ps.get_pcp_group() if self.spec.group_kind == "pcp" else ps.get_tp_group()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        spec = self.spec
        self.layout, layout, backend = read_layout(spec, self.reading, kv_caches)
        if self.layout.mla != spec.use_mla or self.layout.fmt(spec.world_size) != spec.fmt:
            raise KVLayoutError(f"KvctlConnector: backend {backend}, layout {layout}: chunks of "
                                f"{self.layout.fmt(spec.world_size)}, the scheduler keys {spec.fmt} "
                                f"(use_mla={spec.use_mla})")
        group = self._shard_group()
        self.rank = group.rank_in_group
        if group.world_size != spec.world_size:
            raise RuntimeError(f"KvctlConnector: shard group has {group.world_size} ranks, expected {spec.world_size}")
        device = self.layout.device
        on_cuda = device.type == "cuda"
        st = spec.settings
        k = st.instances_per_rank
        # CPU engines exchange host chunks over gloo; CUDA engines exchange device chunks over the
        # group's device (NCCL) group, with replies and saves going through one pinned pool, and the
        # protocol's 64-byte message over the group's gloo group (no device round trip)
        self.group = group.device_group if on_cuda else group.cpu_group
        self._meta_group = group.cpu_group if on_cuda and spec.world_size > 1 else None
        chunk_shape = self.layout.chunk_shape(spec.chunk_tokens, spec.world_size)
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
            self.rank, spec.world_size, [list(r) for r in st.rank_urls], st.host_budget_bytes,
            chunk_shape, self.layout.dtype,
            chunk_tokens=spec.chunk_tokens, model_name=spec.model_name, fmt=spec.fmt,
            group=self.group, device=device, timeout_s=st.timeout_s, pool=pool,
            instances_per_rank=k, connections=st.connections_per_instance, parts=spec.parts,
        )
        self.datapath = KVDataPath(self.store, self.layout, chunk_tokens=spec.chunk_tokens,
                                   block_size=spec.block_size, group=self.group, device=device,
                                   grouping=spec.grouping)
        latent = spec.sparse.latent_names if spec.sparse is not None else spec.layer_names
        unhooked = self.reading.without_layer_hooks(latent) if self.datapath.pipelined else []
        self._layered = LayeredLoads(self.datapath, latent, sparse=spec.sparse is not None, hooked=not unhooked,
                                     switch_ms=st.layered_switch_ms)
        if unhooked and self.rank == 0:
            logger.warning("KvctlConnector: layer_groups %d, but vLLM calls no wait_for_layer_load before %d of the "
                           "%d attention layers (%s first): hits load before the forward (values stay one per group)",
                           len(spec.grouping.units), len(unhooked), len(latent), unhooked[0])
        self._steps = StepTimer(self.rank == 0, device, self.trace, spec.graph_tokens)
        if st.async_loading:
            if spec.world_size > 1:
                # background loads run their collectives on groups of their own, never on vLLM's; only
                # this TP/PCP group's ranks create them (under DP the world holds several such groups)
                t0 = time.perf_counter()
                self._async_group = member_group(group.ranks, backend="nccl" if on_cuda else "gloo")
                if self._meta_group is not None:
                    self._async_meta_group = member_group(group.ranks, backend="gloo")
                logger.info("KvctlConnector rank %d: async load group(s) of %d rank(s) in %.3f s", self.rank,
                            spec.world_size, time.perf_counter() - t0)
            else:
                self._async_group = self.group  # one rank runs no collective: no group of its own needed
            self._async_q = queue.SimpleQueue()
            # the loader's own CUDA stream (docs/connector.md, "the loader")
            self._async_stream = torch.cuda.Stream(device) if on_cuda else None
            self._async_thread = threading.Thread(target=self._async_loop, name="kvctl-async-load", daemon=True)
            self._async_thread.start()
        self._warm_up(on_cuda)
        lanes = getattr(self.store, "lanes_per_instance", None)
        logger.info("KvctlConnector rank %d/%d: %s, model %s, fmt %s, chunk %d tokens (%d bytes), %s loading%s",
                    self.rank, spec.world_size, self.store.url, spec.model_name, spec.fmt, spec.chunk_tokens,
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
        if self.spec.world_size > 1 and on_cuda:
            for g in (self.group, self._meta_group, self._async_group, self._async_meta_group):
                if g is None:
                    continue
                dev = self.store.device if torch.distributed.get_backend(g) == "nccl" else torch.device("cpu")
                t = torch.zeros(self.spec.world_size, dtype=torch.int64, device=dev)
                torch.distributed.all_gather_into_tensor(t, torch.zeros(1, dtype=torch.int64, device=dev), group=g)
            torch.cuda.synchronize(self.store.device)
        n = self.store.tier.k if self.store.tier is not None else 0
        logger.info("KvctlConnector rank %d: warm-up in %.3f s (%d of %d instance(s) answered)", self.rank,
                    time.perf_counter() - t0, n - len(down), n)

    # -- load ----------------------------------------------------------------
    def bind_connector_metadata(self, connector_metadata) -> None:
        """The step's metadata is bound, just before its forward."""
        if isinstance(connector_metadata, KvctlConnectorMetadata):
            self._steps.begin(connector_metadata)  # before the step's forward (kvctl.plugins.vllm_timing)

    def start_load_kv(self, meta: KvctlConnectorMetadata, forward_context: "ForwardContext | None") -> None:
        """Start the step's loads: async ones on the loader, sync ones now or layer by layer in the forward."""
        assert isinstance(meta, KvctlConnectorMetadata)
        # layer by layer only where this step's forward calls the attention hooks: a FULL CUDA graph replay
        # (and a step with no forward) has no attention metadata and runs no hook, so it loads first
        layered = self._layered is not None and self._layered.on and \
            getattr(forward_context, "attn_metadata", None) is not None
        for spec in meta.loads:
            if spec.is_async and self._async_q is not None:
                # its budget (the predicted recompute time) bounds the prefetch from now, its wait in the queue
                # included: its lanes start no GET after it, and the rest of the hit is recomputed
                deadline = time.monotonic() + spec.budget_s if spec.budget_s is not None else None
                with self._lock:
                    self._async_pending += 1
                # the engine's work so far (a step may still write blocks freed to this request): the load's write
                # into the cache waits for it on the GPU, nothing of the load for the steps after it
                issued = torch.cuda.current_stream(self.store.device).record_event() \
                    if self._async_stream is not None else None
                self._async_q.put((spec, time.perf_counter(), deadline, issued))
            elif not spec.report_done and layered:
                self._start_pipelined(spec)
            elif not spec.report_done:
                out = self.load(spec, self.group, self._meta_group)
                if self.rank == 0 and out is not None and out.timing is not None:
                    self.stats.add(M.LOAD_WAIT_SECONDS, out.timing.total_s)
            else:  # a sync load vLLM waits for as a receive: loaded here, blocking the step, reported in get_finished
                t0 = time.perf_counter()
                try:
                    self.load(spec, self.group, self._meta_group)
                except BaseException as exc:  # noqa: BLE001 - the request must leave vLLM's receive state either way
                    self._mark_unloaded(spec)
                    logger.exception("KvctlConnector: load of %s interrupted: it is recomputed", spec.req_id)
                    if not isinstance(exc, Exception):
                        raise  # a shutdown's interrupt goes on
                finally:
                    if self.rank == 0:
                        self.stats.add(M.LOAD_WAIT_SECONDS, time.perf_counter() - t0)
                    with self._lock:
                        self._finished_recving.add(spec.req_id)

    def _async_loop(self) -> None:
        while True:
            item = self._async_q.get()
            if item is None:
                return
            spec, queued, deadline, issued = item
            stream = self._async_stream  # None off CUDA: torch.cuda.stream(None) changes nothing
            try:
                # on the thread's default stream each load waited for the engine's step then running (an H100,
                # 2026-12-06: 0.21 s a load, even an empty one; 116 of 129 given up at their deadline)
                # GETs and copies start at once, the insert waits for `issued`; async_switch_ms: kvctl.connector.switch
                with torch.cuda.stream(stream), lowered(self.spec.settings.async_switch_ms):
                    self.load(spec, self._async_group, self._async_meta_group, deadline, queued, issued)
                if stream is not None:  # the insert ran on this stream: done before vLLM schedules the forward
                    stream.synchronize()
                if self.rank == 0:
                    self.stats.add(M.LOAD_WAIT_SECONDS, time.perf_counter() - queued)
            except BaseException:  # noqa: BLE001 - its blocks are marked bad; a dead loader would strand every later load
                self._mark_unloaded(spec)
                logger.exception("KvctlConnector: async load of %s interrupted", spec.req_id)
            finally:
                with self._lock:
                    self._finished_recving.add(spec.req_id)
                    self._async_pending -= 1
                    self._load_done.notify_all()

    def _spec_blocks(self, spec: LoadSpec, from_chunk: int) -> set[int]:
        """The blocks of ``spec``'s hit from chunk ``from_chunk`` on (never the locally computed ones before it)."""
        first_bad = max(from_chunk * self.spec.chunk_tokens, spec.skip_tokens) // self.spec.block_size
        return set(spec.block_ids[first_bad : spec.end_chunk * self.spec.chunk_tokens // self.spec.block_size])

    def _mark_unloaded(self, spec: LoadSpec) -> None:
        """A load that raised: whatever it wrote, the request's whole hit is reported failed (recomputed)."""
        with self._lock:
            self._load_errors |= self._spec_blocks(spec, spec.first_chunk)

    def _before_load(self, spec: LoadSpec) -> None:
        """The test hook (``KVCTL_CONNECTOR_BEFORE_LOAD_HOOK``), on every rank just before a load fetches."""
        store = self.store
        if self._hook is not None:
            try:
                self._hook(self.rank, store.keys(spec.token_ids, spec.key_extra), spec.first_chunk,
                           store.tier.urls[0] if store.tier is not None else None)
            except Exception:  # noqa: BLE001 - a test hook must not break the engine
                logger.exception("KvctlConnector before-load hook failed")

    def load(self, spec: LoadSpec, group, meta_group=None, deadline: float | None = None,
             queued: float | None = None, issued=None) -> LoadOutcome:
        """Agreed-prefix load of one request's hit into the paged cache (collective over ``group``).

        ``deadline`` (monotonic): no GET starts after it, on this rank; the ranks then agree on the chunks every
        one of them staged (a rank past it stages fewer, the exchange still runs: no collective is skipped).
        ``issued``: a CUDA event of the engine's work before the load; only the write into the cache waits for it.
        """
        self._before_load(spec)
        waited = time.perf_counter() - queued if queued is not None else 0.0
        # agreed: the same on every rank; prefix: chunks written into this rank's cache
        out = self.datapath.load(spec.token_ids, spec.block_ids, spec.first_chunk, spec.end_chunk, spec.skip_tokens,
                                 group=group, extra=spec.key_extra, meta_group=meta_group, deadline=deadline,
                                 before_insert=issued)
        given_up = deadline is not None and out.agreed < spec.end_chunk - spec.first_chunk and time.monotonic() >= deadline
        if given_up and self.rank == 0:
            self.stats.add(M.LOAD_DECISIONS, 1, GIVEN_UP, DEADLINE)
        return self._settle(spec, out, given_up=given_up, waited_s=waited)

    def _settle(self, spec: LoadSpec, out: LoadOutcome, given_up: bool = False, waited_s: float = 0.0,
                layered: bool = False) -> LoadOutcome:
        """A finished load's bookkeeping: counters, the agreed end for the save, failed blocks; re-raise an interrupt."""
        planned = spec.end_chunk - spec.first_chunk
        agreed, prefix, interrupted = out.agreed, out.written, out.interrupted
        self._insert_events = count_load(self.stats, self.trace, self.rank, self.spec.chunk_tokens, spec, out,
                                         self._insert_events, given_up=given_up, waited_s=waited_s, layered=layered)
        # every rank keeps the same mark (the agreed chunks are in the tier), so the request's save runs its collectives
        # on every rank or on none; an async load cut short at its budget keeps its hit's end: the lookup found the rest
        # in the tier (H100, 2026-12-07 third: 7 such loads re-saved 3.2 GB through the saturated tier's links)
        self.loaded_end[spec.req_id] = spec.end_chunk if spec.budget_s is not None else spec.first_chunk + agreed
        loaded_end = spec.first_chunk + prefix
        if prefix < planned:
            logger.log(logging.INFO if given_up else logging.WARNING,
                       "KvctlConnector rank %d: load of %s: %d of %d chunk(s) agreed, %d written%s: the rest is "
                       "recomputed", self.rank, spec.req_id, agreed, planned, prefix,
                       f" (given up at its deadline, {spec.budget_s:.3g} s)" if given_up else "")
            bad = self._spec_blocks(spec, loaded_end)
            with self._lock:
                self._load_errors |= bad
            if self.rank == 0 and not given_up:  # a give-up is counted as a decision (kvctl:load_decisions), not an error
                self.stats.add("kvctl:agreed_prefix_shortfall_chunks", planned - prefix)
                self.stats.add("kvctl:load_errors", 1)
        if interrupted is not None:
            raise interrupted
        return out

    # -- layer-by-layer sync loads (kvctl.plugins.vllm_layered) -------------------------
    def _start_pipelined(self, spec: LoadSpec) -> None:
        self._before_load(spec)
        try:
            self._layered.start(spec, group=self.group, meta_group=self._meta_group)
        except Exception:  # noqa: BLE001 - nothing started: the hit is recomputed
            logger.exception("KvctlConnector: starting the load of %s failed: it is recomputed", spec.req_id)
            self._mark_unloaded(spec)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._layered is not None:
            self._layered.wait(layer_name)

    def finish_forward(self) -> None:
        self._finish_pipes()

    def _finish_pipes(self) -> None:
        """Settle this step's layer-by-layer loads: the groups no layer asked for, counters, failed blocks."""
        interrupted = None
        for spec, pipe, out in (self._layered.finish() if self._layered is not None else []):
            if pipe.state.late_groups:
                self._layered.off()  # every rank alike: no layer asked on any of them
                if not self._late_warned:
                    self._late_warned = True
                    logger.warning("KvctlConnector rank %d: %d layer group(s) of %s were not asked for before their "
                                   "layers ran (no wait_for_layer_load): the hit is recomputed, and later hits load "
                                   "before the forward", self.rank, pipe.state.late_groups, spec.req_id)
            if self.rank == 0:
                self.stats.add(M.LOAD_WAIT_SECONDS, pipe.state.wait_s)
                self.stats.add(M.LAYERED_LOADS, 1)
            self.trace.event("load_layered", req=spec.req_id, rank=self.rank, groups=len(pipe.units),
                             wait_s=pipe.state.wait_s, late_groups=pipe.state.late_groups)
            try:
                self._settle(spec, out, layered=True)
            except BaseException as exc:  # noqa: BLE001 - an interrupt a group caught: the other loads settle first
                self._mark_unloaded(spec)
                interrupted = interrupted or exc
        if interrupted is not None:
            raise interrupted

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            bad, self._load_errors = self._load_errors, set()
        return bad

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        for rid in finished_req_ids:
            self.loaded_end.pop(rid, None)
        with self._lock:
            if self._async_pending and not self._finished_recving:
                # vLLM steps again at once while a request waits for its load: a short wait here
                # keeps that loop from starving the load thread of the GIL
                self._load_done.wait(timeout=_POLL_S)
            done, self._finished_recving = self._finished_recving, set()
        return None, (done or None)

    # -- save ----------------------------------------------------------------
    def wait_for_save(self, meta: KvctlConnectorMetadata | None) -> None:
        """After the step's forward: settle its layer-by-layer loads and queue its saves (``meta``: None unbound)."""
        self._steps.end()  # the step's forward is queued (CUDA) or done (CPU)
        self._finish_pipes()  # where the runner called no finish_forward
        if not isinstance(meta, KvctlConnectorMetadata):
            return
        for spec in meta.saves:
            self.save(spec)

    def save(self, spec: SaveSpec) -> None:
        """Copy ``spec``'s chunks out of the paged cache (collective) and queue them for the tier."""
        ct = self.spec.chunk_tokens
        n_full = len(spec.token_ids) // ct
        # loaded chunks are in the tier already, and so are those the lookup found where the decision recomputed them
        first = max(self.loaded_end.get(spec.req_id, 0), spec.first_chunk)
        if first >= n_full:
            return
        # copied out on this thread, before vLLM can reuse the blocks (GQA: a collective on every rank);
        # written to the tier in the background
        batch = self.datapath.extract(spec.token_ids, spec.block_ids, first, extra=spec.key_extra)
        if batch is None:
            return
        traced = self.trace.on and self.rank == 0 and first == 0  # chunk 0 is rank 0's (kvctl explain)
        if traced:  # before the submit: the saver's "save" event must come after it
            self.trace.event("save_queued", req=spec.req_id, chunks=n_full,
                             **chunk0_tags(spec.token_ids, ct, self.spec.model_name, self.spec.fmt, spec.key_extra,
                                           self.spec.parts))
        queued = self.saver.submit(batch, sum(t.nbytes for t in batch.chunks if t is not None))
        if queued == "full" and traced:
            self.trace.event("save_dropped", req=spec.req_id, pending_bytes=self.saver.pending_bytes)
        if queued == "closed":
            self.stats.add(M.SAVES_ABANDONED, 1)  # shutting down: no more saves
        elif queued == "full":  # the tier is behind the engine's saves: a future miss, never the engine's memory
            self.stats.add(M.SAVES_DROPPED, 1)
            if not self._drop_logged:
                self._drop_logged = True
                logger.warning("KvctlConnector rank %d: a save dropped: the saves waiting for the tier hold %d bytes "
                               "(save_queue_bytes %d); the tier is slower than this engine's saves "
                               "(kvctl:saves_dropped counts them; logged once)", self.rank, self.saver.pending_bytes,
                               self.spec.settings.save_queue_bytes)

    def _store_chunks(self, batch) -> None:
        t0 = time.perf_counter()
        try:
            res = self.datapath.store_batch(batch)
            if res.l2_error:
                self.stats.add(M.SAVE_ERRORS, 1)
                logger.warning("KvctlConnector rank %d: store failed: %s", self.rank, res.l2_error)
            else:
                self.stats.add(M.CHUNKS_STORED, res.l2_chunks)
            sp = self.spec
            tags = chunk0_tags(batch.token_ids, sp.chunk_tokens, sp.model_name, sp.fmt, batch.extra, sp.parts) \
                if self.trace.on and self.rank == 0 and batch.first == 0 else {}
            self.trace.event("save", rank=self.rank, chunks=res.l2_chunks, s=time.perf_counter() - t0,
                             error=res.l2_error, **tags)
        except Exception:  # noqa: BLE001 - a failed save is a future miss, never an engine error
            self.stats.add(M.SAVE_ERRORS, 1)
            logger.exception("KvctlConnector: store failed")

    def get_kv_connector_stats(self) -> KvctlConnectorStats | None:
        """The interval's counters: this rank's, folded into ``stats`` first, then taken."""
        if self._insert_events:
            self._insert_events = trace_inserts(self._insert_events, self.trace, self.rank)
        if self.store is not None:
            pending = self.saver.pending
            if pending or self._pending_reported:
                self.stats.set(M.SAVES_PENDING, pending)  # a backlog shows; once it clears, one 0 says so
                self._pending_reported = pending > 0
            b, s = self.store.l2_get_bytes, self.store.l2_get_seconds
            self.stats.add("kvctl:l2_get_bytes", b - self._get_seen[0])
            self.stats.add("kvctl:l2_get_seconds", s - self._get_seen[1])
            # and this rank's own: the bandwidth of its instances, for the load-or-recompute decision
            self.stats.add(M.RANK_GET_BYTES, b - self._get_seen[0], self.rank)
            self.stats.add(M.RANK_GET_SECONDS, s - self._get_seen[1], self.rank)
            self._get_seen = (b, s)
        self._steps.collect(self.stats, self.trace)
        return self.stats.take()

    def shutdown(self) -> None:
        if self._async_q is not None:
            self._async_q.put(None)
        pending = self.saver.pending
        res = self.saver.drain(self.spec.settings.save_drain_s)
        if res.abandoned:
            self.stats.add(M.SAVES_ABANDONED, res.abandoned)
            logger.warning("KvctlConnector rank %d: shutdown: %d save(s) written in %.2f s, %d abandoned after "
                           "save_drain_s=%g (their chunks will be misses)", self.rank, res.written, res.waited_s,
                           res.abandoned, self.spec.settings.save_drain_s)
        elif pending:
            logger.info("KvctlConnector rank %d: shutdown: %d pending save(s) written in %.2f s", self.rank,
                        res.written, res.waited_s)
        self.trace.event("shutdown", rank=self.rank, pending=pending, written=res.written, abandoned=res.abandoned)
        if self.store is not None:
            self.store.close()
            self.datapath.close()
        self.trace.close()
