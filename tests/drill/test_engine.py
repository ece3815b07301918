"""The drill engine against a real valkey-server: real chunks on the tier, vLLM's metric names, the loading key."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest

from kvctl.loading import edit as loading
from kvctl.connector.metric_names import COUNTERS, LABELS
from kvctl.records.prometheus import parse
from kvctl.drill.config import EngineSettings, read_config, write_config
from kvctl.core.errors import InvalidInput
from kvctl.tier.admin import Admin


def _settings(urls, **kw) -> EngineSettings:
    base = dict(remote_urls=urls, chunk_bytes=4096, prefill_tokens_per_s=1e6, t0_s=0.0, stream_bytes_per_s=1e9)
    return EngineSettings(**{**base, **kw})


def _start(cfg_path):
    p = subprocess.Popen([sys.executable, "-m", "kvctl.drill.engine", "--config", str(cfg_path)], stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert line.startswith("PORT "), line
    return p, f"http://127.0.0.1:{int(line.split()[1])}"


def _post(url, ids, stream=False):
    body = json.dumps({"prompt": ids, "max_tokens": 2, "stream": stream}).encode()
    with urllib.request.urlopen(urllib.request.Request(url + "/v1/completions", data=body, headers={"content-type": "application/json"}), timeout=30) as r:
        return r.read().decode()


def test_config_round_trip_and_kvctl_loading_reads_its_key(tmp_path):
    path = write_config(tmp_path / "engine.yaml", _settings(["resp://127.0.0.1:1", "resp://127.0.0.1:2"]))
    cfg = read_config(path)
    assert cfg.async_loading is False and cfg.settings.ranks == 2
    assert loading.yaml_state(path).async_loading is False  # the line `kvctl loading` flips
    loading.apply_all([loading.plan(path, "yaml", True)], backup=False)
    assert read_config(path).async_loading is True


def test_config_errors_name_the_key(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("enable_async_loading: false\ndrill:\n  remote_urls: []\n")
    with pytest.raises(InvalidInput, match="remote_urls"):
        read_config(p)
    good = write_config(tmp_path / "good.yaml", _settings(["resp://127.0.0.1:1"]))
    p.write_text(good.read_text().replace("load_policy: false", "load_policy: 'yes'"))
    with pytest.raises(InvalidInput, match="drill.load_policy must be true or false"):
        read_config(p)


def test_engine_gets_and_sets_real_chunks_and_exports_diagnose_names(tmp_path, valkey_factory):
    servers = [valkey_factory(), valkey_factory()]
    cfg = write_config(tmp_path / "engine.yaml", _settings([s.url for s in servers]))
    proc, url = _start(cfg)
    try:
        ids = list(range(100, 100 + 4 * 256 + 10))  # 4 full chunks and a tail
        first = json.loads(_post(url, ids))
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # each rank's instance holds exactly its own chunks (c mod 2)
        sizes = []
        for s in servers:
            with Admin(s.url, 3.0) as r:
                sizes.append(r.dbsize())
        assert sizes == [2, 2]
        second = _post(url, ids, stream=True)
        usage = [json.loads(x[5:]) for x in second.splitlines() if x.startswith("data: {") and '"usage"' in x][0]["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 4 * 256
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            m = parse(r.read().decode())
        assert m.counter("vllm:request_success") == 2
        assert m.counter("vllm:external_prefix_cache_hits") == 4 * 256
        assert m.counter("kvctl:l2_get_bytes") == 4 * 4096
        assert m.counter("kvctl:l2_get_seconds") > 0
        assert m.gauge("kvctl:ranks") == 2
        assert m.hist_count("vllm:request_prefill_time_seconds") == 2
        assert m.gauge("vllm:num_requests_waiting") == 0
        # the connector's names, from their one place; a labelled one has series once a value arrives (as vLLM's)
        assert all(m.counter(name) is not None for name in COUNTERS if name not in LABELS)
    finally:
        proc.terminate()
        proc.wait(10)


def test_sighup_restarts_with_the_flipped_config_on_the_same_port(tmp_path, valkey_server):
    cfg = write_config(tmp_path / "engine.yaml", _settings([valkey_server.url]))
    from kvctl.tier.server import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvctl.drill.engine", "--config", str(cfg), "--port", str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert "synchronous" in proc.stdout.readline() + proc.stdout.readline()
        loading.apply_all([loading.plan(cfg, "yaml", True)], backup=False)
        proc.send_signal(1)  # SIGHUP
        assert proc.stdout.readline().startswith(f"PORT {port}")
        assert "asynchronous" in proc.stdout.readline()
        ids = list(range(1, 513))
        _post(f"http://127.0.0.1:{port}", ids)
        assert json.loads(_post(f"http://127.0.0.1:{port}", ids))["usage"]["prompt_tokens_details"]["cached_tokens"] == 512
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize("policy, link, cached, decision", [
    (False, 1e9, 4 * 256, None),  # no decision: every hit loads, none is counted
    (True, 1e9, 4 * 256, ("load", "wins")),  # a fast link: the hit wins
    (True, 4096 / 0.5, 0, ("recompute", "below_breakeven")),  # 0.5 s a chunk against 256 tokens / 1e4 tok/s
])
def test_the_load_policy_judges_each_hit_as_the_connector_does(tmp_path, valkey_server, policy, link, cached, decision):
    """Issue 46: `drill.load_policy` runs the connector's own decision (kvctl.connector.policy.decide) before a load
    and counts it as kvctl:load_decisions{decision,reason}; a hit that loses is recomputed."""
    cfg = write_config(tmp_path / "engine.yaml", _settings([valkey_server.url], prefill_tokens_per_s=1e4,
                                                           stream_bytes_per_s=link, load_policy=policy))
    assert read_config(cfg).settings.load_policy is policy
    proc, url = _start(cfg)
    try:
        ids = list(range(100, 100 + 4 * 256 + 10))
        _post(url, ids)
        second = json.loads(_post(url, ids))
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            m = parse(r.read().decode())
        assert m.by_labels("kvctl:load_decisions") == ({decision: 1.0} if decision else {})
    finally:
        proc.terminate()
        proc.wait(10)
