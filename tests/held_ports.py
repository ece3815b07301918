"""Ports held the way a busy shared host holds them: real listening sockets on loopback (issue 48 item 7)."""

from __future__ import annotations

import contextlib
import errno
import socket
from typing import Iterator

from kvctl.core.thresholds import BASE_PORT
from kvctl.tier.server import port_in_use


@contextlib.contextmanager
def held_ports(first: int = BASE_PORT, n: int = 4) -> Iterator[list[int]]:
    """Listen on 127.0.0.1 ports ``first`` .. ``first + n - 1`` (one already taken by someone else stays taken: it is
    busy either way) for the block; yields the ports, every one of them in use."""
    socks = []
    try:
        for port in range(first, first + n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("127.0.0.1", port))
                s.listen(1)
                socks.append(s)
            except OSError as e:
                s.close()
                if e.errno != errno.EADDRINUSE:
                    raise
        ports = list(range(first, first + n))
        assert all(port_in_use(p) for p in ports), ports
        yield ports
    finally:
        for s in socks:
            s.close()
