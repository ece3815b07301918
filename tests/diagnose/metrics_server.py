"""A tiny real HTTP server on 127.0.0.1 (free port) that serves Prometheus text at /metrics.

Each GET of /metrics returns the next text of the sequence it was given (the
last one repeats), so two scrapes of one ``kvctl diagnose`` run see a chosen
before and after; or, given a callable, whatever it returns at that moment
(a counter that moves with wall time). ``delay_s`` holds every answer back
(a slow or hung engine). Anything else is a 404.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
import time
from typing import Callable, Sequence


class MetricsServer:
    def __init__(self, texts: Sequence[str] | Callable[[], str], delay_s: float = 0.0):
        if not callable(texts) and not texts:
            raise ValueError("give at least one metrics text")
        self.texts = texts if callable(texts) else list(texts)
        self.delay_s = delay_s
        self.hits = 0
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server API
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404)
                    return
                if server.delay_s:
                    time.sleep(server.delay_s)
                with server._lock:
                    if callable(server.texts):
                        body = server.texts().encode()
                    else:
                        body = server.texts[min(server.hits, len(server.texts) - 1)].encode()
                    server.hits += 1
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        class Server(ThreadingHTTPServer):
            def handle_error(self, request: object, client_address: object) -> None:
                pass  # a client that gave up on a delayed answer (kvctl's --timeout) closes the socket: expected

        self._httpd = Server(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def __enter__(self) -> "MetricsServer":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
