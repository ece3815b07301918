"""kvctl.diagnose.procnet against this test process's own real sockets and epoll (Linux /proc)."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys

import pytest

from kvctl.diagnose.procnet import TcpConn, _addr, read_sockets

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs Linux /proc")


def test_hex_addresses_as_the_kernel_writes_them():
    # /proc/net/tcp stores IPv4 as one little-endian word: 127.0.0.1 → 0100007F; port 6379 = 0x18EB
    assert _addr("0100007F:18EB") == "127.0.0.1:6379"
    # 10.0.0.2 → bytes 0a 00 00 02 → little-endian word 0200000A; port 80 = 0x0050
    assert _addr("0200000A:0050") == "10.0.0.2:80"
    # IPv6 ::1 is four little-endian words: 0, 0, 0, 1 → the last word 01000000
    assert _addr("00000000000000000000000001000000:1F90") == "[::1]:8080"


def test_listener_connection_and_epoll_registrations_of_a_live_process():
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    cli = socket.create_connection(("127.0.0.1", port), timeout=5)
    acc, _ = srv.accept()
    ep = select.epoll()
    try:
        before = read_sockets(os.getpid())
        assert before is not None and cli.fileno() not in before.epoll_fds and cli.fileno() not in [c.fd for c in before.loop_waits_on]
        ep.register(cli.fileno(), select.EPOLLIN)
        ep.register(srv.fileno(), select.EPOLLIN)
        got = read_sockets(os.getpid())
        assert got is not None
        by_fd = {c.fd: c for c in got.tcp}
        assert by_fd[srv.fileno()] == TcpConn(srv.fileno(), f"127.0.0.1:{port}", "0.0.0.0:0", "LISTEN")
        client_side = by_fd[cli.fileno()]
        assert client_side.state == "ESTABLISHED" and client_side.remote == f"127.0.0.1:{port}"
        assert client_side.local == f"127.0.0.1:{cli.getsockname()[1]}"
        assert by_fd[acc.fileno()].local == f"127.0.0.1:{port}"
        # the loop waits on the client socket only (the accepted one is not registered) and watches the listener
        assert [c.fd for c in got.loop_waits_on] == [cli.fileno()]
        assert got.loop_listens
        assert str(by_fd[srv.fileno()]) == f"listening on 127.0.0.1:{port}"
        assert str(client_side) == f"127.0.0.1:{cli.getsockname()[1]} → 127.0.0.1:{port}"
    finally:
        ep.close()
        for s in (acc, cli, srv):
            s.close()


def test_ipv6_loopback_connection():
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    try:
        srv = socket.create_server(("::1", 0), family=socket.AF_INET6)
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    port = srv.getsockname()[1]
    cli = socket.create_connection(("::1", port), timeout=5)
    try:
        got = read_sockets(os.getpid())
        conn = {c.fd: c for c in got.tcp}[cli.fileno()]
        assert conn.remote == f"[::1]:{port}" and conn.state == "ESTABLISHED"
    finally:
        cli.close()
        srv.close()


def test_a_gone_process_reads_as_none():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(timeout=30)
    assert read_sockets(p.pid) is None  # reaped: /proc/PID no longer exists
