"""Load or recompute in kvctl's LMCache plugin (issue 46 item 5), through LMCache 0.5.6's own RemoteBackend.

LMCache loads as many leading chunks as a remote backend says it holds, so the plugin declines a hit by
answering fewer (kvctl.plugins.lmcache). It has no engine step to measure R by: R comes from its settings,
and without one it answers what it holds, as before. Chunks of 16 tokens, 1024 bytes (tests/lmcache/test_plugin.py).
"""

from __future__ import annotations

from tests.lmcache.lmcache_env import run_scenario

PLUGIN = {
    "remote_storage_plugin.kvctl.module_path": "kvctl.plugins.lmcache",
    "remote_storage_plugin.kvctl.class_name": "KvctlConnectorAdapter",
}


def config(url: str, **extra) -> dict:
    return {"remote_storage_plugins": ["kvctl"],
            "extra_config": dict(PLUGIN, **{"remote_storage_plugin.kvctl.url": url}, **extra)}


def test_a_hit_is_declined_once_its_gets_show_it_loads_slower_than_it_recomputes(lmc_python, valkey_factory):
    """R = 1e9 tokens/s at 64 B a token: break-even is 64 GB/s, which no loopback GET reaches. Nothing measured:
    all 4 chunks (no veto on no data); after LMCache's GET of them, 0 on both of LMCache's lookup paths."""
    v = valkey_factory()
    out = run_scenario("plugin_decision", {"config": config(v.url, **{
        "remote_storage_plugin.kvctl.prefill_tokens_per_s": 1e9, "remote_storage_plugin.kvctl.t0_s": 0.01})})
    assert (out["before"], out["async_before"]) == (4, 4), out
    assert (out["after"], out["async_after"]) == (0, 0), out
    assert out["decisions"] == {"load/no_data": 2, "recompute/below_breakeven": 2}, out


def test_a_hit_that_wins_or_a_plugin_without_r_answers_what_it_holds(lmc_python, valkey_factory):
    """R = 1 token/s: recomputing 64 tokens takes a minute, loading 4 kB does not. Without R: no decision at all."""
    v = valkey_factory()
    out = run_scenario("plugin_decision", {"config": config(v.url, **{"remote_storage_plugin.kvctl.prefill_tokens_per_s": 1})})
    assert (out["before"], out["after"], out["async_after"]) == (4, 4, 4), out
    assert out["decisions"] == {"load/no_data": 2, "load/wins": 2}, out
    out = run_scenario("plugin_decision", {"config": config(v.url)})
    assert (out["before"], out["after"]) == (4, 4) and out["decisions"] == {}, out
