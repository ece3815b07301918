"""A real Prometheus server scrapes a running `kvctl exporter` and evaluates configs/prometheus/kvctl-alerts.yaml.

The engine is a real local HTTP server whose vLLM/LMCache counters grow with wall time at
10 requests/s, 2e8 L2 bytes per request, 200 ms of GET time per request, so by hand:
B = 2e8 B / 0.2 s = 1e9 B/s, B* = 48437.5 × 52200 = 2.53e9 B/s, ρ = 10 × 2e8 / 1e9 = 2.
With the rules' `for` set to 0 s (the only change), Prometheus must fire exactly the ρ ≥ 0.7,
ρ ≥ 1 and B < B* alerts. Skips when Debian's prometheus binary is not unpacked (make promtool).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from kvctl.ops.exporter import Exporter, ExporterConfig
from kvctl.ops.exporter_http import Server, parse_listen
from kvctl.tier.server import free_port
from tests.diagnose.engine_text import EngineState
from tests.diagnose.metrics_server import MetricsServer
from tests.exporter.helpers import PARAMS, RULES, rules_by_name

ROOT = Path(__file__).resolve().parents[2]


def prometheus_binary() -> str | None:
    for cand in (os.environ.get("KVCTL_PROMETHEUS"), shutil.which("prometheus"), str(ROOT / ".tools" / "prometheus" / "usr" / "bin" / "prometheus")):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    return None


pytestmark = pytest.mark.skipif(prometheus_binary() is None, reason="prometheus not found (make promtool unpacks it into .tools/)")


def growing_engine(t0: float):
    def text() -> str:
        n = int((time.time() - t0) * 10)  # 10 requests/s
        return EngineState().advance(
            requests=n, prompt_lengths=[16000] * n, external_hits=4000 * n, remote_read_bytes=2e8 * n, remote_get_ms=[200] * n,
        ).text()

    return text


def api(base: str, path: str, **params: str) -> dict:
    url = f"{base}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read().decode())


def test_prometheus_fires_the_rules_on_the_live_exporter(tmp_path):
    doc = yaml.safe_load(RULES.read_text())
    for g in doc["groups"]:
        for r in g["rules"]:
            r["for"] = "0s"
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(doc, allow_unicode=True))
    with MetricsServer(growing_engine(time.time())) as srv:
        exp = Exporter(ExporterConfig((srv.url,), (), PARAMS, interval_s=0.5, window_s=2.0))
        server = Server(exp, parse_listen("127.0.0.1:0"))
        web = free_port()
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(tmp_path / "rules.yaml")],
            "scrape_configs": [{"job_name": "kvctl", "static_configs": [{"targets": [f"127.0.0.1:{server.port}"]}]}],
        }))
        prom = subprocess.Popen(
            [prometheus_binary(), f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{web}"],
            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "wb"), cwd=tmp_path,
        )
        base = f"http://127.0.0.1:{web}"
        firing: set[str] = set()
        rho = up = None
        try:
            deadline = time.time() + 60
            while time.time() < deadline:
                time.sleep(1)
                try:
                    alerts = api(base, "/api/v1/alerts")["data"]["alerts"]
                    q = api(base, "/api/v1/query", query="kvctl_rho")["data"]["result"]
                    u = api(base, "/api/v1/query", query="kvctl_engine_up")["data"]["result"]
                except OSError:
                    continue  # still starting
                firing = {a["labels"]["alertname"] for a in alerts if a["state"] == "firing"}
                rho = float(q[0]["value"][1]) if q else None
                up = float(u[0]["value"][1]) if u else None
                if {"KvctlRhoHigh", "KvctlRhoUnstable", "KvctlBandwidthBelowBreakeven"} <= firing:
                    time.sleep(2)  # two more evaluations: nothing else may join
                    alerts = api(base, "/api/v1/alerts")["data"]["alerts"]
                    firing = {a["labels"]["alertname"] for a in alerts if a["state"] == "firing"}
                    break
        finally:
            prom.terminate()
            try:
                prom.wait(timeout=20)
            except subprocess.TimeoutExpired:
                prom.kill()
                prom.wait()
            server.stop()
    log = (tmp_path / "prometheus.log").read_text(errors="replace")[-2000:]
    assert firing == {"KvctlRhoHigh", "KvctlRhoUnstable", "KvctlBandwidthBelowBreakeven"}, (firing, log)
    assert set(rules_by_name()) - firing  # the other rules exist and stay quiet (engine up, data sufficient, no findings of theirs)
    assert rho == pytest.approx(2.0, rel=0.15), log  # ρ = 2 by hand; counters step in whole requests, windows are ~2 s
    assert up == 1
