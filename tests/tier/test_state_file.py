"""Issue 44 defect 15: a tier's state file (``kvctl-tier.json``) is read in one place, every field typed and bounded.

A hand-edited or corrupt state file is one clear line naming the key, exit 2, in every command that reads it
(`deploy-valkey status|down|vllm-config|lmcache-config`, `bench --dir`, `doctor --dir`, `diagnose --dir`): never a
TypeError, never a value out of range used silently (instances_per_rank 0 or 65, a port 0, a path outside the
directory).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from kvctl.cli import cli
from tests.hostile.helpers import kvctl, kvctl_env

PORT = 1  # nothing listens there: a valid file gets as far as "unreachable"


def _state(d, k: int = 2) -> dict:
    insts = [{"rank": 0, "host": "127.0.0.1", "port": PORT + i, "pid": 4194000 + i, "url": f"resp://127.0.0.1:{PORT + i}",
              "config": f"valkey-0-{i}.conf", "logfile": f"valkey-0-{i}.log", "pidfile": f"valkey-0-{i}.pid",
              "cmdline": ["valkey-server"], "create_time": 1.5, "instance": i} for i in range(k)]
    return {"dir": str(d), "instances": insts, "binary": "valkey-server", "server_version": "8.1.1", "maxmemory_total": 2 << 20,
            "password_file": None, "created_at": "2025-01-01T00:00:00+00:00", "maxmemory_per_instance": 1 << 20, "io_threads": 1,
            "engine_user": None, "engine_password_file": None, "complete": True, "instances_per_rank": k}


def _write(d, state) -> None:
    d.mkdir(exist_ok=True)
    (d / "kvctl-tier.json").write_text(json.dumps(state) if not isinstance(state, str) else state)


def _set(state: dict, key: str, value) -> dict:
    state = copy.deepcopy(state)
    if key.startswith("instances[1]."):
        state["instances"][1][key.split(".", 1)[1]] = value
    else:
        state[key] = value
    return state


BAD = [
    ("instances_per_rank", "2"), ("instances_per_rank", 0), ("instances_per_rank", 65), ("instances_per_rank", True),
    ("instances_per_rank", 2.5), ("instances_per_rank", None), ("instances_per_rank", 1e300),
    ("instances", "x"), ("instances", [1]), ("instances", None),
    ("instances[1].port", 0), ("instances[1].port", 65536), ("instances[1].port", "2"), ("instances[1].port", PORT),
    ("instances[1].rank", -1), ("instances[1].rank", "0"), ("instances[1].rank", 5000),
    ("instances[1].instance", 2), ("instances[1].instance", 0), ("instances[1].instance", -1),
    ("instances[1].pid", "x"), ("instances[1].pid", -2), ("instances[1].pid", 1 << 40),
    ("instances[1].create_time", "abc"), ("instances[1].create_time", -1.0),
    ("instances[1].host", "127.0.0.1\nx"), ("instances[1].host", 5), ("instances[1].url", ["x"]), ("instances[1].url", "http://x:1"),
    ("instances[1].cmdline", "valkey-server"), ("instances[1].cmdline", [1]),
    ("instances[1].logfile", "/etc/passwd"), ("instances[1].config", "../valkey-0-1.conf"), ("instances[1].pidfile", "valkey-0-0.pid"),
    ("engine_password_file", "/etc/passwd"), ("password_file", 5), ("password_file", "pw\nx"), ("engine_user", 5),
    ("maxmemory_per_instance", "x"), ("maxmemory_per_instance", -1), ("io_threads", 0), ("io_threads", 1000), ("complete", "yes"),
    ("dir", 5), ("binary", ["x"]),
]


@pytest.mark.parametrize("key, value", BAD, ids=[f"{k}={v!r}"[:40] for k, v in BAD])
def test_a_bad_field_is_one_line_naming_it(tmp_path, key, value):
    d = tmp_path / "t"
    _write(d, _set(_state(d), key, value))
    res = CliRunner().invoke(cli, ["deploy-valkey", "status", "--dir", str(d)])
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error:"), res.output
    name = key.split(".")[-1] if not key.startswith("instances[") else key.split(".")[-1]
    assert name in lines[0] and "kvctl-tier.json" in lines[0], lines[0]


@pytest.mark.parametrize("text, why", [
    ("[]", "not a JSON object"), ("{", "not"), ('{"dir": "x"}', "instances"), ("\xff\xfe", "not"), ("[" * 100000, "nested"),
])
def test_a_file_that_is_no_state_is_one_line(tmp_path, text, why):
    d = tmp_path / "t"
    d.mkdir()
    (d / "kvctl-tier.json").write_bytes(text.encode("latin-1"))
    res = CliRunner().invoke(cli, ["deploy-valkey", "status", "--dir", str(d)])
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1 and why in res.output, res.output


def test_a_fifo_or_a_huge_state_file_is_refused_without_reading_it(tmp_path):
    for make in ("fifo", "huge"):
        d = tmp_path / make
        d.mkdir()
        if make == "fifo":
            os.mkfifo(d / "kvctl-tier.json")
        else:
            with open(d / "kvctl-tier.json", "wb") as f:
                f.truncate(1 << 40)  # sparse: 1 TiB of nothing
        ran = kvctl(["deploy-valkey", "status", "--dir", str(d)], tmp_path / "home", timeout_s=30)
        assert ran.returncode == 2 and len(ran.stderr.strip().splitlines()) == 1, ran.output


def test_a_valid_file_is_read(tmp_path):
    """The other side: the base state of these tests is accepted (nothing listens on its ports: unreachable, exit 5)."""
    d = tmp_path / "t"
    _write(d, _state(d))
    res = CliRunner().invoke(cli, ["deploy-valkey", "status", "--dir", str(d), "--json"])
    assert res.exit_code == 5, res.output
    assert [i["state"] for i in json.loads(res.stdout)["instances"]] == ["down", "down"]


READERS = [
    ["deploy-valkey", "status"], ["deploy-valkey", "down"], ["deploy-valkey", "down", "--purge"], ["deploy-valkey", "vllm-config"],
    ["deploy-valkey", "lmcache-config"], ["bench", "--duration", "0.5"], ["doctor"], ["diagnose", "--engine-url", "http://127.0.0.1:1"],
]


@pytest.mark.parametrize("cmd", READERS, ids=[" ".join(c[:2]) for c in READERS])
@pytest.mark.parametrize("value", ["2", 0, 65])
def test_every_reader_refuses_a_bad_instances_per_rank(tmp_path, cmd, value):
    d = tmp_path / "t"
    _write(d, _set(_state(d), "instances_per_rank", value))
    res = CliRunner().invoke(cli, [*cmd, "--dir", str(d)])
    assert res.exit_code == 2, res.output
    assert "instances_per_rank" in res.output and "kvctl-tier.json" in res.output, res.output
    assert (d / "kvctl-tier.json").exists()  # nothing removed


def test_bench_dir_as_a_real_process(tmp_path):
    """`bench --dir` used to run with instances_per_rank "2" as if it were 1: a real kvctl now refuses it."""
    d = tmp_path / "t"
    _write(d, _set(_state(d), "instances_per_rank", "2"))
    res = subprocess.run([sys.executable, "-m", "kvctl.cli", "bench", "--dir", str(d), "--duration", "0.5"],
                         env=kvctl_env(tmp_path / "home"), capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stderr
    assert "instances_per_rank" in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
