"""`kvctl deploy-valkey lmcache-config --plugin`: the plugin form, loaded by LMCache's own config loader and used on the tier.

A real two-instance tier from `kvctl deploy-valkey up`; the printed YAML goes
through LMCache 0.5.6's ``load_engine_config_with_overrides`` and drives the
plugin for worker 1 (tests/lmcache/scenarios.py); `kvctl loading` flips it.
"""

from __future__ import annotations

import json

import pytest
import redis
import yaml
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.connector.lmcache_settings import plugin_settings
from kvctl.tier import local
from kvctl.tier.lmcache_config import LMCacheSettings, lmcache_config, render_lmcache_yaml
from kvctl.tier.targets import state_path
from tests.lmcache.lmcache_env import run_scenario
from tests.tier.helpers import free_base_port

MODULE = "remote_storage_plugin.kvctl.module_path"


def test_plugin_form_pure():
    urls = ["resp://127.0.0.1:7000", "resp://127.0.0.1:7001"]
    cfg = lmcache_config(urls, LMCacheSettings(chunk_size=64), "kvctl-engine", "/run/pw", plugin=True)
    assert "remote_url" not in cfg and cfg["remote_storage_plugins"] == ["kvctl"]
    assert cfg["extra_config"] == {
        MODULE: "kvctl.plugins.lmcache",
        "remote_storage_plugin.kvctl.class_name": "KvctlConnectorAdapter",
        "kvctl_remote_urls": urls,
        "kvctl_username": "kvctl-engine",
        "kvctl_password_file": "/run/pw",
    }
    tpl = lmcache_config("resp://valkey-{rank}.kv:6379", plugin=True)
    assert tpl["extra_config"]["remote_storage_plugin.kvctl.url"] == "resp://valkey-{rank}.kv:6379"
    text = render_lmcache_yaml(tpl, "t")
    assert "Plugin form" in text and "write every chunk twice" in text and yaml.safe_load(text) == tpl
    # what each rank's plugin makes of it
    assert plugin_settings(tpl["extra_config"], "kvctl", 5).url == "resp://valkey-5.kv:6379"


@pytest.fixture
def tier(tmp_path):
    d = tmp_path / "kv-tier"
    base = free_base_port(2)
    res = CliRunner().invoke(cli, ["deploy-valkey", "up", "--ranks", "2", "--base-port", str(base),
                                   "--maxmemory", "64mb", "--dir", str(d), "--json"])
    assert res.exit_code == 0, res.output
    try:
        yield d, json.loads(res.stdout)["instances"]
    finally:
        if state_path(d).exists():
            local.down(d)


def test_plugin_config_loaded_by_lmcache_and_used_on_the_tier(lmc_python, tier, tmp_path):  # noqa: F811
    d, insts = tier
    out_file = tmp_path / "lmcache.yaml"
    res = CliRunner().invoke(cli, ["deploy-valkey", "lmcache-config", "--plugin", "--chunk-tokens", "16",
                                   "--dir", str(d), "--out", str(out_file)])
    assert res.exit_code == 0, res.output
    urls = [i["url"] for i in insts]
    loaded = run_scenario("validate_config_file", {"path": str(out_file)})
    assert loaded["remote_url"] is None and loaded["remote_storage_plugins"] == ["kvctl"]
    assert loaded["extra_config"]["kvctl_remote_urls"] == urls and loaded["chunk_size"] == 16
    assert loaded["enable_async_loading"] is False

    # the same file drives the plugin: worker 1 of 2 writes LMCache's keys to instance 1 only
    out = run_scenario("plugin_roundtrip", {"config": str(out_file), "worker_id": 1, "world_size": 2})
    assert out["batched_get"] == [1.0, None, 3.0] and out["errors"] == 0
    r0, r1 = (redis.Redis(host=i["host"], port=i["port"]) for i in insts)
    assert r1.strlen(out["stored_keys"][0]) == 2 * 2 * 16 * 8 * 2  # K,V x 2 layers x 16 tokens x 8 values x bf16
    assert r0.dbsize() == 0

    # `kvctl loading` flips it like any LMCache config; LMCache still reads the plugin form
    res = CliRunner().invoke(cli, ["loading", "async", "--config", str(out_file), "--json"])
    assert res.exit_code == 0, res.output
    flipped = run_scenario("validate_config_file", {"path": str(out_file)})
    assert flipped["enable_async_loading"] is True
    assert flipped["remote_storage_plugins"] == ["kvctl"] and flipped["extra_config"] == loaded["extra_config"]
    res = CliRunner().invoke(cli, ["loading", "show", "--config", str(out_file), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["sources"][0]["async_loading"] is True


@pytest.mark.parametrize("connector, device", [("lmcache", "cuda"), ("lmcache-native", "cuda"), ("lmcache", "cpu")])
def test_an_lmcache_lab_engine_runs_lmcaches_connector_on_the_config_lmcache_loads(lmc_python, tmp_path, connector, device):  # noqa: F811
    """Issue 47: the GPU chains (tests/gpu/test_engine_gpu.py, LMCache's jobs) and engine_gpu.py's LMCache mode start
    LMCache's own connector with `lmcache-config`'s file for the step's loading, a small L1 and PYTHONHASHSEED fixed
    (LabTier.lmcache_engine); LMCache's loader reads it."""
    from kvctl.lab.engine import LabTier  # noqa: PLC0415

    tier = LabTier(tmp_path / "tier", maxmemory="64mb")
    try:
        cfg, env = tier.lmcache_engine(tmp_path / "step.yaml", {"X": "1"}, loading="async", chunk_tokens=256,
                                       native=connector == "lmcache-native", device=device)
    finally:
        tier.down()
    assert cfg["kv_connector"] == ("LMCacheConnectorV1" if device == "cuda" else "KvctlLMCacheConnector")
    assert (cfg.get("kv_connector_module_path") is None) == (device == "cuda")
    assert env["X"] == "1" and env["PYTHONHASHSEED"] == "0"
    loaded = run_scenario("validate_config_file", {"path": env["LMCACHE_CONFIG_FILE"]})
    assert loaded["enable_async_loading"] is True and loaded["chunk_size"] == 256 and loaded["max_local_cpu_size"] == 0.2
    if connector == "lmcache-native":
        assert loaded["remote_url"] == tier.instances[0]["url"] and not loaded["remote_storage_plugins"]
    else:
        assert loaded["remote_url"] is None and loaded["remote_storage_plugins"] == ["kvctl"]
