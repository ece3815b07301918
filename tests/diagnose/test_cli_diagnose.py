"""`kvctl diagnose` and `kvctl diagnose capture` end to end.

Engines are a real local HTTP server serving Prometheus text written from
vLLM's/LMCache's documented formats (:mod:`tests.diagnose.engine_text`);
Valkey instances are real valkey-server processes.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.diagnose.capture import last_diagnosis_path
from kvctl.core.kvsize import kv_size_from_file
from kvctl.tier.server import free_port
from tests.diagnose.engine_text import EngineState
from tests.diagnose.metrics_server import MetricsServer

MODELS = Path(__file__).resolve().parents[2] / "configs" / "models"
BASE = EngineState()
HEALTHY = BASE.advance(requests=10, prompt_lengths=[16000] * 10, external_hits=100000, remote_read_bytes=1e9, remote_get_ms=[1] * 10)
UNSTABLE = HEALTHY.advance(remote_read_bytes=3e9, remote_get_ms=[1000] * 5)  # ≥ 5 s of GETs in a < 1 s window: ρ > 1
TIMEOUTS = HEALTHY.advance(blocking_failed=4)
MODEL = ["--bytes-per-token", "48437.5", "--prefill-rate", "52200", "--t0", "0.1"]


def run(args, code=0):
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == code, (result.output, result.exception)
    return result


def diagnose_json(texts, extra=(), code=0):
    with MetricsServer(texts) as srv:
        res = run(["diagnose", "--engine-url", srv.url, "--window", "0.3", *MODEL, "--json", *extra], code)
    return json.loads(res.stdout)


@pytest.mark.parametrize(
    "after, code, worst",
    [(HEALTHY, 0, "ok"), (TIMEOUTS, 3, "warning"), (UNSTABLE, 4, "critical")],
)
def test_exit_code_is_worst_severity(after, code, worst):
    d = diagnose_json([BASE.text(), after.text()], code=code)
    assert d["worst_severity"] == worst


def test_json_schema():
    d = diagnose_json([BASE.text(), UNSTABLE.text()], code=4)
    for key, typ in [
        ("arrival_rate_per_s", float), ("mean_prompt_tokens", float), ("hit_token_fraction", float),
        ("bandwidth_gbps", float), ("breakeven_gbps", float), ("rho", float), ("findings", list),
    ]:
        assert isinstance(d[key], typ), key
    assert d["rho"] > 1
    for f in d["findings"]:
        assert set(f) >= {"id", "severity", "message", "recommendation", "evidence"}
        assert f["severity"] in ("info", "warning", "critical")
    assert "rho_unstable" in {f["id"] for f in d["findings"]}
    assert "explain" not in d
    saved = json.loads(last_diagnosis_path().read_text())  # for `kvctl loading sync`'s check
    assert saved["rho"] == d["rho"] and saved["saved_at"]


def test_from_dir_equals_live(tmp_path, valkey_server):
    r = redis.Redis(port=valkey_server.port)
    r.set("chunk", b"z" * 200_000)
    stop = threading.Event()

    def load():  # GETs while the window is open
        for _ in range(2000):
            if stop.is_set():
                return
            r.get("chunk")

    t = threading.Thread(target=load)
    t.start()
    try:
        live = diagnose_json([BASE.text(), TIMEOUTS.text()], ["--valkey", valkey_server.url, "--save", str(tmp_path / "cap"), "--explain"], code=3)
    finally:
        stop.set()
        t.join()
    replay = json.loads(run(["diagnose", "--from", str(tmp_path / "cap"), "--json", "--explain"], 3).stdout)
    assert replay == live
    assert live["instances"][0]["get_calls"] > 0
    # LMCache's engine-side timing is preferred over Valkey's server-side time
    assert live["bandwidth_source"] == "lmcache_client" and live["rho_bound"] == "estimate"


def test_capture_then_from(tmp_path, valkey_factory):
    v0, v1 = valkey_factory(), valkey_factory()
    out = tmp_path / "capture"
    with MetricsServer([BASE.text(), TIMEOUTS.text()]) as srv:
        res = run(["diagnose", "capture", "--out", str(out), "--engine-url", srv.url, "--valkey", v0.url, "--valkey", v1.url, "--window", "0.2", "--bytes-per-token", "1000", "--json"])
    meta = json.loads(res.stdout)
    assert meta["samples"] == 2 and meta["valkey_instances"] == 2
    assert (out / "capture.json").exists() and (out / "sample-001" / "engine-0.txt").read_text() == TIMEOUTS.text()
    assert "total_net_output_bytes" in json.loads((out / "sample-000" / "valkey-1.json").read_text())
    d = json.loads(run(["diagnose", "--from", str(out), "--json"], 3).stdout)
    assert d["bytes_per_token"] == 1000  # parameters travel with the capture
    assert len(d["instances"]) == 2
    # a second capture into the same directory is refused, the first is kept
    with MetricsServer([BASE.text()]) as srv:
        res = run(["diagnose", "capture", "--out", str(out), "--engine-url", srv.url, "--window", "0.1"], 2)
    assert "already holds a capture" in res.output


def test_capture_says_each_unreachable_source_once(tmp_path):
    """Issue 22: `diagnose capture` repeated the same warning once per sample."""
    dead = f"resp://127.0.0.1:{free_port()}"
    with MetricsServer([BASE.text(), HEALTHY.text()]) as srv:
        res = CliRunner().invoke(cli, ["diagnose", "capture", "--out", str(tmp_path / "c"), "--engine-url", srv.url,
                                       "--valkey", dead, "--window", "0.1", "--timeout", "1"])
    assert res.exit_code == 5, res.output
    err = " ".join(res.stderr.split())
    assert err.count("(recorded in the capture)") == 1 and "(in 2 of 2 samples)" in err, res.stderr
    with MetricsServer([BASE.text(), HEALTHY.text()]) as srv:
        res = CliRunner().invoke(cli, ["diagnose", "capture", "--out", str(tmp_path / "d"), "--engine-url", srv.url,
                                       "--valkey", dead, "--window", "0.1", "--timeout", "1", "--json"])
    (line,) = json.loads(res.stdout)["unreachable"]
    assert "(in 2 of 2 samples)" in line


def test_gpu_idle_capture_is_critical(tmp_path):
    """A capture edited to carry idle GPUs (as NVML would report) with a growing queue."""
    out = tmp_path / "c"
    with MetricsServer([BASE.advance(waiting=1).text(), HEALTHY.advance(waiting=9).text()]) as srv:
        run(["diagnose", "capture", "--out", str(out), "--engine-url", srv.url, "--window", "0.1"])
    meta = json.loads((out / "capture.json").read_text())
    for s in meta["samples"]:
        s["gpu"] = {"utilization_pct": [4.0, 6.0], "names": ["H200", "H200"], "note": ""}
    (out / "capture.json").write_text(json.dumps(meta))
    d = json.loads(run(["diagnose", "--from", str(out), "--json", *MODEL], 4).stdout)
    assert [f["id"] for f in d["findings"] if f["severity"] == "critical"] == ["queue_growing_gpu_idle"]


def test_unreachable_engine_exits_5_with_one_line():
    port = free_port()
    res = CliRunner().invoke(cli, ["diagnose", "--engine-url", f"http://127.0.0.1:{port}", "--window", "0.1"])
    assert res.exit_code == 5
    errors = [ln for ln in res.stderr.splitlines() if not ln.startswith("kvctl diagnose: ")]  # less the progress lines
    # one line for the engine, and (issue 48) the one that says no window was waited for nothing
    assert len(errors) == 2 and "unreachable" in errors[0] and str(port) in errors[0], res.stderr
    assert "nothing answered the first sample, so diagnose did not wait the 0.1 s window" in errors[1], res.stderr


def test_unreachable_valkey_exits_5():
    with MetricsServer([BASE.text()]) as srv:
        res = CliRunner().invoke(cli, ["diagnose", "--engine-url", srv.url, "--valkey", f"resp://127.0.0.1:{free_port()}", "--window", "0.1", "--timeout", "1"])
    assert res.exit_code == 5 and "Valkey rank 0" in res.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["diagnose"], "--engine-url"),
        (["diagnose", "--from", "/nonexistent-kvctl-capture"], "holds no capture"),
        (["diagnose", "--engine-url", "ftp://x", "--window", "0.1"], "http(s) URL"),
        (["diagnose", "--from", "/tmp", "--engine-url", "http://x"], "--from analyses a saved capture"),
    ],
)
def test_usage_errors(args, message):
    res = run(args, 2)
    assert message in res.output


def test_human_output_and_explain():
    with MetricsServer([BASE.text(), UNSTABLE.text()]) as srv:
        res = run(["diagnose", "--engine-url", srv.url, "--window", "0.2", *MODEL, "--explain"], 4)
    out = res.stdout
    assert "Findings" in out and "rho_unstable" in out and "s·R" in out and "How each number was computed" in out


def test_watch_streams_one_json_per_refresh():
    texts = [BASE.text(), HEALTHY.text(), HEALTHY.advance(requests=10, prompt_lengths=[16000] * 10, blocking_failed=2).text()]
    with MetricsServer(texts) as srv:
        res = run(["diagnose", "--engine-url", srv.url, "--window", "0.2", *MODEL, "--watch", "--count", "2", "--json"], 3)
    lines = [json.loads(x) for x in res.stdout.splitlines() if x.strip()]
    assert len(lines) == 2
    assert lines[0]["worst_severity"] == "ok" and lines[1]["findings"][0]["id"] == "timeouts_rising"


def test_model_config_gives_bytes_per_token():
    cfg = MODELS / "llama-3.1-8b.json"
    with MetricsServer([BASE.text(), HEALTHY.text()]) as srv:
        d = json.loads(run(["diagnose", "--engine-url", srv.url, "--window", "0.1", "--model-config", str(cfg), "--json"]).stdout)
    assert d["bytes_per_token"] == kv_size_from_file(cfg).bytes_per_token
