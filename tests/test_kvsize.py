import json
from pathlib import Path

import pytest

from kvctl.errors import InvalidInput
from kvctl.kvsize import kv_size, kv_size_from_file

MODELS = Path(__file__).resolve().parent.parent / "configs" / "models"


def test_deepseek_v3_mla_fp8():
    k = kv_size_from_file(MODELS / "deepseek-v3.json", dtype="fp8")
    assert k.attention == "mla"
    assert k.bytes_per_token == 61 * (512 + 64) * 1
    # MLA latent is replicated: TP does not divide it
    assert kv_size_from_file(MODELS / "deepseek-v3.json", dtype="fp8", tp=8).bytes_per_token == k.bytes_per_token


def test_llama31_gqa_split_across_tp():
    k = kv_size_from_file(MODELS / "llama-3.1-8b.json")
    assert (k.attention, k.dtype) == ("gqa", "bf16")
    assert k.bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072
    assert kv_size_from_file(MODELS / "llama-3.1-8b.json", tp=4).bytes_per_token == 131072 / 4
    # fewer KV heads than ranks: each rank keeps one (replicated) head
    assert kv_size_from_file(MODELS / "llama-3.1-8b.json", tp=16).bytes_per_token == 2 * 32 * 1 * 128 * 2


def test_llama2_mha_fp16_and_chunk():
    k = kv_size_from_file(MODELS / "llama-2-7b.json", chunk_tokens=256)
    assert k.attention == "mha" and k.dtype == "fp16"
    assert k.chunk_bytes == 256 * 2 * 32 * 32 * 128 * 2


def test_explicit_head_dim_wins():
    k = kv_size_from_file(MODELS / "qwen3-32b.json")
    assert k.bytes_per_token == 2 * 64 * 8 * 128 * 2


def test_text_config_wrapper(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"text_config": json.loads((MODELS / "llama-3.1-8b.json").read_text())}))
    assert kv_size_from_file(p).bytes_per_token == 131072


@pytest.mark.parametrize(
    "cfg,msg",
    [
        ({"num_attention_heads": 8, "hidden_size": 64}, "num_hidden_layers"),
        ({"num_hidden_layers": 2, "kv_lora_rank": 512}, "qk_rope_head_dim"),
        ({"num_hidden_layers": 2, "hidden_size": 64}, "num_attention_heads"),
    ],
)
def test_missing_fields(cfg, msg):
    with pytest.raises(InvalidInput, match=msg):
        kv_size(cfg)


def test_unknown_dtype():
    with pytest.raises(InvalidInput, match="dtype"):
        kv_size_from_file(MODELS / "llama-2-7b.json", dtype="int3")


def test_bad_json(tmp_path):
    p = tmp_path / "c.json"
    p.write_text("{nope")
    with pytest.raises(InvalidInput, match="not valid JSON"):
        kv_size_from_file(p)
