"""KvctlConnector's scheduler side: lookups of the tier, load and save planning (see :mod:`kvctl.plugins.vllm`).

The half :class:`kvctl.plugins.vllm.KvctlConnector` (the facade vLLM loads) builds for the scheduler role and
forwards vLLM's scheduler calls to, from the connector's spec (:mod:`kvctl.plugins.vllm_spec`: settings, chunk
tokens, format, parts); it shares the spec, the counters and the trace with the facade, nothing else, and holds
the scheduler's state: the tier lookup, the requests it follows and the loads it has planned. Nothing here
touches a KV cache; the workers load and save (:mod:`kvctl.plugins.vllm_worker`).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.logger import init_logger

from kvctl.connector import metric_names as M
from kvctl.connector.lookup import LookupCache, TierLookup, loadable_chunks
from kvctl.connector.trace import Trace

from .vllm_keys import request_key_extra
from .vllm_meta import KvctlConnectorMetadata, LoadSpec, SaveSpec, ReqState
from .vllm_policy import SchedulerPolicy, chunk0_tags
from .vllm_spec import ConnectorSpec
from .vllm_stats import KvctlConnectorStats, StatsCollector

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["SchedulerSide"]

logger = init_logger("vllm.kvctl.plugins.vllm")  # the facade's logger: one name in the engine's log

_POLL_S = 0.005  # how long one scheduler step waits for a background lookup


#: a wait longer than this is not a wait but another clock (an arrival_time that is not wall-clock time): unknown
MAX_LINE_WAIT_S = 3600.0


def line_wait(request: "Request", now: float | None = None) -> float:
    """How long ``request`` has waited since it reached vLLM (its ``arrival_time``, wall clock, set where the engine
    took it in): asked at the head of vLLM's waiting line, that is how long the line is (0 where unknown)."""
    arrived = getattr(request, "arrival_time", None)
    if not isinstance(arrived, (int, float)) or isinstance(arrived, bool) or arrived <= 0:
        return 0.0
    wait = (time.time() if now is None else now) - float(arrived)
    return wait if 0.0 < wait <= MAX_LINE_WAIT_S else 0.0


class SchedulerSide:
    """The scheduler role of KvctlConnector: built from the connector's spec, holding its own state."""

    def __init__(self, spec: ConnectorSpec, stats: StatsCollector, trace: Trace) -> None:
        self.spec, self.stats, self.trace = spec, stats, trace
        st = spec.settings
        # a sync load through vLLM's remote-receive state (connector/settings.py, SYNC_LOAD_PATHS): where vLLM
        # cannot take a short load back on its step path (async scheduling, Model Runner V2: vllm#49250)
        self.step_unsafe = spec.async_scheduling or spec.v2_runner
        self.sync_via_receive = not st.async_loading and (
            st.sync_load_path == "receive" or (st.sync_load_path == "auto" and self.step_unsafe))
        # parts: a sparse-MLA chunk is a hit only when its latent and its indexer part are both in the tier
        self.lookup = TierLookup(st.rank_urls, spec.chunk_tokens, spec.model_name, spec.fmt, st.timeout_s,
                                 parts=spec.parts)
        self.requests: dict[str, ReqState] = {}  # the requests scheduled and not finished
        self._pending_loads: list[LoadSpec] = []
        self._local_hit: dict[str, int] = {}  # req -> local computed tokens seen by the last lookup
        self.sync_answers = LookupCache(st.timeout_s)  # a waiting request's answer, reused step after step
        self._async_lookups: dict[str, tuple[Future, float, int]] = {}
        # req -> its extra key material (LoRA, cache_salt, mm inputs: plugins/vllm_keys.py), built once from
        # vLLM's Request; a request never seen with its Request (so its cache_salt is unknown) is not saved
        self._extras: dict[str, Any] = {}
        self._in_tier: dict[str, int] = {}  # req -> chunks its lookup found in the tier (its save starts there)
        self._loaded: dict[str, int] = {}  # req -> its num_preemptions when a load of it was planned
        # outer async lookups get their own threads: they wait on the lookup pool's per-rank EXISTS tasks
        self._async_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvctl-async-lookup")
        # load or recompute (kvctl.plugins.vllm_policy): a whole chunk, all of it on its owner, is what a hit
        # moves per chunk (spec.chunk_bytes counts every rank's heads)
        self.policy = SchedulerPolicy(st.load_policy, world=spec.world_size, chunk_tokens=spec.chunk_tokens,
                                      chunk_bytes=spec.chunk_bytes, async_loading=st.async_loading,
                                      timeout_s=st.timeout_s, stats=self.stats, trace=self.trace,
                                      hit_step=st.async_loading or self.sync_via_receive,
                                      graph_tokens=spec.graph_tokens, step_budget=spec.step_budget)
        self._step = 0

    def log_start(self, shutdown_timeout: float | None) -> None:
        """The engine's log at start: what the scheduler keys, how sync loads go, and a grace too short for saves."""
        spec, st = self.spec, self.spec.settings
        # the worker logs its own format; the two must agree, or every lookup misses what the worker saved
        logger.info("KvctlConnector scheduler: model %s, fmt %s%s", spec.model_name, spec.fmt,
                    f", parts {spec.parts.names} of {spec.parts.sizes} bytes" if spec.parts is not None else "")
        if not st.async_loading:
            why = ", ".join(w for w, on in (("vLLM's async scheduling is on", spec.async_scheduling),
                                             ("vLLM's workers run Model Runner V2", spec.v2_runner)) if on)
            if self.sync_via_receive:
                logger.info("KvctlConnector: sync loads go through vLLM's remote-receive state (sync_load_path=%s%s): "
                            "a hit waits one step while the worker loads it, a short load is settled before the "
                            "request is scheduled", st.sync_load_path, f", {why}" if why else "")
                if st.layer_groups > 1:  # the values stay grouped (the keys), the overlap needs the step path
                    logger.warning("KvctlConnector: layer_groups=%d, but a hit loads layer by layer only on vLLM's step "
                                   "path: here each hit loads before its step. sync_load_path: step turns the overlap "
                                   "on%s", st.layer_groups,
                                   f", where a load that comes up short ends the engine core ({why}: vllm#49250, "
                                   "docs/gpu.md, Async scheduling)" if why else "")
            elif self.step_unsafe:
                logger.warning("KvctlConnector: sync_load_path=step while %s: a load that comes up short (an evicted "
                               "chunk, a dead instance) ended vLLM 0.32's engine core on an H200 and an H100 (vLLM "
                               "rewinds the request on the host only, vllm#49250; docs/gpu.md, Async scheduling); use "
                               "sync_load_path auto or receive", why)
        if shutdown_timeout is not None and shutdown_timeout < st.save_drain_s + 1:
            # vLLM's process manager kills the engine core `shutdown_timeout` s after SIGTERM (0: at once),
            # and the workers with it: the connector's drain of pending saves never runs
            logger.warning("KvctlConnector: vLLM's --shutdown-timeout is %s s: on SIGTERM the workers are killed before "
                           "saves still pending are written (save_drain_s=%g); start vLLM with --shutdown-timeout %d "
                           "to let them finish", shutdown_timeout, st.save_drain_s, int(st.save_drain_s) + 1)

    def _hit_tokens(self, request: "Request", num_computed_tokens: int, result) -> int:
        rid, prompt_len = request.request_id, len(request.prompt_token_ids or [])
        if result.failed_ranks:
            self.stats.add("kvctl:lookup_timeouts", 1)
            logger.warning("KvctlConnector: lookup of %s: rank(s) %s erred or timed out: recompute",
                           rid, list(result.failed_ranks))
            self.policy.waiting(rid, prompt_len - num_computed_tokens)
            return 0
        if result.hit_chunks * self.spec.chunk_tokens <= num_computed_tokens:
            self.policy.waiting(rid, prompt_len - num_computed_tokens)
            return 0
        # what the tier holds of it: a hit the decision recomputes whole is not saved again (each 16k hit recomputed
        # on the H100, 2026-12-06, sent its 494 MB back through the links the tier's loads needed)
        self._in_tier[rid] = result.hit_chunks
        running = self._running_left() if self.spec.settings.async_loading else 0
        return self.policy.judge(rid, prompt_len, num_computed_tokens, result.hit_chunks, running,
                                 line_wait(request), others_running=bool(self.requests)).tokens

    def _running_left(self) -> int:
        """Prompt tokens the scheduled requests still have to compute (the prefill queue an async load waits by)."""
        return sum(max(0, len(st.prompt) - st.computed) for st in self.requests.values())

    def _timed_lookup(self, rid: str, prompt: list[int], first: int, vector: bool, extra):
        """One lookup of the tier, counted (kvctl:lookups, kvctl:lookup_seconds) and traced."""
        t0 = time.perf_counter()
        result = self.lookup.lookup(prompt, first, vector, extra)
        dt = time.perf_counter() - t0
        self.stats.add(M.LOOKUPS, 1)
        self.stats.add(M.LOOKUP_SECONDS, dt)
        if self.trace.on:
            self.trace.event("lookup", req=rid, s=dt, first_chunk=first, hit_chunks=result.hit_chunks,
                             failed=list(result.failed_ranks), tokens=len(prompt), chunk_tokens=self.spec.chunk_tokens,
                             **chunk0_tags(prompt, self.spec.chunk_tokens, self.spec.model_name, self.spec.fmt, extra,
                                           self.spec.parts))
        return result

    def _key_extra(self, request: "Request"):
        """The request's :class:`~kvctl.connector.ownership.KeyExtra` (None: tokens only), built once."""
        rid = request.request_id
        if rid not in self._extras:
            self._extras[rid] = request_key_extra(request, self.spec.chunk_tokens)
        return self._extras[rid]

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        # every request asked counts for the engine's arrival rate (the line's credit), whether or not it can hit
        self.policy.arrivals.arrived(request.request_id, getattr(request, "arrival_time", None))
        prompt = list(request.prompt_token_ids or [])
        first = num_computed_tokens // self.spec.chunk_tokens
        if loadable_chunks(len(prompt), self.spec.chunk_tokens) <= first:
            return 0, False
        rid = request.request_id
        if self._loaded.get(rid, -1) == getattr(request, "num_preemptions", 0):
            # vLLM asks again about a request whose load this connector planned and nothing of which was valid
            # (vLLM frees its blocks and asks anew): the load came up short (given up at its deadline, a chunk
            # gone, an instance down), so the request is recomputed, not loaded again. On an H100 (2026-12-06)
            # 25 of 40 requests were loaded again, up to 10 times, each time waiting out its deadline.
            # A preempted request (num_preemptions grew) may load again.
            self.policy.waiting(rid, len(prompt) - num_computed_tokens)
            if self.trace.on:
                self.trace.event("reload_refused", req=rid, computed=num_computed_tokens, tokens=len(prompt))
            return 0, False
        extra = self._key_extra(request)
        self._local_hit[rid] = num_computed_tokens
        if not self.spec.settings.async_loading:
            n_tokens = getattr(request, "num_tokens", len(prompt))
            result = self.sync_answers.get(rid, n_tokens, first)
            if result is None:
                result = self._timed_lookup(rid, prompt, first, False, extra)
                self.sync_answers.put(rid, n_tokens, result)
            ext = self._hit_tokens(request, num_computed_tokens, result)
            # the "receive" path: vLLM parks the request for one step while the worker loads it in that step
            return ext, ext > 0 and self.sync_via_receive
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
            if time.monotonic() - started < self.spec.settings.timeout_s * 2:
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
        rid, ct = request.request_id, self.spec.chunk_tokens
        self._async_lookups.pop(rid, None)
        self.sync_answers.drop(rid)
        extra = self._key_extra(request)  # recorded for its save, whether or not it was looked up
        local = self._local_hit.pop(rid, None)
        if local is None:
            return
        prompt = list(request.prompt_token_ids or [])
        loadable = loadable_chunks(len(prompt), ct) - local // ct
        hit = num_external_tokens // ct if num_external_tokens else 0
        if request.num_preemptions == 0:
            self.stats.add("kvctl:chunks_hit", hit)
            self.stats.add("kvctl:chunks_missed", max(0, loadable - hit))
            self.stats.add("kvctl:remote_hit_tokens", num_external_tokens)
        end = local + num_external_tokens
        report_done = self.spec.settings.async_loading or self.sync_via_receive
        decision = self.policy.scheduled(rid, local // ct, end // ct, num_external_tokens,
                                         report_done, request.num_preemptions == 0)
        if num_external_tokens <= 0:
            return
        # a load is planned: what it writes decides where the save starts (the worker's loaded_end), so a chunk that
        # went between lookup and load is saved again after its recompute
        self._in_tier.pop(rid, None)
        self._loaded[rid] = request.num_preemptions
        self._pending_loads.append(LoadSpec(
            req_id=rid,
            token_ids=prompt[:end],
            first_chunk=local // ct,
            end_chunk=end // ct,
            skip_tokens=local,
            block_ids=list(blocks.get_block_ids()[0]),
            is_async=self.spec.settings.async_loading,
            key_extra=extra,
            report_done=report_done,
            budget_s=decision.budget_s if decision is not None else None,
        ))

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        self._step += 1
        meta = KvctlConnectorMetadata(loads=self._pending_loads, step=self._step)
        for spec in self._pending_loads:
            self.policy.shipped(spec.req_id)
            self.trace.event("scheduled_load", req=spec.req_id, chunks=spec.end_chunk - spec.first_chunk,
                             asynchronous=spec.is_async, step=self._step, budget_s=spec.budget_s)
        self._pending_loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        meta.step_tokens = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or sum(scheduled.values()))
        for new in scheduler_output.scheduled_new_reqs:
            st = ReqState(list(new.prompt_token_ids or []), list(new.block_ids[0]),
                           key_extra=self._extras.get(new.req_id))
            if new.req_id not in self._extras:
                st.saved = True  # its Request (cache_salt) never reached this side: storing it could mix tenants
            st.in_tier = self._in_tier.pop(new.req_id, 0)
            self.requests[new.req_id] = st
            self._advance(meta, new.req_id, st, new.num_computed_tokens, scheduled.get(new.req_id, 0))
            self._maybe_save(meta, new.req_id, st, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self.requests.get(rid)
            if st is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                st.block_ids = list(new_blocks[0]) if new_blocks is not None else []
            elif new_blocks is not None:
                st.block_ids.extend(new_blocks[0])
            self._advance(meta, rid, st, cached.num_computed_tokens[i], scheduled.get(rid, 0))
            self._maybe_save(meta, rid, st, cached.num_computed_tokens[i] + scheduled.get(rid, 0))
        for rid in scheduler_output.finished_req_ids:
            self._forget(rid)
        return meta

    def _advance(self, meta: KvctlConnectorMetadata, rid: str, st: ReqState, computed: int, scheduled: int) -> None:
        """This step's prompt tokens of the request (the step's prefill, which the workers time) and where it stands."""
        prompt = len(st.prompt)
        meta.prefill_tokens += max(0, min(scheduled, prompt - computed))
        st.computed = computed + scheduled
        if computed < prompt <= st.computed and self.trace.on:
            self.trace.event("prefill_done", req=rid, step=self._step, tokens=prompt)

    def _maybe_save(self, meta: KvctlConnectorMetadata, rid: str, st: ReqState, computed_after_step: int) -> None:
        n_full = len(st.prompt) // self.spec.chunk_tokens
        if st.saved or n_full == 0 or computed_after_step < len(st.prompt):
            return
        st.saved = True
        meta.saves.append(SaveSpec(rid, st.prompt[: n_full * self.spec.chunk_tokens],
                                   st.block_ids[: -(-n_full * self.spec.chunk_tokens // self.spec.block_size)],
                                   key_extra=st.key_extra, first_chunk=min(st.in_tier, n_full)))

    def _forget(self, rid: str) -> None:
        self.policy.forget(rid)
        self.requests.pop(rid, None)
        self._local_hit.pop(rid, None)
        self._extras.pop(rid, None)
        self._in_tier.pop(rid, None)
        self._loaded.pop(rid, None)
        self.sync_answers.drop(rid)
        entry = self._async_lookups.pop(rid, None)
        if entry is not None:
            entry[0].cancel()

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._forget(request.request_id)
        return False, None

    def update_connector_output(self, connector_output) -> None:
        self.policy.on_output(connector_output)

    def get_kv_connector_stats(self) -> KvctlConnectorStats | None:
        return self.stats.take()

    def shutdown(self) -> None:
        self._async_pool.shutdown(wait=False, cancel_futures=True)
        self.lookup.close()
