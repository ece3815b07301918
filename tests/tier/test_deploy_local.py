"""`kvctl deploy-valkey up|status|down|lmcache-config` against real local valkey-server processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
from pathlib import Path

import psutil
import pytest
import redis
import yaml

from kvctl.core.errors import KvctlError
from kvctl.tier import local
from kvctl.tier import status as tier_status
from kvctl.tier.server import ping, port_in_use
from kvctl.tier.targets import TierState, load_tier, resolve_targets, state_path
from tests.tier.helpers import free_base_port, invoke, valkey_pids_on

MB12 = 12 * 1000 * 1000


@pytest.fixture
def tier(tmp_path):
    """Start a tier through the CLI; `down` (by the test or here) stops it."""
    started: list[Path] = []

    def make(ranks: int, *extra: str) -> tuple[Path, dict]:
        d = tmp_path / f"tier{len(started)}"
        base = free_base_port(ranks)
        res = invoke("up", "--ranks", str(ranks), "--base-port", str(base), "--maxmemory", f"{64 * ranks}MiB", "--dir", str(d), "--json", *extra)
        assert res.exit_code == 0, res.output
        started.append(d)
        return d, json.loads(res.stdout)

    yield make
    for d in started:
        if state_path(d).exists():
            local.down(d)


def test_status_of_an_idle_tier_counts_no_client_and_no_get_time(tier):
    """Issue 22: an idle tier showed status's own connection as a client and "µs/GET 0"."""
    d, out = tier(1)
    (st,) = json.loads(invoke("status", "--dir", str(d), "--json").stdout)["instances"]
    assert st["connected_clients"] == 0 and st["get_calls"] == 0 and st["get_usec_per_call"] is None
    i = out["instances"][0]
    with redis.Redis(host=i["host"], port=i["port"]) as r:  # one client of the tier, connected while status reads
        r.set("k", b"v")
        assert r.get("k") == b"v"
        (st,) = json.loads(invoke("status", "--dir", str(d), "--json").stdout)["instances"]
        assert st["connected_clients"] == 1 and st["get_calls"] == 1 and st["get_usec_per_call"] > 0
    table = " ".join(invoke("status", "--dir", str(d)).stdout.split())
    assert "not this status read" in table


@pytest.mark.parametrize("command", ["lmcache-config", "vllm-config"])
def test_engine_config_of_a_stopped_tier_is_warned_about(tier, command):
    """Issue 22: `lmcache-config --dir` printed a stopped tier's URLs without a word."""
    d, out = tier(2)
    res = invoke(command, "--dir", str(d))
    assert res.exit_code == 0 and "not running" not in res.stderr
    assert invoke("down", "--dir", str(d)).exit_code == 0  # the state file stays (no --purge)
    res = invoke(command, "--dir", str(d))
    assert res.exit_code == 0, res.output  # still printed: the tier may be started again
    err = " ".join(res.stderr.split())
    assert "is not running (no valkey-server for rank(s) 0, 1)" in err and "deploy-valkey up" in err


def test_up_three_ping_set_get_status_down(tier):
    d, out = tier(3)
    insts = out["instances"]
    assert [i["rank"] for i in insts] == [0, 1, 2]
    assert [i["port"] for i in insts] == [insts[0]["port"] + r for r in range(3)]
    assert set(insts[0]) >= {"rank", "host", "port", "pid", "url"}
    value = os.urandom(MB12)
    for i in insts:
        assert ping(i["host"], i["port"])
        assert psutil.Process(i["pid"]).is_running()
        with redis.Redis(host=i["host"], port=i["port"]) as r:
            r.set(f"chunk-{i['rank']}", value)
            assert r.get(f"chunk-{i['rank']}") == value
    # per-instance config: the split total, LRU, no persistence, loopback
    conf = Path(d / "valkey-1.conf").read_text().splitlines()
    assert f"maxmemory {64 * 1024 * 1024}" in conf
    assert {"maxmemory-policy allkeys-lru", 'save ""', "appendonly no", "protected-mode yes", "bind 127.0.0.1"} <= set(conf)
    assert any(line.startswith("io-threads ") for line in conf)

    # state file readable by bench/diagnose
    targets = resolve_targets(tier_dir=d)
    assert [(t.rank, t.port) for t in targets] == [(i["rank"], i["port"]) for i in insts]

    res = invoke("status", "--dir", str(d), "--json")
    assert res.exit_code == 0, res.output
    st = json.loads(res.stdout)["instances"]
    assert [s["up"] for s in st] == [True] * 3
    for s in st:
        assert s["keys"] == 1 and s["get_calls"] == 1 and s["get_usec_per_call"] > 0
        assert s["maxmemory"] == 64 * 1024 * 1024 and s["used_memory"] > MB12
        assert s["evicted_keys"] == 0 and s["connected_clients"] >= 0
    assert invoke("status", "--dir", str(d)).exit_code == 0

    res = invoke("lmcache-config", "--dir", str(d))
    assert res.exit_code == 0, res.output
    cfg = yaml.safe_load(res.stdout)
    assert cfg["extra_config"]["kvctl_remote_urls"] == [i["url"] for i in insts]
    assert cfg["remote_storage_plugins"] == ["kvctl"] and "remote_url" not in cfg and cfg["chunk_size"] == 256
    res = invoke("lmcache-config", "--dir", str(d), "--native")
    assert yaml.safe_load(res.stdout)["remote_url"] == insts[0]["url"] and "--native" in res.stderr
    assert "not running" not in res.stderr

    res = invoke("down", "--dir", str(d), "--json")
    assert res.exit_code == 0, res.output
    assert [r["result"] for r in json.loads(res.stdout)["instances"]] == ["stopped"] * 3
    for i in insts:
        assert not psutil.pid_exists(i["pid"]) or psutil.Process(i["pid"]).status() == psutil.STATUS_ZOMBIE
        assert not port_in_use(i["port"])
    assert (d / "valkey-0.conf").exists()  # kept without --purge
    res = invoke("status", "--dir", str(d))
    assert res.exit_code == 5 and "3 of 3 instance(s) not answering" in res.output
    assert invoke("down", "--dir", str(d), "--purge").exit_code == 0
    assert not d.exists()


def test_port_in_use_starts_nothing(tmp_path):
    base = free_base_port(3)
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", base + 2))
        blocker.listen()
        res = invoke("up", "--ranks", "3", "--base-port", str(base), "--dir", str(tmp_path / "t"))
    assert res.exit_code == 1
    assert res.output.count("\n") == 1 and "rank 2" in res.output and str(base + 2) in res.output
    assert valkey_pids_on(range(base, base + 3)) == []
    assert not (tmp_path / "t").exists()  # not even the directory (or its lock file) is left


def test_failure_midway_stops_the_started_ones(tmp_path):
    """Without the port pre-check, rank 2 fails at start and ranks 0-1 are stopped again."""
    base = free_base_port(3)
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", base + 2))
        blocker.listen()
        req = local.UpRequest(tmp_path / "t", 3, base, "96mb")
        with pytest.raises(KvctlError, match=rf"rank 2 .*{base + 2}.*stopped the 2 instance"):
            local.up(req, check_ports_first=False)
    assert valkey_pids_on(range(base, base + 3)) == []
    assert not port_in_use(base) and not port_in_use(base + 1)
    assert not state_path(tmp_path / "t").exists()


def test_dir_of_a_running_tier_is_refused(tier):
    d, out = tier(1)
    base = free_base_port(1)
    res = invoke("up", "--ranks", "1", "--base-port", str(base), "--dir", str(d))
    assert res.exit_code == 1 and "already runs a tier" in res.output
    assert valkey_pids_on([base]) == []
    assert load_tier(d).instances[0].pid == out["instances"][0]["pid"]


def test_down_reports_dead_and_foreign_pids_and_goes_on(tier):
    d, out = tier(3)
    dead = out["instances"][0]
    os.kill(dead["pid"], signal.SIGKILL)  # a process this test started (through `up`)
    psutil.Process(dead["pid"]).wait(5)
    # rank 1's recorded pid now belongs to another process (this test runner): never signal it; its real server
    # still works in the tier's directory, so `down` finds it there
    state = load_tier(d)
    foreign = state.instances[1]
    real_pid = foreign.pid
    state.instances[1].pid = os.getpid()
    TierState.write(state)
    res = invoke("down", "--dir", str(d), "--json")
    assert res.exit_code == 0, res.output
    results = [(r["rank"], r["pid"], r["result"], r["note"]) for r in json.loads(res.stdout)["instances"]]
    assert [r[:3] for r in results] == [(0, dead["pid"], "not running"), (1, os.getpid(), "not ours"), (2, out["instances"][2]["pid"], "stopped"),
                                        (1, real_pid, "stopped")]
    assert "another process" in results[1][3]  # this test runner: never signalled
    assert "not in the state file" in results[3][3]  # rank 1's real server works in the tier's directory: stopped all the same
    assert not psutil.pid_exists(real_pid) or psutil.Process(real_pid).status() == psutil.STATUS_ZOMBIE


def test_password_rules(tmp_path):
    pw = tmp_path / "pw"
    pw.write_text("s3cret-tier-pw\n")
    pw.chmod(0o644)
    base = free_base_port(2)
    d = tmp_path / "t"
    res = invoke("up", "--ranks", "2", "--base-port", str(base), "--dir", str(d), "--password-file", str(pw))
    assert res.exit_code == 2 and "0600" in res.output
    res = invoke("up", "--ranks", "2", "--base-port", str(base), "--dir", str(d), "--host", "10.1.2.3")
    assert res.exit_code == 2 and "--password-file" in res.output and res.output.count("\n") == 1
    assert valkey_pids_on(range(base, base + 2)) == []

    pw.chmod(0o600)
    res = invoke("up", "--ranks", "2", "--base-port", str(base), "--maxmemory", "64mb", "--dir", str(d), "--password-file", str(pw), "--json")
    try:
        assert res.exit_code == 0, res.output
        assert "s3cret-tier-pw" not in res.output
        out = json.loads(res.stdout)
        assert out["auth"] is True and out["engine_user"] == "kvctl-engine"
        port = out["instances"][0]["port"]
        assert not ping("127.0.0.1", port) and ping("127.0.0.1", port, password="s3cret-tier-pw")
        for conf in (d / "valkey-0.conf", d / "engine.password"):
            assert stat.S_IMODE(conf.stat().st_mode) == 0o600
        engine_pw = (d / "engine.password").read_text().strip()
        with redis.Redis(port=port, username="kvctl-engine", password=engine_pw) as r:
            r.set("k", b"v")
            assert r.get("k") == b"v" and r.exists("k") == 1
            with pytest.raises(redis.exceptions.NoPermissionError):
                r.flushall()
            with pytest.raises(redis.exceptions.NoPermissionError):
                r.config_get("requirepass")
        res = invoke("status", "--dir", str(d), "--json")
        assert res.exit_code == 0 and json.loads(res.stdout)["instances"][0]["keys"] == 1
        res = invoke("lmcache-config", "--dir", str(d))
        assert "s3cret" not in res.output and engine_pw not in res.output
        extra = yaml.safe_load(res.stdout)["extra_config"]
        assert extra["kvctl_username"] == "kvctl-engine" and extra["kvctl_password_file"] == str((d / "engine.password").resolve())
    finally:
        if state_path(d).exists():
            local.down(d)


@pytest.mark.parametrize(
    "args, code, needle",
    [
        (["--ranks", "0"], 2, "1<=x<=4096"),
        (["--ranks", "-3"], 2, "1<=x<=4096"),
        (["--ranks", "2", "--maxmemory", "lots"], 2, "cannot parse size"),
        (["--ranks", "2", "--maxmemory", "1kb"], 2, "per instance"),
        (["--ranks", "2", "--maxmemory", "nan"], 2, "cannot parse size"),
        (["--ranks", "1", "--maxmemory", "999999tb"], 2, "more than 1.0 PiB"),  # past the cap of any target
        (["--ranks", "1", "--maxmemory", "1023tb"], 2, "more than this host's"),  # no test host has 1 PB of memory
        (["--ranks", "3", "--base-port", "65534"], 2, "outside"),
        (["--ranks", "1", "--io-threads", "0"], 2, "io-threads"),
        (["--ranks", "1", "--io-threads", "1000"], 2, "1<=x<=256"),  # Valkey's own limit
        (["--ranks", "1", "--password-file", "/nonexistent/pw"], 2, "cannot read password file"),
        (["--ranks", "1", "--out", "x"], 2, "--out"),
        (["--ranks", "1", "--host", "192.0.2.1", "--insecure-no-auth"], 2, "address 192.0.2.1 is not on this host"),
    ],
)
def test_bad_input_one_line_nothing_running(tmp_path, args, code, needle):
    res = invoke("up", "--dir", str(tmp_path / "t"), *args)
    assert res.exit_code == code, res.output
    assert needle in res.output
    assert res.output.strip().splitlines()[-1].startswith("Error:")
    assert not (tmp_path / "t").exists()  # refused before anything was written


def test_missing_binary(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCTL_VALKEY_SERVER", str(tmp_path / "no-such-valkey-server"))
    res = invoke("up", "--ranks", "1", "--base-port", str(free_base_port(1)), "--dir", str(tmp_path / "t"))
    assert res.exit_code == 1 and res.output.startswith("Error:") and "KVCTL_VALKEY_SERVER" in res.output


def test_status_and_down_need_a_tier(tmp_path):
    for cmd in ("status", "down", "lmcache-config"):
        res = invoke(cmd, "--dir", str(tmp_path / "nothing"))
        assert res.exit_code == 2 and "holds no kvctl tier" in res.output


def test_a_failed_state_write_stops_what_was_started(tmp_path, monkeypatch):
    """Without the state file `down` cannot find the servers: `up` must not leave them running."""
    base = free_base_port(2)

    def fail(self):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(TierState, "write", fail)
    with pytest.raises(OSError, match="No space left"):
        local.up(local.UpRequest(tmp_path / "t", 2, base, "64mb"))
    assert valkey_pids_on(range(base, base + 2)) == []
    assert not port_in_use(base) and not port_in_use(base + 1)


def test_status_of_stalled_instances_costs_one_timeout(tier):
    import time

    d, out = tier(3)
    stalled = [i["pid"] for i in out["instances"][:2]]
    for pid in stalled:
        os.kill(pid, signal.SIGSTOP)  # processes this test started (through `up`); down sends SIGCONT
    try:
        t = time.monotonic()
        st = tier_status.status(d)
        took = time.monotonic() - t
    finally:
        for pid in stalled:
            os.kill(pid, signal.SIGCONT)
    assert [i.up for i in st.instances] == [False, False, True]
    assert took < 6  # one 3 s timeout for both, not 3 s each
