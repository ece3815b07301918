"""benchmarks/connector_overhead.py: what a KV connector costs a prompt the tier does not serve (issue 46).

The fast tests check its inputs and the connector configs it starts engines with (the no-op connector is a real
vLLM connector class); the slow one runs it on vllm-cpu with two variants and two prompts each, real engines and a
real local tier, and reads its JSON.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def overhead():
    spec = importlib.util.spec_from_file_location("connector_overhead", ROOT / "benchmarks" / "connector_overhead.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_defaults_follow_the_device(overhead):
    gpu = overhead.parse_args([])
    cpu = overhead.parse_args(["--device", "cpu"])
    assert (gpu.prompt_tokens, gpu.gap_s, gpu.variants, gpu.interleave) == (16384, 0.5, list(overhead.VARIANTS), False)
    assert (cpu.prompt_tokens, cpu.gap_s, cpu.interleave) == (1024, 0.2, False)
    assert overhead.parse_args(["--device", "cpu", "--interleave"]).interleave is True


@pytest.mark.parametrize("argv", [["--variants", "none,kvctl-of"], ["--variants", ","], ["--prompts", "0"],
                                  ["--prompt-tokens", "8"]])
def test_bad_input_is_one_line_and_exit_2(overhead, argv, capsys):
    with pytest.raises(SystemExit) as e:
        overhead.parse_args(argv)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


def test_the_noop_connector_is_a_connector_that_finds_and_saves_nothing(overhead):
    vllm_base = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")
    from kvctl.lab import noop_connector

    cls = getattr(noop_connector, overhead.NOOP["kv_connector"])
    assert overhead.NOOP["kv_connector_module_path"] == noop_connector.__name__
    assert issubclass(cls, vllm_base.KVConnectorBase_V1) and not getattr(cls, "__abstractmethods__", None)
    conn = object.__new__(cls)  # its hooks use no state
    assert conn.get_num_new_matched_tokens(object(), 0) == (0, False)
    assert isinstance(conn.build_connector_meta(object()), vllm_base.KVConnectorMetadata)


def test_the_kvctl_variants_differ_only_in_the_decision(overhead):
    class Tier:
        def vllm_config(self, *args):
            assert args == ("--chunk-tokens", "64", "--loading", "sync")
            return {"kv_connector": "KvctlConnector", "kv_connector_extra_config": {"urls": ["resp://127.0.0.1:1"]}}

    on, off = overhead.kv_config("kvctl", Tier(), 64), overhead.kv_config("kvctl-off", Tier(), 64)
    assert "load_policy" not in on["kv_connector_extra_config"] and off["kv_connector_extra_config"]["load_policy"] is False
    assert overhead.kv_config("none", Tier(), 64) is None


def test_the_engines_keep_the_pythonpath_they_are_given(overhead, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/tmp/site")
    assert overhead.variant_env("cpu")["PYTHONPATH"].split(":") == [str(ROOT), "/tmp/site"]
    monkeypatch.delenv("PYTHONPATH")
    assert overhead.variant_env("cpu")["PYTHONPATH"] == str(ROOT)


def test_the_h100_result_says_what_benchmarks_readme_quotes():
    """results/connector_overhead-h100-2026-12-05-night.json: lone 16k prompts, compiled, 16 an engine."""
    doc = json.loads((ROOT / "benchmarks" / "results" / "connector_overhead-h100-2026-12-05-night.json").read_text())
    v = doc["variants"]
    assert doc["compiled"] and doc["prompt_tokens"] == 16384 and {k: v[k]["prompts"] for k in v} == dict.fromkeys(v, 16)
    assert {k: v[k]["p50_s"] for k in v} == {"none": 0.2362, "noop": 0.236, "kvctl-off": 0.2378, "kvctl": 0.238}
    assert {k: round(v[k]["p50_s"] / v["none"]["p50_s"], 3) for k in v} == {
        "none": 1.0, "noop": 0.999, "kvctl-off": 1.007, "kvctl": 1.008}
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    assert "KvctlConnector with the decision off 0.2378 s (1.007×) and on\n  0.2380 s (1.008×)" in readme


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_it_runs_on_vllm_cpu_and_reports_each_variant(tmp_path):
    pytest.importorskip("vllm")
    out = tmp_path / "o.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "connector_overhead.py"), "--device", "cpu",
                        "--variants", "none,kvctl", "--prompts", "2", "--prompt-tokens", "256", "--interleave",
                        "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert list(res["variants"]) == ["none", "kvctl"] and res["prompt_tokens"] == 256 and res["interleaved"] is True
    for v in res["variants"].values():
        split = v["vllm_split"]
        assert v["prompts"] == 2 and 0 < v["p50_s"] <= v["p90_s"] < 60
        assert split["prefill_s"] > 0 and split["e2e_s"] >= split["prefill_s"]
    assert res["variants"]["none"]["p50_vs_none"] == 1.0
    assert "p50 against no connector: none 1.0x, kvctl" in r.stdout


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sigterm_mid_run_stops_its_engines_and_tier_and_removes_its_work_dir(tmp_path):
    """SIGTERM while an engine serves: the run ends through its teardown (exit 143): no valkey-server and no engine
    process of it is left, and its temporary work directory is gone."""
    import os
    import signal
    import time

    import psutil

    pytest.importorskip("vllm")
    from tests.tier.tier_procs import servers_under

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    p = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "connector_overhead.py"), "--device", "cpu",
                          "--variants", "none", "--prompts", "1000", "--prompt-tokens", "64"],
                         cwd=ROOT, env={**os.environ, "TMPDIR": str(tmp)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and p.poll() is None:  # serving: the engine's log has a completion in it
            logs = list(tmp.glob("kvctl-overhead-*/engine-none/*.log"))
            if logs and "POST /v1/completions" in logs[0].read_text(errors="replace"):
                break
            time.sleep(0.5)
        assert p.poll() is None and servers_under(tmp), "the run never reached a serving engine on its tier"
        kids = psutil.Process(p.pid).children(recursive=True)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=120) == 143, p.stderr.read()[-2000:]
    finally:
        if p.poll() is None:
            p.kill()
    gone, alive = psutil.wait_procs(kids, timeout=30)
    assert not alive, [k.pid for k in alive]
    assert servers_under(tmp) == [] and list(tmp.glob("kvctl-overhead-*")) == []  # (vLLM's own temp files stay)
