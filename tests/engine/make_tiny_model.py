"""Build a tiny Llama-style (or DeepSeek-V2 MLA) model with random weights and a local tokenizer.

Nothing is downloaded: the config is written by hand, the weights are random
(seeded) and saved as safetensors, and the tokenizer is a byte-level BPE trained
with the ``tokenizers`` library on a small generated corpus, saved in the
Hugging Face layout that ``vllm serve DIR`` loads.

    python tests/engine/make_tiny_model.py OUT_DIR [--mla]

Shape (chosen for vLLM's CPU attention backend, which needs head_dim in
{32, 64, 80, ...}): 2 layers, hidden 128, 4 query heads, 2 KV heads,
head_dim 32, vocab 512. KV bytes per token = 2 x layers x kv_heads x head_dim x
dtype bytes = 2*2*2*32*2 = 512 B in bfloat16 (1024 B in float32).

``--mla`` builds a DeepSeek-V2-architecture MLA model instead (all layers
dense, no MoE): 2 layers, hidden 128, 4 heads, kv_lora_rank 512 and
qk_rope_head_dim 64 (the only latent size vLLM's CPU MLA kernels take),
qk_nope_head_dim 32, v_head_dim 32, no q LoRA. Latent KV bytes per token =
layers x (kv_lora_rank + qk_rope_head_dim) x dtype bytes = 2*576*2 = 2304 B
in bfloat16, the same on every TP rank.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

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
QK_NOPE_HEAD_DIM = 32
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


def build_tokenizer(out: Path) -> int:
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
                "model_max_length": MAX_POSITIONS,
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


def build_model(out: Path, vocab_size: int, seed: int = 0) -> None:
    """Write config.json and random bfloat16 weights (model.safetensors)."""

    config = _base_config(vocab_size) | {
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


def build_mla_model(out: Path, vocab_size: int, seed: int = 0) -> None:
    """Write a DeepSeek-V2 config (MLA, dense MLP in every layer) and random bfloat16 weights."""
    import torch

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
        "qk_nope_head_dim": QK_NOPE_HEAD_DIM,
        "v_head_dim": V_HEAD_DIM,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
    }
    _write_config(out, config)
    rnd, w = _dense_weights(vocab_size, seed)
    qk_head = QK_NOPE_HEAD_DIM + QK_ROPE_HEAD_DIM
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rnd(HEADS * qk_head, HIDDEN)
        w[p + "self_attn.kv_a_proj_with_mqa.weight"] = rnd(KV_LORA_RANK + QK_ROPE_HEAD_DIM, HIDDEN)
        w[p + "self_attn.kv_a_layernorm.weight"] = torch.ones(KV_LORA_RANK, dtype=torch.bfloat16)
        w[p + "self_attn.kv_b_proj.weight"] = rnd(HEADS * (QK_NOPE_HEAD_DIM + V_HEAD_DIM), KV_LORA_RANK)
        w[p + "self_attn.o_proj.weight"] = rnd(HIDDEN, HEADS * V_HEAD_DIM)
    _save(out, w)


def make_tiny_model(out_dir: str | os.PathLike, mla: bool = False) -> Path:
    """Create the tiny model in ``out_dir`` (idempotent: reuses a finished build).

    ``mla=True`` builds the DeepSeek-V2 MLA variant instead of the Llama.
    """
    out = Path(out_dir)
    if (out / ".complete").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = build_tokenizer(out)
    (build_mla_model if mla else build_model)(out, vocab_size)
    (out / ".complete").write_text((MLA_MODEL_NAME if mla else MODEL_NAME) + "\n")
    return out


def main(argv: list[str]) -> int:
    args = [a for a in argv[1:] if a != "--mla"]
    mla = "--mla" in argv[1:]
    if len(args) != 1:
        print(__doc__.strip().splitlines()[0])
        print("usage: make_tiny_model.py OUT_DIR [--mla]", file=sys.stderr)
        return 2
    out = make_tiny_model(args[0], mla=mla)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"tiny model in {out} ({size} bytes, {kv_bytes_per_token(mla=mla)} KV bytes/token in bf16)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
