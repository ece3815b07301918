"""A thread pool whose threads never hold the interpreter's exit, and that its owner waits for with a bound.

``concurrent.futures.ThreadPoolExecutor`` joins every worker of every pool of the process when the interpreter
exits (its atexit hook, daemon threads or not): one worker blocked in a read that no cut reaches (a TCP connect to
a server whose accept queue is full waits for its own timeout; shutting the socket down does not end it) keeps a
stopped ``kvctl exporter`` alive for that timeout. The exporter used to end its process with ``os._exit`` instead,
which also ended a test run that called it in-process (issue 44 defect 20). :class:`DaemonPool`'s workers are
daemon threads registered nowhere: its owner waits for them with :meth:`DaemonPool.join` (bounded) and leaves
behind what does not end in time.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["DaemonPool", "join_all"]


def join_all(threads: list[threading.Thread], timeout_s: float | None) -> list[threading.Thread]:
    """Wait for ``threads`` (those started), all together at most ``timeout_s`` (None: no bound); the ones still alive."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    for t in threads:
        if t.ident is None:  # never started
            continue
        t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    return [t for t in threads if t.is_alive()]


class DaemonPool(concurrent.futures.Executor):
    """An executor of at most ``max_workers`` daemon threads named ``name_0``, ``name_1``, ... (started as needed).

    :meth:`shutdown` never waits unbounded unless asked (``wait=True``, the ``with`` form); :meth:`join` waits
    with a bound, and :attr:`threads` says which threads are the pool's.
    """

    def __init__(self, max_workers: int, name: str) -> None:
        if max_workers < 1:
            raise ValueError("max_workers must be at least 1")
        self._max, self._name = max_workers, name
        self._work: queue.SimpleQueue[Any] = queue.SimpleQueue()  # (future, fn, args, kwargs), or None: stop
        self._threads: list[threading.Thread] = []
        self._idle = threading.Semaphore(0)  # one release per worker waiting for work
        self._lock = threading.Lock()
        self._shut = False

    @property
    def threads(self) -> list[threading.Thread]:
        """Every thread this pool started (alive or not)."""
        with self._lock:
            return list(self._threads)

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        with self._lock:
            if self._shut:
                raise RuntimeError("cannot schedule new futures after shutdown")
            f: concurrent.futures.Future[Any] = concurrent.futures.Future()
            self._work.put((f, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._max:
                t = threading.Thread(target=self._run, name=f"{self._name}_{len(self._threads)}", daemon=True)
                self._threads.append(t)
                t.start()
        return f

    def _run(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                self._work.put(None)  # the next worker stops too
                return
            f, fn, args, kwargs = item
            del item
            if f.set_running_or_notify_cancel():
                try:
                    f.set_result(fn(*args, **kwargs))
                except BaseException as e:  # noqa: BLE001 - handed to the future's owner, as ThreadPoolExecutor does
                    f.set_exception(e)
            del f, fn, args, kwargs  # hold nothing while idle
            self._idle.release()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Refuse new work; with ``cancel_futures`` cancel what has not started; with ``wait`` wait for every thread."""
        with self._lock:
            self._shut = True
            if cancel_futures:
                while True:
                    try:
                        item = self._work.get_nowait()
                    except queue.Empty:
                        break
                    if item is not None:
                        item[0].cancel()
            self._work.put(None)
        if wait:
            self.join(None)

    def join(self, timeout_s: float | None) -> list[threading.Thread]:
        """Wait for the pool's threads (after :meth:`shutdown`) at most ``timeout_s`` in all; those still alive."""
        return join_all(self.threads, timeout_s)
