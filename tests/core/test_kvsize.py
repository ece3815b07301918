import json
import re
from pathlib import Path

import pytest

from kvctl.core.errors import InvalidInput
from kvctl.core.kvsize import kv_size, kv_size_from_file

MODELS = Path(__file__).resolve().parents[2] / "configs" / "models"


def test_deepseek_v3_mla_fp8():
    k = kv_size_from_file(MODELS / "deepseek-v3.json", dtype="fp8")
    assert k.attention == "mla"
    assert k.bytes_per_token == 61 * (512 + 64) * 1
    assert k.bytes_per_token_per_rank == k.bytes_per_token  # tp 1: one rank moves everything
    # MLA latent is replicated on every rank, so TP does not change the whole model's s; the sharded store
    # has each of the 8 ranks store and load every 8th chunk: 35136 / 8 = 4392 B per token per rank.
    # A stored chunk is the whole latent of 256 tokens: 35136 × 256 = 8994816 B.
    k8 = kv_size_from_file(MODELS / "deepseek-v3.json", dtype="fp8", tp=8)
    assert k8.bytes_per_token == 35136 and k8.bytes_per_token_per_rank == 4392
    assert k8.chunk_bytes == 8994816


def test_glm5_counts_the_indexer_and_the_readme_says_how_it_relates_to_the_papers_s():
    """Issue 34: configs/models/glm-5.json is the public GLM-5 (the paper's GLM-5.3 is not public), MLA with a
    sparse-attention indexer: 78 layers of a 512 + 64 latent, and in every layer the indexer's 128-wide keys.
    kv-size counted the latent by the plain MLA formula (78 x 576 at fp8 = 44 928 B/token) and no indexer; vLLM
    stores FLASHMLA_SPARSE's 656-byte fp8_ds_mla row and 132 bytes of indexer keys a layer."""
    k = kv_size_from_file(MODELS / "glm-5.json", dtype="fp8")
    assert (k.attention, k.layers, k.latent_row_bytes, k.indexer_layers, k.indexer_row_bytes) == ("mla+indexer", 78, 656, 78, 132)
    assert k.bytes_per_token == 78 * 656 + 78 * 132 == 61464 and k.indexer_bytes_per_token == 10296
    assert k.chunk_bytes == 61464 * 256 == 15734784
    bf16 = kv_size_from_file(MODELS / "glm-5.json")  # the config's bfloat16: vLLM's kv-cache dtype auto
    assert bf16.bytes_per_token == 78 * 1152 + 78 * 132 == 100152
    assert kv_size_from_file(MODELS / "glm-5.json", dtype="fp8", tp=8).bytes_per_token == 61464  # replicated
    readme = " ".join((MODELS.parent.parent / "README.md").read_text().split())
    assert "configs/models/glm-5.json" in readme and "48437.5" in readme
    assert "61 464 bytes per token" in readme and "15.7 MB" in readme and "12.49 MiB" in readme


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_glm5_s_is_vllms_own_page_arithmetic_for_the_groups_specs(dtype):
    """s from kv-size = the page size vLLM 0.32 computes for GLM-5's KV cache group / its block size: the group's
    specs built as vLLM's layers build them (mla_attention.py:1350-1381 with FLASHMLA_SPARSE's fp8_ds_mla or bf16
    row; deepseek_v2.py:658-667 with the head size deepseek_v32/attention.py:96 gives the indexer), grouped by
    vLLM's get_kv_cache_groups."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.v1.kv_cache_interface import KVQuantMode, MLAAttentionSpec, SparseCacheRole, UniformTypeKVCacheSpecs

    cfg = json.loads((MODELS / "glm-5.json").read_text())
    bs = 64
    if dtype == "fp8":
        latent = MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"],
                                  dtype=torch.uint8, cache_dtype_str="fp8_ds_mla", kv_quant_mode=KVQuantMode.FP8_PER_TENSOR,
                                  state_content_bytes=656, is_index_group_leader=True)
    else:
        latent = MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"],
                                  dtype=torch.bfloat16, cache_dtype_str="auto", is_index_group_leader=True)
    head_dim, quant_block_size = cfg["index_head_dim"], 128
    indexer = MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=head_dim + head_dim // quant_block_size * 4,
                               dtype=torch.uint8, cache_role=SparseCacheRole.INDEXER)
    specs = {}
    for i in range(cfg["num_hidden_layers"]):
        specs[f"model.layers.{i}.self_attn.attn"] = latent
        specs[f"model.layers.{i}.self_attn.indexer.k_cache"] = indexer
    vcfg = SimpleNamespace(scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=True),
                           attention_config=SimpleNamespace(hisparse_config=None), speculative_config=None,
                           model_config=None, parallel_config=SimpleNamespace(decode_context_parallel_size=1))
    from tests.vllm_placement import placement  # noqa: PLC0415 - after the importorskip

    (group,) = placement.get_kv_cache_groups(vcfg, specs)
    assert isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs)
    vllm_s = group.kv_cache_spec.page_size_bytes / bs
    assert kv_size_from_file(MODELS / "glm-5.json", dtype=dtype).bytes_per_token == vllm_s
    # and against the paper's 12.4 MB per 256-token chunk (s = 48437.5): the fp8 chunk is 27 % more; the latent
    # rows alone, 13.1 MB, are 12.49 MiB
    if dtype == "fp8":
        assert vllm_s * 256 / 12.4e6 == pytest.approx(1.269, abs=1e-3)
        assert 78 * 656 * 256 / 2**20 == pytest.approx(12.49, abs=0.005)


def test_indexer_layers_follow_vllms_topk_rule():
    """models/deepseek_v32/attention.py:165-190: a layer whose top-k is skipped has no indexer (no K cache)."""
    from kvctl.core.kvsize import indexer_layers

    assert indexer_layers({}, 6) == 6
    # freq 2, offset 2: max(i - 1, 0) % 2 -> layers 0, 1, 3, 5 keep one; 2, 4 skip
    assert indexer_layers({"index_topk_freq": 2}, 6) == 4
    assert indexer_layers({"index_topk_pattern": "FFSFSS"}, 6) == 3
    base = json.loads((MODELS / "glm-5.json").read_text())
    k = kv_size({**base, "index_topk_freq": 2}, dtype="fp8")
    assert k.indexer_layers == indexer_layers({"index_topk_freq": 2}, 78) and k.bytes_per_token == 78 * 656 + k.indexer_layers * 132
    with pytest.raises(InvalidInput, match="fp32"):
        kv_size(base, dtype="fp32")
    with pytest.raises(InvalidInput, match="index_head_dim"):
        kv_size({k: v for k, v in base.items() if k != "index_head_dim"} | {"index_topk": 2048})


def test_tp_past_the_kv_heads_counts_every_copy_and_the_docs_say_so():
    """Issue 22: the docs said `--tp` never changes s, while `kv-size --tp 16` on Qwen3-32B (8 KV heads) doubles
    it (each head on 2 ranks, kv_head_copies 2). Code and text now agree."""
    from kvctl.commands.options import TP_HELP

    k8, k16 = (kv_size_from_file(MODELS / "qwen3-32b.json", tp=t) for t in (8, 16))
    assert (k8.kv_head_copies, k16.kv_head_copies) == (1, 2)
    assert k16.bytes_per_token == 2 * k8.bytes_per_token == 524288
    ref = " ".join((MODELS.parent.parent / "docs" / "reference.md").read_text().split())
    assert "never changes s" not in ref.replace("never changes an MLA model's s", "")
    assert f"{int(k8.bytes_per_token)} at `--tp 8` and {int(k16.bytes_per_token)} at `--tp 16`" in ref
    assert "kv_head_copies" in TP_HELP
    mla8, mla16 = (kv_size_from_file(MODELS / "deepseek-v3.json", dtype="fp8", tp=t) for t in (8, 16))
    assert mla8.bytes_per_token == mla16.bytes_per_token  # MLA: --tp never changes s


def test_llama31_gqa_split_across_tp():
    k = kv_size_from_file(MODELS / "llama-3.1-8b.json")
    assert (k.attention, k.dtype) == ("gqa", "bf16")
    assert k.bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072
    # tp 4: 8 KV heads / 4 = 2 per rank: 2 × 32 × 2 × 128 × 2 = 32768 B per rank; the 4 ranks together
    # still move the whole model's 131072 B per token (issue 13: bytes_per_token is the whole model)
    k4 = kv_size_from_file(MODELS / "llama-3.1-8b.json", tp=4)
    assert k4.bytes_per_token == 131072 and k4.bytes_per_token_per_rank == 32768
    # fewer KV heads than ranks: each of the 16 ranks keeps one head (each head on 2 ranks) and loads its
    # own copy: 2 × 32 × 1 × 128 × 2 = 16384 B per rank, 16 × 16384 = 262144 B through the tier per token
    k16 = kv_size_from_file(MODELS / "llama-3.1-8b.json", tp=16)
    assert k16.bytes_per_token_per_rank == 16384 and k16.bytes_per_token == 262144 and k16.kv_head_copies == 2


def test_llama31_tp8_names_whole_model_and_per_rank_separately():
    """Issue 13: with --tp 8, bytes_per_token stayed the per-rank figure (16384) under the whole model's name.

    Llama-3.1-8B: 32 layers, 8 KV heads, head_dim 4096 / 32 = 128, bf16 (2 B), K and V:
    whole model 2 × 32 × 8 × 128 × 2 = 131072 B/token; at tp 8 one KV head per rank:
    2 × 32 × 1 × 128 × 2 = 16384 B/token per rank. A rank's stored 256-token chunk: 16384 × 256 = 4194304 B.
    """
    k = kv_size_from_file(MODELS / "llama-3.1-8b.json", tp=8)
    assert k.bytes_per_token == 131072
    assert k.bytes_per_token_per_rank == 16384
    assert k.chunk_bytes == 4194304 and k.kv_head_copies == 1


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
    with pytest.raises(InvalidInput, match="is not a JSON model config"):
        kv_size_from_file(p)


# ----------------------------------------------------------------------------- vLLM's --dtype auto (issue 13)

LLAMA = json.loads((MODELS / "llama-3.1-8b.json").read_text())  # 32 layers, 8 KV heads, head_dim 4096/32 = 128


def _cfg(tmp_path, **changes) -> Path:
    cfg = {k: v for k, v in {**LLAMA, **changes}.items() if v is not None}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    return p


def test_float32_checkpoint_is_served_at_16_bit(tmp_path):
    """vLLM's --dtype auto downcasts a float32 checkpoint to bfloat16 (its first supported dtype on an
    Ampere-or-newer GPU), and the KV cache follows the model dtype: 2 bytes, not 4."""
    k = kv_size_from_file(_cfg(tmp_path, torch_dtype="float32"))
    assert k.dtype == "bf16"
    assert k.bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072  # K+V × layers × KV heads × head_dim × 2 bytes
    assert "float32" in k.dtype_source and "bfloat16" in k.dtype_source and "auto" in k.dtype_source


@pytest.mark.parametrize(
    "changes, dtype, said",
    [
        ({"torch_dtype": None}, "bf16", "no dtype"),  # vLLM reads a missing dtype as float32, then downcasts
        ({"torch_dtype": "float16"}, "fp16", "float16"),
        ({"torch_dtype": None, "dtype": "float16"}, "fp16", "float16"),  # newer transformers write `dtype`
        ({"torch_dtype": "float16", "model_type": "gemma2"}, "bf16", "gemma2"),  # vLLM refuses float16 for gemma2
        ({"torch_dtype": "float8_e4m3fn"}, "bf16", "--dtype fp8"),  # not a compute dtype: falls back to bfloat16
        ({"torch_dtype": "bfloat16"}, "bf16", "bfloat16"),
    ],
)
def test_auto_dtype_rule(tmp_path, changes, dtype, said):
    k = kv_size_from_file(_cfg(tmp_path, **changes))
    assert k.dtype == dtype and said in k.dtype_source, k.dtype_source
    assert k.bytes_per_token == 2 * 32 * 8 * 128 * {"bf16": 2, "fp16": 2}[dtype]


def test_explicit_dtype_wins_and_is_named(tmp_path):
    k = kv_size_from_file(_cfg(tmp_path, torch_dtype="float32"), dtype="fp32")
    assert (k.dtype, k.bytes_per_token) == ("fp32", 2 * 32 * 8 * 128 * 4)
    assert k.dtype_source == "--dtype"


def test_cli_says_which_dtype_was_used(tmp_path):
    from click.testing import CliRunner  # noqa: PLC0415

    from kvctl.cli import cli  # noqa: PLC0415

    p = _cfg(tmp_path, torch_dtype="float32")
    res = CliRunner().invoke(cli, ["cost", "kv-size", "--model-config", str(p), "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert d["dtype"] == "bf16" and "float32" in d["dtype_source"] and d["bytes_per_token"] == 131072
    res = CliRunner().invoke(cli, ["cost", "kv-size", "--model-config", str(p)])
    assert "bf16" in res.stdout and "float32" in res.stdout


# ----------------------------------------------------------------------------- heads and --tp (issue 13)


@pytest.mark.parametrize(
    "changes, tp, msg",
    [
        ({}, 3, "--tp 3 does not divide the 32 attention heads"),
        ({"num_attention_heads": 48, "hidden_size": 6144}, 3, "--tp 3 and the 8 KV heads"),  # 48 % 3 == 0, 8 % 3 != 0
        ({"num_attention_heads": 48, "hidden_size": 6144}, 12, "--tp 12 and the 8 KV heads"),  # 12 > 8, 12 % 8 != 0
        ({"num_key_value_heads": 64}, 1, "64 KV heads but 32 attention heads"),
        ({"num_key_value_heads": 6}, 1, "32 attention heads are not a multiple of the 6 KV heads"),
    ],
)
def test_heads_that_cannot_be_split_are_refused(tmp_path, changes, tp, msg):
    with pytest.raises(InvalidInput, match=re.escape(msg)):
        kv_size_from_file(_cfg(tmp_path, **changes), tp=tp)


def test_tp_that_divides_or_replicates_is_accepted(tmp_path):
    # 48 heads, 8 KV heads: tp 4 splits 8 → 2 per rank; tp 16 (a multiple of 8) replicates 1 per rank
    p = _cfg(tmp_path, num_attention_heads=48, hidden_size=6144)
    assert kv_size_from_file(p, tp=4).bytes_per_token_per_rank == 2 * 32 * 2 * 128 * 2
    assert kv_size_from_file(p, tp=16).bytes_per_token_per_rank == 2 * 32 * 1 * 128 * 2
    # whole model: tp 4 → 4 × 32768 = 131072; tp 16 → 16 ranks × 16384 (every head held twice) = 262144
    assert kv_size_from_file(p, tp=4).bytes_per_token == 131072
    assert kv_size_from_file(p, tp=16).bytes_per_token == 262144


def test_mla_heads_must_divide_by_tp():
    with pytest.raises(InvalidInput, match=re.escape("--tp 3 does not divide the 128 attention heads")):
        kv_size_from_file(MODELS / "deepseek-v3.json", tp=3)


def test_cli_bad_tp_is_exit_2_one_line(tmp_path):
    from click.testing import CliRunner  # noqa: PLC0415

    from kvctl.cli import cli  # noqa: PLC0415

    res = CliRunner().invoke(cli, ["cost", "kv-size", "--model-config", str(_cfg(tmp_path)), "--tp", "3"])
    assert res.exit_code == 2 and "does not divide the 32 attention heads" in res.output and "Traceback" not in res.output


def test_the_shrunk_glm5_of_the_gpu_tests_has_glm5s_attention_latent_and_indexer():
    """configs/models/glm-5-shrunk-shape.json (the GPU tests' and benchmark's model, dummy weights): GLM-5's
    attention, latent and indexer in 4 layers, so its s is GLM-5's per layer (and GLM-5's with 78 layers)."""
    full = json.loads((MODELS / "glm-5.json").read_text())
    small = json.loads((MODELS / "glm-5-shrunk-shape.json").read_text())
    for key in ("hidden_size", "num_attention_heads", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
                "qk_nope_head_dim", "v_head_dim", "index_head_dim", "index_n_heads"):
        assert small[key] == full[key], key
    assert small["architectures"] == full["architectures"] and small["num_hidden_layers"] == 4
    k = kv_size_from_file(MODELS / "glm-5-shrunk-shape.json", dtype="fp8")
    assert k.bytes_per_token == 4 * (656 + 132)
    assert kv_size({**small, "num_hidden_layers": 78}, dtype="fp8").bytes_per_token == 61464
