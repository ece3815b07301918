"""Scheduler-side lookup of the sharded tier (no vLLM, no torch import).

A rank with K instances (``instances_per_rank``) is asked on all of them at
once, each about the owned chunks it holds (:class:`~kvctl.connector.striped.RankTier`).

The scheduler process is none of the W ranks, so it asks every rank's own
Valkey instance about that rank's owned chunks (EXISTS only) and takes the
minimum of the W answers ``a_r`` -- the longest prefix every owner holds
(paper §5.1). Synchronous lookups use ``lookup_answer``; asynchronous ones
use the rank's cumulative-length vector and ``contiguous_hit_tokens``
(paper §5.3: a rank with no hit reports its first owned chunk's start).
A rank whose instance errs or does not answer within the timeout answers
"nothing past the start": the request recomputes, it never hangs. Such an
instance is then left alone for ``down_for_s`` (answers are misses at once),
so a dead or stopped instance does not stall every new request's lookup.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Sequence

from .ownership import (
    ChunkParts,
    KeyExtra,
    chunk_keys,
    contiguous_hit_tokens,
    cumulative_lengths,
    lookup_answer,
    owned_chunks,
)
from .resp import RespClient
from .striped import RankTier

__all__ = ["LookupCache", "LookupResult", "TierLookup", "loadable_chunks"]


def loadable_chunks(num_tokens: int, chunk_tokens: int) -> int:
    """Full chunks that may come from the tier: the last prompt token is always computed."""
    return max(0, num_tokens - 1) // chunk_tokens


@dataclass(frozen=True)
class LookupResult:
    hit_chunks: int  # absolute chunk index where the agreed prefix ends (>= first_chunk)
    first_chunk: int
    loadable: int  # chunks that could have been hits
    failed_ranks: tuple[int, ...] = ()  # ranks whose instance erred or timed out


class TierLookup:
    """EXISTS-only lookups against the W per-rank instances (one client each)."""

    def __init__(self, urls: Sequence[str | Sequence[str]], chunk_tokens: int, model_name: str, fmt: str, timeout_s: float,
                 down_for_s: float | None = None, parts: ChunkParts | None = None) -> None:
        # urls[r]: rank r's instance, or its K instances (chunk c on instance (c // W) mod K)
        self.rank_urls = [[u] if isinstance(u, str) else list(u) for u in urls]
        self.urls = [u for rank in self.rank_urls for u in rank]
        self.down_for_s = max(5.0, 5 * timeout_s) if down_for_s is None else down_for_s
        self.world_size = len(self.rank_urls)
        self._down_until = [0.0] * self.world_size
        self.chunk_tokens, self.model_name, self.fmt = chunk_tokens, model_name, fmt
        self.timeout_s = timeout_s
        # parts: a chunk stored as several values is present only when every part is (RankTier)
        self.tiers = [RankTier(r, self.world_size, timeout_s=timeout_s, connections=1, parts=parts)
                      for r in self.rank_urls]
        self._pool = ThreadPoolExecutor(max_workers=max(2, 2 * self.world_size), thread_name_prefix="kvctl-lookup")

    @property
    def clients(self) -> list[RespClient]:
        """Every instance's client, rank-major (one a rank when K = 1)."""
        return [c for t in self.tiers for c in t.clients]

    def keys(self, token_ids: Sequence[int], n_chunks: int, extra: KeyExtra | None = None) -> list[str]:
        """The same keys the workers load and store under (``extra``: the request's LoRA/salt/mm material)."""
        return chunk_keys(list(token_ids[: n_chunks * self.chunk_tokens]), self.chunk_tokens, self.model_name, self.fmt,
                          extra)

    def _rank_present(self, rank: int, keys: list[str], first: int, stop_at_first_miss: bool) -> list[bool]:
        """Presence of rank ``rank``'s owned chunks >= ``first``, in owned order (EXISTS on its instance)."""
        mine = [c for c in owned_chunks(len(keys), rank, self.world_size) if c >= first]
        if not mine:
            return []
        found = self.tiers[rank].exists(mine, [keys[c] for c in mine])
        if stop_at_first_miss and False in found:
            found = found[: found.index(False) + 1]
        return found

    def lookup(self, token_ids: Sequence[int], first_chunk: int = 0, vector: bool = False,
               extra: KeyExtra | None = None) -> LookupResult:
        """The agreed hit for a prompt, from chunk ``first_chunk`` on; bounded by ``timeout_s``.

        ``vector=True`` answers through each rank's cumulative-length vector
        (the asynchronous form); the result is the same prefix.
        """
        n = loadable_chunks(len(token_ids), self.chunk_tokens)
        if n <= first_chunk:
            return LookupResult(first_chunk, first_chunk, n)
        keys = self.keys(token_ids, n, extra)
        now = time.monotonic()
        if self.world_size == 1:
            # one rank: ask on this thread (its client's deadline bounds the call); a hop to the pool's
            # thread and back costs two GIL handoffs, each up to the switch interval in a busy engine
            futures = [None if now < self._down_until[0] else _run_inline(self._rank_present, 0, keys, first_chunk, vector)]
        else:
            futures = [None if now < self._down_until[r] else self._pool.submit(self._rank_present, r, keys, first_chunk, vector)
                       for r in range(self.world_size)]
        done, _ = wait([f for f in futures if f is not None], timeout=self.timeout_s * 1.5)
        answers, failed = [], []
        for r, fut in enumerate(futures):
            if fut is None or fut not in done or fut.exception() is not None:
                if fut is not None:
                    self._down_until[r] = time.monotonic() + self.down_for_s
                failed.append(r)
                answers.append(first_chunk)
                continue
            found = fut.result()
            mine = [c for c in owned_chunks(n, r, self.world_size) if c >= first_chunk]
            if vector:
                # the rank's cumulative-length vector (tokens), restricted to chunks from first_chunk on
                ct = self.chunk_tokens
                cum = cumulative_lengths(n * ct, r, self.world_size, ct)
                cum = [s for s in cum[:-1] if s >= first_chunk * ct] + [cum[-1]]
                answers.append(contiguous_hit_tokens(cum, found[: len(mine)]) // ct)
            else:
                present = [True] * n
                for c, hit in zip(mine, found):
                    present[c] = hit
                answers.append(lookup_answer(present, r, self.world_size))
        return LookupResult(min(answers), first_chunk, n, tuple(failed))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for t in self.tiers:
            t.close()


def _run_inline(fn, *args) -> Future:
    """``fn(*args)`` run now, on this thread, as a finished Future (its result or its exception)."""
    fut: Future = Future()
    try:
        fut.set_result(fn(*args))
    except Exception as exc:  # noqa: BLE001 - delivered through the future, as the pool would
        fut.set_exception(exc)
    return fut


class LookupCache:
    """The last answer for each waiting request, so a request vLLM cannot schedule yet is not asked about
    at every step (sync lookups: one EXISTS pipeline per rank each time).

    An answer is reused while the request's token count is the one it was
    found for, its lookup started at or before the chunk asked for now (a
    larger local prefix narrows an old answer, it does not change it), and it
    is younger than ``ttl_s``; answers with a failed rank are never kept. The
    caller drops a request's answer once it is scheduled or finished.
    """

    def __init__(self, ttl_s: float, clock=time.monotonic) -> None:
        self.ttl_s, self.clock = ttl_s, clock
        self._answers: dict[str, tuple[int, float, LookupResult]] = {}

    def get(self, req_id: str, num_tokens: int, first_chunk: int) -> LookupResult | None:
        entry = self._answers.get(req_id)
        if entry is None:
            return None
        n, at, result = entry
        if n != num_tokens or result.first_chunk > first_chunk or self.clock() - at >= self.ttl_s:
            del self._answers[req_id]
            return None
        return result

    def put(self, req_id: str, num_tokens: int, result: LookupResult) -> None:
        if not result.failed_ranks:
            self._answers[req_id] = (num_tokens, self.clock(), result)

    def drop(self, req_id: str) -> None:
        self._answers.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._answers)
