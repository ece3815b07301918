"""`deploy-valkey up --target systemd|k8s`: rendered objects checked structurally, and the
rendered Valkey configs accepted by a real valkey-server."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
import redis
import yaml
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.connector.urls import expand_url, parse_resp_url
from kvctl.tier.server import free_port, start_valkey

REPO = Path(__file__).resolve().parents[2]
GIB = 1024**3


def invoke(*args: str):
    return CliRunner().invoke(cli, ["deploy-valkey", *args])


@pytest.fixture
def pw_file(tmp_path) -> Path:
    p = tmp_path / "tier.pw"
    p.write_text("k8s-tier-secret\n")
    p.chmod(0o600)
    return p


def load_dir(out: Path) -> dict[str, dict]:
    objs = {}
    for f in sorted(out.glob("*.yaml")):
        for obj in yaml.safe_load_all(f.read_text()):
            objs[obj["kind"]] = obj
    return objs


def test_k8s_statefulset_service_configmap_secret(tmp_path, pw_file):
    out = tmp_path / "k8s"
    res = invoke("up", "--target", "k8s", "--ranks", "4", "--maxmemory", "8GiB", "--io-threads", "3", "--password-file", str(pw_file), "--out", str(out))
    assert res.exit_code == 0, res.output
    assert "nothing installed or enabled" in res.output and "k8s-tier-secret" not in res.output
    objs = load_dir(out)
    assert set(objs) == {"ConfigMap", "Secret", "Service", "StatefulSet"}

    sts = objs["StatefulSet"]
    assert sts["apiVersion"] == "apps/v1" and sts["spec"]["replicas"] == 4
    assert sts["spec"]["serviceName"] == "valkey-kv" == sts["metadata"]["name"]
    pod = sts["spec"]["template"]
    assert pod["metadata"]["labels"] == sts["spec"]["selector"]["matchLabels"]
    (c,) = pod["spec"]["containers"]
    assert c["ports"] == [{"name": "resp", "containerPort": 6379}]
    assert "exec" in c["readinessProbe"] and c["livenessProbe"]["tcpSocket"]["port"] == "resp"
    limit = int(c["resources"]["limits"]["memory"].removesuffix("Mi")) * 1024**2
    assert limit > 2 * GIB  # above maxmemory (8gb / 4 ranks)
    assert c["resources"]["requests"]["cpu"] == "3"
    assert any(e["name"] == "REDISCLI_AUTH" for e in c["env"])  # the probe can PING with auth
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/etc/valkey", "/etc/valkey-auth"} <= mounts

    svc = objs["Service"]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["selector"] == pod["metadata"]["labels"]
    assert svc["spec"]["ports"][0]["port"] == 6379

    conf = objs["ConfigMap"]["data"]["valkey.conf"]
    assert f"maxmemory {2 * GIB}" in conf and "maxmemory-policy allkeys-lru" in conf and 'save ""' in conf
    assert "io-threads 3" in conf and "include /etc/valkey-auth/auth.conf" in conf
    assert "k8s-tier-secret" not in conf
    secret = objs["Secret"]
    assert "requirepass k8s-tier-secret" in secret["stringData"]["auth.conf"]
    assert "user kvctl-engine on" in secret["stringData"]["auth.conf"]
    assert stat.S_IMODE((out / "secret.yaml").stat().st_mode) == 0o600

    res = invoke("lmcache-config", "--target", "k8s", "--ranks", "4", "--json")
    assert res.exit_code == 0, res.output
    url = json.loads(res.stdout)["extra_config"]["remote_storage_plugin.kvctl.url"]
    assert url == "resp://valkey-kv-{rank}.valkey-kv:6379"
    assert parse_resp_url(expand_url(url, 3)).host == "valkey-kv-3.valkey-kv"


def test_k8s_names_namespace_and_auth_rules(tmp_path):
    res = invoke("up", "--target", "k8s", "--ranks", "2", "--out", str(tmp_path / "a"))
    assert res.exit_code == 2 and "--password-file" in res.output
    assert not (tmp_path / "a").exists()
    res = invoke("up", "--target", "k8s", "--ranks", "2", "--name", "Bad_Name", "--insecure-no-auth", "--out", str(tmp_path / "b"))
    assert res.exit_code == 2 and "DNS label" in res.output
    res = invoke("up", "--target", "k8s", "--ranks", "2", "--out", str(tmp_path / "c"), "--insecure-no-auth", "--name", "kv", "--service", "kvs", "--namespace", "serving")
    assert res.exit_code == 0, res.output
    objs = load_dir(tmp_path / "c")
    assert "Secret" not in objs and "protected-mode no" in objs["ConfigMap"]["data"]["valkey.conf"]
    assert objs["StatefulSet"]["spec"]["serviceName"] == "kvs" and objs["StatefulSet"]["metadata"]["namespace"] == "serving"
    res = invoke("lmcache-config", "--target", "k8s", "--ranks", "2", "--name", "kv", "--service", "kvs", "--namespace", "serving", "--json")
    assert json.loads(res.stdout)["extra_config"]["remote_storage_plugin.kvctl.url"] == "resp://kv-{rank}.kvs.serving.svc:6379"
    assert invoke("up", "--target", "k8s", "--ranks", "2", "--insecure-no-auth").exit_code == 2  # no --out


def _start_rendered(conf_text: str, workdir: Path, password: str | None):
    """Start a real valkey-server from a rendered config, its lines read by Valkey as written (an included file),
    with only port/bind/paths moved to the sandbox."""
    keep = [ln for ln in conf_text.splitlines() if ln.split(" ", 1)[0] not in ("port", "bind", "dir", "pidfile", "logfile", "include") and not ln.startswith("#")]
    workdir.mkdir(parents=True, exist_ok=True)
    rendered = workdir / "rendered.conf"
    rendered.write_text("\n".join(keep) + "\n")
    rendered.chmod(0o600)
    return start_valkey(workdir, port=free_port(), settings={"include": str(rendered)}, password=password)


def test_systemd_units_and_configs_run_on_a_real_server(tmp_path, pw_file):
    out = tmp_path / "units"
    res = invoke("up", "--target", "systemd", "--ranks", "3", "--base-port", "7400", "--maxmemory", "192MiB", "--password-file", str(pw_file), "--out", str(out), "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["applied"] is None
    assert data["remote_url"] == [f"resp://127.0.0.1:{7400 + r}" for r in range(3)]
    unit = (out / "valkey-kv@.service").read_text()
    assert "ExecStart=/usr/bin/valkey-server /etc/valkey-kv/valkey-kv-%i.conf" in unit
    assert "[Install]" in unit and "WantedBy=multi-user.target" in unit and "MemoryMax=" in unit
    for r in range(3):
        conf = (out / f"valkey-kv-{r}.conf").read_text()
        assert f"port {7400 + r}" in conf.splitlines() and stat.S_IMODE((out / f"valkey-kv-{r}.conf").stat().st_mode) == 0o600
    # rank 1's config, as rendered, runs on the real binary; the engine ACL user works and is limited
    engine_pw = (out / "engine.password").read_text().strip()
    proc = _start_rendered((out / "valkey-kv-1.conf").read_text(), tmp_path / "run", "k8s-tier-secret")
    try:
        with redis.Redis(port=proc.port, username="kvctl-engine", password=engine_pw) as r:
            r.set("c", b"x" * 1000)
            assert r.get("c") == b"x" * 1000
            with pytest.raises(redis.exceptions.NoPermissionError):
                r.execute_command("KEYS", "*")
        with redis.Redis(port=proc.port, password="k8s-tier-secret") as admin:
            cfg = admin.config_get("maxmemory*")
            assert int(cfg["maxmemory"]) == 64 * 1024 * 1024 and cfg["maxmemory-policy"] == "allkeys-lru"
    finally:
        proc.stop()


def test_k8s_configmap_runs_on_a_real_server(tmp_path):
    out = tmp_path / "k8s"
    assert invoke("up", "--target", "k8s", "--ranks", "2", "--maxmemory", "128MiB", "--insecure-no-auth", "--out", str(out)).exit_code == 0
    conf = load_dir(out)["ConfigMap"]["data"]["valkey.conf"]
    proc = _start_rendered(conf, tmp_path / "run", None)
    try:
        with redis.Redis(port=proc.port) as r:
            assert int(r.config_get("maxmemory")["maxmemory"]) == 64 * 1024 * 1024
            assert r.config_get("save")["save"] == "" and r.config_get("appendonly")["appendonly"] == "no"
    finally:
        proc.stop()


def test_apply_without_the_tool_fails_cleanly(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    res = invoke("up", "--target", "k8s", "--ranks", "1", "--insecure-no-auth", "--out", str(tmp_path / "o"), "--apply")
    assert res.exit_code == 1 and "kubectl" in res.output and res.output.startswith("Error:")


def test_k8s_examples_in_configs_match_the_renderer(tmp_path, pw_file):
    """configs/k8s/ holds manifests rendered by the tool with the options in configs/k8s/ARGS."""
    out = tmp_path / "k8s"
    args = (REPO / "configs/k8s/ARGS").read_text().split()
    res = invoke("up", "--out", str(out), "--password-file", str(pw_file), *args)
    assert res.exit_code == 0, res.output
    fresh = load_dir(out)
    example = load_dir(REPO / "configs/k8s")
    for kind in ("StatefulSet", "Service", "ConfigMap"):
        assert example[kind] == fresh[kind], kind
    assert example["Secret"]["stringData"]["password"] == "CHANGE-ME"


def test_rerender_replaces_each_file_in_one_rename(tmp_path, pw_file):
    """A second `up --out` into the same directory: every file is a new inode (written beside, then renamed:
    a crash mid-write leaves the old file whole), no temp file remains, the Secret stays 0600, and a mode the
    operator gave a plain file is kept."""
    out = tmp_path / "k8s"
    args = ("up", "--target", "k8s", "--ranks", "2", "--password-file", str(pw_file), "--out", str(out))
    assert invoke(*args).exit_code == 0
    (out / "configmap.yaml").chmod(0o640)
    before = {f.name: f.stat().st_ino for f in out.iterdir()}
    res = invoke(*args)
    assert res.exit_code == 0, res.output
    after = {f.name: f.stat() for f in out.iterdir()}
    assert set(after) == set(before)  # nothing left beside them
    assert all(after[n].st_ino != before[n] for n in before), "a file was rewritten in place"
    assert stat.S_IMODE(after["secret.yaml"].st_mode) == 0o600
    assert stat.S_IMODE(after["configmap.yaml"].st_mode) == 0o640


def test_atomic_write_leaves_the_old_file_when_the_text_cannot_be_written(tmp_path):
    """The temp file is removed and the target untouched when writing fails (here: text not encodable)."""
    from kvctl.core.files import write_atomic

    target = tmp_path / "a.yaml"
    target.write_text("old\n")
    with pytest.raises(UnicodeEncodeError):
        write_atomic(target, "new \udcff\n")  # a lone surrogate cannot be written as UTF-8
    assert target.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.yaml"]


def test_lmcache_config_out_replaces_the_file_in_one_rename(tmp_path):
    """`lmcache-config --out FILE` over an existing file (an engine may be reading it): a new inode, the
    file's mode kept, the new YAML in it, nothing left beside it."""
    out = tmp_path / "lmcache.yaml"
    out.write_text("old: true\n")
    out.chmod(0o640)
    ino = out.stat().st_ino
    res = invoke("lmcache-config", "--target", "k8s", "--ranks", "2", "--out", str(out))
    assert res.exit_code == 0, res.output
    assert out.stat().st_ino != ino and stat.S_IMODE(out.stat().st_mode) == 0o640
    assert yaml.safe_load(out.read_text())["remote_storage_plugins"] == ["kvctl"]
    assert [p.name for p in tmp_path.iterdir()] == ["lmcache.yaml"]
