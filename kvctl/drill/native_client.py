"""The tier client of the ``missing-key-stall`` drill: the fixed-size-header reader of paper §5.4, bug 2.

It sizes each GET's reply header for a stored chunk (``$<chunk_bytes>\\r\\n``) and reads exactly that
many bytes. A missing key's reply is the 5-byte null bulk ``$-1\\r\\n``, so the read never returns
and the engine's load blocks in a socket receive forever: what LMCache 0.5.6's native ``resp://``
client does, and what ``kvctl diagnose stalls`` names ``missing-key-get``. Only the drill engine
uses it, on purpose; kvctl's own client (:class:`kvctl.connector.resp.RespClient`) parses headers
up to CRLF and cannot hang this way.
"""

from __future__ import annotations

import socket
import threading
from typing import Sequence
from urllib.parse import urlsplit

#: Seconds the drill engine waits to connect to its own loopback tier (a connect, not a read: reads have no
#: deadline, on purpose)
CONNECT_TIMEOUT_S = 5.0


class FixedHeaderRespClient:
    """One socket, one call at a time; SET and EXISTS are read correctly, GET is not (on purpose)."""

    def __init__(self, url: str, chunk_bytes: int, connect_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        parts = urlsplit(url)
        self._sock = socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 6379), timeout=connect_timeout_s)
        self._sock.settimeout(None)  # like the native client: no deadline on a read
        self._header_bytes = len(f"${chunk_bytes}\r\n")
        self._lock = threading.Lock()

    def close(self) -> None:
        self._sock.close()

    def _send(self, *parts: bytes) -> None:
        out = b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)
        self._sock.sendall(out)

    def _read_exactly(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            part = self._sock.recv(n - len(buf))
            if not part:
                raise ConnectionError("the server closed the connection")
            buf += part
        return bytes(buf)

    def _read_line(self) -> bytes:
        buf = bytearray()
        while not buf.endswith(b"\r\n"):
            part = self._sock.recv(1)
            if not part:
                raise ConnectionError("the server closed the connection")
            buf += part
        return bytes(buf[:-2])

    def batched_exists(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            out = []
            for k in keys:
                self._send(b"EXISTS", k.encode())
                out.append(self._read_line() == b":1")
            return out

    def batched_set(self, keys: Sequence[str], values: Sequence[bytes | bytearray | memoryview]) -> None:
        with self._lock:
            for k, v in zip(keys, values):
                self._send(b"SET", k.encode(), bytes(v))
                line = self._read_line()
                if line != b"+OK":
                    raise ConnectionError(f"SET answered {line[:80]!r}")

    def batched_get(self, keys: Sequence[str], buffers: Sequence[bytearray | memoryview]) -> list[bool]:
        with self._lock:
            for k, buf in zip(keys, buffers):
                self._send(b"GET", k.encode())
                header = self._read_exactly(self._header_bytes)  # never returns on "$-1\r\n" (bug 2)
                size = int(header[1:].strip())
                memoryview(buf)[:size] = self._read_exactly(size + 2)[:-2]
            return [True] * len(keys)
