"""Bug 1 of §5.4: no completion is lost between submit and register."""

from __future__ import annotations

import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as futures_wait

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


def test_close_from_a_done_callback_resolves_every_future():
    """Issue 11 item 4: close() from a done-callback (it runs on the drain thread) still fails every pending future."""
    registry = CompletionRegistry()
    rids: list[int] = []
    seen: list[object] = []

    def close_from_callback(fut) -> None:
        seen.append(threading.current_thread().name)
        try:
            registry.close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            seen.append(exc)

    first = registry.submit(rids.append)
    first.add_done_callback(close_from_callback)
    pending = [registry.submit(lambda rid: None) for _ in range(20)]  # never completed
    registry.complete(rids[0], result="x")
    assert first.result(timeout=2) == "x"
    for fut in pending:
        with pytest.raises(RespClosedError):
            fut.result(timeout=2)
    assert seen == ["resp-completion-drain"], seen  # ran on the drain thread, raised nothing
    with pytest.raises(RespClosedError):
        registry.submit(lambda rid: None)


class _CallbackExit(BaseException):
    """A BaseException (not an Exception) raised by a done-callback."""


@pytest.mark.parametrize("spoiler", ["cancelled", "callback_raises_base_exception"])
def test_drain_survives_what_callers_do_to_their_futures(spoiler):
    """A future the caller cancelled, or a callback raising a BaseException, must not stop the drain."""
    registry = CompletionRegistry()
    try:
        rids: list[int] = []
        futs = [registry.submit(rids.append) for _ in range(3)]
        if spoiler == "cancelled":
            assert futs[0].cancel()
        else:
            futs[0].add_done_callback(lambda f: (_ for _ in ()).throw(_CallbackExit()))
        for rid in rids:
            registry.complete(rid, result=rid * 10)
        assert [f.result(timeout=2) for f in futs[1:]] == [10, 20]
        # wait() sees every future done, the cancelled one included (it must be notified)
        assert not futures_wait(futs, timeout=2).not_done
    finally:
        registry.close()


def test_client_close_from_a_done_callback(valkey_server):
    """RespClient.close() from a submit_get future's callback: every future resolves, idle sockets close."""
    import os
    import signal

    client = RespClient(valkey_server.url, timeout_s=2.0, pool_size=2)
    client.batched_set(["cb"], [b"x" * 64])
    errors: list[BaseException] = []

    def close_client(fut) -> None:
        try:
            client.close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    os.kill(valkey_server.pid, signal.SIGSTOP)  # so the first future is surely resolved by the drain thread
    try:
        first = client.submit_get(["cb"], [bytearray(64)])
        first.add_done_callback(close_client)
        rest = []
        for _ in range(50):
            try:
                rest.append(client.submit_get(["cb"], [bytearray(64)]))
            except RespClosedError:
                break
    finally:
        os.kill(valkey_server.pid, signal.SIGCONT)
    assert first.result(timeout=5) == [True]
    for fut in rest:
        try:
            assert fut.result(timeout=5) == [True]
        except RespClosedError:
            pass
    assert errors == []
    assert client.pool_stats().idle == 0
