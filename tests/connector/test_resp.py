"""RespClient against a real Valkey (fixtures start valkey-server on free loopback ports)."""

from __future__ import annotations

import array
import threading
import time

import pytest
import redis

from kvctl.connector.resp import (
    RespAuthError,
    RespClient,
    RespClosedError,
    RespConnectionError,
    RespServerError,
)


def _url(proc, user: str | None = None, password: str | None = None) -> str:
    auth = ""
    if password is not None:
        auth = f"{user or ''}:{password}@"
    return f"resp://{auth}{proc.host}:{proc.port}"


def test_set_exists_get_roundtrip(valkey_server):
    with RespClient(valkey_server.url, timeout_s=5.0) as client:
        keys = [f"rt-{i}" for i in range(5)]
        values = [bytes([i]) * (1000 * i + 3) for i in range(5)]
        values[4] = bytes(range(256)) * 4096  # 1 MiB, sent straight from the caller's buffer
        client.batched_set(keys, values)
        assert client.batched_exists(keys + ["rt-missing"]) == [True] * 5 + [False]
        buffers = [bytearray(len(v)) for v in values]
        assert client.batched_get(keys, buffers) == [True] * 5
        assert [bytes(b) for b in buffers] == values
        # redis-py sees exactly what we wrote
        r = redis.Redis(host=valkey_server.host, port=valkey_server.port)
        assert r.get("rt-4") == values[4]
        r.close()
        assert client.batched_get([], []) == [] and client.batched_exists([]) == []


def test_set_with_ttl_gives_every_key_that_ttl(valkey_server):
    """SET k v EX n: small values (packed into one write) and a 1 MiB one (sent from the caller's buffer)."""
    with RespClient(valkey_server.url, timeout_s=5.0) as client:
        keys = ["ttl-small", "ttl-big", "no-ttl"]
        values = [b"x" * 10, bytes(range(256)) * 4096, b"y"]
        client.batched_set(keys[:2], values[:2], ttl_s=120)
        client.batched_set(keys[2:], values[2:])
        r = redis.Redis(host=valkey_server.host, port=valkey_server.port)
        try:
            ttls = [r.ttl(k) for k in keys]
            assert 110 <= ttls[0] <= 120 and 110 <= ttls[1] <= 120, ttls
            assert ttls[2] == -1, ttls  # -1: the key exists and has no TTL
            assert r.get("ttl-big") == values[1] and r.get("ttl-small") == values[0]
        finally:
            r.close()
        for bad in (0, -5, 1.5):
            with pytest.raises(ValueError):
                client.batched_set(["k"], [b"v"], ttl_s=bad)


def test_get_fills_typed_buffers_in_place(valkey_server):
    """Any writable contiguous buffer works (here an int32 array); its bytes are overwritten."""
    with RespClient(valkey_server.url) as client:
        src = array.array("i", range(1000))
        client.batched_set(["arr"], [src])
        dest = array.array("i", [0] * 1000)
        assert client.batched_get(["arr"], [dest]) == [True]
        assert dest == src


def test_deleted_third_key_is_a_miss_and_connection_stays_usable(valkey_server):
    """Bug 2 (§5.4): $-1 for the third key -> [T, T, F, T]; same socket serves the next GET."""
    with RespClient(valkey_server.url, timeout_s=5.0, pool_size=1) as client:
        size = 64 * 1024
        keys = [f"chunk-{i}" for i in range(4)]
        values = [bytes([65 + i]) * size for i in range(4)]
        client.batched_set(keys, values)
        client.delete([keys[2]])
        buffers = [bytearray(size) for _ in keys]
        t0 = time.monotonic()
        assert client.batched_get(keys, buffers) == [True, True, False, True]
        first_s = time.monotonic() - t0
        assert bytes(buffers[3]) == values[3] and bytes(buffers[2]) == bytes(size)
        t1 = time.monotonic()
        again = [bytearray(size) for _ in keys]
        assert client.batched_get([keys[3], keys[0]], again[:2]) == [True, True]
        second_s = time.monotonic() - t1
        assert bytes(again[0]) == values[3]
        assert first_s < 1.0 and second_s < 1.0
        stats = client.pool_stats()
        assert stats.created == 1 and stats.dropped == 0  # one connection throughout


def test_length_mismatch_is_a_miss_with_reply_consumed(valkey_server):
    with RespClient(valkey_server.url, pool_size=1) as client:
        client.batched_set(["a", "b", "c"], [b"x" * 100, b"y" * 5000, b"z" * 10])
        bufs = [bytearray(100), bytearray(10), bytearray(10)]  # b is larger than its buffer
        assert client.batched_get(["a", "b", "c"], bufs) == [True, False, True]
        assert bufs[1] == bytearray(10)  # nothing written into the missed buffer
        assert bytes(bufs[2]) == b"z" * 10
        assert client.batched_get(["b"], [bytearray(5000)]) == [True]
        assert client.pool_stats().dropped == 0


def test_readonly_buffer_rejected(valkey_server):
    with RespClient(valkey_server.url) as client:
        with pytest.raises(ValueError, match="read-only"):
            client.batched_get(["k"], [b"immutable"])
        with pytest.raises(ValueError):
            client.batched_get(["k", "j"], [bytearray(1)])


def test_wrongtype_is_server_error_and_connection_survives(valkey_server):
    r = redis.Redis(host=valkey_server.host, port=valkey_server.port)
    r.rpush("alist", "x")
    r.set("good", b"ok")
    r.close()
    with RespClient(valkey_server.url, pool_size=1) as client:
        with pytest.raises(RespServerError, match="WRONGTYPE"):
            client.batched_get(["alist", "good"], [bytearray(1), bytearray(2)])
        buf = bytearray(2)
        assert client.batched_get(["good"], [buf]) == [True] and buf == b"ok"
        assert client.pool_stats().dropped == 0


def test_auth_with_password(valkey_factory):
    proc = valkey_factory(password="s3cret")
    with RespClient(_url(proc, password="s3cret")) as client:
        client.batched_set(["p"], [b"1"])
        assert client.batched_exists(["p"]) == [True]
    with RespClient(_url(proc)) as client:
        with pytest.raises(RespAuthError):
            client.batched_exists(["p"])
    with RespClient(_url(proc, password="wrong")) as client:
        with pytest.raises(RespAuthError):
            client.ping()


def test_auth_with_acl_user(valkey_server):
    admin = redis.Redis(host=valkey_server.host, port=valkey_server.port)
    admin.execute_command("ACL", "SETUSER", "alice", "on", ">alicepw", "~kv:*", "+@all")
    admin.execute_command("ACL", "SETUSER", "bob", "on", ">bobpw", "~*", "+@all", "-get")
    admin.close()
    with RespClient(_url(valkey_server, "alice", "alicepw"), pool_size=1) as client:
        client.batched_set(["kv:1"], [b"v"])
        buf = bytearray(1)
        assert client.batched_get(["kv:1"], [buf]) == [True] and buf == b"v"
        with pytest.raises(RespAuthError, match="NOPERM"):
            client.batched_set(["other"], [b"v"])  # outside alice's key pattern
        assert client.batched_exists(["kv:1"]) == [True]  # connection still in sync
    with RespClient(_url(valkey_server, "alice", "nope")) as client:
        with pytest.raises(RespAuthError):
            client.ping()
    with RespClient(_url(valkey_server, "bob", "bobpw")) as client:
        with pytest.raises(RespAuthError, match="NOPERM"):
            client.batched_get(["kv:1"], [bytearray(1)])


def test_select_db_from_url(valkey_server):
    with RespClient(valkey_server.url + "/3") as client:
        client.batched_set(["in-db3"], [b"x"])
    r = redis.Redis(host=valkey_server.host, port=valkey_server.port, db=3)
    assert r.get("in-db3") == b"x"
    r.close()
    with RespClient(valkey_server.url) as client:
        assert client.batched_exists(["in-db3"]) == [False]


def test_server_gone_raises_connection_error_and_drops(valkey_factory):
    proc = valkey_factory()
    client = RespClient(proc.url, timeout_s=2.0, pool_size=2)
    client.batched_set(["k"], [b"v"])
    proc.stop()
    t0 = time.monotonic()
    with pytest.raises(RespConnectionError):
        client.batched_exists(["k"])
    assert time.monotonic() - t0 < 3.0
    assert client.pool_stats().idle == 0 and client.pool_stats().dropped == 1
    with pytest.raises(RespConnectionError):  # a fresh connect is refused too
        client.ping()
    client.close()


def test_closed_client_refuses(valkey_server):
    client = RespClient(valkey_server.url)
    client.ping()
    client.close()
    client.close()
    with pytest.raises(RespClosedError):
        client.ping()


def test_many_threads_racing_sync_calls_lose_nothing(valkey_server):
    """Stress: 8 threads share a 3-connection pool; every call returns, with the right bytes."""
    n_threads, n_calls, size = 8, 60, 4096
    results: dict[int, int] = {}
    errors: list[BaseException] = []
    with RespClient(valkey_server.url, timeout_s=5.0, pool_size=3) as client:

        def worker(tid: int) -> None:
            ok = 0
            try:
                for i in range(n_calls):
                    keys = [f"t{tid}-{i}-{j}" for j in range(3)]
                    vals = [bytes([(tid * 31 + i + j) % 256]) * size for j in range(3)]
                    client.batched_set(keys, vals)
                    bufs = [bytearray(size) for _ in keys]
                    got = client.batched_get(keys + [f"missing-{tid}"], bufs + [bytearray(1)])
                    if got == [True, True, True, False] and [bytes(b) for b in bufs] == vals:
                        ok += 1
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
            results[tid] = ok

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "a call never returned"
        assert not errors, errors
        assert results == {t: n_calls for t in range(n_threads)}
        assert client.pool_stats().created <= 3


@pytest.mark.parametrize("value_bytes", [512, 3 << 20])  # one connection per call; a batch split over the GET threads
def test_close_racing_batched_get_resolves_every_call(valkey_server, value_bytes):
    """close() while 4 threads call batched_get: each call returns the right bytes or raises RespClosedError
    (never wrong bytes, never another error, never past its deadline), and no socket stays open after."""
    timeout = 2.0
    keys = [f"close-race-{i}" for i in range(2)]
    vals = [bytes([i + 1]) * value_bytes for i in range(2)]
    with RespClient(valkey_server.url) as c:
        c.batched_set(keys, vals)
    for round_ in range(3):  # close after 0, 20, 40 ms of calls
        client = RespClient(valkey_server.url, timeout_s=timeout, pool_size=4, parallel_gets=2)  # 1 GET thread: sub-batches queue
        outcomes: list[object] = []
        worst = [0.0]
        lock = threading.Lock()

        def caller() -> None:
            stop_at = time.monotonic() + 5.0
            for _ in range(100_000):  # bounded in count and time; ends at the first refusal
                if time.monotonic() > stop_at:
                    return
                bufs = [bytearray(value_bytes) for _ in keys]
                t0 = time.monotonic()
                try:
                    got = client.batched_get(keys, bufs)
                    out: object = "ok" if got == [True, True] and [bytes(b) for b in bufs] == vals else ("wrong", got)
                except RespClosedError:
                    out = "closed"
                except BaseException as exc:  # noqa: BLE001 - reported by the assert below
                    out = exc
                with lock:
                    worst[0] = max(worst[0], time.monotonic() - t0)
                    outcomes.append(out)
                if out != "ok":
                    return

        threads = [threading.Thread(target=caller) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.02 * round_)
        closed_at = time.monotonic()
        client.close()
        for t in threads:
            t.join(timeout=3 * timeout)
        # a call in flight ends when its sub-batches do, not at its deadline (loopback: milliseconds)
        assert time.monotonic() - closed_at < timeout / 4
        assert not any(t.is_alive() for t in threads), "a call never returned"
        assert set(map(str, outcomes)) <= {"ok", "closed"}, [o for o in outcomes if o not in ("ok", "closed")][:3]
        assert outcomes.count("closed") == 4  # every thread ended on the refusal
        assert worst[0] <= timeout * 1.1
        assert client.pool_stats().idle == 0
