"""Paper §5.4 bug 2: a GET of a missing key read with a fixed-size header.

A client sized its reply header for a chunk (``$12400000\\r\\n`` is 11 bytes)
and reads exactly that many bytes. For a missing key Valkey answers the
5-byte null bulk ``$-1\\r\\n``, so the read never completes. The GET runs on
an I/O pool thread; the caller waits on its future (which is *not* a lost
completion: the I/O thread is still busy with it).
"""

from __future__ import annotations

import concurrent.futures
import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import parse_args, ready  # noqa: E402

HEADER_BYTES = 11  # "$12400000\r\n": the header of one 12.4 MB chunk


class FixedHeaderRespClient:
    def __init__(self, host: str, port: int) -> None:
        self._sock = socket.create_connection((host, port), timeout=5)
        self._sock.settimeout(None)

    def _send(self, *parts: bytes) -> None:
        out = b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)
        self._sock.sendall(out)

    def _read_exactly(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            part = self._sock.recv(n - len(buf))
            if not part:
                raise ConnectionError("closed")
            buf += part
        return bytes(buf)

    def set(self, key: bytes, value: bytes) -> None:
        self._send(b"SET", key, value)
        assert self._read_exactly(5) == b"+OK\r\n"

    def get(self, key: bytes) -> bytes:
        self._send(b"GET", key)
        header = self._read_exactly(HEADER_BYTES)  # never returns on "$-1\r\n"
        size = int(header[1:].strip())
        return self._read_exactly(size + 2)[:-2]


def main() -> None:
    ns = parse_args([(("--port",), {"type": int, "required": True})])
    client = FixedHeaderRespClient("127.0.0.1", ns.port)
    client.set(b"present-chunk", b"x" * 64)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="remote-io")
    fut = pool.submit(client.get, b"evicted-chunk-0042")
    time.sleep(0.3)
    ready("get blocked")
    fut.result()


if __name__ == "__main__":
    main()
