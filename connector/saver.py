"""The worker's background saver: saves run off the engine step, and a shutdown waits for them, bounded.

A prompt's chunks are extracted on the engine's thread and written to the tier
here, one save at a time, in order. :meth:`Saver.drain` (the worker's
shutdown) stops taking new saves, waits up to ``drain_s`` for the queued and
running ones, and abandons what is left: it returns how many were written
meanwhile and how many were abandoned, so the worker can log and count them.
With ``max_bytes``, the saves queued and running hold at most that many bytes
(each submit names its size): a save that would pass it is refused at once
(``submit`` answers "full"), never waited for, so a tier slower than the
engine's saves costs misses, not the engine's memory or its step. One save
is always taken when none is pending, however large.
The thread is a daemon: an abandoned save still running (a tier that stopped
answering: each of its calls is bounded by the client's timeout) never holds
the process's exit.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["DrainResult", "Saver"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DrainResult:
    written: int  # saves that finished during the drain
    abandoned: int  # saves still queued or running when it ended
    waited_s: float


class Saver:
    """Runs ``fn(item)`` for each submitted item on one daemon thread, in order."""

    def __init__(self, fn: Callable[[Any], None], name: str = "kvctl-save", max_bytes: int | None = None) -> None:
        self._fn = fn
        self._max_bytes = max_bytes
        self._bytes = 0  # of the saves queued and running
        self._q: deque = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self._done = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, item: Any, nbytes: int = 0) -> str:
        """Queue ``item`` of ``nbytes``: "queued"; "closed" once the saver is draining or drained, "full" when
        the pending saves' bytes and this one's would pass ``max_bytes`` (in both, the item is not saved)."""
        with self._cond:
            if self._closed:
                return "closed"
            pending = self._q or self._busy
            if self._max_bytes is not None and pending and self._bytes + nbytes > self._max_bytes:
                return "full"
            self._bytes += nbytes
            self._q.append((item, nbytes))
            self._cond.notify_all()
            return "queued"

    @property
    def pending_bytes(self) -> int:
        """Bytes of the saves queued or running."""
        with self._cond:
            return self._bytes

    @property
    def pending(self) -> int:
        """Saves queued or running."""
        with self._cond:
            return len(self._q) + (1 if self._busy else 0)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until every save submitted so far has run; True if they all have."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._q or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._q and not self._closed:
                    self._cond.wait()
                if not self._q:
                    return
                item, nbytes = self._q.popleft()
                self._busy = True
            try:
                self._fn(item)
            except BaseException:  # noqa: BLE001 - a failed save is a future miss, never the end of the saver
                log.exception("kvctl: save failed")
            finally:
                del item  # its chunks go back to the allocator before the bytes are counted free
                with self._cond:
                    self._busy = False
                    self._bytes -= nbytes
                    self._done += 1
                    self._cond.notify_all()

    def drain(self, drain_s: float) -> DrainResult:
        """Take no more saves; wait up to ``drain_s`` for the pending ones; abandon the rest."""
        t0 = time.monotonic()
        deadline = t0 + max(0.0, drain_s)
        with self._cond:
            self._closed = True
            done_before = self._done
            self._cond.notify_all()
            while (self._q or self._busy) and time.monotonic() < deadline:
                self._cond.wait(max(0.0, deadline - time.monotonic()))
            abandoned = len(self._q) + (1 if self._busy else 0)
            self._bytes -= sum(n for _, n in self._q)
            self._q.clear()  # the thread exits after the running one (if any)
            self._cond.notify_all()
            return DrainResult(self._done - done_before, abandoned, time.monotonic() - t0)
