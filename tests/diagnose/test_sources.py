"""The outside-world readers of ``kvctl diagnose``, against real local sockets."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from kvctl.diagnose import sources
from kvctl.errors import Unreachable
from kvctl.tier.targets import Target


def test_silent_valkey_costs_one_timeout_not_one_per_retry():
    """A server that accepts and never answers: Unreachable after about --timeout, on one connection."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    conns: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conns.append(srv.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    port = srv.getsockname()[1]
    t0 = time.monotonic()
    try:
        with pytest.raises(Unreachable, match="Valkey rank 0"):
            sources.valkey_info(Target(0, "127.0.0.1", port, f"resp://127.0.0.1:{port}"), timeout_s=0.5)
        elapsed = time.monotonic() - t0
    finally:
        srv.close()
        for c in conns:
            c.close()
    assert elapsed < 2.0, f"one scrape of a silent instance took {elapsed:.1f}s with --timeout 0.5"
    assert len(conns) == 1
