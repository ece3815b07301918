"""RespClient against misbehaving servers: every failure is bounded and drops the connection.

The servers here are NOT Valkey: :class:`ScriptedServer` (tests/connector/resp_fakes.py)
is a tiny loopback socket server that plays a misbehaving RESP server
(silence, truncated replies, garbage type bytes, a close mid-payload).
"""

from __future__ import annotations

import socket
import time
from typing import Callable

import pytest

from kvctl.connector import resp_conn
from kvctl.connector.resp import (
    RespClient,
    RespConnectionError,
    RespProtocolError,
    RespTimeout,
)
from tests.connector.resp_fakes import ScriptedServer

TIMEOUT_S = 0.5


@pytest.fixture
def scripted():
    servers: list[ScriptedServer] = []

    def make(script: Callable[[socket.socket], bool]) -> ScriptedServer:
        srv = ScriptedServer(lambda conn, _n: script(conn))
        servers.append(srv)
        return srv

    yield make
    for s in servers:
        s.stop()


def _assert_dropped(client: RespClient) -> None:
    stats = client.pool_stats()
    assert stats.idle == 0 and stats.dropped == 1, stats


def test_silent_server_times_out(scripted):
    srv = scripted(lambda conn: True)  # reads the GET, never answers
    with RespClient(srv.url, timeout_s=TIMEOUT_S) as client:
        t0 = time.monotonic()
        with pytest.raises(RespTimeout, match="no reply"):
            client.batched_get(["k"], [bytearray(4)])
        assert time.monotonic() - t0 < TIMEOUT_S + 1.0
        _assert_dropped(client)


#: a value small enough for the buffered reader, and one whose rest takes the MSG_WAITALL receive (resp_conn.py)
SIZES = [1000, 4 * resp_conn.WAITALL_MIN_BYTES]


def _expect_waitall(size: int, calls: list[int]) -> None:
    """The large size went through the MSG_WAITALL receive where the platform has it, the small one never."""
    if size >= resp_conn.WAITALL_MIN_BYTES + resp_conn._READ_CHUNK and resp_conn.WAITALL_OK:
        assert calls, "a multi-MB payload was read without MSG_WAITALL"
    elif size < resp_conn.WAITALL_MIN_BYTES:
        assert not calls


@pytest.mark.parametrize("size", SIZES)
def test_close_mid_payload(scripted, waitall_calls, size):
    def script(conn: socket.socket) -> bool:
        conn.sendall(b"$%d\r\n" % size + b"x" * (size * 3 // 4))
        return False

    srv = scripted(script)
    with RespClient(srv.url, timeout_s=TIMEOUT_S) as client:
        t0 = time.monotonic()
        with pytest.raises(RespConnectionError, match="closed"):
            client.batched_get(["k"], [bytearray(size)])
        assert time.monotonic() - t0 < TIMEOUT_S + 1.0
        _assert_dropped(client)
    _expect_waitall(size, waitall_calls)


@pytest.mark.parametrize("size", SIZES)
def test_stall_mid_payload_times_out(scripted, waitall_calls, size):
    """A server that stops mid-value (the paper's §5.4 stall): the call ends at its deadline, in either reader."""

    def script(conn: socket.socket) -> bool:
        conn.sendall(b"$%d\r\n" % size + b"x" * (size * 3 // 4))
        return True

    srv = scripted(script)
    with RespClient(srv.url, timeout_s=TIMEOUT_S) as client:
        t0 = time.monotonic()
        with pytest.raises(RespTimeout):
            client.batched_get(["k"], [bytearray(size)])
        took = time.monotonic() - t0
        assert TIMEOUT_S * 0.9 < took < TIMEOUT_S + 1.0, took
        _assert_dropped(client)
    _expect_waitall(size, waitall_calls)


@pytest.mark.parametrize("size", SIZES)
def test_a_value_dripped_in_pieces_arrives_whole(scripted, waitall_calls, size):
    """The payload and its CRLF in eight pieces 20 ms apart, then a second value: both filled, the connection kept.

    The MSG_WAITALL receive waits across the pieces in the kernel; the CRLF it reads with the payload's rest
    arrives in a piece of its own.
    """
    first = bytes(range(256)) * (size // 256) + bytes(size % 256)
    second = b"y" * size

    srv = scripted(lambda conn: _drip(conn, size, first, second))
    with RespClient(srv.url, timeout_s=5.0) as client:
        a, b = bytearray(size), bytearray(size)
        assert client.batched_get(["a", "b"], [a, b]) == [True, True]
        assert a == first and b == second
        assert client.pool_stats().idle == 1  # in sync, kept
    _expect_waitall(size, waitall_calls)


def _drip(conn: socket.socket, size: int, first: bytes, second: bytes) -> bool:
    """Two GET replies, the first in eight pieces and its CRLF split, 20 ms apart."""
    wire = b"$%d\r\n" % size + first
    step = len(wire) // 8 + 1
    for i in range(0, len(wire), step):
        conn.sendall(wire[i : i + step])
        time.sleep(0.02)
    conn.sendall(b"\r")
    time.sleep(0.02)
    conn.sendall(b"\n" + b"$%d\r\n" % size + second + b"\r\n")
    return True


@pytest.mark.parametrize("size", SIZES)
def test_a_large_value_not_ended_by_crlf_is_a_protocol_error(scripted, waitall_calls, size):
    def script(conn: socket.socket) -> bool:
        conn.sendall(b"$%d\r\n" % size + b"x" * size + b"XY")
        return True

    srv = scripted(script)
    with RespClient(srv.url, timeout_s=TIMEOUT_S) as client:
        with pytest.raises(RespProtocolError, match="CRLF"):
            client.batched_get(["k"], [bytearray(size)])
        _assert_dropped(client)
    _expect_waitall(size, waitall_calls)


def test_truncated_header_then_close(scripted):
    def script(conn: socket.socket) -> bool:
        conn.sendall(b"$-")  # half a null bulk header
        return False

    srv = scripted(script)
    with RespClient(srv.url, timeout_s=TIMEOUT_S) as client:
        with pytest.raises(RespConnectionError):
            client.batched_get(["k"], [bytearray(4)])
        _assert_dropped(client)


def test_null_bulk_split_across_packets_is_a_miss(scripted):
    """The 5-byte $-1 header arrives in pieces: still a per-key miss, no hang (bug 2)."""

    def script(conn: socket.socket) -> bool:
        for piece in (b"$", b"-1", b"\r", b"\n", b"$4\r\nab", b"cd\r\n"):
            conn.sendall(piece)
            time.sleep(0.02)
        return True

    srv = scripted(script)
    with RespClient(srv.url, timeout_s=TIMEOUT_S) as client:
        buf = bytearray(4)
        assert client.batched_get(["gone", "here"], [bytearray(11), buf]) == [False, True]
        assert buf == b"abcd"
        assert client.pool_stats().idle == 1  # in sync, kept


@pytest.mark.parametrize(
    "reply, error",
    [
        (b"!garbage\r\n", RespProtocolError),
        (b"*1\r\n$1\r\nx\r\n", RespProtocolError),  # an array where a bulk was expected
        (b"$abc\r\n", RespProtocolError),
        (b"$-5\r\n", RespProtocolError),
        (b"$4\r\nabcdXX", RespProtocolError),  # payload not followed by CRLF
        (b"$" + b"9" * 70000, RespProtocolError),  # header with no CRLF in sight
    ],
)
def test_malformed_get_replies(scripted, reply, error):
    def script(conn: socket.socket) -> bool:
        conn.sendall(reply)
        return True

    srv = scripted(script)
    with RespClient(srv.url, timeout_s=TIMEOUT_S) as client:
        t0 = time.monotonic()
        with pytest.raises(error):
            client.batched_get(["k"], [bytearray(4)])
        assert time.monotonic() - t0 < TIMEOUT_S + 1.0
        _assert_dropped(client)


@pytest.mark.parametrize("reply", [b"$3\r\nabc\r\n", b"?1\r\n", b":x\r\n"])
def test_malformed_exists_replies(scripted, reply):
    def script(conn: socket.socket) -> bool:
        conn.sendall(reply)
        return True

    srv = scripted(script)
    with RespClient(srv.url, timeout_s=TIMEOUT_S) as client:
        with pytest.raises(RespProtocolError):
            client.batched_exists(["k"])
        _assert_dropped(client)


def test_connect_refused_is_bounded():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        with RespClient(f"resp://127.0.0.1:{port}", timeout_s=TIMEOUT_S) as client:
            t0 = time.monotonic()
            with pytest.raises(RespConnectionError, match="cannot connect"):
                client.ping()
            assert time.monotonic() - t0 < TIMEOUT_S + 1.0


@pytest.mark.parametrize("reply", [b"+OK\r\n", b":x\r\n"])
def test_malformed_del_replies(scripted, reply):
    """A DEL answered with something other than an integer is a protocol error (not a ValueError)."""

    def script(conn: socket.socket) -> bool:
        conn.sendall(reply)
        return True

    srv = scripted(script)
    with RespClient(srv.url, timeout_s=TIMEOUT_S) as client:
        with pytest.raises(RespProtocolError):
            client.delete(["k"])
        _assert_dropped(client)
