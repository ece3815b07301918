"""Shard mode inside LMCache 0.5.6 for MLA under tensor parallelism (paper §5).

Stock LMCache stores MLA KV from rank 0 only and feeds the other ranks by a
broadcast (lmcache/v1/cache_engine.py:424-426, 881-892): one rank's Valkey
instance serves the whole prompt. In shard mode every rank is active:

* store: rank ``r`` keeps only chunks ``c`` with ``c % W == r`` (``c`` = the
  chunk's index in the prompt), under worker 0's key name, on its own instance;
* lookup: rank ``r`` answers ``a_r`` = the start token of the first chunk it
  owns that is missing (the prompt's end when none is); LMCache's scheduler
  takes the minimum over the lookup servers of all ranks, which is the longest
  stored prefix (§5.1);
* retrieve: every rank fetches its own chunks and runs
  :func:`kvctl.connector.protocol.load_agreed_prefix` over the TP group: all
  ranks load the same agreed prefix, shortened on every rank when one owner
  could not provide a chunk between lookup and load.

LMCache 0.5.6 has no hook for any of this (its remote connector never sees
chunk indexes, lmcache/v1/storage_backend/storage_manager.py:994-1008), so
:class:`ShardLMCacheEngine` subclasses ``LMCacheEngine`` and relies on its
internals (``token_database``, ``storage_manager``, ``lookup_pins``,
``event_manager``, ``stats_monitor``, ``gpu_connector``):
:func:`check_lmcache_version` refuses any other LMCache version. With
``enable_async_loading`` the lookup is LMCache's async lookup-and-prefetch over
the owned chunks with this rank's cumulative-length vector, and retrieve takes
the prefetched chunks. Layerwise mode is not supported.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import threading
from typing import Any, Iterable, Optional

import torch

from kvctl.connector.ownership import chunk_start_token, cumulative_lengths, lookup_answer, num_chunks, owner
from kvctl.connector.protocol import load_agreed_prefix

from .hooks import hook_from_env

__all__ = ["PINNED_LMCACHE_VERSION", "ShardLMCacheEngine", "ShardModeError", "check_lmcache_version", "prepare_config"]

PINNED_LMCACHE_VERSION = "0.5.6"
BEFORE_RETRIEVE_HOOK_ENV = "KVCTL_LMCACHE_BEFORE_RETRIEVE_HOOK"  # "module:function", called with (rank, chunk_infos)


class ShardModeError(RuntimeError):
    """Shard mode cannot run with this LMCache, config or parallel layout; the message says why."""


def check_lmcache_version(version: str | None = None) -> str:
    """The installed LMCache version, if it is the one shard mode is written against; else :class:`ShardModeError`."""
    if version is None:
        try:
            version = importlib.metadata.version("lmcache")
        except importlib.metadata.PackageNotFoundError:
            raise ShardModeError("kvctl shard mode needs LMCache, which is not installed "
                                 f"(from kvctl's checkout: pip install '.[lmcache]', LMCache {PINNED_LMCACHE_VERSION})") from None
    if version != PINNED_LMCACHE_VERSION:
        raise ShardModeError(
            f"kvctl shard mode (kv_connector_extra_config.kvctl_shard) relies on LMCache {PINNED_LMCACHE_VERSION} "
            f"internals (LMCacheEngine store/lookup/retrieve); this engine has LMCache {version}. Install "
            f"lmcache=={PINNED_LMCACHE_VERSION} or drop kvctl_shard (stock LMCache MLA mode)."
        )
    return version


def prepare_config(config: Any, world_size: int, pipeline_size: int, use_mla: bool, sparse_indexer: bool = False) -> None:
    """Turn LMCache's config into shard mode in place, or refuse with :class:`ShardModeError`.

    Every rank active (``save_only_first_rank: false``), a lookup server on
    every rank (the scheduler takes their minimum). ``sparse_indexer``: the
    model is MLA with a sparse-attention indexer (GLM-5, DeepSeek-V3.2), refused:
    LMCache 0.5.6 keeps the indexer's K cache as a kernel group of its own in
    each chunk object, while shard mode's agreed-prefix load rebuilds objects of
    the first group's shape and dtype only (``ShardLMCacheEngine.retrieve``).
    """
    if not use_mla:
        raise ShardModeError("kvctl shard mode is for MLA models (every TP rank holds the same latent KV); "
                             "this model is not MLA: drop kvctl_shard")
    if sparse_indexer:
        raise ShardModeError("kvctl shard mode does not store MLA with a sparse-attention indexer (GLM-5, "
                             "DeepSeek-V3.2): its load rebuilds LMCache's chunk objects in the latent's shape only, "
                             "not the indexer's keys beside it; use KvctlConnector (README, Limitations)")
    if pipeline_size != 1:
        raise ShardModeError(f"kvctl shard mode shards over the TP group; pipeline_parallel_size {pipeline_size} > 1 "
                             "is not supported")
    if config.use_layerwise:
        raise ShardModeError("kvctl shard mode does not support use_layerwise: true")
    if config.save_unfull_chunk:
        raise ShardModeError("kvctl shard mode stores whole chunks only: set save_unfull_chunk: false")
    extra = dict(config.extra_config or {})
    extra["save_only_first_rank"] = False
    # keys carry worker 0's name from the token database (_OwnedChunks); LMCache's own worker-0 mode
    # would also skip every put of the other ranks (storage_backend/remote_backend.py:244-246)
    extra["remote_enable_mla_worker_id_as0"] = False
    config.extra_config = extra
    config.lookup_server_worker_ids = list(range(world_size))


class _OwnedChunks:
    """LMCache's token database, yielding only this rank's chunks while a store runs on this thread."""

    def __init__(self, inner: Any, rank: int, world: int, chunk_size: int) -> None:
        self._inner, self._rank, self._world, self._chunk = inner, rank, world, chunk_size
        self.storing = threading.local()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def owns(self, start: int) -> bool:
        return owner(start // self._chunk, self._world) == self._rank

    def process_tokens(self, *args: Any, **kwargs: Any) -> Iterable:
        """LMCache's chunks with keys under worker 0's name (the same on every rank); owned ones only while storing."""
        storing = getattr(self.storing, "active", False)
        for start, end, key in self._inner.process_tokens(*args, **kwargs):
            if storing and not self.owns(start):
                continue
            yield start, end, (key.with_new_worker_id(0) if hasattr(key, "with_new_worker_id") else key)


class _NoHitAnswer:
    """LMCache's async lookup server, answering a rank's first cumulative length instead of 0 when nothing hit."""

    def __init__(self, server: Any) -> None:
        self._server = server
        self.first: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)

    def send_response_to_scheduler(self, lookup_id: str, num_hit_tokens: int) -> None:
        first = self.first.pop(lookup_id, 0)
        self._server.send_response_to_scheduler(lookup_id, num_hit_tokens or first)


class ShardLMCacheEngine:
    """Methods that replace ``LMCacheEngine``'s store, lookup and retrieve in shard mode.

    :func:`enable` turns a built ``LMCacheEngine`` into a subclass that has
    them (LMCache's ``LMCacheEngineBuilder`` hard-codes its engine class,
    cache_engine.py:2149, so the engine is converted once built, before the
    first request).
    """

    _kvctl_group: Any
    _kvctl_rank: int
    _kvctl_world: int
    _kvctl_chunk: int
    _kvctl_device: torch.device

    @staticmethod
    def enable(engine: Any, rank: int, world: int, group_fn, device: Any = "cpu") -> Any:
        """Turn ``engine`` into a shard-mode engine; ``group_fn()`` gives the exchange's process group.

        ``device``: where the exchange moves the chunks -- "cpu" with the TP
        group's gloo group (CPU engines), a CUDA device with its NCCL group (GPU
        engines: the chunks LMCache fetched into its host L1 are staged on the
        GPU, exchanged there and copied back into L1 objects, which at ~50 GB/s
        a copy beats gloo's ~1.6 GB/s host exchange many times over).
        """
        from lmcache.v1.cache_engine import LMCacheEngine  # noqa: PLC0415

        if not isinstance(engine, LMCacheEngine):
            raise ShardModeError(f"kvctl shard mode needs LMCache's LMCacheEngine, got {type(engine).__name__}")
        if engine.save_only_first_rank:
            raise ShardModeError("kvctl shard mode: LMCache still saves from the first rank only (config not prepared)")
        engine.__class__ = type("ShardLMCacheEngine", (_ShardMethods, type(engine)), {})
        engine._kvctl_rank, engine._kvctl_world = rank, world
        engine._kvctl_group_fn = group_fn
        engine._kvctl_device = torch.device(device)
        engine._kvctl_chunk = int(engine.config.chunk_size)
        engine.token_database = _OwnedChunks(engine.token_database, rank, world, engine._kvctl_chunk)
        engine._kvctl_hook = hook_from_env(BEFORE_RETRIEVE_HOOK_ENV)
        return engine


class _ShardMethods:
    """Mixed in before LMCacheEngine (see :meth:`ShardLMCacheEngine.enable`)."""

    def store(self, tokens=None, hashes=None, offsets=None, mask=None, **kwargs):  # noqa: ANN001
        self.token_database.storing.active = True
        try:
            return super().store(tokens, hashes, offsets, mask, **kwargs)
        finally:
            self.token_database.storing.active = False

    def lookup(self, tokens=None, hashes=None, offsets=None, search_range=None, lookup_id=None, pin=False,
               request_configs=None) -> int:
        """``a_r`` in tokens: the start of the first owned chunk that is missing, else the prompt's end."""
        if not self.is_healthy():
            return 0
        n_tokens = len(tokens) if tokens is not None else sum(offsets)
        stats = self.stats_monitor.on_lookup_request(n_tokens)
        res = 0
        try:
            chunks = list(self.token_database.process_tokens(tokens=tokens, hashes=hashes, offsets=offsets,
                                                             request_configs=request_configs))
            if not chunks:
                return 0
            owned = [c for c in chunks if self.token_database.owns(c[0])]
            present = [True] * num_chunks(chunks[-1][1], self._kvctl_chunk)  # only this rank's entries are read
            if owned:
                hit, block_mapping = self.storage_manager.batched_contains(
                    [key for _, _, key in owned], search_range or self.retrieve_locations, pin)
                if pin and block_mapping:
                    self.lookup_pins[lookup_id] = block_mapping
                for start, _, _ in owned[hit:]:
                    present[start // self._kvctl_chunk] = False
            a_r = lookup_answer(present, self._kvctl_rank, self._kvctl_world)
            res = chunk_start_token(a_r, self._kvctl_chunk, chunks[-1][1])
            return res
        finally:
            self.stats_monitor.on_lookup_finished(stats, res)
            if pin:
                self.storage_manager.touch_cache()

    def async_lookup_and_prefetch(self, lookup_id, tokens=None, hashes=None, offsets=None, search_range=None,
                                  pin=False, request_configs=None) -> None:
        """The async lookup over owned chunks, with the cumulative-length vector of this rank.

        ``[start of owned chunk 0, start of owned chunk 1, ..., prompt end]``: LMCache's storage manager
        answers entry h for h leading hits, i.e. ``a_r`` in tokens. With no hit at all it answers 0
        (storage_manager.py:792-794); this rank's answer is then entry 0 (:class:`_NoHitAnswer`).
        """
        chunks = list(self.token_database.process_tokens(tokens=tokens, hashes=hashes, offsets=offsets,
                                                         request_configs=request_configs))
        owned = [c for c in chunks if self.token_database.owns(c[0])]
        # entry k: the start of the k-th owned chunk, then the prompt's end (chunks start at token 0 here)
        cum = cumulative_lengths(chunks[-1][1] if chunks else 0, self._kvctl_rank, self._kvctl_world, self._kvctl_chunk)
        sm = self.storage_manager
        if not isinstance(sm.async_lookup_server, _NoHitAnswer):
            sm.async_lookup_server = _NoHitAnswer(sm.async_lookup_server)
        sm.async_lookup_server.first[lookup_id] = cum[0]
        asyncio.run_coroutine_threadsafe(
            sm.async_lookup_and_prefetch(lookup_id, [key for _, _, key in owned], cum,
                                         search_range or self.retrieve_locations, pin, keys_per_chunk=1),
            sm.loop,
        )

    def _kvctl_prefetched(self, req_id: str) -> dict:
        """The owned chunks the async lookup prefetched for ``req_id`` (key -> memory object); {} if none."""
        from lmcache.v1.event_manager import EventType  # noqa: PLC0415

        # bounded: this runs before the collectives, so a prefetch that never completes must not hold this
        # rank while its peers wait in the exchange; a late prefetch is a local miss (a shorter agreed prefix)
        wait_s = float(getattr(self.config, "blocking_timeout_secs", 10) or 10)
        try:
            keyed = self.event_manager.get_event_future(EventType.LOADING, req_id).result(timeout=wait_s)
        except Exception:  # noqa: BLE001 - no hit registers no event (or it timed out): nothing prefetched
            return {}
        return {key: obj for tier in keyed for key, obj in tier if obj is not None}

    def _kvctl_fetch(self, infos: list) -> list:
        """This rank's chunks ``infos`` ((key, start, end), ascending) from L1 or its Valkey; None where missing."""
        found: dict[Any, Any] = {}
        for location, blocks in self.storage_manager.get_block_mapping(infos).items():
            objs = self.storage_manager.batched_get(keys=[k for k, _, _ in blocks], location=location)
            for (key, _, _), obj in zip(blocks, objs or [], strict=False):
                if obj is None:
                    continue
                if key in found:  # the same chunk twice: keep one reference
                    obj.ref_count_down()
                else:
                    found[key] = obj
        out = [found.pop(key, None) for key, _, _ in infos]
        for obj in found.values():
            obj.ref_count_down()
        return out

    def retrieve(self, tokens, mask: Optional[torch.Tensor] = None, **kwargs) -> torch.Tensor:  # noqa: ANN001
        """Load the agreed prefix on every rank (a collective: every rank of the TP group calls it in step)."""
        from lmcache.logging import init_logger  # noqa: PLC0415

        ret_mask = torch.zeros(len(tokens), dtype=torch.bool)
        # no early return on an unhealthy engine: health is per rank, and a rank that skipped the
        # collective below would leave its peers waiting in it; it fetches nothing instead
        healthy = self.is_healthy()
        required = int(mask.sum().item()) if mask is not None else len(tokens)
        stats = self.stats_monitor.on_retrieve_request(required)
        chunks = []
        for start, end, key in self.token_database.process_tokens(tokens=tokens, mask=mask,
                                                                  request_configs=kwargs.get("request_configs")):
            if end - start != self._kvctl_chunk:
                break  # whole chunks only (save_unfull_chunk: false)
            chunks.append((key, start, end))
        if self._kvctl_hook is not None:
            try:
                self._kvctl_hook(self._kvctl_rank, chunks)
            except Exception:  # noqa: BLE001 - a test hook must not make this rank skip the collective
                init_logger(__name__).exception("kvctl shard mode: before-load hook failed")
        first_chunk = chunks[0][1] // self._kvctl_chunk if chunks else 0
        fetched: list = []
        prefetched = self._kvctl_prefetched(kwargs.get("req_id", "")) if self.async_loading and healthy else None

        def fetch_owned(indexes: list[int]) -> list:
            if not healthy:
                return [None] * len(indexes)
            if prefetched is not None:
                objs = [prefetched.pop(chunks[i][0], None) for i in indexes]
            else:
                objs = self._kvctl_fetch([chunks[i] for i in indexes])
            fetched.extend(o for o in objs if o is not None)
            return [None if o is None else o.tensor for o in objs]

        shape = self.metadata.get_shapes(self._kvctl_chunk)[0]
        dtype = self.metadata.get_dtypes()[0]
        try:
            result = load_agreed_prefix(self._kvctl_group_fn(), [key.chunk_hash for key, _, _ in chunks], fetch_owned,
                                        shape, dtype, self._kvctl_device, first_chunk=first_chunk)
        finally:
            # sync: lookup pins are LMCache's adapter's to release (lookup_unpin); async: the prefetch pinned them
            for obj in fetched + list((prefetched or {}).values()):
                if self.async_loading and obj.is_pinned:
                    obj.unpin()
                obj.ref_count_down()
        objs, starts, ends = [], [], []
        try:
            n = result.prefix if healthy else 0  # an unhealthy rank took part in the collectives; it loads nothing
            for (key, start, end), data in zip(chunks[:n], result.chunks[:n], strict=True):
                obj = self.storage_manager.allocate([shape], [dtype], fmt=self.fmt)
                if obj is None:
                    break  # L1 full: load what fits (a prefix), vLLM recomputes the rest
                obj.tensor.copy_(data)
                objs.append(obj)
                starts.append(start)
                ends.append(end)
            if objs:
                self.gpu_connector.batched_to_gpu(objs, starts, ends, **kwargs)
                ret_mask[starts[0]: ends[-1]] = True
        finally:
            for obj in objs:
                obj.ref_count_down()
        loaded = int(ret_mask.sum().item())
        self.stats_monitor.on_retrieve_finished(stats, loaded)
        init_logger(__name__).info(
            "kvctl shard: rank %d of %d loaded the agreed prefix of %d of %d chunks (%d tokens)",
            self._kvctl_rank, self._kvctl_world, len(objs), len(chunks), loaded)
        return ret_mask
