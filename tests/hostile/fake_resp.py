"""A small fake RESP2 server on 127.0.0.1 (a free port) for what a real Valkey will not do: drip its replies a
byte at a time, or answer INFO / CONFIG GET with hostile replies.

It answers like a small, healthy, empty Valkey 8 (PING, AUTH, SELECT, CLIENT, INFO, CONFIG GET, RANDOMKEY,
STRLEN, DBSIZE, ...) unless ``replies`` names the raw bytes a command gets (by its upper-cased name, e.g.
``"INFO"``, ``"CONFIG"``). ``drip_s``: every reply (or only those to the commands in ``drip``) goes out one
byte per ``drip_s`` seconds. Everything is
bounded: ``max_conns`` connections, ``life_s`` seconds of dripping, and leaving the ``with`` stops the
accept loop, shuts every connection and joins every thread.
"""

from __future__ import annotations

import fnmatch
import socket
import threading
import time

INFO_TEXT = (
    "# Server\r\nredis_version:7.2.4\r\nvalkey_version:8.1.1\r\nprocess_id:4242\r\nrun_id:5f1c0ffee5f1c0ffee5f1c0ffee5f1c0ffee00000\r\n\r\n"
    "# Clients\r\nconnected_clients:1\r\n\r\n"
    "# Memory\r\nused_memory:1048576\r\nused_memory_rss:4194304\r\nmaxmemory:67108864\r\ntotal_system_memory:8589934592\r\n\r\n"
    "# Stats\r\nevicted_keys:0\r\nkeyspace_hits:0\r\ntotal_net_input_bytes:100\r\ntotal_net_output_bytes:200\r\n\r\n"
    "# Commandstats\r\ncmdstat_get:calls=0,usec=0,usec_per_call=0.00,rejected_calls=0,failed_calls=0\r\n"
    "cmdstat_info:calls=1,usec=10,usec_per_call=10.00,rejected_calls=0,failed_calls=0\r\n\r\n"
    "# Keyspace\r\n"
)
CONFIG = {
    "maxmemory": "67108864", "maxmemory-policy": "allkeys-lru", "save": "", "appendonly": "no", "io-threads": "1",
    "proto-max-bulk-len": "536870912", "client-output-buffer-limit": "normal 0 0 0 replica 268435456 67108864 60 pubsub 33554432 8388608 60",
    "maxclients": "10000", "disable-thp": "yes",
}


def bulk(data: bytes | str) -> bytes:
    raw = data.encode() if isinstance(data, str) else data
    return b"$%d\r\n%s\r\n" % (len(raw), raw)


def info_with(extra: str) -> bytes:
    """An INFO reply (a bulk) of :data:`INFO_TEXT` with ``extra`` lines appended (``\\r\\n`` each)."""
    return bulk(INFO_TEXT + "".join(line + "\r\n" for line in extra.split("\n") if line))


def _array(items: list[bytes]) -> bytes:
    return b"*%d\r\n" % len(items) + b"".join(bulk(i) for i in items)


def _default_reply(args: list[bytes]) -> bytes:
    name = args[0].upper() if args else b""
    if name == b"PING":
        return b"+PONG\r\n"
    if name in (b"AUTH", b"SELECT", b"CLIENT", b"FLUSHALL", b"SET"):
        return b"+OK\r\n"
    if name == b"INFO":
        return bulk(INFO_TEXT)
    if name == b"CONFIG" and len(args) >= 3 and args[1].upper() == b"GET":
        pattern = args[2].decode()
        return _array([x for k, v in CONFIG.items() if fnmatch.fnmatchcase(k, pattern) for x in (k.encode(), v.encode())])
    if name in (b"RANDOMKEY", b"GET"):
        return b"$-1\r\n"
    if name in (b"STRLEN", b"DBSIZE", b"EXISTS", b"DEL"):
        return b":0\r\n"
    return b"-ERR unknown command '%s'\r\n" % name[:40]


class FakeResp:
    def __init__(self, replies: dict[str, bytes] | None = None, drip_s: float | None = None, max_conns: int = 32, life_s: float = 60.0,
                 drip: tuple[str, ...] | None = None) -> None:
        self.replies = {k.upper().encode(): v for k, v in (replies or {}).items()}
        self.drip = None if drip is None else {d.upper().encode() for d in drip}
        self.drip_s, self.max_conns, self.life_s = drip_s, max_conns, life_s
        self.stopping = threading.Event()
        self.seen: list[list[bytes]] = []  # every command received, in order
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self._listener.settimeout(0.05)
        self._conns: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._accept = threading.Thread(target=self._serve, daemon=True)
        self._end = time.monotonic() + life_s

    @property
    def port(self) -> int:
        return self._listener.getsockname()[1]

    @property
    def url(self) -> str:
        return f"resp://127.0.0.1:{self.port}"

    def __enter__(self) -> "FakeResp":
        self._accept.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self._accept.join(timeout=5)
        self._listener.close()
        with self._lock:
            conns, threads = list(self._conns), list(self._threads)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()
        for t in threads:
            t.join(timeout=5)

    def _serve(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except (socket.timeout, OSError):
                continue
            with self._lock:
                if len(self._conns) >= self.max_conns:
                    conn.close()
                    continue
                self._conns.append(conn)
                t = threading.Thread(target=self._handle, args=(conn,), daemon=True)
                self._threads.append(t)
            t.start()

    def _send(self, conn: socket.socket, data: bytes, name: bytes) -> None:
        if not self.drip_s or (self.drip is not None and name not in self.drip):
            conn.sendall(data)
            return
        for i in range(len(data)):
            if self.stopping.is_set() or time.monotonic() > self._end:
                return
            conn.sendall(data[i : i + 1])
            self.stopping.wait(self.drip_s)

    def _handle(self, conn: socket.socket) -> None:
        buf = b""
        conn.settimeout(0.2)
        try:
            while not self.stopping.is_set() and time.monotonic() < self._end:
                cmd, buf = _parse(buf)
                if cmd is None:
                    try:
                        data = conn.recv(65536)
                    except socket.timeout:
                        continue
                    if not data:
                        return
                    buf += data
                    continue
                self.seen.append(cmd)
                name = cmd[0].upper() if cmd else b""
                self._send(conn, self.replies[name] if name in self.replies else _default_reply(cmd), name)
        except OSError:
            return


def _parse(buf: bytes) -> tuple[list[bytes] | None, bytes]:
    """One RESP array-of-bulks command off the front of ``buf``, or (None, buf) when it is not all there."""
    if not buf.startswith(b"*"):
        return None, buf
    end = buf.find(b"\r\n")
    if end < 0:
        return None, buf
    n, pos, args = int(buf[1:end]), end + 2, []
    for _ in range(n):
        end = buf.find(b"\r\n", pos)
        if end < 0:
            return None, buf
        size = int(buf[pos + 1 : end])
        if len(buf) < end + 2 + size + 2:
            return None, buf
        args.append(buf[end + 2 : end + 2 + size])
        pos = end + 2 + size + 2
    return args, buf[pos:]
