"""The outside-world readers of ``kvctl diagnose``, against real local sockets."""

from __future__ import annotations

import socket
import time

import pytest

from kvctl.diagnose import sources
from kvctl.errors import Unreachable
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
