"""`kvctl deploy-valkey vllm-config`: the --kv-transfer-config for kvctl's vLLM connector, checked by
vLLM's own KVTransferConfig and argument parser, and pointed at a real local tier."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.connector.resp import RespClient
from kvctl.connector.urls import expand_url, parse_resp_url
from kvctl.core.errors import InvalidInput
from kvctl.connector.settings import parse_settings
from kvctl.tier import local
from kvctl.tier.targets import state_path
from kvctl.tier.vllm_config import ConnectorOptions, kv_transfer_config, render_shell, with_user
from tests import vllm_loaders
from tests.tier.helpers import free_base_port


def invoke(*args: str):
    return CliRunner().invoke(cli, ["deploy-valkey", "vllm-config", *args])


def test_k8s_template_form_is_accepted_by_vllm():
    pytest.importorskip("vllm")
    res = invoke("--target", "k8s", "--ranks", "4", "--chunk-tokens", "128")
    assert res.exit_code == 0, res.output
    assert res.stdout.count("\n") == 1  # one line: the value of --kv-transfer-config
    cfg = json.loads(res.stdout)
    assert cfg == {
        "kv_connector": "KvctlConnector",
        "kv_connector_module_path": "kvctl.plugins.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        # 4 instances on a 16-core host (--host-cores' default): io-threads floor(12 / 4) = 3, one connection each
        "kv_connector_extra_config": {"url": "resp://valkey-kv-{rank}.valkey-kv:6379", "chunk_tokens": 128, "async_loading": False,
                                      "connections_per_instance": 3},
    }
    assert parse_resp_url(expand_url(cfg["kv_connector_extra_config"]["url"], 3)).host == "valkey-kv-3.valkey-kv"
    kv = vllm_loaders.kv_config(cfg)
    assert kv.kv_connector == "KvctlConnector" and kv.kv_connector_module_path == "kvctl.plugins.vllm"
    assert kv.kv_load_failure_policy == "recompute" and kv.is_kv_producer and kv.is_kv_consumer
    assert kv.get_from_extra_config("chunk_tokens", None) == 128


def test_shell_form_goes_through_vllms_parser_with_auth_async_and_timeout():
    pytest.importorskip("vllm")
    res = invoke("--target", "k8s", "--ranks", "2", "--namespace", "serving", "--loading", "async", "--timeout", "2.5",
                 "--engine-password-file", "/run/secrets/valkey-kv/engine-password", "--shell")  # fmt: skip
    assert res.exit_code == 0, res.output
    line = res.stdout.strip()
    assert line.startswith("--kv-transfer-config '{") and line.endswith("}'")
    kv = vllm_loaders.kv_from_command_line(f"python -m vllm.entrypoints.openai.api_server --model m {line}")
    assert kv.kv_connector == "KvctlConnector" and kv.kv_role == "kv_both"
    assert kv.kv_connector_extra_config == {
        "url": "resp://kvctl-engine@valkey-kv-{rank}.valkey-kv.serving.svc:6379",
        "chunk_tokens": 256,
        "async_loading": True,
        "connections_per_instance": 6,  # 2 instances on a 16-core host: io-threads 6
        "timeout_s": 2.5,
        "password_file": "/run/secrets/valkey-kv/engine-password",
    }


def test_systemd_list_form_and_json_output(tmp_path):
    res = invoke("--target", "systemd", "--ranks", "3", "--base-port", "18000", "--host", "10.0.0.5", "--json")
    assert res.exit_code == 0, res.output
    extra = json.loads(res.stdout)["kv_connector_extra_config"]
    assert extra["urls"] == ["resp://10.0.0.5:18000", "resp://10.0.0.5:18001", "resp://10.0.0.5:18002"]
    assert "url" not in extra and "password_file" not in extra and "timeout_s" not in extra
    out = tmp_path / "sub" / "kv.json"
    res = invoke("--target", "systemd", "--ranks", "3", "--base-port", "18000", "--host", "10.0.0.5", "--out", str(out))
    assert res.exit_code == 0 and res.stdout == ""
    assert json.loads(out.read_text())["kv_connector_extra_config"] == extra


@pytest.mark.parametrize("command", ["vllm-config", "lmcache-config"])
def test_kvctl_base_port_env_is_honoured_like_up(command, monkeypatch):
    """`up` reads KVCTL_BASE_PORT; the engine configs of the same systemd tier must point at the same ports
    (before, they ignored it and pointed engines at 17400)."""
    monkeypatch.setenv("KVCTL_BASE_PORT", "18100")
    res = CliRunner().invoke(cli, ["deploy-valkey", command, "--target", "systemd", "--ranks", "2", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    text = json.dumps(out)
    assert "127.0.0.1:18100" in text and "127.0.0.1:18101" in text and ":17400" not in text


def test_local_tier_with_auth_reaches_every_instance(tmp_path):
    """The connector's own settings parser turns the rendered URLs + password file into logins that reach each real instance."""
    pw = tmp_path / "tier.pw"
    pw.write_text("tier-admin-pw\n")
    pw.chmod(0o600)
    d = tmp_path / "tier"
    base = free_base_port(2)
    up = CliRunner().invoke(cli, ["deploy-valkey", "up", "--ranks", "2", "--base-port", str(base), "--maxmemory", "64mb", "--dir", str(d), "--password-file", str(pw)])
    assert up.exit_code == 0, up.output
    try:
        res = invoke("--dir", str(d), "--loading", "sync")
        assert res.exit_code == 0, res.output
        assert "tier-admin-pw" not in res.output
        extra = json.loads(res.stdout)["kv_connector_extra_config"]
        assert extra["urls"] == [f"resp://kvctl-engine@127.0.0.1:{base}", f"resp://kvctl-engine@127.0.0.1:{base + 1}"]
        assert extra["password_file"] == str((d / "engine.password").resolve()) and extra["async_loading"] is False
        password = Path(extra["password_file"]).read_text().strip()
        assert password not in res.output
        engine_urls = parse_settings(extra, world_size=2).urls  # what the connector inside vLLM connects to
        for rank in (0, 1):
            url = parse_resp_url(engine_urls[rank])
            assert (url.username, url.password, url.port) == ("kvctl-engine", password, base + rank)
            client = RespClient(engine_urls[rank], timeout_s=2)
            try:
                client.batched_set([f"probe-{rank}"], [b"x" * 10])
                assert client.batched_exists([f"probe-{rank}", "probe-missing"]) == [True, False]
            finally:
                client.close()
    finally:
        if state_path(d).exists():
            local.down(d)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--target", "k8s"], "--ranks"),
        (["--target", "systemd", "--ranks", "0"], "--ranks"),
        (["--target", "k8s", "--ranks", "2", "--chunk-tokens", "0"], "--chunk-tokens"),
        (["--target", "k8s", "--ranks", "2", "--timeout", "0"], "--timeout"),
        (["--target", "k8s", "--ranks", "2", "--shell", "--json"], "pick one"),
        (["--dir", "/nonexistent/tier"], "no kvctl tier"),
    ],
)
def test_bad_input_exits_2_with_one_line(args, needle):
    res = invoke(*args)
    assert res.exit_code == 2, res.output
    (error,) = [ln for ln in res.output.splitlines() if ln.startswith("Error")]  # one line, after click's usage lines
    assert needle in error


def test_library_rules():
    with pytest.raises(InvalidInput, match=r"\{rank\}"):
        kv_transfer_config("resp://one-host:6379")
    with pytest.raises(InvalidInput, match="no instances"):
        kv_transfer_config([])
    with pytest.raises(InvalidInput, match="timeout"):
        kv_transfer_config(["resp://h:1"], ConnectorOptions(timeout_s=-1))
    # the configured user wins over one in the URL (with_credentials' rule); it goes before the host, never a password
    assert with_user("resp://a@h:1", "b") == "resp://b@h:1"
    assert with_user("rediss://h:1/2?ssl_cert_reqs=none", "kvctl-engine") == "rediss://kvctl-engine@h:1/2?ssl_cert_reqs=none"
    cfg = kv_transfer_config(["resp://h:1"], ConnectorOptions(chunk_tokens=64, async_loading=True))
    assert shlex.split(render_shell(cfg)) == ["--kv-transfer-config", json.dumps(cfg, separators=(",", ":"))]


def test_the_lmcache_launch_line_of_docs_gpu_loads_in_vllm_with_recompute():
    """docs/gpu.md's launch of LMCache's own connector, through vLLM's own argument parser: LMCacheConnectorV1 with
    ``kv_load_failure_policy`` recompute (vLLM's default, fail, ends a request whose hit LMCache cannot load in full:
    doctor's load_failure_policy)."""
    import re

    text = (Path(__file__).resolve().parents[2] / "docs" / "gpu.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "LMCacheConnectorV1" in b)
    line = next(ln for ln in block.replace("\\\n", " ").splitlines() if "api_server" in ln)
    kv = vllm_loaders.kv_from_command_line(line)
    assert (kv.kv_connector, kv.kv_role, kv.kv_load_failure_policy) == ("LMCacheConnectorV1", "kv_both", "recompute")
