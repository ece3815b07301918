"""Fake RESP servers for fault tests and ``benchmarks/connector_faults.py``.

These are NOT Valkey. They play misbehaving servers that a real Valkey cannot
be made to produce (unsolicited replies, a reply dripped one byte at a time,
an announced 10 GB bulk, garbage type bytes, silence during AUTH...). Faults a
real server can produce (SIGSTOP, SIGKILL, restart) are tested against a real
``valkey-server`` instead.
"""

from __future__ import annotations

import socket
import threading
from typing import Callable

# script(conn, request_no) -> keep; request_no counts requests over all connections
Script = Callable[[socket.socket, int], bool]


class ScriptedServer:
    """A fake RESP server on a free loopback port (not Valkey: a misbehaving test double).

    For every accepted connection it reads one request, then calls
    ``script(conn, request_no)``, which writes whatever broken reply the test
    wants and returns True to keep the socket open or False to close it. With
    ``serve_more=False`` a kept socket is held silently; with ``serve_more=True``
    the next request on it is read and scripted the same way, until the script
    returns False or the client closes. Connections are served one after the
    other on one thread, or with ``concurrent=True`` each on its own thread
    (then ``request_on[conn]`` is the request a script is answering on
    ``conn``); accepting stops after ``max_conns`` connections, and
    everything is closed on :meth:`stop`.
    """

    def __init__(
        self,
        script: Script,
        max_conns: int = 4,
        serve_more: bool = False,
        read_timeout_s: float = 2.0,
        concurrent: bool = False,
    ) -> None:
        self.script = script
        self.max_conns = max_conns
        self.serve_more = serve_more
        self.read_timeout_s = read_timeout_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.port = self.listener.getsockname()[1]
        self.url = f"resp://127.0.0.1:{self.port}"
        self._stop = threading.Event()
        self._held: list[socket.socket] = []
        self.accepted = 0
        self.requests = 0
        self.last_request = b""  # what the script is answering (one recv: small requests only)
        self.concurrent = concurrent
        self.request_on: dict[socket.socket, bytes] = {}
        self._lock = threading.Lock()
        self._conn_threads: list[threading.Thread] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set() and self.accepted < self.max_conns:
            try:
                conn, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            self.accepted += 1
            conn.settimeout(self.read_timeout_s)
            if self.concurrent:
                t = threading.Thread(target=self._serve_and_hold, args=(conn,), daemon=True)
                self._conn_threads.append(t)
                t.start()
            else:
                self._serve_and_hold(conn)

    def _serve_and_hold(self, conn: socket.socket) -> None:
        if self._serve_conn(conn):
            with self._lock:
                self._held.append(conn)
        else:
            conn.close()

    def _serve_conn(self, conn: socket.socket) -> bool:
        """Serve one connection; True when it is to be held open."""
        while not self._stop.is_set():
            try:
                request = conn.recv(65536)
                if not request:
                    return False  # the client closed it
                with self._lock:
                    self.last_request = request
                    self.request_on[conn] = request
                    n = self.requests
                    self.requests += 1
                keep = self.script(conn, n)
            except OSError:
                return False
            if not keep or not self.serve_more:
                return keep
        return False

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for t in self._conn_threads:
            t.join(timeout=5)
        for c in self._held:
            c.close()
        self.listener.close()

    def __enter__(self) -> "ScriptedServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
