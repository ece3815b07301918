"""`kvctl bench --model-config --tp`: the verdict gets the whole model's bytes per token (issue 13), real valkey-server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvctl.cli import cli

LLAMA = str(Path(__file__).resolve().parents[2] / "configs" / "models" / "llama-3.1-8b.json")


def test_bench_tp8_verdict_uses_the_whole_models_bytes_per_token(valkey_server):
    """Llama-3.1-8B bf16 at tp 8, 16-token chunks, R = 100k tok/s.

    whole model 2 × 32 layers × 8 KV heads × 128 × 2 B = 131072 B/token; per rank (1 KV head) 16384 B/token;
    a rank's stored 16-token chunk: 16384 × 16 = 262144 B. B* = 131072 × 1e5 = 13.1072 GB/s for the tier;
    with the one instance here every token's 131072 B come from it (bytes_per_token_per_rank of the run = 131072).
    """
    res = CliRunner().invoke(cli, [
        "bench", "--valkey", valkey_server.url, "--model-config", LLAMA, "--tp", "8", "--chunk-tokens", "16",
        "--batch", "2", "--keys", "8", "--duration", "0.5", "--prefill-rate", "100000", "--json",
    ])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    p = d["metadata"]["parameters"]
    assert p["bytes_per_token"] == 131072 and p["bytes_per_token_per_rank"] == 16384 and p["tp"] == 8
    assert p["chunk_bytes"] == 262144
    v = d["verdict"]
    assert v["bytes_per_token"] == 131072
    assert v["breakeven_gbps"] == pytest.approx(13.1072)
    assert v["ranks"] == 1 and v["bytes_per_token_per_rank"] == 131072
    # the load cost per token is s over the measured tier bandwidth: 131072 B / (GB/s × 1e9) in µs
    assert v["load_us_per_token"] == pytest.approx(131072 / (v["tier_gbps"] * 1e9) * 1e6)
    assert v["recompute_us_per_token"] == pytest.approx(10.0)
    assert v["loading_wins"] == (v["load_us_per_token"] < 10.0)


def test_bench_tp_with_other_instance_count_warns(valkey_server):
    """--tp 8 but the run has one instance: the verdict is for the tier measured, and the output says so."""
    res = CliRunner().invoke(cli, [
        "bench", "--valkey", valkey_server.url, "--model-config", LLAMA, "--tp", "8", "--chunk-tokens", "16",
        "--batch", "2", "--keys", "8", "--duration", "0.5", "--prefill-rate", "100000",
    ])
    assert res.exit_code == 0, res.output
    assert "verdict:" in res.output and "--tp 8" in res.output and "1 instance" in res.output
