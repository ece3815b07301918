"""The worker's data path between the tier and one rank's paged KV cache (torch only, no vLLM).

    load:  fetch owned chunks -> stage -> exchange over the shard group -> insert into the cache
    save:  extract from the cache (GQA: all-gather the heads) -> store owned chunks

The cache is reached only through a *layout* object (``kvctl.connector.layouts.layout_for``
builds one from vLLM's views, ``kvctl.connector.sparse_mla.sparse_layout_for`` one of a
sparse-MLA group's two kinds of caches) with ``extract(slots)`` -> the KV of
those tokens on the cache's device, ``chunks_of(kv, chunk_tokens)`` -> new
tensors in the canonical chunk format, ``join_chunks(chunks, skip, rank)`` and
``insert(slots, kv, rank=0)`` back, ``to_local(chunk, rank)`` and ``mla``.

Two paths, chosen by where the cache lives:

* CPU engines: chunks in host memory, the exchange over the shard group's
  gloo group, L1 + L2 as :class:`~kvctl.connector.store.ShardedStore` does.
* CUDA engines: the store has a :class:`~kvctl.connector.pinned.PinnedPool`;
  replies are read into pinned slots and copied to a device staging buffer,
  the exchange runs over the group's device (NCCL) group, chunks are inserted
  from device memory; saves extract on the device and SET from pinned slots.

The vLLM plugin and the GPU harness (``tests/gpu``, ``benchmarks/connector_gpu.py``)
call these same functions.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import torch

from .layer_groups import Grouping
from .ownership import KeyExtra
from .store import ShardedStore, StoreResult

__all__ = ["KVDataPath", "LoadOutcome", "LoadTiming", "SaveBatch", "slots_for"]

log = logging.getLogger(__name__)


def slots_for(block_ids: Sequence[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """Slots (``block_id * block_size + offset``) of tokens ``start..end-1`` of a request whose blocks are ``block_ids``."""
    if end <= start:
        return torch.empty(0, dtype=torch.long)
    tok = torch.arange(start, end, dtype=torch.long)
    blocks = torch.as_tensor(list(block_ids), dtype=torch.long)
    return blocks[tok // block_size] * block_size + tok % block_size


@dataclass(frozen=True)
class LoadTiming:
    """Where one load's wall time went on this rank (seconds); the phases add up to ``total_s``.

    ``get_s``: from the start until the last GET ended (the device path's
    lanes also copy to the device meanwhile); ``copy_tail_s``: the copies
    still running after it; ``exchange_s``: the agreed-prefix message and the
    move of the chunks between ranks (0 at W = 1: no collective); ``insert_s``:
    building the slots and queueing the scatter into the paged cache;
    ``insert_events``: CUDA events around that scatter, for its device time
    once it has run (None on CPU).
    """

    chunks: int
    get_bytes: int
    get_s: float
    copy_tail_s: float
    exchange_s: float
    insert_s: float
    total_s: float
    insert_events: tuple | None = None
    lanes: int = 0  # the device path's GET lanes, and what they summed (FetchStats; the host path: 0 and ())
    recv_s_by_instance: tuple[float, ...] = ()
    slot_wait_s: float = 0.0


@dataclass(frozen=True)
class LoadOutcome:
    """One load on one rank.

    ``agreed``: chunks (from the load's first chunk) every rank agreed on, the
    same on every rank; ``written``: how many of them this rank wrote into its
    cache (fewer only if a write failed); ``interrupted``: a BaseException
    that is not an Exception (CancelledError, KeyboardInterrupt) caught after
    the collectives, for the caller to re-raise once its bookkeeping is done.
    """

    agreed: int
    written: int
    interrupted: BaseException | None = None
    timing: LoadTiming | None = None


@dataclass
class SaveBatch:
    """Chunks extracted for a save, ready to hand to a background thread.

    ``chunks[c]`` is chunk c's KV for the chunks this rank owns from ``first``
    on (others None). ``ready``: a CUDA event recorded after the extracting
    kernels (None on CPU).
    """

    token_ids: list[int]
    chunks: list[torch.Tensor | None]
    first: int
    ready: object = None
    extra: KeyExtra | None = None  # the request's extra key material (LoRA, cache_salt, images)


def _timing(parts: dict, agreed: int, t0: float, t_ins: float | None, t_end: float, events) -> LoadTiming:
    """The phases of one load from what the store reported (``parts``) and the datapath's own clocks."""
    fetch = parts.get("fetch")
    protocol_s = parts.get("protocol_s", (t_ins or t_end) - t0)
    get_s = fetch.get_s if fetch is not None else 0.0
    tail_s = fetch.copy_tail_s if fetch is not None else 0.0
    if fetch is None:  # the host path: the protocol's fetch is its GETs and staging copies
        get_s = protocol_s
    return LoadTiming(chunks=agreed, get_bytes=fetch.got_bytes if fetch is not None else 0, get_s=get_s,
                      copy_tail_s=tail_s, exchange_s=max(0.0, protocol_s - get_s - tail_s),
                      insert_s=t_end - t_ins if t_ins is not None else 0.0, total_s=t_end - t0,
                      insert_events=events, **({} if fetch is None else {"lanes": fetch.lanes, "slot_wait_s": fetch.slot_wait_s,
                                                                          "recv_s_by_instance": fetch.recv_s_by_instance}))


class KVDataPath:
    """Rank ``store.rank``'s data path over ``layout`` (see the module docstring).

    ``group``: the shard group's process group for this path's collectives
    (gloo on CPU, the device group on CUDA). ``device``: where the cache lives.
    """

    def __init__(self, store: ShardedStore, layout, *, chunk_tokens: int, block_size: int, group,
                 device: torch.device | str, grouping: Grouping | None = None) -> None:
        self.store, self.layout = store, layout
        self.rank, self.world_size = store.rank, store.world_size
        self.chunk_tokens, self.block_size = chunk_tokens, block_size
        self.group = group
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"
        # layer groups (kvctl.connector.layer_groups): a hit can be loaded group by group while the forward runs
        self.grouping = grouping if grouping is not None and grouping.groups > 1 else None
        self.group_layouts = [layout.rows(u.rows) for u in self.grouping.units] if self.grouping else []
        self._cpu_lanes: ThreadPoolExecutor | None = None

    @property
    def pipelined(self) -> bool:
        """Whether loads can run group by group of layers (:func:`kvctl.connector.pipeline.begin`)."""
        return self.grouping is not None and self.store.tier is not None

    def lane_executor(self) -> ThreadPoolExecutor:
        """Threads for a pipelined load's lanes: the store's on CUDA, else K x connections of this path's own."""
        if self.store.lane_executor is not None:
            return self.store.lane_executor
        if self._cpu_lanes is None:
            tier = self.store.tier
            self._cpu_lanes = ThreadPoolExecutor(max_workers=tier.k * tier.connections,
                                                 thread_name_prefix=f"kvctl-pipe-r{self.rank}")
        return self._cpu_lanes

    def close(self) -> None:
        """Stop the CPU pipeline's lane threads (the store closes its own)."""
        if self._cpu_lanes is not None:
            self._cpu_lanes.shutdown(wait=True)
            self._cpu_lanes = None

    # -- load -----------------------------------------------------------------
    def load(self, token_ids: Sequence[int], block_ids: Sequence[int], first_chunk: int, end_chunk: int,
             skip_tokens: int = 0, *, group=None, extra: KeyExtra | None = None, meta_group=None,
             deadline: float | None = None, before_insert=None) -> LoadOutcome:
        """Agreed-prefix load of chunks ``first_chunk..end_chunk-1`` into the request's blocks.

        Collective over ``group`` (None: this path's group): every rank calls
        it with the same arguments. Tokens before ``skip_tokens`` are already
        in the cache and are not written. A failure after the agreement (a
        write) is logged and shortens ``written``; it never skips a collective.
        ``extra``: the request's extra key material (see :class:`~kvctl.connector.ownership.KeyExtra`).
        ``deadline``: see :meth:`ShardedStore.load <kvctl.connector.store.ShardedStore.load>`.
        ``before_insert``: a CUDA event (the engine's work issued before this load) that the write into the cache
        waits for on the GPU; the GETs, copies and exchange before it do not (a load on its own stream then overlaps
        the engine's step instead of starting after it).
        """
        ct = self.chunk_tokens
        agreed = written = 0
        interrupted = None
        timing: dict = {}
        t0 = time.perf_counter()
        t_ins = t_end = None
        events = None
        try:
            result = self.store.load(token_ids, end_chunk * ct, first_chunk, group=self.group if group is None else group,
                                     extra=extra, meta_group=meta_group, timing=timing, deadline=deadline)
            agreed = result.prefix
            t_ins = time.perf_counter()
            if agreed:
                # the slots of the whole prefix at once, and the chunks as they lie: one scatter over all layers
                start = max(first_chunk * ct, skip_tokens)
                slots = slots_for(block_ids, self.block_size, start, (first_chunk + agreed) * ct)
                data = self.layout.join_chunks(result.chunks, start - first_chunk * ct, self.rank)
                if self.on_cuda:
                    events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                    if before_insert is not None:
                        torch.cuda.current_stream(self.device).wait_event(before_insert)
                    events[0].record()
                self.layout.insert(slots, data)
                if events is not None:
                    events[1].record()
                written = agreed
        except Exception:  # noqa: BLE001 - a failed write is a load error: the engine recomputes
            log.exception("kvctl: load of %d chunk(s) from chunk %d failed", end_chunk - first_chunk, first_chunk)
        except BaseException as exc:  # noqa: BLE001 - handed back: the caller marks its blocks, then re-raises
            interrupted = exc
        t_end = time.perf_counter()
        return LoadOutcome(agreed, written, interrupted, _timing(timing, agreed, t0, t_ins, t_end, events))

    # -- save -----------------------------------------------------------------
    def extract(self, token_ids: Sequence[int], block_ids: Sequence[int], first: int, *, group=None,
                extra: KeyExtra | None = None) -> SaveBatch | None:
        """Copy out the chunks this rank stores, from chunk ``first`` to the last full one.

        Runs on the engine's thread, before the blocks can be reused. MLA:
        every rank holds the same latent KV, so only owned chunks are copied.
        GQA/MHA: each rank holds its own heads; all ranks gather every head
        (a collective, entered by every rank with the same ``first``) and
        keep their owned chunks. None when there is nothing to store.
        """
        ct, W, r = self.chunk_tokens, self.world_size, self.rank
        n_full = len(token_ids) // ct
        if first >= n_full:
            return None
        chunks: list[torch.Tensor | None] = [None] * n_full
        if self.layout.mla:
            mine = [c for c in range(first, n_full) if c % W == r]
            if mine:
                # every full chunk's slots at once, then this rank's rows (one per chunk): O(tokens), where a
                # slots_for per chunk converted the whole block list again for each
                slots = slots_for(block_ids, self.block_size, 0, n_full * ct).view(n_full, ct)[mine].reshape(-1)
                allkv = self.layout.extract(slots)  # (layers, len(mine) * ct, row): one gather per layer
                for c, chunk in zip(mine, self.layout.chunks_of(allkv, ct)):
                    chunks[c] = chunk
        else:
            local = self.layout.extract(slots_for(block_ids, self.block_size, first * ct, n_full * ct)).contiguous()
            parts = [torch.empty_like(local) for _ in range(W)]
            torch.distributed.all_gather(parts, local, group=self.group if group is None else group)
            full = torch.cat(parts, dim=2)
            for c in range(first, n_full):
                if c % W == r:
                    chunks[c] = full[:, (c - first) * ct : (c - first + 1) * ct].contiguous()
        ready = torch.cuda.current_stream(self.device).record_event() if self.on_cuda else None
        return SaveBatch(list(token_ids[: n_full * ct]), chunks, first, ready, extra)

    def store_batch(self, batch: SaveBatch) -> StoreResult:
        """Write a :class:`SaveBatch` to the tier (safe on a background thread)."""
        chunks = batch.chunks
        if not self.on_cuda:
            chunks = [None if t is None else t.cpu() for t in chunks]
        return self.store.store(batch.token_ids, chunks, batch.first, batch.extra, ready=batch.ready)
