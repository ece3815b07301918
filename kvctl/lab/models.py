"""Model directories for engine runs: tiny random-weight models with a local tokenizer, and shapes for dummy weights.

Nothing is downloaded: configs are written here, tiny models get seeded random
bfloat16 weights (safetensors), and the tokenizer is a byte-level BPE trained
with the ``tokenizers`` library on a small generated corpus (vocabulary 512),
saved in the Hugging Face layout that vLLM loads.

* :func:`make_tiny_model` -- a 2-layer Llama (GQA: 4 query heads, 2 KV heads of
  32) or a 2-layer DeepSeek-V2 MLA model (kv_lora_rank 512 + rope 64, the only
  latent size vLLM's CPU MLA kernels take). ``mla_head_dims`` sets
  qk_nope_head_dim / v_head_dim: 32 for vLLM's CPU backends, 128 for its CUDA
  MLA prefill, which has "No valid MLA prefill backend" for anything else.
* :func:`make_shaped_model` -- a real model's config.json (e.g.
  ``configs/models/deepseek-v2-lite-shape.json``: 27 layers of MLA, 64 experts)
  with the tiny tokenizer and no weights, for ``load_format="dummy"``: realistic
  prefill compute and KV sizes without a checkpoint. Token ids stay below 512,
  inside any real vocabulary. :data:`GLM5_SHRUNK_SHAPE` is GLM-5
  (``GlmMoeDsaForCausalLM``: MLA with a sparse-attention indexer) in 4 layers
  and 8 experts, its attention, latent and indexer unchanged.

Used by the engine tests (tests/engine, tests/gpu) and benchmarks/engine_gpu.py;
needs torch, safetensors and tokenizers (the engine extra).

    python -m kvctl.lab.models OUT_DIR [--mla] [--mla-head-dims 128]
    python -m kvctl.lab.models OUT_DIR --shape configs/models/deepseek-v2-lite-shape.json
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

__all__ = ["GLM5_SHRUNK_SHAPE", "HEAD_DIM", "HIDDEN", "KV_HEADS", "MLA_MODEL_NAME", "MODEL_NAME", "NUM_LAYERS", "VOCAB",
           "kv_bytes_per_token", "make_shaped_model", "make_tiny_model"]

#: GLM-5 in 4 layers and 8 experts (the checkout's configs/models/; the GPU tests and benchmarks/engine_gpu.py)
GLM5_SHRUNK_SHAPE = Path(__file__).resolve().parents[2] / "configs" / "models" / "glm-5-shrunk-shape.json"
NUM_LAYERS = 2
HIDDEN = 128
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
VOCAB = 512
MAX_POSITIONS = 2048
MODEL_NAME = "kvctl-tiny-llama"
MLA_MODEL_NAME = "kvctl-tiny-deepseek-v2"
KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
QK_NOPE_HEAD_DIM = 32  # vLLM's CPU MLA backends; CUDA MLA prefill needs 128 (mla_head_dims=128)
V_HEAD_DIM = 32

_WORDS = (
    "the cache tier stores key value blocks for prompts that repeat across requests "
    "valkey serves get and set over resp while lmcache moves chunks between host "
    "memory and the remote store prefill engines recompute tokens when a lookup "
    "misses and load them when it hits bandwidth latency queue rank owner chunk "
    "prefix token model layer head batch stream engine server client metric"
).split()


def kv_bytes_per_token(dtype_bytes: int = 2, mla: bool = False) -> int:
    """KV-cache bytes per token (GQA: 2 x layers x kv_heads x head_dim x bytes; MLA: layers x 576 x bytes)."""
    if mla:
        return NUM_LAYERS * (KV_LORA_RANK + QK_ROPE_HEAD_DIM) * dtype_bytes
    return 2 * NUM_LAYERS * KV_HEADS * HEAD_DIM * dtype_bytes


def _corpus(lines: int = 2000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        n = rng.randint(5, 30)
        out.append(" ".join(rng.choice(_WORDS) for _ in range(n)) + ".")
    # digits and punctuation so arbitrary prompts tokenize without many byte fallbacks
    out.append("0 1 2 3 4 5 6 7 8 9 , . ; : ! ? - ( ) request number user assistant")
    return out


def build_tokenizer(out: Path, max_positions: int = MAX_POSITIONS) -> int:
    """Train a byte-level BPE tokenizer on a generated corpus and save it HF-style."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "model_max_length": max_positions,
                "add_bos_token": True,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}, indent=2)
    )
    return tok.get_vocab_size()


def _base_config(vocab_size: int) -> dict:
    """config.json keys both architectures share."""
    return {
        "vocab_size": vocab_size, "hidden_size": HIDDEN, "intermediate_size": 2 * HIDDEN,
        "num_hidden_layers": NUM_LAYERS, "hidden_act": "silu", "max_position_embeddings": MAX_POSITIONS,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "attention_bias": False,
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "torch_dtype": "bfloat16", "initializer_range": 0.02,
    }


def _write_config(out: Path, config: dict) -> None:
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}, indent=2)
    )


def _dense_weights(vocab_size: int, seed: int):
    """(rnd, weights): a seeded random-tensor maker and the embedding, norms and dense MLP of every layer."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    inter = 2 * HIDDEN
    w = {
        "model.embed_tokens.weight": rnd(vocab_size, HIDDEN),
        "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
        "lm_head.weight": rnd(vocab_size, HIDDEN),
    }
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
        w[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
        w[p + "mlp.gate_proj.weight"] = rnd(inter, HIDDEN)
        w[p + "mlp.up_proj.weight"] = rnd(inter, HIDDEN)
        w[p + "mlp.down_proj.weight"] = rnd(HIDDEN, inter)
    return rnd, w


def _save(out: Path, w: dict) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in w.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})


def build_model(out: Path, vocab_size: int, seed: int = 0, max_positions: int = MAX_POSITIONS) -> None:
    """Write config.json and random bfloat16 weights (model.safetensors)."""

    config = _base_config(vocab_size) | {
        "max_position_embeddings": max_positions,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-5,
        "mlp_bias": False,
    }
    _write_config(out, config)
    rnd, w = _dense_weights(vocab_size, seed)
    kv_dim = KV_HEADS * HEAD_DIM
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rnd(HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.k_proj.weight"] = rnd(kv_dim, HIDDEN)
        w[p + "self_attn.v_proj.weight"] = rnd(kv_dim, HIDDEN)
        w[p + "self_attn.o_proj.weight"] = rnd(HIDDEN, HEADS * HEAD_DIM)
    _save(out, w)


def build_mla_model(out: Path, vocab_size: int, seed: int = 0, head_dims: int = QK_NOPE_HEAD_DIM,
                    max_positions: int = MAX_POSITIONS) -> None:
    """Write a DeepSeek-V2 config (MLA, dense MLP in every layer) and random bfloat16 weights.

    ``head_dims``: qk_nope_head_dim = v_head_dim (32 for vLLM's CPU MLA, 128 for its CUDA MLA prefill).
    """
    import torch

    nope = v_dim = head_dims
    config = _base_config(vocab_size) | {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "moe_intermediate_size": HIDDEN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "n_shared_experts": 1,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": NUM_LAYERS,  # every layer dense: no MoE kernels needed
        "moe_layer_freq": 1,
        "routed_scaling_factor": 1.0,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": False,
        "scoring_func": "softmax",
        "q_lora_rank": None,
        "kv_lora_rank": KV_LORA_RANK,
        "qk_rope_head_dim": QK_ROPE_HEAD_DIM,
        "qk_nope_head_dim": nope,
        "v_head_dim": v_dim,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "max_position_embeddings": max_positions,
    }
    _write_config(out, config)
    rnd, w = _dense_weights(vocab_size, seed)
    qk_head = nope + QK_ROPE_HEAD_DIM
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rnd(HEADS * qk_head, HIDDEN)
        w[p + "self_attn.kv_a_proj_with_mqa.weight"] = rnd(KV_LORA_RANK + QK_ROPE_HEAD_DIM, HIDDEN)
        w[p + "self_attn.kv_a_layernorm.weight"] = torch.ones(KV_LORA_RANK, dtype=torch.bfloat16)
        w[p + "self_attn.kv_b_proj.weight"] = rnd(HEADS * (nope + v_dim), KV_LORA_RANK)
        w[p + "self_attn.o_proj.weight"] = rnd(HIDDEN, HEADS * v_dim)
    _save(out, w)


def make_tiny_model(out_dir: str | os.PathLike, mla: bool = False, mla_head_dims: int = QK_NOPE_HEAD_DIM,
                    max_positions: int = MAX_POSITIONS) -> Path:
    """Create the tiny model in ``out_dir`` (idempotent: reuses a finished build of the same shape).

    ``mla=True`` builds the DeepSeek-V2 MLA variant instead of the Llama, with
    ``mla_head_dims`` as qk_nope_head_dim and v_head_dim.
    """
    out = Path(out_dir)
    tag = (f"{MLA_MODEL_NAME}-{mla_head_dims}" if mla else MODEL_NAME) + f"-{max_positions}"
    if (out / ".complete").exists() and (out / ".complete").read_text().strip() in (tag, MLA_MODEL_NAME if mla else MODEL_NAME):
        return out
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = build_tokenizer(out, max_positions)
    if mla:
        build_mla_model(out, vocab_size, head_dims=mla_head_dims, max_positions=max_positions)
    else:
        build_model(out, vocab_size, max_positions=max_positions)
    (out / ".complete").write_text(tag + "\n")
    return out


def make_shaped_model(out_dir: str | os.PathLike, shape: str | os.PathLike | dict, *,
                      max_positions: int | None = None, overrides: dict | None = None) -> Path:
    """A model directory for ``load_format="dummy"``: ``shape`` (a config.json, or its dict) and the tiny tokenizer.

    No weights are written: vLLM initialises them itself (the same seeded values in every engine, so a
    restarted engine computes what the one before it did). bos/eos are the tokenizer's (0 and 1);
    ``max_positions`` overrides ``max_position_embeddings``; ``overrides`` any other keys (e.g.
    ``num_hidden_layers``: the per-layer lists ``layer_types``, ``indexer_types`` and ``mlp_layer_types``
    are then left to the config class's defaults).
    """
    out = Path(out_dir)
    config = dict(shape) if isinstance(shape, dict) else json.loads(Path(shape).read_text())
    if overrides:
        if "num_hidden_layers" in overrides:
            for key in ("layer_types", "indexer_types", "mlp_layer_types"):
                config.pop(key, None)
        config.update(overrides)
    config.update({"bos_token_id": 0, "eos_token_id": 1})
    if max_positions is not None:
        config["max_position_embeddings"] = int(max_positions)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, int(config.get("max_position_embeddings", MAX_POSITIONS)))
    _write_config(out, config)
    (out / ".complete").write_text(f"shaped-{config.get('model_type', 'model')}\n")
    return out


def parse_overrides(items: list[str]) -> dict:
    """``["num_hidden_layers=78", ...]`` as a dict of integers (the shape overrides of the CLIs)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"a shape override is KEY=INT, got {item!r}")
        out[key] = int(value)
    return out


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kvctl.lab.models", description=__doc__.strip().splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--mla", action="store_true", help="DeepSeek-V2 MLA instead of the Llama")
    ap.add_argument("--mla-head-dims", type=int, default=QK_NOPE_HEAD_DIM, help="qk_nope/v head dims (CUDA MLA: 128)")
    ap.add_argument("--max-positions", type=int, default=MAX_POSITIONS)
    ap.add_argument("--shape", help="a config.json to write with the tokenizer and no weights (load_format dummy)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=INT",
                    help="with --shape: override a config key with an integer (e.g. num_hidden_layers=78)")
    args = ap.parse_args(argv[1:])
    if args.shape:
        out = make_shaped_model(args.out_dir, args.shape, overrides=parse_overrides(args.overrides))
        print(f"shaped model (no weights) in {out}")
        return 0
    out = make_tiny_model(args.out_dir, mla=args.mla, mla_head_dims=args.mla_head_dims, max_positions=args.max_positions)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"tiny model in {out} ({size} bytes, {kv_bytes_per_token(mla=args.mla)} KV bytes/token in bf16)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
