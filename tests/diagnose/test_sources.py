"""The outside-world readers of ``kvctl diagnose``, against real local sockets."""

from __future__ import annotations

import socket
import time

import pytest

from kvctl.diagnose import sources
from kvctl.core.errors import Unreachable
from kvctl.tier.targets import Target


def test_silent_valkey_costs_one_timeout_not_one_per_retry():
    """A server that accepts and never answers: Unreachable after about --timeout, on one connection.

    The kernel completes each handshake into the listen backlog without accept(),
    so the connections made are counted afterwards by draining it.
    """
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(32)
    port = srv.getsockname()[1]
    conns: list[socket.socket] = []
    try:
        t0 = time.monotonic()
        with pytest.raises(Unreachable, match="Valkey rank 0"):
            sources.valkey_info(Target(0, "127.0.0.1", port, f"resp://127.0.0.1:{port}"), timeout_s=0.5)
        elapsed = time.monotonic() - t0
        srv.setblocking(False)
        while True:
            try:
                conns.append(srv.accept()[0])
            except BlockingIOError:
                break
    finally:
        srv.close()
        for c in conns:
            c.close()
    # redis-py's default retries made this ~9.5 s and 11 connections
    assert elapsed < 4.0, f"one scrape of a silent instance took {elapsed:.1f}s with --timeout 0.5"
    assert len(conns) == 1


def test_engine_dripping_its_metrics_costs_one_deadline_not_forever():
    """An engine that answers /metrics 1 byte every 0.1 s (each read just inside the socket timeout).

    Before, urlopen's timeout bounded each read only, so the scrape lasted as long as the
    drip (here up to 8 s, in production forever). Now the whole read ends by about two
    timeouts (one deadline, plus at most one last blocked read): 2 × 0.5 s + slack < 2 s.
    """
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    stop = threading.Event()

    def drip():
        conn, _ = srv.accept()
        with conn:
            conn.recv(4096)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 80\r\n\r\n")
            for _ in range(80):  # bounded: 80 bytes, 8 s at most
                if stop.is_set():
                    return
                try:
                    conn.sendall(b"#")
                except OSError:
                    return
                time.sleep(0.1)

    t = threading.Thread(target=drip, daemon=True)
    t.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(Unreachable, match="not read within"):
            sources.fetch_metrics(f"http://127.0.0.1:{port}", timeout_s=0.5)
        assert time.monotonic() - t0 < 2.0
    finally:
        stop.set()
        t.join(timeout=5)
        srv.close()
