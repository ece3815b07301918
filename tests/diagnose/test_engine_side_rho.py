"""ρ from engine-side timing against a real Valkey at io-threads 1 and 4 (paper §4: B is what the engine sees).

A GPU engine cannot run here, so a synchronous loader stands in for the
engine's load path: back-to-back batched GETs through kvctl's own RespClient
(the connector's client) against a real valkey-server, one batch per
"request", never idle. It exports what the kvctl vLLM connector exports on
/metrics (``kvctl:l2_get_bytes_total``, ``kvctl:l2_get_seconds_total``) plus
vLLM's request counter and queue gauges (one request always running). A
loader busy 100 % of the time is a queue at ρ ≈ 1 whatever io-threads does;
Valkey's server-side time per GET leaves the socket writes out and reports a
lower ρ, which kvctl must call a lower bound.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.connector.resp import RespClient
from kvctl.diagnose.analysis import analyse
from kvctl.diagnose.capture import load_capture
from tests.diagnose.engine_text import EngineState
from tests.diagnose.metrics_server import MetricsServer
from tests.tier.servers import valkey_8

CHUNK = 2_000_000
BATCH = 4
WINDOW_S = 2.0


class SyncLoader:
    """Back-to-back synchronous loads; bounded by ``max_s`` seconds and ``max_loads`` loads."""

    def __init__(self, url: str, keys: list[str], max_s: float = 30.0, max_loads: int = 200_000):
        self.client = RespClient(url, timeout_s=5.0, pool_size=1)
        self.keys = keys
        self.bufs = [bytearray(CHUNK) for _ in keys]
        self.max_s, self.max_loads = max_s, max_loads
        self.loads, self.bytes, self.seconds = 0, 0.0, 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sync-loader", daemon=True)

    def _run(self) -> None:
        end = time.monotonic() + self.max_s
        while not self._stop.is_set() and time.monotonic() < end and self.loads < self.max_loads:
            t = time.perf_counter()
            hits = self.client.batched_get(self.keys, self.bufs)
            dt = time.perf_counter() - t
            assert all(hits)
            with self._lock:
                self.loads += 1
                self.bytes += CHUNK * len(self.keys)
                self.seconds += dt

    def text(self) -> str:
        with self._lock:
            return EngineState(requests=self.loads, running=1, kvctl_get_bytes=self.bytes, kvctl_get_s=self.seconds, lmcache=False).text()

    def __enter__(self) -> "SyncLoader":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.client.close()


def _without_kvctl(text: str) -> str:
    return "\n".join(ln for ln in text.splitlines() if "kvctl:" not in ln) + "\n"


@pytest.mark.slow
@pytest.mark.parametrize("io_threads", [1, 4])
def test_saturating_loader_is_rho_one_from_engine_side_timing(valkey_factory, tmp_path, io_threads):
    # Valkey 8.1: its GET time holds the copy of the value, so the server-side half below is a bound at all (9.x
    # writes the reply from the value after the command: diagnose takes no B from it, test_analysis.py says so)
    v = valkey_factory(binary=valkey_8(), settings={"maxmemory": "256mb", "io-threads": io_threads})
    keys = [f"chunk-{i}" for i in range(BATCH)]
    with RespClient(v.url) as setter:
        setter.batched_set(keys, [bytes([65 + i]) * CHUNK for i in range(BATCH)])
    with SyncLoader(v.url, keys) as loader, MetricsServer(loader.text) as srv:
        time.sleep(0.3)  # loading before the first sample
        res = CliRunner().invoke(cli, ["diagnose", "--engine-url", srv.url, "--valkey", v.url, "--window", str(WINDOW_S),
                                       "--save", str(tmp_path / "cap"), "--json", "--explain"])
    assert res.exit_code in (3, 4), res.output  # ρ ≈ 1: rho_high (≥ 0.7) or rho_unstable (≥ 1)
    d = json.loads(res.stdout)
    assert d["bandwidth_source"] == "kvctl_connector" and d["rho_bound"] == "estimate"
    assert d["completion_rate_per_s"] > 0 and d["queue_growth"] == 0
    assert 0.85 <= d["rho"] <= 1.1, d["rho"]
    assert {f["id"] for f in d["findings"]} & {"rho_high", "rho_unstable"}
    assert d["instances"][0]["get_calls"] > 0

    # the same samples with only Valkey's server-side time: B overstated, ρ a stated lower bound
    cap = load_capture(tmp_path / "cap")
    for s in cap.samples:
        s.engines = [_without_kvctl(t) for t in s.engines]
    server = analyse(cap)
    assert server.bandwidth_source == "valkey_server_upper_bound" and server.rho_bound == "lower_bound"
    assert server.bandwidth_gbps > d["bandwidth_gbps"]
    assert server.rho < d["rho"]
    print(f"io-threads {io_threads}: engine-side ρ = {d['rho']:.2f} (B {d['bandwidth_gbps']:.2f} GB/s); "
          f"server-side ρ ≥ {server.rho:.2f} (B ≤ {server.bandwidth_gbps:.2f} GB/s)")
