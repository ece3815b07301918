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


def test_close_mid_payload(scripted):
    def script(conn: socket.socket) -> bool:
        conn.sendall(b"$1000\r\n" + b"x" * 300)
        return False

    srv = scripted(script)
    with RespClient(srv.url, timeout_s=TIMEOUT_S) as client:
        with pytest.raises(RespConnectionError, match="closed"):
            client.batched_get(["k"], [bytearray(1000)])
        _assert_dropped(client)


def test_stall_mid_payload_times_out(scripted):
    def script(conn: socket.socket) -> bool:
        conn.sendall(b"$1000\r\n" + b"x" * 300)
        return True

    srv = scripted(script)
    with RespClient(srv.url, timeout_s=TIMEOUT_S) as client:
        with pytest.raises(RespTimeout):
            client.batched_get(["k"], [bytearray(1000)])
        _assert_dropped(client)


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
