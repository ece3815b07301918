"""The sharded store's building blocks: a bounded host-memory LRU and async prefetch state.

* :class:`LRUCache` -- L1: a thread-safe LRU bounded in bytes (each rank gets
  1/W of the engine's host budget, paper §5.1).
* :class:`PrefetchRequest` -- one request's background prefetch (paper §5.3):
  the rank's cumulative-length vector plus the hits found so far, in owned
  order. :meth:`PrefetchRequest.hit_tokens` waits at most ``timeout_s`` and
  answers with what is contiguous so far, so a slow or failed prefetch only
  ever shortens its own request's hit.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Hashable, Sequence

import torch

from .ownership import contiguous_hit_tokens

__all__ = ["LRUCache", "PrefetchRequest"]


class LRUCache:
    """Least-recently-used map of key -> uint8-backed chunk, bounded by ``capacity_bytes``.

    Values are ``(buffer, tensor)`` pairs: the bytearray that backs the chunk
    (also what is written to L2) and a tensor view of it. An item larger than
    the capacity is not stored.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = int(capacity_bytes)
        self._items: OrderedDict[Hashable, tuple[bytearray, torch.Tensor]] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()
        self.evictions = 0

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._items

    def get(self, key: Hashable) -> torch.Tensor | None:
        """The chunk (now most recently used), or None."""
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            self._items.move_to_end(key)
            return item[1]

    def put(self, key: Hashable, buffer: bytearray, tensor: torch.Tensor) -> bool:
        """Insert or refresh ``key``; evicts least recently used items to fit. False if too large."""
        size = len(buffer)
        if size > self.capacity_bytes:
            return False
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._used -= len(old[0])
            while self._used + size > self.capacity_bytes and self._items:
                _, (buf, _) = self._items.popitem(last=False)
                self._used -= len(buf)
                self.evictions += 1
            self._items[key] = (buffer, tensor)
            self._used += size
            return True

    def pop(self, key: Hashable) -> bool:
        """Drop ``key``; True if it was there."""
        with self._lock:
            item = self._items.pop(key, None)
            if item is None:
                return False
            self._used -= len(item[0])
            return True

    def keys(self) -> list[Hashable]:
        """Keys from least to most recently used."""
        with self._lock:
            return list(self._items)


class PrefetchRequest:
    """Background prefetch of one request's owned chunks into L1 (paper §5.3).

    ``cum_lengths`` is the rank's vector (start token of its k-th owned chunk,
    then the prompt length); ``hits`` grows in owned order as chunks land in
    L1 and stops at the first miss, since nothing after it can count.
    """

    def __init__(self, keys: Sequence[str], cum_lengths: Sequence[int]) -> None:
        self.keys = list(keys)  # owned, storable chunks in owned order
        self.cum_lengths = list(cum_lengths)
        self._hits: list[bool] = []
        self._cond = threading.Condition()
        self._done = False
        self.error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self._done

    def add_hits(self, hits: Sequence[bool]) -> None:
        with self._cond:
            for hit in hits:
                if self._hits and not self._hits[-1]:
                    break
                self._hits.append(bool(hit))
            self._cond.notify_all()

    def finish(self, error: BaseException | None = None) -> None:
        with self._cond:
            self.error = error
            self._done = True
            self._cond.notify_all()

    def hits(self) -> list[bool]:
        with self._cond:
            return list(self._hits)

    def wait(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for the prefetch to finish; True if it did."""
        with self._cond:
            return self._cond.wait_for(lambda: self._done, timeout=max(0.0, timeout_s))

    def hit_tokens(self, timeout_s: float = 0.0) -> int:
        """``a_r`` in tokens from the hits so far, after waiting at most ``timeout_s``.

        A rank with no hits reports ``cum_lengths[0]`` (its first owned chunk's
        start), not 0.
        """
        self.wait(timeout_s)
        hits = self.hits()[: len(self.cum_lengths) - 1]
        return contiguous_hit_tokens(self.cum_lengths, hits)
