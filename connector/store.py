"""ShardedStore: the sharded MLA KV store with a rank-partitioned remote tier (paper §5.1-§5.3).

For W ranks that all hold the same latent KV (MLA under PCP, or under TP),
rank r stores, looks up and loads only the chunks it owns (``c mod W == r``):

* L1 -- a bounded LRU in host memory, ``host_budget_bytes / W`` per rank, so
  the engine's total host memory is unchanged;
* L2 -- rank r's own Valkey instance (``{rank}`` in the remote URL, or a
  per-rank URL list), through :class:`~kvctl.connector.resp.RespClient`,
  under worker-0 key names so any engine can reuse any chunk.

``lookup`` answers ``a_r`` in tokens (the scheduler's minimum over ranks is
the longest cached prefix); ``load`` runs the agreed-prefix protocol; the
async path (``prefetch`` + ``lookup_async``) prefetches owned chunks into L1
in the background and answers through the cumulative-length vector.

Only full chunks are stored: a trailing partial chunk is always a miss and is
recomputed (under 1 chunk of tokens).

The optional :class:`LoadPolicy` (off by default) reports 0 hit tokens when
the cost model predicts that loading is slower than recomputing. Because
``T_recompute - T_load`` grows with the hit length when ``B > B*`` (and is
negative for every length when ``B <= B*``), each rank judging its own
``a_r`` leaves the scheduler's minimum either 0 or the true longest prefix:
the ranks never disagree into a partial load.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import torch

from .fetch import fetch_to_device, lanes_for
from .ownership import ChunkParts, KeyExtra, chunk_keys, chunk_start_token, cumulative_lengths, lookup_answer, num_chunks, owned_chunks
from .urls import expand_rank_urls
from .pinned import PinnedPool, set_from_device
from .striped import RankTier
from .policy import LoadPolicy, ewma  # LoadPolicy re-exported: part of the store's API
from .prefetch import LRUCache, PrefetchRequest
from .protocol import DEFAULT_MODE, LoadResult, load_agreed_prefix
from .resp import RespClient, RespError

from kvctl.core.thresholds import CHUNK_TOKENS  # pure constants


__all__ = ["LoadPolicy", "ShardedStore", "StoreResult"]

log = logging.getLogger("vllm.kvctl.connector.store")  # under vLLM's logger in an engine, so its handlers print it


@dataclass(frozen=True)
class StoreResult:
    """What one rank did in :meth:`ShardedStore.store`."""

    owned_chunks: int  # full chunks of the prompt this rank owns
    l1_chunks: int
    l2_chunks: int
    l2_error: str | None = None


class ShardedStore:
    """Rank ``rank``'s shard of the KV store (see the module docstring).

    ``remote_url``: ``resp://host-{rank}:6379``-style template or a per-rank
    list (None = L1 only); with ``instances_per_rank`` K > 1, a template with
    ``{instance}`` too, or per-rank lists of K URLs (chunk ``c`` on instance
    ``(c // W) mod K``, :class:`~kvctl.connector.striped.RankTier`).
    ``connections``: GETs kept in flight per instance during a device load.
    ``chunk_shape``/``dtype``: one full chunk's KV.
    ``group``: the torch.distributed group of the W ranks (None = default
    group), used only by :meth:`load` when its caller names no other.
    ``parts``: each chunk is stored as these parts, one value and key each
    (:class:`~kvctl.connector.ownership.ChunkParts`: a chunk is present only
    when every part is); their sizes add up to the chunk's bytes.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        remote_url: str | Sequence[str] | None,
        host_budget_bytes: int,
        chunk_shape: Sequence[int],
        dtype: torch.dtype,
        *,
        chunk_tokens: int = CHUNK_TOKENS,
        model_name: str = "model",
        fmt: str = "mla",
        group=None,
        device: torch.device | str = "cpu",
        timeout_s: float = 5.0,
        pool_size: int = 4,
        prefetch_workers: int = 2,
        prefetch_batch: int = 4,
        policy: LoadPolicy | None = None,
        load_mode: str = DEFAULT_MODE,
        pool: PinnedPool | None = None,
        instances_per_rank: int = 1,
        connections: int = 2,
        parts: ChunkParts | None = None,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        self.rank, self.world_size = rank, world_size
        self.chunk_shape = tuple(int(d) for d in chunk_shape)
        self.dtype = dtype
        self.chunk_nbytes = torch.empty((), dtype=dtype).element_size() * int(torch.Size(self.chunk_shape).numel())
        if self.chunk_nbytes <= 0:
            raise ValueError("chunk_shape must describe a non-empty chunk")
        if parts is not None and parts.nbytes != self.chunk_nbytes:
            raise ValueError(f"chunk parts of {parts.nbytes} bytes for chunks of {self.chunk_nbytes}")
        self.parts = parts
        self.chunk_tokens = chunk_tokens
        self.model_name, self.fmt = model_name, fmt
        self.group, self.device, self.load_mode = group, torch.device(device), load_mode
        self.timeout_s = timeout_s
        self.policy = policy
        self.prefetch_batch = max(1, prefetch_batch)
        self.l1 = LRUCache(host_budget_bytes // world_size)
        self.tier: RankTier | None = None
        self.url = None
        if remote_url is not None:
            urls = expand_rank_urls(remote_url, rank, instances_per_rank)
            self.tier = RankTier(urls, world_size, timeout_s=timeout_s, connections=connections, parts=parts)
            self.url = self.tier.url
        self._executor = ThreadPoolExecutor(max_workers=max(1, prefetch_workers), thread_name_prefix=f"kv-prefetch-r{rank}")
        self._bw_lock = threading.Lock()
        self._get_gbps: float | None = None  # EWMA of this rank's L2 GET bandwidth
        self.l2_get_bytes = 0  # cumulative bytes and wall seconds of L2 GETs (for engine metrics)
        self.l2_get_seconds = 0.0
        # the device path (CUDA caches): replies read into pinned slots and copied to the device on a
        # stream per direction; loads and saves then skip L1 (the GPU's own prefix cache holds them)
        self.pool = pool if self.device.type == "cuda" else None
        if self.pool is not None and self.pool.slot_nbytes != self.chunk_nbytes:
            raise ValueError(f"pinned pool slots of {self.pool.slot_nbytes} bytes for chunks of {self.chunk_nbytes}")
        self._streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)) if self.pool is not None else None
        # the device load's lanes: K instances x connections each, a thread and a copy stream per lane
        self._lanes: ThreadPoolExecutor | None = None
        self._lane_streams = None
        if self.pool is not None and self.tier is not None:
            self.lanes_per_instance = lanes_for(self.pool, self.tier.k, self.tier.connections)
            n_lanes = self.tier.k * self.lanes_per_instance
            self._lanes = ThreadPoolExecutor(max_workers=n_lanes, thread_name_prefix=f"kvctl-get-r{rank}")
            self._lane_streams = [torch.cuda.Stream(self.device) for _ in range(n_lanes)]

    @property
    def lane_executor(self) -> ThreadPoolExecutor | None:
        """The device load's lane threads (K instances x lanes each; None off CUDA or without a tier)."""
        return self._lanes

    @property
    def lane_streams(self) -> list | None:
        """One CUDA copy stream per lane of :attr:`lane_executor` (None off CUDA)."""
        return self._lane_streams

    @property
    def client(self) -> RespClient | None:
        """The one instance's client (K = 1); None without a tier. With K > 1 use :attr:`tier`."""
        if self.tier is None:
            return None
        if self.tier.k != 1:
            raise AttributeError(f"this rank has {self.tier.k} instances: use store.tier, not store.client")
        return self.tier.clients[0]

    # -- keys and ownership ---------------------------------------------------
    def keys(self, token_ids: Sequence[int], extra: KeyExtra | None = None) -> list[str]:
        """Worker-0 keys of the prompt's full chunks (the one key builder, sync and async).

        ``extra``: the request's extra key material (LoRA, cache_salt, multimodal inputs; see
        :class:`~kvctl.connector.ownership.KeyExtra`); every method below takes it and passes it here.
        """
        n_full = len(token_ids) // self.chunk_tokens
        return chunk_keys(list(token_ids[: n_full * self.chunk_tokens]), self.chunk_tokens, self.model_name, self.fmt,
                          extra)

    def owned(self, n_chunks: int) -> range:
        return owned_chunks(n_chunks, self.rank, self.world_size)

    # -- bytes <-> tensors ----------------------------------------------------
    def _new_chunk(self) -> tuple[bytearray, torch.Tensor]:
        buf = bytearray(self.chunk_nbytes)
        return buf, torch.frombuffer(buf, dtype=torch.uint8).view(self.dtype).view(self.chunk_shape)

    def _l2_get(self, chunks: list[int], keys: list[str]) -> list[tuple[bytearray, torch.Tensor] | None]:
        """GET chunks ``chunks`` (their ``keys``) into fresh buffers; a miss is None. Raises RespError on a broken tier."""
        items = [self._new_chunk() for _ in keys]
        t0 = time.perf_counter()
        ok = self.tier.get(chunks, keys, [b for b, _ in items])
        self.note_get(sum(ok) * self.chunk_nbytes, time.perf_counter() - t0)
        return [item if hit else None for item, hit in zip(items, ok)]

    def note_get(self, got: int, dt: float) -> None:
        """Count ``got`` bytes of L2 GETs in ``dt`` seconds (engine metrics, the measured bandwidth)."""
        with self._bw_lock:
            self.l2_get_bytes += got
            self.l2_get_seconds += dt
            if got and dt > 0:
                gbps = got / dt / 1e9
                self._get_gbps = ewma(self._get_gbps, gbps)

    @property
    def measured_gbps(self) -> float | None:
        """This rank's L2 GET bandwidth (EWMA, 1e9 B/s), None before the first GET."""
        return self._get_gbps

    # -- store ------------------------------------------------------------------
    def store(self, token_ids: Sequence[int], chunks: Sequence[torch.Tensor | None], first_chunk: int = 0,
              extra: KeyExtra | None = None, *, ready=None) -> StoreResult:
        """Store this rank's chunks of a prompt; ``chunks[c]`` is chunk c's KV (any rank holds all).

        Writes L1 and L2 (one pipelined batch). An unreachable tier is
        reported in the result, not raised: the engine must keep serving.
        Chunks before ``first_chunk`` are skipped (already stored; their
        ``chunks`` entries may be None). Chunks on a CUDA device, with a
        pinned pool, go to L2 only, through pinned slots; ``ready`` is a CUDA
        event recorded after they were written (None: they are ready now).
        """
        keys = self.keys(token_ids, extra)
        if len(chunks) < len(keys):
            raise ValueError(f"{len(keys)} full chunks in the prompt but {len(chunks)} chunk tensors")
        mine = [c for c in self.owned(len(keys)) if c >= first_chunk]
        for c in mine:
            t = chunks[c]
            if tuple(t.shape) != self.chunk_shape or t.dtype != self.dtype:
                raise ValueError(f"chunk {c} is {tuple(t.shape)} {t.dtype}, expected {self.chunk_shape} {self.dtype}")
        if self.pool is not None and mine and chunks[mine[0]].is_cuda:
            return self._store_from_device(keys, [chunks[c].contiguous() for c in mine], mine, ready)
        bufs = []
        for c in mine:
            t = chunks[c]
            buf, view = self._new_chunk()
            view.copy_(t)
            bufs.append((buf, view))
        l1 = sum(self.l1.put(keys[c], buf, view) for c, (buf, view) in zip(mine, bufs))
        l2, err = 0, None
        if self.tier is not None and mine:
            try:
                self.tier.set(mine, [keys[c] for c in mine], [buf for buf, _ in bufs])
                l2 = len(mine)
            except RespError as exc:
                err = str(exc)
        return StoreResult(len(mine), l1, l2, err)

    def _store_from_device(self, keys: list[str], chunks: list[torch.Tensor], mine: list[int], ready) -> StoreResult:
        if self.tier is None:
            return StoreResult(len(mine), 0, 0, None)
        try:
            # a save holds at most a quarter of the pool (batches of up to 4, double-buffered), so a load
            # that arrives meanwhile still finds slots for its lanes
            set_from_device(self.tier, self.pool, mine, [keys[c] for c in mine], chunks, self._streams[1],
                            batch=max(1, min(4, self.pool.n_slots // 4)), ready=ready, timeout_s=self.timeout_s)
        except (RespError, TimeoutError) as exc:
            return StoreResult(len(mine), 0, 0, str(exc))
        return StoreResult(len(mine), 0, len(mine), None)

    # -- lookup (sync) ------------------------------------------------------------
    def _apply_policy(self, tokens: int) -> int:
        if self.policy is None or tokens <= 0:
            return tokens
        measured = self._get_gbps * self.world_size if self._get_gbps is not None else None
        return tokens if self.policy.load_wins(tokens, measured) else 0

    def lookup(self, token_ids: Sequence[int], extra: KeyExtra | None = None) -> int:
        """``a_r`` in tokens: start of this rank's first owned chunk missing from L1 and L2.

        L2 is asked only about owned chunks that are not in L1 (one pipeline);
        if L2 fails they count as missing, so a broken tier shortens the hit.
        """
        n_tokens = len(token_ids)
        n = num_chunks(n_tokens, self.chunk_tokens)
        keys = self.keys(token_ids, extra)
        present = [True] * n  # lookup_answer reads only this rank's entries
        ask = []
        for c in self.owned(n):
            if c >= len(keys):
                present[c] = False  # trailing partial chunk: never stored
            elif keys[c] not in self.l1:
                present[c] = False
                ask.append(c)
        if ask and self.tier is not None:
            try:
                found = self.tier.exists(ask, [keys[c] for c in ask])
            except RespError:
                found = [False] * len(ask)
            for c, hit in zip(ask, found):
                present[c] = hit
        a_r = lookup_answer(present, self.rank, self.world_size)
        return self._apply_policy(chunk_start_token(a_r, self.chunk_tokens, n_tokens))

    # -- load ---------------------------------------------------------------------
    def _fetch_owned(self, keys: list[str], indexes: list[int], deadline: float | None = None) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = []
        missing: list[int] = []
        for c in indexes:
            t = self.l1.get(keys[c])
            out.append(t)
            if t is None:
                missing.append(len(out) - 1)
        if missing and self.tier is not None:
            # nothing after the first chunk we fail to get can be used: fetch in order, stop early
            # (batches of prefetch_batch chunks a rank instance, split over its instances; one chunk an instance
            # under a deadline, which no GET may start after, as the device path's lanes do)
            step = (self.prefetch_batch if deadline is None else 1) * self.tier.k
            for i in range(0, len(missing), step):
                if deadline is not None and time.monotonic() >= deadline:
                    break  # no GET starts after the load's deadline
                batch = missing[i : i + step]
                try:
                    got = self._l2_get([indexes[j] for j in batch], [keys[indexes[j]] for j in batch])
                except RespError:
                    break
                stop = False
                for j, item in zip(batch, got):
                    if item is None:
                        stop = True
                        continue
                    self.l1.put(keys[indexes[j]], *item)
                    out[j] = item[1]
                if stop:
                    break
        return out

    def load(self, token_ids: Sequence[int], max_tokens: int | None = None, first_chunk: int = 0, *,
             group=None, extra: KeyExtra | None = None, meta_group=None, timing: dict | None = None,
             deadline: float | None = None) -> LoadResult:
        """Load the agreed prefix of the prompt's chunks onto ``device`` on every rank.

        ``max_tokens`` caps the chunks asked for (e.g. the scheduler's agreed
        hit); every rank must pass the same value, or the key fingerprints
        differ and the agreed prefix is 0. ``first_chunk`` starts the load at
        that chunk (the engine already holds the ones before it): the result's
        ``chunks[i]`` is chunk ``first_chunk + i``, and ``prefix`` counts from
        ``first_chunk``. Collective: every rank of the group must call it.
        ``group``: the process group of this load's collectives (None = the
        store's ``group``); loads on different threads (a background load next
        to the engine's own) each pass their own and leave the store as it is.
        ``meta_group``: a CPU group of the same ranks for the protocol's small
        message (see :func:`~kvctl.connector.protocol.load_agreed_prefix`).
        ``timing``: a dict this call fills with ``fetch`` (the device path's
        :class:`~kvctl.connector.fetch.FetchStats`) and ``protocol_s`` (the
        whole agreed-prefix load, fetch included), for metrics and traces.
        ``deadline`` (``time.monotonic()``): no GET starts after it on this rank; the chunks staged by then are
        what this rank offers, so every rank still runs the exchange and they agree on a shorter prefix.
        """
        keys = self.keys(token_ids, extra)
        if max_tokens is not None:
            keys = keys[: max(0, max_tokens) // self.chunk_tokens]
        keys = keys[first_chunk:]
        pinned = self.pool is not None and self.tier is not None

        def stage(owned: list[int], slot) -> int:  # the device path: lanes GET into pinned slots, then to the GPU
            # owned[j] indexes `keys`, i.e. absolute chunk first_chunk + owned[j] (its instance follows that)
            if deadline is not None and time.monotonic() >= deadline:
                return 0  # past the load's deadline before it began: this rank offers nothing
            try:
                stats = fetch_to_device(
                    self.tier, self.pool, [first_chunk + c for c in owned], [keys[c] for c in owned], slot, self._lanes,
                    streams=self._lane_streams, l1=self.l1, errors=(RespError,), deadline=deadline)
            except Exception as exc:  # the protocol counts it as a local failure; say why, once in a while
                _warn_every(f"kvctl rank {self.rank}: staging a load failed ({type(exc).__name__}: {exc}); the agreed "
                            "prefix stops at this rank's first chunk and the engine recomputes")
                raise
            if timing is not None:
                timing["fetch"] = stats
            self.note_get(stats.got_bytes, stats.get_s)
            return stats.staged

        t0 = time.perf_counter()
        result = load_agreed_prefix(
            self.group if group is None else group,
            keys,
            None if pinned else (lambda idx: self._fetch_owned(keys, idx, deadline)),
            self.chunk_shape,
            self.dtype,
            self.device,
            self.load_mode,
            first_chunk,
            stage_owned=stage if pinned else None,
            meta_group=meta_group,
        )
        if timing is not None:
            timing["protocol_s"] = time.perf_counter() - t0
        return result

    # -- async prefetch (§5.3) --------------------------------------------------------
    def prefetch(self, token_ids: Sequence[int], extra: KeyExtra | None = None) -> PrefetchRequest:
        """Start prefetching this rank's owned chunks into L1; returns at once.

        Chunks already in L1 count immediately; the rest are fetched from L2
        in owned order on a background thread, stopping at the first miss.
        """
        n_tokens = len(token_ids)
        keys = self.keys(token_ids, extra)
        mine = [keys[c] for c in self.owned(len(keys))]
        req = PrefetchRequest(mine, cumulative_lengths(n_tokens, self.rank, self.world_size, self.chunk_tokens))
        lead = 0
        while lead < len(mine) and mine[lead] in self.l1:
            lead += 1
        req.add_hits([True] * lead)
        if lead == len(mine) or self.tier is None:
            if lead < len(mine):
                req.add_hits([False])
            req.finish()
            return req
        try:
            job = self._executor.submit(self._prefetch_job, req, lead)
        except RuntimeError as exc:  # executor shut down: this request just gets no more hits
            req.finish(exc)
            return req
        job.add_done_callback(lambda f: _finish_if_cancelled(req, f))
        return req

    def _prefetch_job(self, req: PrefetchRequest, start: int) -> None:
        try:
            pos = start
            owned = [self.rank + i * self.world_size for i in range(len(req.keys))]  # req.keys[i] is this chunk
            step = self.prefetch_batch * self.tier.k
            while pos < len(req.keys):
                batch = req.keys[pos : pos + step]
                need = [(owned[pos + i], k) for i, k in enumerate(batch) if k not in self.l1]
                got = self._l2_get([c for c, _ in need], [k for _, k in need]) if need else []
                fetched = {k: item for (_, k), item in zip(need, got)}
                hits = []
                for k in batch:
                    item = fetched.get(k)
                    if item is not None:
                        self.l1.put(k, *item)
                        hits.append(True)
                    else:
                        hits.append(k not in fetched and k in self.l1)
                req.add_hits(hits)
                if not all(hits):
                    break
                pos += len(batch)
            req.finish()
        except BaseException as exc:  # noqa: BLE001 - a failed prefetch only ends its own request
            req.add_hits([False])
            req.finish(exc)

    def lookup_async(self, request: PrefetchRequest, timeout_s: float = 0.0) -> int:
        """``a_r`` in tokens from the prefetch so far, waiting at most ``timeout_s``."""
        return self._apply_policy(request.hit_tokens(timeout_s))

    def close(self) -> None:
        """Cancel queued prefetches (their requests finish with no more hits) and close the L2 client."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._lanes is not None:
            self._lanes.shutdown(wait=False, cancel_futures=True)
        if self.tier is not None:
            self.tier.close()

    def __enter__(self) -> "ShardedStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_WARN_EVERY_S = 30.0
_warned: dict[str, float] = {}


def _warn_every(message: str) -> None:
    """``message`` as a warning, at most once per ``_WARN_EVERY_S`` per distinct text (a broken path must not flood)."""
    now = time.monotonic()
    if now - _warned.get(message, -_WARN_EVERY_S) >= _WARN_EVERY_S:
        _warned[message] = now
        log.warning(message)


def _finish_if_cancelled(req: PrefetchRequest, job: Future) -> None:
    """A prefetch job cancelled by :meth:`ShardedStore.close` never ran: finish its request, or it stays open."""
    if job.cancelled():
        req.add_hits([False])
        req.finish(CancelledError("prefetch cancelled: store closed"))
