"""Issue 11: RespClient never returns wrong bytes and never outlives its deadline.

Server stops, kills and restarts use a real valkey-server (tests/conftest.py
fixtures). Misbehaviours a real Valkey cannot produce (an unsolicited extra
reply, a reply dripped byte by byte, an announced 10 GB bulk) come from
:class:`ScriptedServer` (tests/connector/resp_fakes.py), a fake RESP server on
loopback that is NOT Valkey. Every server loop here is bounded in count and time.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest

from kvctl.connector.resp import RespClient, RespConnectionError, RespProtocolError, RespTimeout
from tests.connector.resp_fakes import ScriptedServer

TIMEOUT_S = 0.5
# worst call allowed against the deadline: the target is deadline + 10 %
SLACK = 1.10


# -- item 1: bytes left unread after a reply are never the next reply ---------------
@pytest.mark.parametrize("late_s", [0.0, 0.05])
def test_unsolicited_extra_reply_is_never_returned_as_a_hit(late_s):
    """``GET a`` answered with AAAA plus an unsolicited EVIL: the next ``GET b`` must get BBBB.

    late_s=0: EVIL arrives in the same packet (left in the client's read
    buffer); late_s=0.05: EVIL arrives 50 ms later, while the connection sits
    idle in the pool (left in the kernel's socket buffer). An unsolicited
    reply that arrives only after the next request was sent cannot be told
    from that request's reply in RESP2; no client can catch that one.
    """

    def script(conn: socket.socket, n: int) -> bool:
        if n == 0 and not late_s:
            conn.sendall(b"$4\r\nAAAA\r\n$4\r\nEVIL\r\n")  # one packet
        elif n == 0:
            conn.sendall(b"$4\r\nAAAA\r\n")
            time.sleep(late_s)
            conn.sendall(b"$4\r\nEVIL\r\n")
        else:
            conn.sendall(b"$4\r\nBBBB\r\n")
        return True

    with ScriptedServer(script, serve_more=True) as srv, RespClient(srv.url, timeout_s=1.0, pool_size=1) as client:
        a = bytearray(4)
        assert client.batched_get(["a"], [a]) == [True] and a == b"AAAA"
        time.sleep(4 * late_s)  # the late EVIL is in the idle socket before the next call
        b = bytearray(4)
        assert client.batched_get(["b"], [b]) == [True]
        assert b == b"BBBB", f"the next call returned the unsolicited {bytes(b)!r}"
        stats = client.pool_stats()
        assert stats.created == 2 and stats.dropped == 1, stats  # the desynced socket was dropped


# -- item 2: one deadline per call ------------------------------------------------------
def _drip(reply: bytes, every_s: float):
    """A script that sends ``reply`` one byte every ``every_s`` (each byte well within the timeout)."""

    def script(conn: socket.socket, n: int) -> bool:
        for i in range(len(reply)):
            conn.sendall(reply[i : i + 1])
            time.sleep(every_s)
        return True

    return script


def test_dripped_reply_cannot_stretch_the_call():
    """10 bytes, one per 0.1 s = 1.0 s of reply against timeout_s=0.5: the call ends at 0.5 s."""
    with ScriptedServer(_drip(b"$4\r\nAAAA\r\n", 0.1)) as srv, RespClient(srv.url, timeout_s=TIMEOUT_S) as client:
        t0 = time.monotonic()
        with pytest.raises(RespTimeout):
            client.batched_get(["k"], [bytearray(4)])
        took = time.monotonic() - t0
        assert took <= TIMEOUT_S * SLACK, f"call took {took:.2f}s against a {TIMEOUT_S}s deadline"
        assert client.pool_stats().idle == 0


def _stream_bulk(header: bytes, chunk: int, every_s: float, max_s: float):
    """Announce a bulk with ``header``, then stream ``chunk`` bytes every ``every_s`` for at most ``max_s``."""

    def script(conn: socket.socket, n: int) -> bool:
        conn.sendall(header)
        data = b"x" * chunk
        end = time.monotonic() + max_s
        while time.monotonic() < end:
            conn.sendall(data)
            time.sleep(every_s)
        return False

    return script


def test_announced_10gb_bulk_is_refused_at_once():
    """``$10000000000`` is 20x Valkey's 512 MB proto-max-bulk-len: a protocol error, not 10 GB of reading."""
    script = _stream_bulk(b"$10000000000\r\n", 64 * 1024, 0.005, 3.0)
    with ScriptedServer(script) as srv, RespClient(srv.url, timeout_s=1.0) as client:
        t0 = time.monotonic()
        with pytest.raises(RespProtocolError, match="10000000000"):
            client.batched_get(["k"], [bytearray(4)])
        assert time.monotonic() - t0 < 0.5
        assert client.pool_stats().dropped == 1


def test_bulk_within_the_cap_streamed_slowly_ends_at_the_deadline():
    """100 MB announced (under the cap) at ~6.4 MB/s: discarding it would take 15 s; the call ends at 0.5 s."""
    script = _stream_bulk(b"$100000000\r\n", 64 * 1024, 0.01, 3.0)
    with ScriptedServer(script) as srv, RespClient(srv.url, timeout_s=TIMEOUT_S) as client:
        t0 = time.monotonic()
        with pytest.raises(RespTimeout):
            client.batched_get(["k"], [bytearray(4)])
        took = time.monotonic() - t0
        assert took <= TIMEOUT_S * SLACK, took


def test_max_bulk_bytes_knob(valkey_server):
    """A value over ``max_bulk_bytes`` is refused; the default (512 MiB) reads it."""
    with RespClient(valkey_server.url) as client:
        client.batched_set(["big"], [b"v" * 1000])
        buf = bytearray(1000)
        assert client.batched_get(["big"], [buf]) == [True] and buf == b"v" * 1000
    with RespClient(valkey_server.url, max_bulk_bytes=999) as client:
        with pytest.raises(RespProtocolError, match="1000"):
            client.batched_get(["big"], [bytearray(1000)])


def test_pool_wait_and_read_share_one_deadline(valkey_server):
    """SIGSTOPped Valkey, pool of 1, two callers: the second waits for the pool AND reads, within 1.0 s in all."""
    timeout = 1.0
    client = RespClient(valkey_server.url, timeout_s=timeout, pool_size=1)
    client.batched_set(["k"], [b"v"])
    times: list[float] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def call() -> None:
        t0 = time.monotonic()
        try:
            client.batched_get(["k"], [bytearray(1)])
        except RespConnectionError as exc:
            errors.append(exc)
        with lock:
            times.append(time.monotonic() - t0)

    os.kill(valkey_server.pid, signal.SIGSTOP)
    try:
        threads = [threading.Thread(target=call) for _ in range(2)]
        for t in threads:
            t.start()
            time.sleep(0.05)  # the first holds the only connection when the second asks
        for t in threads:
            t.join(timeout=10)
    finally:
        os.kill(valkey_server.pid, signal.SIGCONT)
        client.close()
    assert len(errors) == 2 and all(isinstance(e, RespTimeout) for e in errors), errors
    assert max(times) <= timeout * SLACK, f"calls took {times} against a {timeout}s deadline"


def test_multi_mb_gets_keep_the_deadline_on_the_connection_they_leave(valkey_server, waitall_calls):
    """A 4 MB value read with MSG_WAITALL on the blocking socket (resp_conn.py) hands its connection back with the
    deadline machinery intact: the next call on it, against the SIGSTOPped server, still ends at its deadline, and
    once the server runs again the value reads whole."""
    from kvctl.connector import resp_conn

    timeout = 1.0
    value = os.urandom(4 << 20)
    client = RespClient(valkey_server.url, timeout_s=timeout, pool_size=1)
    try:
        client.batched_set(["big"], [value])
        buf = bytearray(len(value))
        assert client.batched_get(["big"], [buf]) == [True] and buf == value
        assert client.pool_stats().idle == 1
        assert waitall_calls or not resp_conn.WAITALL_OK
        os.kill(valkey_server.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(RespTimeout):
                client.batched_get(["big"], [bytearray(len(value))])
            took = time.monotonic() - t0
        finally:
            os.kill(valkey_server.pid, signal.SIGCONT)
        assert took <= timeout * SLACK, f"the call took {took:.2f}s against a {timeout}s deadline"
        buf = bytearray(len(value))
        assert client.batched_get(["big"], [buf]) == [True] and buf == value
    finally:
        client.close()


# -- item 3: dead pooled connections after a restart -------------------------------------
def _fill_pool(client: RespClient, n: int, key: str) -> None:
    """Make the pool hold ``n`` idle connections: ``n`` threads GET at once (bounded retries)."""
    for _ in range(20):
        barrier = threading.Barrier(n)

        def get() -> None:
            barrier.wait(timeout=5)
            client.batched_get([key] * 4, [bytearray(1 << 20) for _ in range(4)])

        threads = [threading.Thread(target=get) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
        if client.pool_stats().idle == n:
            return
    raise AssertionError(f"could not get {n} idle connections: {client.pool_stats()}")


def test_first_calls_after_a_restart_succeed(valkey_factory):
    """SIGKILL + restart on the same port: no call fails because of the pool's dead sockets."""
    proc = valkey_factory()
    pool = 4
    client = RespClient(proc.url, timeout_s=2.0, pool_size=pool)
    client.batched_set(["warm"], [b"w" * (1 << 20)])
    _fill_pool(client, pool, "warm")
    os.kill(proc.pid, signal.SIGKILL)
    proc._popen.wait(timeout=10)
    restarted = valkey_factory(port=proc.port)
    try:
        for i in range(2 * pool):  # more calls than pooled sockets: each would have failed once
            value = bytes([i]) * 1000
            client.batched_set([f"after-{i}"], [value])
            buf = bytearray(1000)
            assert client.batched_get([f"after-{i}"], [buf]) == [True] and buf == value
            assert client.batched_exists([f"after-{i}", "warm"]) == [True, False]  # "warm" died with the old server
        assert client.ping()
    finally:
        client.close()
    assert restarted.alive()


def test_reused_connection_failing_before_any_reply_is_retried_once():
    """A pooled socket that the server closes on our request without a reply byte (as after a restart).

    Fake server (not Valkey): on an idle connection it passes the health check,
    then closes as soon as the next request arrives. Requests 1, 3, 5 and 7 are
    answered that way; the others normally. GET, EXISTS and SET are retried
    once on a fresh connection (idempotent); DEL is not, because a second DEL
    would report a different count if the first had been applied.
    """
    replies = {0: b"+PONG\r\n", 2: b"$1\r\nv\r\n", 4: b":1\r\n", 6: b"+OK\r\n"}

    def script(conn: socket.socket, n: int) -> bool:
        if n not in replies:
            return False  # request read, connection closed without a reply
        conn.sendall(replies[n])
        return True

    with ScriptedServer(script, serve_more=True, max_conns=8) as srv, RespClient(srv.url, timeout_s=1.0, pool_size=1) as client:
        assert client.ping()  # request 0, connection 1
        buf = bytearray(1)
        assert client.batched_get(["k"], [buf]) == [True] and buf == b"v"  # 1 closed, retried as 2
        assert client.batched_exists(["k"]) == [True]  # 3 closed, retried as 4
        client.batched_set(["k"], [b"v"])  # 5 closed, retried as 6
        with pytest.raises(RespConnectionError, match="closed"):
            client.delete(["k"])  # 7 closed: no retry
        assert srv.requests == 8
        stats = client.pool_stats()
        assert stats.created == 4 and stats.dropped == 4, stats


def test_a_call_whose_deadline_passed_keeps_the_idle_connection(valkey_server):
    """A submitted GET that waited past its deadline fails at once and leaves the pooled socket pooled."""
    with RespClient(valkey_server.url, timeout_s=TIMEOUT_S, pool_size=1) as client:
        client.batched_set(["k"], [b"v"])
        assert client.pool_stats().idle == 1
        with pytest.raises(RespTimeout, match="deadline"):
            client._run(lambda conn: None, deadline=time.monotonic() - 0.01)  # what the I/O thread does
        stats = client.pool_stats()
        assert stats.idle == 1 and stats.dropped == 0 and stats.created == 1, stats
        buf = bytearray(1)
        assert client.batched_get(["k"], [buf]) == [True] and buf == b"v"
