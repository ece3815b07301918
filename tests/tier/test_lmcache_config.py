"""LMCache configs for a per-rank tier, the configs/ samples, and the pure tier helpers."""

from __future__ import annotations

from pathlib import Path
from string import Template

import pytest
import redis
import yaml

from kvctl.connector.urls import expand_url, parse_resp_url
from kvctl.core.errors import InvalidInput
from kvctl.tier import spec
from kvctl.tier.sizing import io_threads_for
from kvctl.tier.lmcache_config import URL_LIST_KEY, LMCacheSettings, lmcache_config, plugin_key, render_lmcache_yaml
from kvctl.tier.server import free_port, start_valkey

REPO = Path(__file__).resolve().parents[2]
# Top-level keys LMCache's v1 config defines (lmcache/v1/config.py) that kvctl writes.
LMCACHE_KEYS = {"chunk_size", "local_cpu", "max_local_cpu_size", "remote_url", "remote_serde", "enable_async_loading", "extra_config", "remote_storage_plugins"}


def per_rank_urls(cfg: dict, ranks: int) -> list[str]:
    """What the engine plugin does with either form: rank r's URL."""
    extra = cfg.get("extra_config") or {}
    form = extra.get(URL_LIST_KEY) or extra.get(plugin_key("url")) or cfg["remote_url"]
    return [expand_url(form, r) for r in range(ranks)]


def test_template_form():
    cfg = lmcache_config("resp://valkey-kv-{rank}.valkey-kv:6379", LMCacheSettings(enable_async_loading=True))
    assert set(cfg) <= LMCACHE_KEYS and "extra_config" not in cfg
    assert cfg["enable_async_loading"] is True and isinstance(cfg["max_local_cpu_size"], float)
    assert [parse_resp_url(u).host for u in per_rank_urls(cfg, 3)] == [f"valkey-kv-{r}.valkey-kv" for r in range(3)]


def test_list_form_and_yaml_roundtrip():
    urls = [f"resp://127.0.0.1:{17400 + r}" for r in range(4)]
    cfg = lmcache_config(urls, username="kvctl-engine", password_file="/x/engine.password")
    text = render_lmcache_yaml(cfg, "t")
    assert "kvctl extension key" in text
    back = yaml.safe_load(text)
    assert back == cfg and isinstance(back["remote_url"], str)  # LMCache's remote_url is one string
    assert per_rank_urls(back, 4) == urls


@pytest.mark.parametrize("bad", ["resp://one-host:6379", []])
def test_bad_url_forms(bad):
    with pytest.raises(InvalidInput):
        lmcache_config(bad)


@pytest.mark.parametrize("name, ranks", [("per-rank-list.yaml", 4), ("per-rank-template.yaml", 8)])
def test_samples_in_configs(name, ranks):
    cfg = yaml.safe_load((REPO / "configs/lmcache" / name).read_text())
    assert set(cfg) <= LMCACHE_KEYS
    assert cfg["remote_storage_plugins"] == ["kvctl"] and "remote_url" not in cfg  # the form kvctl doctor passes
    urls = per_rank_urls(cfg, ranks)
    assert len(set(urls)) == ranks  # one instance per rank
    for u in urls:
        parse_resp_url(u)


def test_valkey_template_runs_on_a_real_server(tmp_path):
    text = Template((REPO / "configs/valkey/valkey-kv.conf.template").read_text()).substitute(
        port=free_port(), bind="127.0.0.1", dir=tmp_path, maxmemory=32 * 1024 * 1024, io_threads=1
    )
    settings = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition(" ")
            settings[key] = "" if value == '""' else value
    port = int(settings.pop("port"))
    with start_valkey(tmp_path, port=port, settings=settings) as v, redis.Redis(port=v.port) as r:
        assert r.config_get("maxmemory-policy")["maxmemory-policy"] == "allkeys-lru"


@pytest.mark.parametrize(
    "text, expected",
    [("400mb", 400 * 10**6), ("400MB", 400 * 10**6), ("2g", 2 * 10**9), ("1.5gb", 15 * 10**8), ("1048576", 1048576), (4096, 4096),
     # one parser for every byte-sized option (issue 31): an exponent is bytes; issue 48: MB is 10^6, MiB 2^20
     ("1e9", 10**9), ("12.4e6", 12_400_000), ("12MiB", 12 * 2**20), ("12.4mb", 12_400_000), ("400MiB", 400 * 2**20)],
)
def test_parse_size(text, expected):
    assert spec.parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "abc", "10 parsecs", "-5mb", "0", "1e", "nan", "inf"])
def test_parse_size_rejects(bad):
    with pytest.raises(InvalidInput):
        spec.parse_size(bad)


def test_split_and_io_threads_and_loopback():
    assert spec.split_maxmemory("400mb", 4) == 100 * 10**6
    with pytest.raises(InvalidInput):
        spec.split_maxmemory("400mb", 0)
    assert [io_threads_for(c) for c in (1, 2, 3, 8, 64)] == [1, 1, 2, 6, 8]  # clamp(floor(0.75 × cores), 1, 8)
    assert spec.is_loopback("127.0.0.1") and spec.is_loopback("::1") and spec.is_loopback("localhost")
    assert not spec.is_loopback("0.0.0.0") and not spec.is_loopback("10.0.0.1") and not spec.is_loopback("valkey-0")
    with pytest.raises(InvalidInput, match="password-file"):
        spec.resolve_auth("0.0.0.0", None, False)
    assert spec.resolve_auth("0.0.0.0", None, True).insecure_no_auth
    assert not spec.resolve_auth("127.0.0.1", None, True).insecure_no_auth  # loopback stays protected


def test_default_lmcache_config_passes_kvctl_doctor_and_native_is_warned(tmp_path):
    """Issue 22: without --plugin, lmcache-config wrote LMCache's native `remote_url: resp://...`, which kvctl's
    own doctor fails (the native client hangs on a missing key). The plugin form is the default now; --native
    still writes the old form, with a warning, and doctor still fails that one where LMCache <= 0.5.6 runs."""
    import json
    import os

    from click.testing import CliRunner

    from kvctl.cli import cli

    args = ["deploy-valkey", "lmcache-config", "--target", "systemd", "--ranks", "2"]
    res = CliRunner().invoke(cli, [*args, "--out", str(tmp_path / "default.yaml")])
    assert res.exit_code == 0, res.output
    cfg = yaml.safe_load((tmp_path / "default.yaml").read_text())
    assert cfg["remote_storage_plugins"] == ["kvctl"] and "remote_url" not in cfg
    res = CliRunner().invoke(cli, [*args, "--native", "--out", str(tmp_path / "native.yaml")])
    assert res.exit_code == 0 and "hangs on a GET of a missing key" in " ".join(res.stderr.split())
    assert yaml.safe_load((tmp_path / "native.yaml").read_text())["remote_url"] == "resp://127.0.0.1:17400"
    # kvctl doctor on both (LMCache 0.5.6 from $KVCTL_LMCACHE_PYTHON, as `make test` sets it)
    def doctor(name):
        res = CliRunner().invoke(cli, ["doctor", "--config", str(tmp_path / name), "--no-host-checks", "--world-size", "2", "--json"])
        return {c["name"]: c["status"] for c in json.loads(res.stdout)["checks"]}

    assert "fail" not in doctor("default.yaml").values()
    if os.environ.get("KVCTL_LMCACHE_PYTHON"):  # doctor finds LMCache 0.5.6 and fails its native client
        assert doctor("native.yaml")["known_bugs"] == "fail"
