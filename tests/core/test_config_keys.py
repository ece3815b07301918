"""Issue 48 item 4: a typo'd config key is named, with the key it was meant to be.

With `enable_async_loadin: false` (one letter short), `loading show` said "not set" and `loading async` added a second
key beside the typo; `doctor --config` with `chunk_sise: 256` said nothing, and LMCache quietly used its default. Now
every config kvctl reads or edits warns of a key it does not know with the nearest known one (one helper,
kvctl.core.known_keys, difflib), and `loading async|sync` refuse (exit 2, naming both) to add a key beside a near-miss
of it unless --force. LMCache's keys are LMCache 0.5.6's own (read from its config class), vLLM's those of its
KVTransferConfig, the connector's those it accepts.
"""

from __future__ import annotations

import ast
import json
import logging
import re
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.connector import config_keys as K
from kvctl.connector.settings import ConnectorConfigError, parse_settings
from kvctl.core import engine_keys
from kvctl.core.known_keys import nearest

ROOT = Path(__file__).resolve().parents[2]


def run(args, code=0):
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == code, (res.output, res.exception)
    return res


def words(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv("LMCACHE_CONFIG_FILE", raising=False)


# --- LMCache YAML: loading show / async / sync ----------------------------------------------------------------


TYPO = "chunk_size: 256\nenable_async_loadin: false   # one letter short\nlocal_cpu: true\n"


def test_show_names_the_typo_and_the_key_it_was_meant_to_be(tmp_path):
    p = tmp_path / "lmcache.yaml"
    p.write_text(TYPO)
    d = json.loads(run(["loading", "show", "--config", str(p), "--json"]).stdout)
    (src,) = d["sources"]
    assert src["async_loading"] is None
    (u,) = src["unknown_keys"]
    assert (u["key"], u["nearest"], u["line"], u["where"]) == ("enable_async_loadin", "enable_async_loading", 2, str(p))
    assert "LMCache ignores it" in u["effect"]
    res = run(["loading", "show", "--config", str(p)])
    text = words(res.output)
    assert "enable_async_loadin" in text and "did you mean enable_async_loading" in text and "line 2" in text, text


def test_async_refuses_to_add_the_key_beside_a_near_miss(tmp_path):
    p = tmp_path / "lmcache.yaml"
    p.write_text(TYPO)
    res = run(["loading", "async", "--config", str(p)], 2)
    text = words(res.output)
    assert "enable_async_loadin" in text and "enable_async_loading" in text and "line 2" in text and "--force" in text, text
    assert p.read_text() == TYPO  # untouched: no second key beside the typo
    run(["loading", "sync", "--config", str(p), "--dry-run", "--force"])  # sync too, unless forced
    res = run(["loading", "sync", "--config", str(p), "--dry-run", "--diagnosis", str(_fresh(tmp_path))], 2)
    assert "enable_async_loadin" in res.output
    res = run(["loading", "async", "--config", str(p), "--force", "--no-backup"])
    assert yaml.safe_load(p.read_text())["enable_async_loading"] is True
    assert "enable_async_loadin" in words(res.output)  # still said, when forced


def _fresh(tmp_path) -> Path:
    import datetime as dt  # noqa: PLC0415

    f = tmp_path / "diag.json"
    f.write_text(json.dumps({"rho": 0.1, "rho_bound": "estimate", "created_at": dt.datetime.now(dt.timezone.utc).isoformat(), "findings": []}))
    return f


def test_a_key_that_is_not_a_near_miss_does_not_stop_the_flip(tmp_path):
    p = tmp_path / "lmcache.yaml"
    p.write_text("chunk_size: 256\nmax_local_cpu_sise: 5\n")
    res = run(["loading", "async", "--config", str(p), "--no-backup"])
    assert yaml.safe_load(p.read_text())["enable_async_loading"] is True
    assert "max_local_cpu_sise" in words(res.output) and "max_local_cpu_size" in words(res.output)


def test_env_file(tmp_path):
    env = tmp_path / "engine.env"
    env.write_text("VLLM_PORT=8000\nLMCACHE_ENABLE_ASYNC_LOADIN=False\nLMCACHE_CHUNK_SIZ=256\n")
    d = json.loads(run(["loading", "show", "--env-file", str(env), "--json"]).stdout)
    got = {(u["key"], u["nearest"], u["line"]) for u in d["sources"][0]["unknown_keys"]}
    assert got == {("LMCACHE_ENABLE_ASYNC_LOADIN", "LMCACHE_ENABLE_ASYNC_LOADING", 2), ("LMCACHE_CHUNK_SIZ", "LMCACHE_CHUNK_SIZE", 3)}
    res = run(["loading", "async", "--env-file", str(env)], 2)
    assert "LMCACHE_ENABLE_ASYNC_LOADIN" in res.output and "LMCACHE_ENABLE_ASYNC_LOADING" in res.output


def test_vllm_connector_extra_config(tmp_path):
    cfg = tmp_path / "vllm.yaml"
    text = ("model: m\nkv-transfer-config:\n  kv_connector: KvctlConnector\n  kv_connector_module_path: kvctl.plugins.vllm\n"
            "  kv_role: kv_both\n  kv_connector_extra_config: {urls: ['resp://127.0.0.1:7000'], asyncloading: true}\n")
    cfg.write_text(text)
    d = json.loads(run(["loading", "show", "--vllm", str(cfg), "--json"]).stdout)
    assert [(u["key"], u["nearest"]) for u in d["sources"][0]["unknown_keys"]] == [("kv_connector_extra_config.asyncloading", "async_loading")]
    res = run(["loading", "async", "--vllm", str(cfg)], 2)
    assert "asyncloading" in res.output and "async_loading" in res.output
    assert cfg.read_text() == text


# --- doctor ---------------------------------------------------------------------------------------------------


def _doctor(*args):
    res = CliRunner().invoke(cli, ["doctor", "--no-host-checks", "--json", *args])
    return res, [c for c in json.loads(res.stdout)["checks"] if c["name"] == "unknown_key"]


def test_doctor_names_an_lmcache_typo(tmp_path):
    p = tmp_path / "lmcache.yaml"
    p.write_text("chunk_sise: 256\nremote_storage_plugins: [kvctl]\nextra_config:\n  kvctl_remote_urls: ['resp://a:1']\n"
                 "  remote_storage_plugin.kvctl.timeout: 2\n  lookup_timeout_ms: 3000\n")
    res, checks = _doctor("--config", str(p))
    msgs = {c["evidence"]["key"]: c for c in checks}
    assert set(msgs) == {"chunk_sise", "extra_config.remote_storage_plugin.kvctl.timeout"}, checks  # another plugin's keys are its own
    assert msgs["chunk_sise"]["status"] == "warning" and "chunk_size" in msgs["chunk_sise"]["message"]
    assert msgs["chunk_sise"]["evidence"]["nearest"] == "chunk_size"
    assert msgs["extra_config.remote_storage_plugin.kvctl.timeout"]["evidence"]["nearest"] == "remote_storage_plugin.kvctl.timeout_s"
    assert res.exit_code == 3, res.output


def test_doctor_names_a_kv_transfer_typo(tmp_path):
    kvt = {"kv_conector": "KvctlConnector", "kv_connector_module_path": "kvctl.plugins.vllm", "kv_role": "kv_both",
           "kv_connector_extra_config": {"urls": ["resp://a:1"], "chunk_token": 256, "load_policy": {"t0": 0.1}}}
    res, checks = _doctor("--kv-transfer-config", json.dumps(kvt))
    got = {c["evidence"]["key"]: (c["status"], c["evidence"]["nearest"]) for c in checks}
    assert got == {"kv_conector": ("warning", "kv_connector"),
                   "kv_connector_extra_config.chunk_token": ("fail", "chunk_tokens"),  # kvctl's connector refuses it at start
                   "kv_connector_extra_config.load_policy.t0": ("fail", "t0_s")}, checks
    assert res.exit_code == 4


def test_doctor_on_clean_configs_says_nothing_of_keys():
    _, checks = _doctor("--config", str(ROOT / "configs" / "lmcache" / "per-rank-list.yaml"))
    assert checks == []
    _, checks = _doctor("--kv-transfer-config", f"@{ROOT / 'configs' / 'vllm' / 'kv-transfer-sync.json'}")
    assert checks == []


# --- the connector, the LMCache plugin, the tier's state, the drill engine's config, bench files -----------------


def test_the_connector_refusal_names_the_nearest_key():
    with pytest.raises(ConnectorConfigError, match="did you mean chunk_tokens"):
        parse_settings({"urls": ["resp://127.0.0.1:7000"], "chunk_token": 256}, 1)
    with pytest.raises(ConnectorConfigError, match="did you mean t0_s"):
        parse_settings({"urls": ["resp://127.0.0.1:7000"], "chunk_tokens": 256, "load_policy": {"t0": 0.1}}, 1)


def test_the_lmcache_plugin_warns_of_a_key_it_ignores(caplog):
    from kvctl.connector.lmcache_settings import plugin_settings

    with caplog.at_level(logging.WARNING):
        plugin_settings({K.URL_LIST_KEY: ["resp://127.0.0.1:7000"], "remote_storage_plugin.kvctl.pool_sise": 3}, "kvctl", 0)
    assert "remote_storage_plugin.kvctl.pool_sise" in caplog.text and "remote_storage_plugin.kvctl.pool_size" in caplog.text


def test_the_tier_state_warns_of_a_key_it_ignores(tmp_path, caplog):
    from kvctl.tier.state_file import load_tier

    state = {"dir": str(tmp_path), "instances": [{"rank": 0, "host": "127.0.0.1", "port": 17400, "pid": 0, "url": "resp://127.0.0.1:17400",
                                                 "config": "valkey-0.conf", "logfile": "valkey-0.log", "pidfile": "valkey-0.pid"}],
             "maxmemory_totl": 400}
    (tmp_path / "kvctl-tier.json").write_text(json.dumps(state))
    with caplog.at_level(logging.WARNING):
        load_tier(tmp_path)
    assert "maxmemory_totl" in caplog.text and "maxmemory_total" in caplog.text


def test_the_drill_engine_config_warns_of_a_key_it_ignores(tmp_path, caplog):
    from kvctl.drill.config import EngineSettings, read_config, write_config

    p = write_config(tmp_path / "engine.yaml", EngineSettings(remote_urls=["resp://127.0.0.1:1"], chunk_bytes=4096, prefill_tokens_per_s=1e6,
                                                              t0_s=0.0, stream_bytes_per_s=1e9))
    p.write_text(p.read_text().replace("  lookup: exists", "  lookup: exists\n  chunk_rtt: 0.5"))
    with caplog.at_level(logging.WARNING):
        read_config(p)
    assert "drill.chunk_rtt" in caplog.text and "chunk_rtt_s" in caplog.text


def test_a_bench_file_warns_of_a_key_it_ignores(tmp_path, caplog):
    from kvctl.sim.variability import read_bench_file

    f = tmp_path / "b.json"
    f.write_text(json.dumps({"metadata": {}, "runs": [{"op": "get", "instances": 1, "clients": 1, "p50_batch_msec": 2.0}], "verdct": None}))
    with caplog.at_level(logging.WARNING):
        read_bench_file(str(f), "--bench")
    assert "verdct" in caplog.text and "verdict" in caplog.text
    assert "p50_batch_msec" in caplog.text and "p50_batch_ms" in caplog.text


# --- the lists are the engines' own, and the nearest key is found in one place ---------------------------------


def _dict_keys(source: str, name: str) -> set[str]:
    for node in ast.parse(source).body:
        target = node.target if isinstance(node, ast.AnnAssign) else node.targets[0] if isinstance(node, ast.Assign) else None
        if isinstance(target, ast.Name) and target.id == name:
            return {k.value for k in node.value.keys}
    raise AssertionError(name)


def test_lmcache_keys_are_lmcache_056s_own():
    src = next(ROOT.glob(".venv-lmcache/lib/python3*/site-packages/lmcache/v1/config.py"), None)
    if src is None:
        pytest.skip("no .venv-lmcache (make lmcache-venv)")
    text = src.read_text()
    assert engine_keys.lmcache_keys_from_source(text) == (engine_keys.LMCACHE_KEYS, engine_keys.LMCACHE_OLD_KEYS)
    assert engine_keys.lmcache_env_from_package(src.parents[1]) == engine_keys.LMCACHE_OTHER_ENV
    assert engine_keys.LMCACHE_KEYS == frozenset(_dict_keys(text, "_CONFIG_DEFINITIONS"))
    assert "enable_async_loading" in engine_keys.LMCACHE_KEYS and "chunk_size" in engine_keys.LMCACHE_KEYS


def test_vllm_keys_are_its_kv_transfer_configs_fields():
    src = next(ROOT.glob(".venv/lib/python3*/site-packages/vllm/config/kv_transfer.py"), None)
    if src is None:
        pytest.skip("no vLLM in .venv (the engine extra)")
    assert engine_keys.vllm_keys_from_source(src.read_text()) == engine_keys.VLLM_KV_TRANSFER_KEYS


def test_nearest():
    assert nearest("enable_async_loadin", engine_keys.LMCACHE_KEYS) == "enable_async_loading"
    assert nearest("Chunk_Size", engine_keys.LMCACHE_KEYS) == "chunk_size"
    assert nearest("zzz", engine_keys.LMCACHE_KEYS) is None


def test_one_place_finds_the_nearest_key():
    """Config keys are matched in kvctl.core.known_keys alone (kvctl/core/runbooks.py matches runbook ids, not keys)."""
    users = [str(p.relative_to(ROOT)) for d in ("kvctl", "connector", "plugins") for p in (ROOT / d).rglob("*.py")
             if re.search(r"get_close_matches|SequenceMatcher", p.read_text())]
    assert sorted(set(users) - {"kvctl/core/runbooks.py"}) == ["kvctl/core/known_keys.py"], users


def test_a_vllm_config_whose_kv_transfer_key_is_misspelt(tmp_path):
    cfg = tmp_path / "vllm.yaml"
    cfg.write_text("model: m\nkv-transfer-confg:\n  kv_connector: KvctlConnector\n")
    res = run(["loading", "show", "--vllm", str(cfg)], 2)
    assert "kv-transfer-confg on line 2 is a near miss of kv-transfer-config" in words(res.output), res.output


def test_every_plugin_key_kvctl_reads_or_writes_is_a_known_one():
    """The plugin keys are one list (connector/config_keys.py PLUGIN_KEYS): every plugin_key("x") in the code names one,
    so kvctl never warns of a key it writes itself."""
    used = {m for d in ("kvctl", "connector", "plugins") for p in (ROOT / d).rglob("*.py")
            for m in re.findall(r"plugin_key\(\s*[\"']([a-z_]+)[\"']", p.read_text())}
    assert used and used <= K.PLUGIN_KEYS, used - K.PLUGIN_KEYS
    out = CliRunner().invoke(cli, ["deploy-valkey", "lmcache-config", "--target", "systemd", "--ranks", "2", "--instances-per-rank", "2"])
    from kvctl.connector.unknown_keys import in_lmcache  # noqa: PLC0415

    assert out.exit_code == 0, out.output
    assert in_lmcache(yaml.safe_load(out.stdout), "lmcache-config") == []
    out = CliRunner().invoke(cli, ["deploy-valkey", "vllm-config", "--target", "systemd", "--ranks", "2", "--loading", "async", "--timeout-s", "2", "--json"])
    from kvctl.connector.unknown_keys import in_kv_transfer  # noqa: PLC0415

    assert out.exit_code == 0, out.output
    assert in_kv_transfer(json.loads(out.stdout), "vllm-config") == []
