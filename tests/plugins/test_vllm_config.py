"""kv_connector_extra_config parsing: every bad or missing setting is one error naming its key."""

from __future__ import annotations

import pytest

from kvctl.connector.settings import ConnectorConfigError, parse_settings


def test_urls_list_and_defaults():
    s = parse_settings({"urls": ["resp://127.0.0.1:7000", "resp://127.0.0.1:7001"], "chunk_tokens": 128}, 2)
    assert s.urls == ("resp://127.0.0.1:7000", "resp://127.0.0.1:7001")
    assert s.chunk_tokens == 128
    assert s.async_loading is False and s.host_budget_bytes == 0
    # the load-or-recompute decision is on by default, everything measured (issue 46)
    assert s.load_policy is not None and s.load_policy.prefill_tokens_per_s is None and s.load_policy.t0_s is None
    assert s.pinned_pool_bytes == 256 * 2**20
    assert s.sync_load_path == "auto"
    assert s.layered_switch_ms is None  # the switch interval is left alone unless asked for
    assert parse_settings({"url": "resp://x-{rank}:1", "chunk_tokens": 64, "layered_switch_ms": 0.5}, 2).layered_switch_ms == 0.5
    assert s.async_switch_ms is None
    assert parse_settings({"url": "resp://x-{rank}:1", "chunk_tokens": 64, "async_switch_ms": 0.25}, 2).async_switch_ms == 0.25


def test_sync_load_path_is_one_of_three():
    base = {"urls": ["resp://127.0.0.1:7000"], "chunk_tokens": 64}
    for path in ("auto", "step", "receive"):
        assert parse_settings(base | {"sync_load_path": path}, 1).sync_load_path == path
    for bad in ("Receive", "", True, None, 1):
        with pytest.raises(ConnectorConfigError, match=r"^kv_connector_extra_config\.sync_load_path: expected one of"):
            parse_settings(base | {"sync_load_path": bad}, 1)


def test_url_template_expands_per_rank_and_password_file(tmp_path):
    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    pw.chmod(0o600)
    s = parse_settings({"url": "resp://valkey-{rank}:6379", "chunk_tokens": 256, "password_file": str(pw),
                        "async_loading": True, "timeout_s": 0.5, "host_budget_bytes": 1 << 20,
                        "pinned_pool_bytes": 1 << 30}, 3)
    assert s.urls == tuple(f"resp://:s3cret@valkey-{r}:6379" for r in range(3))
    assert s.async_loading and s.timeout_s == 0.5 and s.host_budget_bytes == 1 << 20
    assert s.pinned_pool_bytes == 1 << 30


def test_load_policy_parsed():
    s = parse_settings({"url": "resp://h:1", "chunk_tokens": 64,
                        "load_policy": {"prefill_tokens_per_s": 5000, "t0_s": 0.3}}, 1)
    assert s.load_policy.prefill_tokens_per_s == 5000 and s.load_policy.t0_s == 0.3
    assert s.load_policy.bandwidth_gbps is None and s.load_policy.reprobe_after_s == 30.0
    assert s.load_policy.line_credit_cap == 1.5  # the connector's CREDIT_CAP
    s = parse_settings({"url": "resp://h:1", "chunk_tokens": 64, "load_policy": {"line_credit_cap": 0}}, 1)
    assert s.load_policy.line_credit_cap == 0.0 and s.load_policy.prefill_tokens_per_s is None


@pytest.mark.parametrize("value,on", [(False, False), ({"enabled": False}, False), ({"enabled": False, "t0_s": 1}, False),
                                      (True, True), (None, True), ({}, True), ({"t0_s": 0.2}, True)])
def test_load_policy_is_on_unless_turned_off(value, on):
    """Issue 46: on by default; false or {"enabled": false} turns it off; an object's values override the measured."""
    s = parse_settings({"url": "resp://h:1", "chunk_tokens": 64, "load_policy": value}, 1)
    assert (s.load_policy is not None) == on
    if isinstance(value, dict) and on:
        assert s.load_policy.t0_s == value.get("t0_s") and s.load_policy.prefill_tokens_per_s is None


@pytest.mark.parametrize("cfg,key", [
    ({"chunk_tokens": 128}, "urls"),
    ({"urls": ["resp://a:1", "resp://b:2"], "url": "resp://x-{rank}:1", "chunk_tokens": 128}, "urls"),
    ({"urls": ["resp://a:1"], "chunk_tokens": 128}, "urls"),  # 1 URL for 2 ranks
    ({"urls": "resp://a:1", "chunk_tokens": 128}, "urls"),
    ({"urls": ["resp://a:1", "http://b:2"], "chunk_tokens": 128}, "urls"),
    ({"url": "resp://x-{rank}:1"}, "chunk_tokens"),
    ({"url": "resp://x-{rank}:1", "chunk_tokens": 0}, "chunk_tokens"),
    ({"url": "resp://x-{rank}:1", "chunk_tokens": 12.5}, "chunk_tokens"),
    ({"url": "resp://x-{rank}:1", "chunk_tokens": 64, "timeout_s": -1}, "timeout_s"),
    ({"url": "resp://x-{rank}:1", "chunk_tokens": 64, "async_loading": "yes"}, "async_loading"),
    ({"url": "resp://x-{rank}:1", "chunk_tokens": 64, "host_budget_bytes": -5}, "host_budget_bytes"),
    ({"url": "resp://x-{rank}:1", "chunk_tokens": 64, "pinned_pool_bytes": 0}, "pinned_pool_bytes"),
    ({"url": "resp://x-{rank}:1", "chunk_tokens": 64, "pinned_pool_bytes": 1.5e8}, "pinned_pool_bytes"),
    ({"url": "resp://x-{rank}:1", "chunk_tokens": 64, "password_file": "/nonexistent/pw"}, "password_file"),
    ({"url": "resp://x-{rank}:1", "chunk_tokens": 64, "load_policy": {"enabled": "no"}}, "load_policy.enabled"),
    ({"url": "resp://x-{rank}:1", "chunk_tokens": 64, "load_policy": "on"}, "load_policy"),
    ({"url": "resp://x-{rank}:1", "chunk_tokens": 64, "load_policy": {"prefill_tokens_per_s": 1, "x": 1}}, "load_policy.x"),
    ({"url": "resp://x-{rank}:1", "chunk_tokens": 64, "chunk_size": 64}, "chunk_size"),
])
def test_bad_settings_name_the_key(cfg, key):
    with pytest.raises(ConnectorConfigError) as e:
        parse_settings(cfg, 2)
    msg = str(e.value)
    assert msg.startswith(f"kv_connector_extra_config.{key}: "), msg
    assert "\n" not in msg


def test_shipped_launch_examples_parse(tmp_path):
    """configs/vllm/*.json (written by `kvctl deploy-valkey vllm-config`) are what the connector reads."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "configs" / "vllm"
    sync = json.loads((root / "kv-transfer-sync.json").read_text())
    s = parse_settings(sync["kv_connector_extra_config"], 2)
    assert s.urls == ("resp://127.0.0.1:17400", "resp://127.0.0.1:17401") and not s.async_loading
    k8s = json.loads((root / "kv-transfer-async-k8s.json").read_text())["kv_connector_extra_config"]
    pw = tmp_path / "engine-password"
    pw.write_text("pw")
    pw.chmod(0o640)  # a Kubernetes secret mounted with an fsGroup
    s = parse_settings(dict(k8s, password_file=str(pw)), 2)
    assert s.urls[1] == "resp://kvctl-engine:pw@valkey-kv-1.valkey-kv:6379" and s.async_loading


def test_password_file_open_to_every_user_refused(tmp_path):
    """Issue 22: the connector reads password files through the one reader the CLI uses (a 0644 file was read)."""
    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    pw.chmod(0o644)
    with pytest.raises(ConnectorConfigError, match=r"password_file: .*open to every user") as e:
        parse_settings({"url": "resp://h-{rank}:1", "chunk_tokens": 64, "password_file": str(pw)}, 1)
    assert "s3cret" not in str(e.value)


@pytest.mark.parametrize("key,value,needle", [
    # issue 30 item 8: ints beyond float range raised OverflowError; 1e18 / 1e-300 timeouts were taken
    ("timeout_s", 10**400, "an integer of 401 digits"),
    ("timeout_s", 1e18, r"\[0.01, 3600\]"),
    ("timeout_s", 1e-300, r"\[0.01, 3600\]"),
    ("chunk_tokens", 10**18, r"\[1, 1.04858e\+06\]"),
    ("chunk_tokens", 10**400, "401 digits"),
    ("pinned_pool_bytes", 10**30, r"\[1, 1.09951e\+12\]"),
    ("host_budget_bytes", 10**400, "401 digits"),
    ("instances_per_rank", 0, r"\[1, 64\]"),
    ("connections_per_instance", 17, r"\[1, 16\]"),
    ("save_drain_s", -1, r"\[0, 3600\]"),
    ("save_drain_s", float("inf"), "finite"),
    ("layered_switch_ms", 0, r"\[0.01, 100\]"),
    ("layered_switch_ms", 1e9, r"\[0.01, 100\]"),
    ("layered_switch_ms", "fast", "expected a number"),
    ("async_switch_ms", 0.001, r"\[0.01, 100\]"),
    ("async_switch_ms", "fast", "expected a number"),
])
def test_every_key_has_a_range_checked_with_its_name(key, value, needle):
    cfg = {"url": "resp://x-{rank}:1", "chunk_tokens": 64, key: value}
    with pytest.raises(ConnectorConfigError, match=needle) as e:
        parse_settings(cfg, 2)
    assert str(e.value).startswith(f"kv_connector_extra_config.{key}: ")


@pytest.mark.parametrize("policy_key,value", [("prefill_tokens_per_s", 10**400), ("t0_s", 1e18),
                                               ("bandwidth_gbps", 10**400), ("reprobe_after_s", 0),
                                               ("line_credit_cap", -0.5), ("line_credit_cap", 10.5),
                                               ("line_credit_cap", float("nan"))])
def test_load_policy_values_have_ranges(policy_key, value):
    policy = {"prefill_tokens_per_s": 5000, policy_key: value}
    with pytest.raises(ConnectorConfigError) as e:
        parse_settings({"url": "resp://h:1", "chunk_tokens": 64, "load_policy": policy}, 1)
    assert str(e.value).startswith(f"kv_connector_extra_config.load_policy.{policy_key}: ")


def test_several_instances_per_rank():
    s = parse_settings({"url": "resp://v-{rank}-{instance}:6379", "instances_per_rank": 2, "chunk_tokens": 64}, 2)
    assert s.rank_urls == (("resp://v-0-0:6379", "resp://v-0-1:6379"), ("resp://v-1-0:6379", "resp://v-1-1:6379"))
    assert s.instances_per_rank == 2 and len(s.urls) == 4
    s = parse_settings({"urls": [["resp://h:1", "resp://h:2"], ["resp://h:3", "resp://h:4"]], "chunk_tokens": 64}, 2)
    assert s.instances_per_rank == 2 and s.rank_urls[1] == ("resp://h:3", "resp://h:4")
    for cfg, key in [
        ({"url": "resp://v-{rank}-{instance}:1"}, "instances_per_rank"),  # {instance} without K
        ({"url": "resp://v-{rank}:1", "instances_per_rank": 2}, "url"),  # K without {instance}
        ({"urls": [["resp://h:1"], ["resp://h:3", "resp://h:4"]]}, "urls"),  # ragged
        ({"urls": [["resp://h:1", "resp://h:2"], ["resp://h:3", "resp://h:4"]], "instances_per_rank": 3}, "instances_per_rank"),
        ({"url": "resp://v-0:1", "instances_per_rank": 2}, "url"),
        ({"url": "resp://same-{instance}:1", "instances_per_rank": 2}, "url"),  # both ranks on the same two servers
    ]:
        with pytest.raises(ConnectorConfigError) as e:
            parse_settings(dict(cfg, chunk_tokens=64), 2)
        assert str(e.value).startswith(f"kv_connector_extra_config.{key}: "), (cfg, str(e.value))


def test_graph_tokens_come_from_vllms_compilation_config():
    """The largest CUDA graph the decision fits the step jump at: vLLM's own CompilationConfig, 0 without graphs."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.config import CompilationConfig
    from vllm.config.compilation import CUDAGraphMode

    from kvctl.plugins.vllm_spec import graph_tokens

    def of(**kw) -> int:
        return graph_tokens(SimpleNamespace(compilation_config=CompilationConfig(**kw)))

    assert of(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE, max_cudagraph_capture_size=512) == 512
    assert of(cudagraph_mode=CUDAGraphMode.NONE, max_cudagraph_capture_size=512) == 0  # eager
    assert of() == 0 and graph_tokens(SimpleNamespace()) == 0  # not resolved yet, or no config at all
