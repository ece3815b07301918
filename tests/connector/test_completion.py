"""Bug 1 of §5.4: no completion is lost between submit and register."""

from __future__ import annotations

import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout

import pytest

from kvctl.connector.resp import CompletionRegistry, RespClient, RespClosedError


def _submit_with_fast_drain(registry: CompletionRegistry) -> object:
    """Submit a request whose completion is drained before ``submit`` returns, if the drain can.

    ``start`` completes the request inline (a deliberately fast I/O side) and
    then gives the drain thread up to 0.3 s to process it before returning:
    with the buggy ordering the drain runs inside that window and finds no
    future; with the fix it is blocked on the lock until registration.
    """
    def start(rid: int) -> None:
        registry.complete(rid, result=f"done-{rid}")
        time.sleep(0.3)  # window in which an unlocked drain gets to the completion first

    fut = registry.submit(start)
    return fut


def test_fast_drain_completion_is_not_lost():
    registry = CompletionRegistry()
    try:
        fut = _submit_with_fast_drain(registry)
        assert fut.result(timeout=2) == "done-0"
        assert registry.dropped == 0
    finally:
        registry.close()


def test_buggy_order_loses_the_completion():
    """The same scenario with submit-then-register and no lock: the caller would block forever."""
    registry = CompletionRegistry(unsafe_submit_then_register=True)
    try:
        fut = _submit_with_fast_drain(registry)
        with pytest.raises(FutureTimeout):
            fut.result(timeout=0.5)
        assert registry.dropped == 1
    finally:
        registry.close()


def test_close_fails_pending_futures():
    registry = CompletionRegistry()
    fut = registry.submit(lambda rid: None)  # never completed
    registry.close()
    with pytest.raises(Exception, match="closed"):
        fut.result(timeout=1)


def test_submit_get_races_from_many_threads_lose_nothing(valkey_server):
    """Stress: 8 threads x 50 async GETs through the I/O thread; every future resolves correctly."""
    n_threads, n_calls = 8, 50
    with RespClient(valkey_server.url, timeout_s=5.0, pool_size=2) as client:
        keys = [f"async-{i}" for i in range(4)]
        values = [bytes([i + 1]) * 2048 for i in range(4)]
        client.batched_set(keys, values)
        ok = [0] * n_threads
        errors: list[BaseException] = []

        def worker(tid: int) -> None:
            try:
                for _ in range(n_calls):
                    bufs = [bytearray(2048) for _ in keys] + [bytearray(8)]
                    got = client.submit_get(keys + ["async-missing"], bufs).result(timeout=10)
                    if got == [True] * 4 + [False] and [bytes(b) for b in bufs[:4]] == values:
                        ok[tid] += 1
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads)
        assert not errors, errors
        assert ok == [n_calls] * n_threads
        assert client._registry is not None and client._registry.dropped == 0


def test_submit_after_close_is_refused_not_left_pending():
    """A submit that loses the race with close() must not get a future nobody will ever resolve."""
    registry = CompletionRegistry()
    registry.close()
    started: list[int] = []
    with pytest.raises(RespClosedError):
        registry.submit(started.append)
    assert started == []


def test_submit_get_racing_close_always_resolves(valkey_server):
    """submit_get from several threads while the client closes: each call raises or its future resolves."""
    client = RespClient(valkey_server.url, timeout_s=2.0, pool_size=2)
    client.batched_set(["race-close"], [b"x" * 64])
    futures = []
    refused = 0
    lock = threading.Lock()
    go = threading.Event()

    def worker() -> None:
        nonlocal refused
        go.wait()
        for _ in range(50):
            try:
                fut = client.submit_get(["race-close"], [bytearray(64)])
            except RespClosedError:
                with lock:
                    refused += 1
                continue
            with lock:
                futures.append(fut)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    go.set()
    time.sleep(0.005)
    client.close()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)
    for fut in futures:
        try:
            assert fut.result(timeout=5) == [True]
        except RespClosedError:
            pass
    assert refused + len(futures) == 200
