"""Issue 48 item 12: saved diagnoses are per tier, and `loading sync` and `doctor` read their own tier's.

`~/.kvctl/last-diagnosis.json` was one file per user: another job's diagnosis of another tier replaced the
engineer's within minutes, and `kvctl loading sync` and `kvctl doctor` trusted it. A diagnosis is now kept under
the instances (and engines) it read; a reader finds the one of the tier its files or options name.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import stat

import yaml
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.diagnose import saved
from kvctl.diagnose.capture import last_diagnosis_path, save_last_diagnosis


def now(minus_s: float = 60.0) -> str:
    return (dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=minus_s)).replace(microsecond=0).isoformat()


def diagnosis(rho: float, valkey=(), engines=(), minus_s: float = 60.0) -> dict:
    """What `kvctl diagnose --json` keeps (the fields the readers use), of these instances and engines."""
    return {"rho": rho, "rho_bound": "estimate", "bandwidth_source": "kvctl_connector", "created_at": now(minus_s), "findings": [],
            "engine_urls": list(engines), "instances": [{"rank": r, "url": u} for r, u in enumerate(valkey)]}


def lmcache_yaml(tmp_path, name, urls, asynchronous=True) -> str:
    p = tmp_path / name
    p.write_text(yaml.safe_dump({"chunk_size": 256, "remote_storage_plugins": ["kvctl"], "enable_async_loading": asynchronous,
                                 "extra_config": {"kvctl_remote_urls": urls}}, sort_keys=False))
    return str(p)


def sync(*args):
    return CliRunner().invoke(cli, ["loading", "sync", *args])


def test_another_tiers_newer_diagnosis_is_not_this_tiers(tmp_path):
    """Tier A was diagnosed at ρ 0.2; a minute later another job diagnosed tier B at ρ 0.95. Switching A to sync is
    A's call (allowed); B stays refused. With one file per user A was refused on B's ρ."""
    a = lmcache_yaml(tmp_path, "a.yaml", ["resp://127.0.0.1:17400", "resp://127.0.0.1:17401"])
    b = lmcache_yaml(tmp_path, "b.yaml", ["resp://10.0.0.7:6379"])
    save_last_diagnosis(diagnosis(0.2, ["resp://localhost:17401", "resp://127.0.0.1:17400"], ["http://127.0.0.1:8000"], minus_s=120))
    save_last_diagnosis(diagnosis(0.95, ["resp://10.0.0.7:6379"], ["http://10.0.0.8:8000"]))
    res = sync("--config", a)
    assert res.exit_code == 0, res.output
    assert yaml.safe_load(open(a))["enable_async_loading"] is False
    res = sync("--config", b, "--dry-run")
    assert res.exit_code == 1 and "0.95" in res.stderr, res.output
    # the latest of any tier stays readable for a person, 0600; kvctl reads the tier's own
    assert json.loads(last_diagnosis_path().read_text())["rho"] == 0.95
    for p in [last_diagnosis_path(), *(last_diagnosis_path().parent / saved.SAVED_DIR).iterdir()]:
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p


def test_a_tier_nobody_diagnosed_has_no_diagnosis(tmp_path):
    save_last_diagnosis(diagnosis(0.1, ["resp://10.0.0.7:6379"]))
    c = lmcache_yaml(tmp_path, "c.yaml", ["resp://10.0.0.9:6379"])
    res = sync("--config", c)
    assert res.exit_code == 1 and "no saved diagnosis of the tier resp://10.0.0.9:6379" in res.stderr, res.output


def test_a_rank_template_finds_the_diagnosis_of_its_instances(tmp_path):
    """A vLLM config naming `resp://valkey-{rank}:6379` is the tier of valkey-0 .. valkey-W-1 (W as diagnosed)."""
    save_last_diagnosis(diagnosis(0.3, [f"resp://valkey-{r}:6379" for r in range(4)]))
    save_last_diagnosis(diagnosis(0.9, ["resp://other:6379"]))
    cfg = tmp_path / "vllm.yaml"
    cfg.write_text("model: m\nkv-transfer-config:\n  kv_connector: KvctlConnector\n  kv_connector_module_path: kvctl.plugins.vllm\n"
                   "  kv_role: kv_both\n  kv_connector_extra_config: {url: 'resp://valkey-{rank}:6379', async_loading: true}\n")
    res = sync("--vllm", str(cfg), "--dry-run")
    assert res.exit_code == 0, res.output


def test_an_env_file_names_no_tier_but_engine_urls_do(tmp_path):
    env = tmp_path / "engine.env"
    env.write_text("LMCACHE_ENABLE_ASYNC_LOADING=True\n")
    save_last_diagnosis(diagnosis(0.2, engines=["http://127.0.0.1:8000"]))
    res = sync("--env-file", str(env), "--dry-run")
    assert res.exit_code == 1 and "no Valkey URL named" in res.stderr and "--engine-url" in res.stderr, res.output
    res = sync("--env-file", str(env), "--engine-url", "http://localhost:8000/", "--dry-run")  # another spelling of the engine
    assert res.exit_code == 0, res.output


def test_doctor_reads_the_diagnosis_of_the_tier_it_checks(tmp_path, valkey_factory):
    a, b = valkey_factory(), valkey_factory()
    cfg = tmp_path / "lmcache.yaml"
    cfg.write_text("chunk_size: 256\nenable_async_loading: false\n")
    save_last_diagnosis(diagnosis(0.25, [a.url], minus_s=120))
    save_last_diagnosis(diagnosis(1.4, [b.url]))  # newer, another tier
    res = CliRunner().invoke(cli, ["doctor", "--valkey", a.url, "--config", str(cfg), "--no-host-checks", "--json"])
    (c,) = [c for c in json.loads(res.stdout)["checks"] if c["name"] == "loading_vs_rho"]
    assert c["status"] == "ok" and c["evidence"]["rho"] == 0.25, c
    res = CliRunner().invoke(cli, ["doctor", "--valkey", b.url, "--config", str(cfg), "--no-host-checks", "--json"])
    (c,) = [c for c in json.loads(res.stdout)["checks"] if c["name"] == "loading_vs_rho"]
    assert c["status"] == "fail" and c["evidence"]["rho"] == 1.4, c


def test_saved_diagnoses_are_bounded(monkeypatch):
    monkeypatch.setattr(saved, "SAVED_KEPT", 3)
    for i in range(6):
        path = save_last_diagnosis(diagnosis(0.1, [f"resp://10.0.0.{i}:6379"]))
        os.utime(path, (1e9 + i, 1e9 + i))  # in the order saved, whatever the clock's resolution
    kept = sorted(p.name for p in (last_diagnosis_path().parent / saved.SAVED_DIR).iterdir())
    assert len(kept) == 3
    assert saved.find(["resp://10.0.0.5:6379"]) is not None and saved.find(["resp://10.0.0.0:6379"]) is None
