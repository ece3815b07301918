"""kvctl doctor's tier-settings lines (kvctl/tier/checks.py), each against a real valkey-server set wrong and
set right; the tier `kvctl deploy-valkey up` starts with its defaults passes every one; bench reports io-threads.

Transparent huge pages: the kernel's setting cannot be changed from a test, so that check reads a copy of
``/sys/kernel/mm/transparent_hugepage/enabled`` written here (the instance it judges is real); the doctor run
against the real file is in the deploy-defaults test.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.tier import checks
from kvctl.tier.admin import Admin
from tests.tier.helpers import free_base_port
from tests.tier.servers import valkey_8, valkey_binary  # noqa: F401 - the fixture

ROOT = Path(__file__).resolve().parents[2]
MB = 2**20
TIER_LINES = ("maxmemory", "eviction_policy", "policy_vs_ttl", "persistence", "io_threads", "proto_max_bulk_len", "output_buffer",
              "maxclients", "fragmentation", "evictions_vs_hits", "transparent_huge_pages", "value_size")


def doctor(*args: str) -> tuple[int, dict]:
    res = CliRunner().invoke(cli, ["doctor", "--no-host-checks", "--json", *args])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    return res.exit_code, json.loads(res.stdout)


def line(data: dict, name: str, rank: int = 0) -> dict:
    (c,) = [c for c in data["checks"] if c["name"] == name and c["evidence"].get("rank") == rank]
    return c


def client(v) -> redis.Redis:
    return redis.Redis(host=v.host, port=v.port, password=v.password, socket_timeout=10)


def test_every_line_links_an_anchor_of_the_runbook(valkey_server):
    _, data = doctor("--valkey", valkey_server.url)
    page = (ROOT / checks.RUNBOOK).read_text()
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.lower()).strip().replace(" ", "-") for h in re.findall(r"^#{2,3} (.+)$", page, re.M)}
    seen = {c["name"]: c["runbook"] for c in data["checks"] if c["area"] == "valkey" and c["name"] in TIER_LINES}
    assert set(seen) == set(TIER_LINES)
    for name, link in seen.items():  # the command that prints the section: kvctl runbook tier_settings ANCHOR
        command, page, anchor = link.rsplit(" ", 2)
        assert command == "kvctl runbook" and page == "tier_settings" and anchor in anchors, (name, link)


def test_policy_vs_ttl(valkey_factory):
    wrong = valkey_factory(settings={"maxmemory": "64mb", "maxmemory-policy": "volatile-lru"})
    code, data = doctor("--valkey", wrong.url)
    assert line(data, "policy_vs_ttl")["status"] == "warning"  # empty: the known writers set no TTL
    client(wrong).set("chunk-without-ttl", b"x" * 1000)
    client(wrong).set("chunk-with-ttl", b"x" * 1000, ex=3600)
    code, data = doctor("--valkey", wrong.url)
    c = line(data, "policy_vs_ttl")
    assert code == 4 and c["status"] == "fail" and "1 of 2 keys have none" in c["message"]
    assert c["fix"].startswith("CONFIG SET maxmemory-policy allkeys-lru")
    client(wrong).expire("chunk-without-ttl", 3600)
    assert line(doctor("--valkey", wrong.url)[1], "policy_vs_ttl")["status"] == "ok"  # every key has a TTL
    right = valkey_factory(settings={"maxmemory": "64mb", "maxmemory-policy": "allkeys-lru"})
    client(right).set("chunk-without-ttl", b"x" * 1000)
    assert line(doctor("--valkey", right.url)[1], "policy_vs_ttl")["status"] == "ok"


def test_persistence(valkey_factory):
    wrong = valkey_factory(settings={"maxmemory": "64mb", "save": "3600 1", "appendonly": "yes"})
    assert line(doctor("--valkey", wrong.url)[1], "persistence")["status"] == "warning"
    right = valkey_factory(settings={"maxmemory": "64mb", "save": "", "appendonly": "no"})
    assert line(doctor("--valkey", right.url)[1], "persistence")["status"] == "ok"


def test_io_threads_against_this_hosts_cores(valkey_factory):
    cores = checks.host_cores()
    wrong = valkey_factory(settings={"maxmemory": "64mb", "io-threads": min(256, cores + 1)})
    c = line(doctor("--valkey", wrong.url)[1], "io_threads")
    assert c["status"] == "warning" and f"on {cores} core(s)" in c["message"] and c["evidence"]["io_threads"] == min(256, cores + 1)
    right = valkey_factory(settings={"maxmemory": "64mb", "io-threads": 1})
    assert line(doctor("--valkey", right.url)[1], "io_threads")["status"] == "ok"


def test_proto_max_bulk_len_against_the_chunk(valkey_factory):
    wrong = valkey_factory(settings={"maxmemory": "64mb", "proto-max-bulk-len": "1mb"})
    with pytest.raises(redis.ResponseError):  # the failure the line names, for real
        client(wrong).set("chunk", b"x" * 2 * MB)
    code, data = doctor("--valkey", wrong.url, "--chunk-bytes", "2mb")
    assert code == 4 and line(data, "proto_max_bulk_len")["status"] == "fail"
    right = valkey_factory(settings={"maxmemory": "64mb"})
    client(right).set("chunk", b"x" * 2 * MB)
    c = line(doctor("--valkey", right.url)[1], "proto_max_bulk_len")  # chunk size from the stored value
    assert c["status"] == "ok" and c["evidence"]["chunk_bytes"] == 2 * MB


def _batch(v) -> list[int]:
    pipe = client(v).pipeline(transaction=False)
    for i in range(8):
        pipe.get(f"chunk-{i}")
    return [len(x) for x in pipe.execute()]


def test_output_buffer_limit_against_a_batch(valkey_binary, valkey_factory):
    """8.1 cuts a pipelined batch of 8 chunks of 1 MB under `normal 4mb 2mb 10`, and the line fails; 9.1 writes the
    replies from the values (copy avoidance: the buffer holds references), the batch comes back whole, and the
    line is ok, saying why."""
    wrong = valkey_factory(settings={"maxmemory": "64mb", "client-output-buffer-limit": "normal 4mb 2mb 10"}, binary=valkey_binary)
    right = valkey_factory(settings={"maxmemory": "64mb"}, binary=valkey_binary)
    for v in (wrong, right):
        r = client(v)
        for i in range(8):
            r.set(f"chunk-{i}", b"x" * MB)
    code, data = doctor("--valkey", wrong.url)
    c = line(data, "output_buffer")
    assert "normal 4194304 2097152 10" in c["message"]
    if valkey_binary == valkey_8():
        assert code == 4 and c["status"] == "fail"
        with pytest.raises(redis.ConnectionError):  # a pipelined batch of 8 chunks is cut off, as the line says
            _batch(wrong)
    else:
        assert c["status"] == "ok" and "copy avoidance" in c["message"] and c["evidence"]["copy_avoided"]
        assert _batch(wrong) == [MB] * 8  # whole, as the line says
    assert line(doctor("--valkey", right.url)[1], "output_buffer")["status"] == "ok"
    pipe = client(right).pipeline(transaction=False)
    for i in range(8):
        pipe.get(f"chunk-{i}")
    assert [len(x) for x in pipe.execute()] == [MB] * 8


def test_maxclients_against_engines_ranks_and_pool(valkey_factory):
    wrong = valkey_factory(settings={"maxmemory": "64mb", "maxclients": 40})
    code, data = doctor("--valkey", wrong.url, "--engines", "2")
    c = line(data, "maxclients")
    assert code == 4 and c["status"] == "fail" and c["evidence"]["needed"] == 2 * 1 * 8 + 32
    right = valkey_factory(settings={"maxmemory": "64mb", "maxclients": 1000})
    assert line(doctor("--valkey", right.url, "--engines", "2")[1], "maxclients")["status"] == "ok"


def test_fragmentation(valkey_factory):
    """120 000 values of 1 KB, then three of every four deleted: the allocator keeps the pages (each still
    holds a live value), so RSS stays near 130 MB for about 33 MB of data."""
    wrong = valkey_factory(settings={"maxmemory": "512mb"})
    r = client(wrong)
    n, value = 120_000, b"v" * 1000
    for start in range(0, n, 2000):
        r.mset({f"k{i}": value for i in range(start, start + 2000)})
    pipe = r.pipeline(transaction=False)
    for start in range(0, n, 1000):
        pipe.delete(*[f"k{i}" for i in range(start, start + 1000) if i % 4])
    pipe.execute()
    c = None
    for _ in range(50):  # bounded: Valkey samples its RSS in its periodic cron (every 100 ms)
        c = line(doctor("--valkey", wrong.url)[1], "fragmentation")
        if c["status"] == "warning":
            break
    assert c["status"] == "warning" and c["evidence"]["ratio"] >= 1.5, c
    right = valkey_factory(settings={"maxmemory": "64mb"})
    assert line(doctor("--valkey", right.url)[1], "fragmentation")["status"] == "ok"


def test_evictions_against_hits(valkey_factory):
    wrong = valkey_factory(settings={"maxmemory": "8mb"})
    r = client(wrong)
    for i in range(20):
        r.set(f"chunk-{i}", b"x" * MB)
    c = line(doctor("--valkey", wrong.url)[1], "evictions_vs_hits")
    assert c["status"] == "warning" and c["evidence"]["evicted_keys"] > c["evidence"]["keyspace_hits"] == 0
    right = valkey_factory(settings={"maxmemory": "64mb"})
    r = client(right)
    for i in range(4):
        r.set(f"chunk-{i}", b"x" * MB)
        r.get(f"chunk-{i}")
    c = line(doctor("--valkey", right.url)[1], "evictions_vs_hits")
    assert c["status"] == "ok" and c["evidence"] == {"rank": 0, "evicted_keys": 0, "keyspace_hits": 4}


@pytest.mark.parametrize("disable_thp, thp, status", [
    ("no", "[always] madvise never", "warning"), ("yes", "[always] madvise never", "ok"),
    ("no", "always [madvise] never", "ok"), ("no", "always madvise [never]", "ok"),
])
def test_transparent_huge_pages(valkey_factory, tmp_path, disable_thp, thp, status):
    v = valkey_factory(settings={"maxmemory": "64mb", "disable-thp": disable_thp})
    sysfs = tmp_path / "enabled"
    sysfs.write_text(thp + "\n")
    with Admin(v.url, 10.0, v.password) as a:
        x = checks.read_instance(a, 0, v.host, v.port)
    (c,) = [c for c in checks.tier_checks([x], checks.TierContext(thp_path=str(sysfs)))[0] if c.name == "transparent_huge_pages"]
    assert c.status == status, c
    remote = checks.InstanceRead(0, "192.0.2.1", v.port, x.info, x.config, x.keys, x.keys_with_ttl, x.largest_value)  # TEST-NET-1
    (c,) = [c for c in checks.tier_checks([remote], checks.TierContext(thp_path=str(sysfs)))[0] if c.name == "transparent_huge_pages"]
    assert c.status == "skipped" and "not checked" in c.message


def test_value_size(valkey_factory):
    wrong = valkey_factory(settings={"maxmemory": "128mb"})
    client(wrong).set("chunk", b"x" * 40 * MB)
    c = line(doctor("--valkey", wrong.url)[1], "value_size")
    assert c["status"] == "warning" and c["evidence"]["chunk_bytes"] == 40 * MB
    right = valkey_factory(settings={"maxmemory": "128mb"})
    client(right).set("chunk", b"x" * 12 * MB)
    assert line(doctor("--valkey", right.url)[1], "value_size")["status"] == "ok"
    assert line(doctor("--valkey", right.url, "--chunk-bytes", "48mb")[1], "value_size")["status"] == "warning"


def test_deploy_valkey_up_defaults_pass_every_tier_check(tmp_path, monkeypatch):
    """`kvctl deploy-valkey up` with only --ranks (and a free port, and its directory): doctor's tier lines all ok,
    with a 12.4 MB chunk (the paper's) and 4 engines, read from the real /sys THP setting of this host.
    (Without $KVCTL_LMCACHE_PYTHON: LMCache 0.5.6's known bugs would make doctor warn about the engine side.)"""
    monkeypatch.delenv("KVCTL_LMCACHE_PYTHON", raising=False)
    d = tmp_path / "tier"
    res = CliRunner().invoke(cli, ["deploy-valkey", "up", "--ranks", "2", "--base-port", str(free_base_port(2)), "--dir", str(d), "--json"])
    assert res.exit_code == 0, res.output
    try:
        code, data = doctor("--dir", str(d), "--chunk-bytes", "12.4mb", "--engines", "4")
        lines = [c for c in data["checks"] if c["area"] == "valkey"]
        assert {c["name"] for c in lines} >= set(TIER_LINES)
        thp_readable = checks.read_thp(checks.THP_PATH) is not None
        bad = [c for c in lines if c["status"] != "ok" and not (c["name"] == "transparent_huge_pages" and not thp_readable)]
        assert not bad, bad
        assert code == 0
    finally:
        CliRunner().invoke(cli, ["deploy-valkey", "down", "--dir", str(d)])


def test_bench_json_reports_io_threads_and_version(valkey_factory):
    v = valkey_factory(settings={"maxmemory": "128mb", "io-threads": 2})
    res = CliRunner().invoke(cli, ["bench", "--valkey", v.url, "--chunk-bytes", "1e6", "--batch", "2", "--keys", "8", "--duration", "0.5", "--json"])
    assert res.exit_code == 0, res.output
    meta = json.loads(res.stdout)["metadata"]
    assert meta["server_io_threads"] == [2] and meta["server_versions"][0].count(".") >= 1


@pytest.mark.parametrize("cores, ranks, threads", [(16, 1, 8), (16, 2, 6), (16, 4, 3), (16, 8, 1), (2, 1, 1), (64, 3, 8), (1, 8, 1)])
def test_the_io_threads_default_shares_three_quarters_of_the_cores_among_the_instances(cores, ranks, threads):
    from kvctl.tier.sizing import io_threads_for

    assert io_threads_for(cores, ranks) == threads  # clamp(floor(0.75 × cores / instances), 1, 8)
    assert ranks * threads <= cores or threads == 1  # never more threads than cores, beyond one main thread each


def test_the_engines_acl_user_is_told_to_use_the_admin_password(valkey_factory, tmp_path, monkeypatch):
    """The engines' user (kvctl-engine: GET/SET/EXISTS only) may not read CONFIG: an auth line that says so,
    not "unreachable"; the admin password reads every setting."""
    monkeypatch.delenv("KVCTL_LMCACHE_PYTHON", raising=False)  # LMCache 0.5.6's known bugs would add a warning
    from kvctl.tier.spec import ENGINE_USER, engine_acl

    v = valkey_factory(password="admin-pw", settings={"maxmemory": "64mb", "user": [engine_acl("engine-pw")]})
    pw = tmp_path / "engine.password"
    pw.write_text("engine-pw\n")
    pw.chmod(0o600)
    code, data = doctor("--valkey", f"resp://{ENGINE_USER}@127.0.0.1:{v.port}", "--password-file", str(pw))
    (c,) = [c for c in data["checks"] if c["name"] == "auth"]
    assert code == 4 and "may not run INFO/CONFIG GET" in c["message"] and "admin password" in c["fix"]
    assert not [c for c in data["checks"] if c["name"] == "up"]
    admin = tmp_path / "admin.password"
    admin.write_text("admin-pw\n")
    admin.chmod(0o600)
    code, data = doctor("--valkey", f"resp://127.0.0.1:{v.port}", "--password-file", str(admin))
    assert line(data, "maxclients")["status"] == "ok" and code == 0
