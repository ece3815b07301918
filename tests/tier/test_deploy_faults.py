"""`kvctl deploy-valkey` under signals, races and odd hosts: real `kvctl` subprocesses, real valkey-servers."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import redis
import yaml
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.tier import local
from kvctl.tier.server import port_in_use
from kvctl.tier.targets import state_path
from tests.tier.helpers import free_base_port, invoke, valkey_pids_on
from tests.tier.tier_procs import servers_in

KVCTL = str(Path(sys.executable).with_name("kvctl"))


def kvctl(*args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([KVCTL, "deploy-valkey", *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def read_state(d: Path) -> dict | None:
    try:
        return json.loads(state_path(d).read_text())
    except (OSError, ValueError):
        return None


def wait_for_instances(d: Path, proc: subprocess.Popen, n: int, limit_s: float = 20.0) -> dict:
    """Until the state file lists ``n`` instances (bounded)."""
    deadline = time.monotonic() + limit_s
    while True:
        st = read_state(d)
        if st and len(st["instances"]) >= n:
            return st
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "up never recorded an instance"
        time.sleep(0.01)


@pytest.fixture
def cleanup_ports():
    """Ports a test started servers on: afterwards no valkey-server may be left on them."""
    ports: list[int] = []
    yield ports
    leaked = valkey_pids_on(ports)
    for pid in leaked:  # only servers on this test's ports; the assertion below still fails the test
        psutil.Process(pid).kill()
    assert not leaked, f"valkey-servers left running: {leaked}"


def test_sigkilled_up_is_cleaned_by_down(tmp_path, cleanup_ports):
    d, base = tmp_path / "t", free_base_port(8)
    cleanup_ports.extend(range(base, base + 8))
    up = kvctl("up", "--ranks", "8", "--base-port", str(base), "--maxmemory", "64mb", "--dir", str(d), cwd=tmp_path)
    wait_for_instances(d, up, 1)
    up.kill()
    up.communicate(timeout=10)
    st = read_state(d)
    assert st["complete"] is False and 1 <= len(st["instances"]) < 8  # killed midway, every started one recorded
    # found by working directory, as `down` finds them: a server killed into existence a moment ago may not have set its
    # process title (``valkey-server HOST:PORT``) yet (Valkey 9.1 sets it after loading its modules)
    running = servers_in(d)
    assert running and running == sorted(i["pid"] for i in st["instances"] if psutil.pid_exists(i["pid"]))
    res = invoke("down", "--dir", str(d), "--json")
    assert res.exit_code == 0, res.output
    assert servers_in(d) == [] and valkey_pids_on(range(base, base + 8)) == []
    assert all(not port_in_use(base + r) for r in range(8))


def test_sigterm_during_up_stops_what_it_started(tmp_path, cleanup_ports):
    d, base = tmp_path / "t", free_base_port(8)
    cleanup_ports.extend(range(base, base + 8))
    up = kvctl("up", "--ranks", "8", "--base-port", str(base), "--maxmemory", "64mb", "--dir", str(d), cwd=tmp_path)
    wait_for_instances(d, up, 1)
    up.send_signal(signal.SIGTERM)
    _, err = up.communicate(timeout=30)
    assert up.returncode == 143, err
    assert "interrupted by SIGTERM" in err
    assert valkey_pids_on(range(base, base + 8)) == []
    assert not state_path(d).exists()


def test_two_concurrent_ups_into_one_dir_start_one_tier(tmp_path, cleanup_ports):
    d = tmp_path / "t"
    bases = [free_base_port(8)]
    bases.append(next(b for b in range(bases[0] + 100, 65000, 100) if not any(port_in_use(b + r) for r in range(8))))
    for b in bases:
        cleanup_ports.extend(range(b, b + 8))
    ups = [kvctl("up", "--ranks", "8", "--base-port", str(b), "--maxmemory", "64mb", "--dir", str(d), cwd=tmp_path) for b in bases]
    errs = [u.communicate(timeout=60)[1] for u in ups]
    codes = [u.returncode for u in ups]
    assert sorted(codes) == [0, 1], errs  # before the lock: both 0, 16 servers, a state file listing 8
    loser = codes.index(1)
    assert "another kvctl (pid" in errs[loser] or "already runs a tier" in errs[loser]
    assert valkey_pids_on(range(bases[loser], bases[loser] + 8)) == []
    assert len(read_state(d)["instances"]) == 8
    assert invoke("down", "--dir", str(d)).exit_code == 0
    assert valkey_pids_on(range(bases[1 - loser], bases[1 - loser] + 8)) == []


def test_up_into_a_dir_another_kvctl_holds_is_refused_naming_it(tmp_path):
    d, base = tmp_path / "t", free_base_port(1)
    with local.tier_lock(d, "deploy-valkey up"):  # as a concurrent `up` in this very process would
        res = invoke("up", "--ranks", "1", "--base-port", str(base), "--dir", str(d))
    assert res.exit_code == 1
    assert f"another kvctl (pid {os.getpid()}, deploy-valkey up) is working on the tier in {d}" in res.output
    assert not port_in_use(base) and not state_path(d).exists()


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_ipv6_loopback_tier(tmp_path, cleanup_ports):
    d, base = tmp_path / "t", free_base_port(2)
    cleanup_ports.extend(range(base, base + 2))
    res = invoke("up", "--ranks", "2", "--base-port", str(base), "--maxmemory", "64mb", "--host", "::1", "--dir", str(d), "--json")
    assert res.exit_code == 0, res.output  # was "port already in use": the check bound 0.0.0.0-style IPv4 only
    insts = json.loads(res.stdout)["instances"]
    assert [i["url"] for i in insts] == [f"resp://[::1]:{base}", f"resp://[::1]:{base + 1}"]
    with redis.Redis(host="::1", port=base) as r:
        assert r.ping()
    st = invoke("status", "--dir", str(d), "--json")
    assert st.exit_code == 0 and [i["state"] for i in json.loads(st.stdout)["instances"]] == ["up", "up"]
    assert invoke("down", "--dir", str(d)).exit_code == 0


def test_status_names_a_stopped_instance_and_down_reports_a_sigkill(tmp_path, cleanup_ports):
    d, base = tmp_path / "t", free_base_port(2)
    cleanup_ports.extend(range(base, base + 2))
    res = invoke("up", "--ranks", "2", "--base-port", str(base), "--maxmemory", "64mb", "--dir", str(d), "--json")
    assert res.exit_code == 0, res.output
    stopped, busy = (i["pid"] for i in json.loads(res.stdout)["instances"])
    os.kill(stopped, signal.SIGSTOP)  # a server this test started
    try:
        st = invoke("status", "--dir", str(d), "--json")
    finally:
        os.kill(stopped, signal.SIGCONT)
    assert st.exit_code == 5
    rows = json.loads(st.stdout)["instances"]
    assert rows[0]["state"] == "alive, not answering (state T)" and f"kvctl diagnose stalls --pid {stopped}" in rows[0]["hint"]
    assert rows[1]["state"] == "up"
    assert "alive, not answering (state T)" in " ".join(st.stderr.split())

    # rank 1 busy in an endless Lua script: SIGTERM cannot stop it, only the SIGKILL after --timeout
    def endless() -> None:
        with redis.Redis(port=base + 1, socket_timeout=15) as r:
            try:
                r.eval("while true do end", 0)
            except redis.RedisError:
                pass

    t = threading.Thread(target=endless, daemon=True)
    t.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    res = invoke("down", "--dir", str(d), "--timeout", "1", "--json")
    took = time.monotonic() - t0
    assert res.exit_code == 0, res.output
    results = {r["rank"]: r["result"] for r in json.loads(res.stdout)["instances"]}
    assert results == {0: "stopped", 1: "killed"}
    assert f"pid {busy} did not exit within --timeout 1s of SIGTERM; sent SIGKILL" in " ".join(res.stderr.split())
    assert took < 1 + 2.5, took  # --timeout 1, then SIGKILL and the port check: not 8 s
    t.join(timeout=5)


def test_auth_failures_name_the_password_file(tmp_path, cleanup_ports, valkey_factory):
    pw, wrong = tmp_path / "pw", tmp_path / "wrong"
    for f, text in ((pw, "s3cret-tier-pw\n"), (wrong, "not-it\n")):
        f.write_text(text)
        f.chmod(0o600)
    d, base = tmp_path / "t", free_base_port(1)
    cleanup_ports.append(base)
    assert invoke("up", "--ranks", "1", "--base-port", str(base), "--maxmemory", "64mb", "--dir", str(d), "--password-file", str(pw)).exit_code == 0
    try:
        res = invoke("status", "--dir", str(d), "--password-file", str(wrong))
        assert res.exit_code == 1, res.output  # not 5: the instance answered, it refused the login
        assert "refused the login: the password was refused: give the tier's password with --password-file" in res.output
        # bench: no password at all, then the wrong one
        url = f"resp://127.0.0.1:{base}"
        res = CliRunner().invoke(cli, ["bench", "--valkey", url, "--chunk-bytes", "1e6", "--keys", "8", "--duration", "0.5"])
        assert res.exit_code == 1 and "no password given" in res.output and "--password-file" in res.output, res.output
        assert "cannot reach" not in res.output
        res = CliRunner().invoke(cli, ["bench", "--valkey", url, "--password-file", str(wrong), "--chunk-bytes", "1e6", "--keys", "8", "--duration", "0.5"])
        assert res.exit_code == 1 and "the password was refused" in res.output, res.output
    finally:
        local.down(d)


def test_lmcache_config_for_k8s_says_where_the_engine_password_is():
    res = CliRunner().invoke(cli, ["deploy-valkey", "lmcache-config", "--target", "k8s", "--ranks", "2"])
    assert res.exit_code == 0, res.output
    err = " ".join(res.stderr.split())  # rich wraps long warnings
    assert "mount key engine-password of Secret valkey-kv-auth" in err and "--engine-password-file" in err
    assert "# NOTE: no engine credentials" in res.stdout
    assert yaml.safe_load(res.stdout)["extra_config"]["remote_storage_plugin.kvctl.url"] == "resp://valkey-kv-{rank}.valkey-kv:6379"
    res = CliRunner().invoke(cli, ["deploy-valkey", "lmcache-config", "--target", "k8s", "--ranks", "2", "--engine-password-file", "/etc/valkey-auth/engine-password"])
    assert res.exit_code == 0 and "NOTE" not in res.output
    assert yaml.safe_load(res.stdout)["extra_config"]["kvctl_password_file"] == "/etc/valkey-auth/engine-password"
