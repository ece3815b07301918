"""Scheduler-side lookup of the vLLM connector, and the load-or-recompute policy (no vLLM import).

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

import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Sequence

from kvctl.connector.ownership import (
    KeyExtra,
    chunk_keys,
    contiguous_hit_tokens,
    cumulative_lengths,
    lookup_answer,
    owned_chunks,
)
from kvctl.connector.resp import RespClient
from kvctl.connector.store import LoadPolicy

__all__ = ["LookupCache", "LookupResult", "PolicyState", "TierLookup", "loadable_chunks"]


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

    def __init__(self, urls: Sequence[str], chunk_tokens: int, model_name: str, fmt: str, timeout_s: float,
                 down_for_s: float | None = None) -> None:
        self.urls = list(urls)
        self.down_for_s = max(5.0, 5 * timeout_s) if down_for_s is None else down_for_s
        self._down_until = [0.0] * len(self.urls)
        self.world_size = len(self.urls)
        self.chunk_tokens, self.model_name, self.fmt = chunk_tokens, model_name, fmt
        self.timeout_s = timeout_s
        self.clients = [RespClient(u, timeout_s=timeout_s, pool_size=2) for u in self.urls]
        self._pool = ThreadPoolExecutor(max_workers=max(2, 2 * self.world_size), thread_name_prefix="kvctl-lookup")

    def keys(self, token_ids: Sequence[int], n_chunks: int, extra: KeyExtra | None = None) -> list[str]:
        """The same keys the workers load and store under (``extra``: the request's LoRA/salt/mm material)."""
        return chunk_keys(list(token_ids[: n_chunks * self.chunk_tokens]), self.chunk_tokens, self.model_name, self.fmt,
                          extra)

    def _rank_present(self, rank: int, keys: list[str], first: int, stop_at_first_miss: bool) -> list[bool]:
        """Presence of rank ``rank``'s owned chunks >= ``first``, in owned order (EXISTS on its instance)."""
        mine = [c for c in owned_chunks(len(keys), rank, self.world_size) if c >= first]
        if not mine:
            return []
        found = self.clients[rank].batched_exists([keys[c] for c in mine])
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
        for c in self.clients:
            c.close()


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


class PolicyState:
    """Load-or-recompute with one bandwidth estimate for all ranks that cannot lock itself out.

    The estimate is the engine-wide GET bandwidth the workers report (bytes
    and seconds summed over ranks, so every rank's load is judged by the
    same number, and the scheduler's one decision holds for all ranks). The
    ``ranks`` load in parallel, each its own share from its own instance, so
    Σbytes / Σseconds is one rank's bandwidth and the tier's is ``ranks`` times
    it: that is what the whole model's ``bytes_per_token`` is judged against. A
    veto lets no loads through, so no new measurement would ever raise a low
    estimate: after ``reprobe_after_s`` without a measurement one load is let
    through (a re-probe) and the estimate it produces replaces the old one.
    """

    def __init__(self, bytes_per_token: float, prefill_tokens_per_s: float, t0_s: float = 0.0,
                 bandwidth_gbps: float | None = None, reprobe_after_s: float = 30.0, clock=time.monotonic,
                 ranks: int = 1) -> None:
        self.bytes_per_token, self.rate, self.t0_s, self.ranks = bytes_per_token, prefill_tokens_per_s, t0_s, max(1, ranks)
        self._cost = LoadPolicy(bytes_per_token, prefill_tokens_per_s, t0_s, bandwidth_gbps)  # the one cost test
        self.fixed_gbps, self.reprobe_after_s, self.clock = bandwidth_gbps, reprobe_after_s, clock
        self.measured_gbps: float | None = None
        self._last_measured = clock()
        self._lock = threading.Lock()
        self.vetoes = 0
        self.probes = 0

    def observe(self, get_bytes: float, get_seconds: float) -> None:
        """Fold in one interval's GET bytes and seconds, each summed over the ranks (tier GB/s = ranks × Σbytes/Σseconds)."""
        if get_bytes <= 0 or get_seconds <= 0:
            return
        gbps = self.ranks * get_bytes / get_seconds / 1e9
        with self._lock:
            self.measured_gbps = gbps if self.measured_gbps is None else 0.5 * self.measured_gbps + 0.5 * gbps
            self._last_measured = self.clock()

    def allow(self, tokens: int) -> bool:
        """True when loading ``tokens`` should go ahead (predicted faster, unknown yet, or a re-probe)."""
        if self._cost.load_wins(tokens, self.measured_gbps):  # also True with no estimate yet
            return True
        with self._lock:
            if self.fixed_gbps is None and self.clock() - self._last_measured >= self.reprobe_after_s:
                self._last_measured = self.clock()  # one probe per period
                self.probes += 1
                return True
            self.vetoes += 1
            return False
