"""kvctl's LMCache remote-storage plugin against real Valkey servers, through LMCache 0.5.6's own RemoteBackend.

The scenarios run in the LMCache venv (tests/lmcache/scenarios.py); Valkey
runs here, on free loopback ports. The chunks are LMCache's: 2 layers x 16
tokens x 8 values in bf16 = 2 (K,V) * 2 * 16 * 8 * 2 bytes = 1024 bytes each
(GQA layout), 512 bytes for MLA (one latent row per token).
"""

from __future__ import annotations

import pytest
import redis

from tests.lmcache.lmcache_env import run_scenario, run_scenario_until_stalled

PLUGIN = {
    "remote_storage_plugin.kvctl.module_path": "kvctl.plugins.lmcache",
    "remote_storage_plugin.kvctl.class_name": "KvctlConnectorAdapter",
}


def _plugin_config(**extra) -> dict:
    return {"remote_storage_plugins": ["kvctl"], "extra_config": dict(PLUGIN, **extra)}


def _check_roundtrip(out: dict, server: redis.Redis, other: redis.Redis, chunk_bytes: int) -> None:
    assert out["connection"].startswith("InstrumentedRemoteConnector(<KvctlRemoteConnector"), out
    assert out["full_chunk_bytes"] == chunk_bytes
    # the stored keys are on this rank's instance, whole chunks, and nowhere else; k103 was removed at the end
    for i, key in enumerate(out["stored_keys"]):
        assert server.strlen(key) == (0 if i == 2 else chunk_bytes), key
        assert other.exists(key) == 0, key
    # [k101, k102, missing, k103]: prefix of 2
    assert out["batched_contains"] == 2 and out["backend_batched_contains"] == 2
    assert out["async_contains"] == 1  # [k101, missing, k102]
    assert out["exists"] == [True, False, True]
    assert out["get_missing"] is None and out["get_missing_s"] < 1.0
    # chunks were filled with 1.0, 2.0, 3.0: [k101, missing, k103] -> [1.0, None, 3.0]
    assert out["batched_get"] == [1.0, None, 3.0]
    assert out["non_blocking_prefix"] == [2.0, 1.0]  # [k102, k101, missing, k103]: stops at the miss
    assert out["backend_get_blocking"] == 2.0
    # every buffer allocated for a miss (or after one) was given back to LMCache's allocator
    assert out["active_after"] == out["active_before"]
    assert out["remove"] == [True, False]
    assert out["ping"] == 0 and out["errors"] == 0


def test_roundtrip_url_list_rank_1(lmc_python, valkey_factory):
    """kvctl_remote_urls: worker 1 of 2 (LMCache's metadata.worker_id) uses the list's entry 1."""
    v0, v1 = valkey_factory(), valkey_factory()
    cfg = _plugin_config(kvctl_remote_urls=[v0.url, v1.url])
    out = run_scenario("plugin_roundtrip", {"config": cfg, "worker_id": 1, "world_size": 2})
    r0, r1 = redis.Redis(port=v0.port), redis.Redis(port=v1.port)
    _check_roundtrip(out, r1, r0, 1024)
    # LMCache's key names: model@world_size@worker_id@hash@dtype
    assert all(k.startswith("tiny@2@1@") for k in out["stored_keys"])
    assert r0.dbsize() == 0


def test_roundtrip_template_acl_user_password_file_mla(lmc_python, valkey_factory, tmp_path):
    """{rank} template + ACL user + password file; MLA chunks (1 x 2 x 16 x 8 x 2 bytes = 512)."""
    v0 = valkey_factory(password="admin-pw")
    admin = redis.Redis(port=v0.port, password="admin-pw")
    admin.execute_command("ACL", "SETUSER", "kvctl-engine", "on", ">engine-pw", "~*", "+@all")
    pw = tmp_path / "engine.pw"
    pw.write_text("engine-pw\n")
    pw.chmod(0o600)
    # host differs by rank in production (valkey-{rank}); here {rank} picks the database: rank 0 -> /0
    cfg = _plugin_config(**{"remote_storage_plugin.kvctl.url": f"resp://127.0.0.1:{v0.port}/{{rank}}",
                            "kvctl_username": "kvctl-engine", "kvctl_password_file": str(pw)})
    out = run_scenario("plugin_roundtrip", {"config": cfg, "worker_id": 0, "world_size": 1, "use_mla": True})
    other = redis.Redis(port=v0.port, password="admin-pw", db=1)
    _check_roundtrip(out, admin, other, 512)
    assert "engine-pw" not in out["connection"]
    # engine-pw is only kvctl-engine's password (the default user's is admin-pw): the stores above logged in as it
    # a wrong password is a miss/drop, not a crash: same config with a bad password file
    pw.write_text("wrong\n")
    bad = run_scenario("plugin_dead_server", {"config": cfg})
    assert bad["contains"] == 0 and bad["get"] is None and bad["batched_get"] == [None, None]
    assert bad["ping"] == 1 and bad["errors"] >= 4


def test_dead_server_every_call_bounded(lmc_python, valkey_factory):
    """A port nobody listens on: put dropped, lookups 0, gets None, ping 1 -- all within the 0.5 s deadlines."""
    v0 = valkey_factory()
    port = v0.port
    v0.stop()
    cfg = _plugin_config(**{"remote_storage_plugin.kvctl.url": f"resp://127.0.0.1:{port}",
                            "remote_storage_plugin.kvctl.timeout_s": 0.5})
    out = run_scenario("plugin_dead_server", {"config": cfg})
    assert out["contains"] == 0 and out["get"] is None and out["batched_get"] == [None, None] and out["ping"] == 1
    # 5 calls (put, contains, get, batched_get, ping), each at most 0.5 s (+2 % overrun): well under 5 * 0.51
    assert out["elapsed_s"] < 5 * 0.51
    assert out["errors"] == 5


def test_remote_url_next_to_plugin_refused(lmc_python, valkey_factory):
    """remote_url beside the plugin would write every chunk twice: the plugin backend refuses to start."""
    v0 = valkey_factory()
    cfg = _plugin_config(**{"remote_storage_plugin.kvctl.url": v0.url})
    cfg["remote_url"] = v0.url
    out = run_scenario("plugin_roundtrip", {"config": cfg, "worker_id": 0, "world_size": 1})
    # LMCache logs the plugin's error and leaves the plugin backend without a connection
    assert out["connection"] == "None"


@pytest.mark.slow
def test_native_resp_client_blocks_on_missing_key(lmc_python, valkey_factory):
    """Contrast: LMCache 0.5.6's own resp:// client answers a stored key, then never returns for a missing one.

    Skipped (not failed) the day it returns: the bug is LMCache's, not kvctl's.
    """
    v0 = valkey_factory()
    wait_s = 8.0
    progress, result, output = run_scenario_until_stalled(
        "native_resp_get_missing", {"url": v0.url, "wait_s": wait_s}, ready_timeout_s=180, stall_s=wait_s)
    assert progress is not None, f"the native client did not even read a stored key:\n{output}"
    assert progress["stored_get"] == 5.0
    if result is not None:
        pytest.skip(f"LMCache's native RESP client returned for a missing key after {result['missing_returned_after_s']:.2f} s")
    # still blocked after wait_s: 16x the plugin's whole-call deadline (0.5 s in the test above)
