"""``--timeout`` is one deadline for the whole answer, status line and headers included (issue 30, item 4).

A real local HTTP server drips its status line and headers one byte every 0.5 s: a socket timeout set
once never fires (every read gets a byte in time), so ``diagnose --timeout 2`` used to run past 60 s and
the exporter's first round never ended, leaving ``/metrics`` without any ``kvctl_engine_up``, the healthy
engines' included. Real kvctl processes.
"""

from __future__ import annotations

import time
import urllib.request
from http.server import BaseHTTPRequestHandler

from tests.diagnose.engine_text import EngineState
from tests.exporter.helpers import ExporterProcess
from tests.hostile.helpers import HostileHTTP, kvctl, kvctl_env, send_head

METRICS = EngineState(requests=3, prompt_lengths=(100.0, 100.0, 100.0)).text()
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n" + b"X-Pad: " + b"a" * 400 + b"\r\n\r\n"


def drip(server: HostileHTTP, h: BaseHTTPRequestHandler, every_s: float = 0.5, deadline_s: float = 90.0) -> None:
    """The status line and headers, one byte every ``every_s`` seconds (never a body)."""
    end = time.monotonic() + deadline_s
    for b in HEAD:
        if server.stopping.is_set() or time.monotonic() > end:
            return
        h.wfile.write(bytes([b]))
        h.wfile.flush()
        server.stopping.wait(every_s)


def healthy(server: HostileHTTP, h: BaseHTTPRequestHandler) -> None:
    send_head(h, len(METRICS))
    h.wfile.write(METRICS.encode())


def test_diagnose_timeout_bounds_a_dripping_status_line(tmp_path):
    with HostileHTTP(drip) as eng:
        t0 = time.monotonic()
        res = kvctl(["diagnose", "--engine-url", eng.url, "--timeout", "2", "--window", "1"], tmp_path / "home", timeout_s=30)
        took = time.monotonic() - t0
    assert res.returncode == 5, (res.returncode, took, res.output[-1000:])  # None: still dripping at 30 s
    assert "timed out" in res.output and "2 s" in res.output, res.output[-1000:]
    assert took < 15, took  # two samples of at most 2 s each, 1 s apart, and the start


def test_exporter_publishes_each_engine_while_one_drips(tmp_path):
    """One dripping engine and one healthy one: within a few rounds the healthy engine is up 1, the dripping
    one up 0, and the exporter's log says why."""
    with HostileHTTP(drip) as slow, HostileHTTP(healthy) as ok, \
            ExporterProcess(["--engine-url", slow.url, "--engine-url", ok.url, "--interval", "1", "--window", "2", "--timeout", "1"],
                            env=kvctl_env(tmp_path / "home")) as ex:
        up: dict[str, float] = {}
        deadline = time.monotonic() + 10
        while len(up) < 2 and time.monotonic() < deadline:
            time.sleep(0.3)
            with urllib.request.urlopen(ex.start["metrics_url"], timeout=5) as r:
                body = r.read().decode()
            up = {ln.split('engine="')[1].split('"')[0]: float(ln.rsplit(" ", 1)[1])
                  for ln in body.splitlines() if ln.startswith("kvctl_engine_up{")}
    assert up == {slow.url: 0.0, ok.url: 1.0}, up
    assert f"engine {slow.url}" in ex.err and "timed out" in ex.err, ex.err[-2000:]
