"""configs/vllm/: every launch example is accepted by vLLM's own loaders and says what it claims
(sync/async, list/template), and the JSON samples are what `kvctl deploy-valkey vllm-config` prints."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.connector.urls import parse_resp_url
from kvctl.connector.settings import parse_settings
from tests import vllm_loaders

pytest.importorskip("vllm")

SAMPLES = Path(__file__).resolve().parents[2] / "configs" / "vllm"
LIST = ["resp://127.0.0.1:17400", "resp://127.0.0.1:17401"]
TEMPLATE = "resp://kvctl-engine@valkey-kv-{rank}.valkey-kv:6379"
PW = "/run/secrets/valkey-kv/engine-password"
# connections_per_instance: one per I/O thread of the fleet's instances, as `up` sizes them on a 16-core host (--host-cores
# default): 2 instances get io-threads 6, 8 instances 1 (at least 2 connections)
SYNC_LIST = {"urls": LIST, "chunk_tokens": 256, "async_loading": False, "connections_per_instance": 6}
ASYNC_TEMPLATE = {"url": TEMPLATE, "chunk_tokens": 256, "async_loading": True, "connections_per_instance": 2, "timeout_s": 2.0, "password_file": PW}


def assert_kvctl_connector(kv, extra: dict) -> None:
    """vLLM's config names kvctl's connector with ``extra``, and the connector's own parser accepts it."""
    assert (kv.kv_connector, kv.kv_connector_module_path, kv.kv_role, kv.kv_load_failure_policy) == (
        "KvctlConnector", "kvctl.plugins.vllm", "kv_both", "recompute",
    )  # fmt: skip
    assert kv.kv_connector_extra_config == extra
    settings = parse_settings({k: v for k, v in extra.items() if k != "password_file"}, world_size=2)  # /run/secrets is not here
    assert settings.async_loading is extra["async_loading"] and settings.chunk_tokens == extra["chunk_tokens"]
    assert [parse_resp_url(u).port for u in settings.urls] in ([17400, 17401], [6379, 6379])


def env_file(path: Path) -> dict[str, str]:
    """KEY=value lines taken literally, as docker --env-file reads them."""
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            out[key] = value
    return out


def exec_start(unit: Path) -> str:
    """The ExecStart command of a unit, continuation lines joined."""
    text = unit.read_text().replace("\\\n", " ")
    (line,) = [ln for ln in text.splitlines() if ln.startswith("ExecStart=")]
    return line.removeprefix("ExecStart=")


@pytest.mark.parametrize(
    "name, args, extra",
    [
        ("kv-transfer-sync.json", ["--target", "systemd", "--ranks", "2"], SYNC_LIST),
        ("kv-transfer-async-k8s.json", ["--target", "k8s", "--ranks", "8", "--loading", "async", "--timeout", "2", "--engine-password-file", PW], ASYNC_TEMPLATE),
    ],
)
def test_json_samples(name, args, extra):
    sample = json.loads((SAMPLES / name).read_text())
    assert_kvctl_connector(vllm_loaders.kv_config(sample), extra)
    res = CliRunner().invoke(cli, ["deploy-valkey", "vllm-config", *args])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout) == sample


@pytest.mark.parametrize("name, extra", [("vllm-config-sync.yaml", SYNC_LIST), ("vllm-config-async.yaml", ASYNC_TEMPLATE)])
def test_config_yaml_samples(name, extra):
    args = vllm_loaders.parse_serve_args(["--config", str(SAMPLES / name)])
    assert_kvctl_connector(args.kv_transfer_config, extra)
    assert args.enable_prompt_tokens_details is True


def test_systemd_unit_sample():
    command = exec_start(SAMPLES / "vllm-prefill.service")
    # systemd expands %-specifiers and $VARS on ExecStart; the sample has none, so its quoting is the shell's
    assert "%" not in command and "$" not in command
    assert_kvctl_connector(vllm_loaders.kv_from_command_line(command), SYNC_LIST)
    assert vllm_loaders.parse_serve_args(shlex.split(command)[3:]).tensor_parallel_size == 2


def test_env_file_through_the_real_entrypoint(tmp_path):
    """entrypoint.sh run by /bin/sh with the env file's values; a stand-in module records the argv vLLM would get."""
    (tmp_path / "dump_argv.py").write_text("import json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    env = {**os.environ, **env_file(SAMPLES / "vllm-prefill.env"), "PYTHON": sys.executable, "VLLM_MODULE": "dump_argv", "PYTHONPATH": str(tmp_path)}
    out = subprocess.run(["/bin/sh", str(SAMPLES / "entrypoint.sh"), "--port", "8123"], env=env, capture_output=True, text=True, timeout=60, check=True)
    argv = json.loads(out.stdout)
    assert argv[-2:] == ["--port", "8123"]  # the container's own arguments come last
    args = vllm_loaders.parse_serve_args(argv)
    assert_kvctl_connector(args.kv_transfer_config, ASYNC_TEMPLATE)
    assert (args.tensor_parallel_size, args.port) == (8, 8123)
