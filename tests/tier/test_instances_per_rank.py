"""`deploy-valkey --instances-per-rank K`: W × K real local servers, systemd units that `systemd-analyze
verify` accepts, k8s manifests that `kubernetes-validate --strict` accepts, and engine configs read back by
the connectors' own readers, instance (r, i) of each config being the process the state file names."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import yaml

from kvctl.connector.urls import instance_of, parse_resp_url
from kvctl.connector.lmcache_settings import plugin_settings
from kvctl.connector.settings import parse_settings
from kvctl.tier.sizing import io_threads_for
from kvctl.tier.server import find_valkey_server
from kvctl.tier.targets import load_tier, resolve_targets
from tests.tier.helpers import free_base_port, invoke

W, K = 2, 2


def _lmcache_extra(*args: str) -> dict:
    res = invoke("lmcache-config", *args, "--json")
    assert res.exit_code == 0, res.output
    cfg = json.loads(res.stdout)
    assert "remote_url" not in cfg and cfg["remote_storage_plugins"] == ["kvctl"]
    return cfg["extra_config"]


def _vllm_extra(*args: str) -> dict:
    res = invoke("vllm-config", *args, "--json")
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)["kv_connector_extra_config"]


@pytest.fixture
def tier(tmp_path):
    """A real local tier of W ranks × K instances, stopped (down --purge) after the test."""
    base = free_base_port(W * K)
    d = tmp_path / "tier"
    res = invoke("up", "--ranks", str(W), "--instances-per-rank", str(K), "--base-port", str(base), "--maxmemory", "64MiB",
                 "--dir", str(d), "--json")
    assert res.exit_code == 0, res.output
    try:
        yield d, base, json.loads(res.stdout)
    finally:
        invoke("down", "--dir", str(d), "--purge")


def test_local_tier_of_k_instances_per_rank(tier):
    d, base, up = tier
    state = load_tier(d)
    assert state.instances_per_rank == K and up["instances_per_rank"] == K
    assert [(i.rank, i.instance, i.port) for i in state.in_tier_order()] == [
        (r, i, base + r * K + i) for r in range(W) for i in range(K)]
    assert sorted(Path(i.config).name for i in state.instances) == [f"valkey-{r}-{i}.conf" for r in range(W) for i in range(K)]
    # the total split over W*K, the io-threads default counting W*K instances on this host
    assert state.maxmemory_per_instance == 16 * 2**20 and state.maxmemory_total == 64 * 2**20
    assert state.io_threads == io_threads_for(instances=W * K)
    for inst in state.instances:
        with redis.Redis(port=inst.port) as r:
            assert int(r.config_get("maxmemory")["maxmemory"]) == 16 * 2**20
            assert int(r.info("server")["process_id"]) == inst.pid

    res = invoke("status", "--dir", str(d), "--json")
    assert res.exit_code == 0, res.output
    st = json.loads(res.stdout)
    assert st["instances_per_rank"] == K
    assert [(i["rank"], i["instance"], i["up"]) for i in st["instances"]] == [(r, i, True) for r in range(W) for i in range(K)]
    res = invoke("status", "--dir", str(d))
    assert res.exit_code == 0 and "inst" in res.output

    # the engine configs, read by the connectors' own readers: instance (r, i) is the state file's (r, i)
    by_ri = {(i.rank, i.instance): i for i in state.instances}
    settings = parse_settings(_vllm_extra("--dir", str(d)), world_size=W)
    assert settings.instances_per_rank == K
    lmc = _lmcache_extra("--dir", str(d))
    for r in range(W):
        plug = plugin_settings(lmc, "kvctl", r)
        for i in range(K):
            want = by_ri[(r, i)]
            for url in (settings.rank_urls[r][i], plug.urls[i]):
                u = parse_resp_url(url)
                assert (u.host, u.port) == (want.host, want.port)
                with redis.Redis(host=u.host, port=u.port) as c:  # the process listening there is the one recorded
                    assert int(c.info("server")["process_id"]) == want.pid
    # rank r's chunk c lives on its instance (c // W) mod K: rank 1's chunks 1, 3, 5 on instances 0, 1, 0
    assert [instance_of(c, W, K) for c in (1, 3, 5)] == [0, 1, 0]

    # the tools read the tier's K from the state file; another K given is refused
    targets = resolve_targets(tier_dir=d)
    assert [(t.rank, t.instance, t.instances_per_rank) for t in targets] == [(r, i, K) for r in range(W) for i in range(K)]
    res = invoke("vllm-config", "--dir", str(d), "--instances-per-rank", "3")
    assert res.exit_code == 2 and "has 2 instance(s) per rank" in res.output

    res = invoke("down", "--dir", str(d), "--json")
    assert res.exit_code == 0, res.output
    stopped = json.loads(res.stdout)["instances"]
    assert [(s["rank"], s["instance"], s["result"]) for s in stopped] == [(r, i, "stopped") for r in range(W) for i in range(K)]


def test_instances_named_by_url_rank_by_rank():
    urls = [f"resp://127.0.0.1:{7000 + n}" for n in range(W * K)]
    targets = resolve_targets(urls, instances_per_rank=K)
    assert [(t.rank, t.instance, t.port, t.name) for t in targets] == [
        (0, 0, 7000, "rank 0 instance 0"), (0, 1, 7001, "rank 0 instance 1"), (1, 0, 7002, "rank 1 instance 0"), (1, 1, 7003, "rank 1 instance 1")]
    tpl = resolve_targets(["resp://kv-{rank}-{instance}:6379"], ranks=W, instances_per_rank=K)
    assert [t.host for t in tpl] == ["kv-0-0", "kv-0-1", "kv-1-0", "kv-1-1"]
    assert [t.name for t in resolve_targets(urls[:2])] == ["rank 0", "rank 1"]  # K = 1: as before


@pytest.mark.parametrize("args, message", [
    (("--valkey", "resp://h:1", "--valkey", "resp://h:2", "--valkey", "resp://h:3", "--instances-per-rank", "2"), "give K URLs per rank"),
    (("--valkey", "resp://kv-{rank}-{instance}:1", "--ranks", "2"), "needs --instances-per-rank"),
    (("--valkey", "resp://kv-{rank}:1", "--ranks", "2", "--instances-per-rank", "2"), "{instance}"),
])
def test_instance_naming_refused_with_one_line(args, message):
    """Bad instance naming is a usage error (exit 2), whatever command reads the tier."""
    res = invoke("status", *args)
    assert res.exit_code == 2, res.output
    assert message in res.output and "Traceback" not in res.output


@pytest.mark.parametrize("args, message", [
    (("--instances-per-rank", "0"), "is not in the range 1<=x<=64"),
    (("--instances-per-rank", "65"), "is not in the range 1<=x<=64"),
    (("--instances-per-rank", "2", "--maxmemory", "3mb"), "over 2 ranks × 2 instances leaves 750000 bytes per instance"),
])
def test_bad_instances_per_rank_is_a_usage_error(args, message, tmp_path):
    res = invoke("up", "--ranks", "2", *args, "--dir", str(tmp_path / "t"))
    assert res.exit_code == 2, res.output
    assert message in res.output and not (tmp_path / "t").exists()


def test_native_lmcache_refuses_several_instances_per_rank():
    res = invoke("lmcache-config", "--target", "systemd", "--ranks", "2", "--instances-per-rank", "2", "--native")
    assert res.exit_code == 2 and "--native" in res.output and "Traceback" not in res.output


# --- systemd ---------------------------------------------------------------------------------


def _verify_unit(template: Path, instance: str, workdir: Path) -> None:
    """`systemd-analyze verify` of one instance of the rendered template, its ExecStart binary pointed at the
    valkey-server this host has (verify refuses a unit whose binary is missing); any warning fails."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    unit = workdir / template.name.replace("@.", f"@{instance}.")
    unit.write_text(template.read_text().replace("/usr/bin/valkey-server", find_valkey_server()))
    res = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and not res.stderr.strip(), res.stderr


@pytest.mark.parametrize("k", [1, 3])
def test_systemd_units_per_instance_pass_systemd_analyze_verify(tmp_path, k):
    out = tmp_path / "units"
    res = invoke("up", "--target", "systemd", "--ranks", "2", "--instances-per-rank", str(k), "--base-port", "7400",
                 "--maxmemory", "192mb", "--out", str(out), "--json")
    assert res.exit_code == 0, res.output
    names = [str(r) if k == 1 else f"{r}-{i}" for r in range(2) for i in range(k)]
    assert sorted(p.name for p in out.glob("*.conf")) == sorted(f"valkey-kv-{n}.conf" for n in names)
    template = out / "valkey-kv@.service"
    unit = template.read_text()
    assert "ExecStart=/usr/bin/valkey-server /etc/valkey-kv/valkey-kv-%i.conf" in unit
    (tmp_path / "verify").mkdir()
    for n in names:
        _verify_unit(template, n, tmp_path / "verify")
    ports = {n: int(next(ln.split()[1] for ln in (out / f"valkey-kv-{n}.conf").read_text().splitlines() if ln.startswith("port ")))
             for n in names}
    assert sorted(ports.values()) == list(range(7400, 7400 + 2 * k))
    # the engine configs name unit r-i's port as rank r's instance i
    args = ("--target", "systemd", "--ranks", "2", "--instances-per-rank", str(k), "--base-port", "7400")
    settings = parse_settings(_vllm_extra(*args), world_size=2)
    lmc = _lmcache_extra(*args)
    for r in range(2):
        for i in range(k):
            n = str(r) if k == 1 else f"{r}-{i}"
            assert parse_resp_url(settings.rank_urls[r][i]).port == ports[n] == 7400 + r * k + i
            assert parse_resp_url(plugin_settings(lmc, "kvctl", r).urls[i]).port == ports[n]
    if k == 1:  # as before: plain per-rank strings, no instances_per_rank key
        assert json.loads(res.stdout)["remote_url"] == ["resp://127.0.0.1:7400", "resp://127.0.0.1:7401"]
        assert "instances_per_rank" not in _vllm_extra(*args)


# --- k8s -------------------------------------------------------------------------------------


def _kubernetes_validate(out: Path) -> None:
    tool = Path(sys.executable).with_name("kubernetes-validate")
    assert tool.exists(), "kubernetes-validate is missing: pip install -e '.[test]'"
    files = sorted(str(p) for p in out.glob("*.yaml"))
    res = subprocess.run([str(tool), "--strict", *files], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("passed") == len(files), res.stdout


@pytest.mark.parametrize("k", [1, 3])
def test_k8s_one_statefulset_of_w_times_k_pods_passes_kubernetes_validate(tmp_path, k):
    pw = tmp_path / "pw"
    pw.write_text("tier-secret\n")
    pw.chmod(0o600)
    out = tmp_path / "k8s"
    res = invoke("up", "--target", "k8s", "--ranks", "2", "--instances-per-rank", str(k), "--maxmemory", "6GiB",
                 "--password-file", str(pw), "--namespace", "serving", "--out", str(out))
    assert res.exit_code == 0, res.output
    _kubernetes_validate(out)
    objs = {o["kind"]: o for f in out.glob("*.yaml") for o in yaml.safe_load_all(f.read_text())}
    assert objs["StatefulSet"]["spec"]["replicas"] == 2 * k
    assert f"maxmemory {6 * 2**30 // (2 * k)}" in objs["ConfigMap"]["data"]["valkey.conf"]
    args = ("--target", "k8s", "--ranks", "2", "--instances-per-rank", str(k), "--namespace", "serving")
    extra = _vllm_extra(*args)
    settings = parse_settings(extra, world_size=2)
    lmc = _lmcache_extra(*args)
    for r in range(2):
        for i in range(k):  # pod ordinal n = r*K + i
            host = f"valkey-kv-{r * k + i}.valkey-kv.serving.svc"
            assert parse_resp_url(settings.rank_urls[r][i]).host == host
            assert parse_resp_url(plugin_settings(lmc, "kvctl", r).urls[i]).host == host
    if k == 1:  # as before: the {rank} template
        assert extra["url"] == "resp://valkey-kv-{rank}.valkey-kv.serving.svc:6379"
