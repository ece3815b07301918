"""Completing background requests without losing any (the fix for bug 1 of paper §5.4)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
from concurrent.futures import Future, InvalidStateError
from typing import Any, Callable

from .resp_errors import RespClosedError

_log = logging.getLogger(__name__)


def _resolve(fut: Future, result: Any, error: BaseException | None) -> None:
    """Resolve ``fut``; what its caller did to it (cancel, a raising callback) cannot stop the drain."""
    try:
        # a future its caller cancelled is marked notified here, so wait() and
        # as_completed() see it done; otherwise it becomes RUNNING and gets its result
        if not fut.set_running_or_notify_cancel():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    except (InvalidStateError, RuntimeError):
        pass  # resolved already (the close sweep got there first): nothing to deliver
    except BaseException:  # noqa: BLE001 - a done-callback raised a non-Exception; the future is resolved
        _log.exception("a done-callback of a RESP future raised; the completion drain goes on")


class CompletionRegistry:
    """Futures keyed by request id, resolved by a drain thread (the fix for bug 1 of §5.4).

    ``submit(start)`` allocates an id, calls ``start(id)`` (which hands the
    request to an I/O thread that later calls :meth:`complete`) and registers
    the future -- all under one lock, which the drain also takes before it
    looks a completion up. A completion that arrives "too early" therefore
    waits for the registration instead of being dropped.

    ``unsafe_submit_then_register=True`` reproduces the buggy ordering
    (register after submit, no lock); it exists only for the regression test.

    After :meth:`close`, ``submit`` raises :class:`RespClosedError` instead of
    registering a future nobody would ever resolve. :meth:`close` works from
    any thread, including a future's done-callback, which runs on the drain
    thread: every future resolves, with its result or a RespClosedError.
    """

    def __init__(self, unsafe_submit_then_register: bool = False) -> None:
        self._lock = threading.Lock()
        # the buggy ordering is the same code with the lock left out
        self._guard = contextlib.nullcontext() if unsafe_submit_then_register else self._lock
        self._closed = False
        self._pending: dict[int, Future] = {}
        self._ids = itertools.count()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self.dropped = 0  # completions that found no future (must stay 0 with the fix)
        self._drainer = threading.Thread(target=self._drain, name="resp-completion-drain", daemon=True)
        self._drainer.start()

    def submit(self, start: Callable[[int], None]) -> Future:
        """Start a request and return the future its completion will resolve."""
        fut: Future = Future()
        with self._guard:
            if self._closed:
                raise RespClosedError("client closed")
            rid = next(self._ids)
            start(rid)
            self._pending[rid] = fut
        return fut

    def complete(self, rid: int, result: Any = None, error: BaseException | None = None) -> None:
        """Called by the I/O side when request ``rid`` finished (any thread)."""
        self._done.put((rid, result, error))

    def _drain(self) -> None:
        while True:
            item = self._done.get()
            if item is None:
                break
            rid, result, error = item
            with self._guard:
                fut = self._pending.pop(rid, None)
            if fut is None:
                self.dropped += 1
                continue
            _resolve(fut, result, error)
        self._fail_pending()

    def _fail_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            _resolve(fut, None, RespClosedError("client closed with the request in flight"))

    def on_drain_thread(self) -> bool:
        """True when called from a future's done-callback (callbacks run on the drain thread)."""
        return threading.current_thread() is self._drainer

    def close(self) -> None:
        """Refuse new submits, stop the drain thread; futures still pending get a RespClosedError.

        From the drain thread itself (a done-callback) it cannot wait for the
        drain: the drain delivers the completions queued before the close,
        then fails what is still pending, after the callback returns.
        """
        with self._lock:
            self._closed = True
        self._done.put(None)
        if self.on_drain_thread():
            return
        self._drainer.join(timeout=5)
        self._fail_pending()  # also when the drain is stuck in a slow callback past the join
