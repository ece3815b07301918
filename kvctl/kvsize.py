"""KV bytes per token from a Hugging Face ``config.json``.

* MLA (DeepSeek-V2/V3 style, ``kv_lora_rank`` present): one latent of
  ``kv_lora_rank + qk_rope_head_dim`` elements per layer, replicated on every
  rank, so tensor parallelism does not divide it.
* GQA/MHA: ``2 × num_key_value_heads × head_dim`` elements per layer (K and V);
  KV heads are split across TP ranks (replicated when there are fewer heads
  than ranks). ``head_dim`` defaults to ``hidden_size / num_attention_heads``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from kvctl.errors import InvalidInput

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
_HF_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8"}


@dataclass(frozen=True)
class KvSize:
    model: str
    attention: str  # "mla", "gqa" or "mha"
    layers: int
    elements_per_token_per_layer: int
    dtype: str
    tp: int
    bytes_per_token: float
    chunk_tokens: int
    chunk_bytes: float


def load_config(path: Path | str) -> dict[str, Any]:
    """Read a config.json, raising InvalidInput with the path on any problem."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise InvalidInput(f"cannot read model config {path}: {e.strerror or e}") from e
    except json.JSONDecodeError as e:
        raise InvalidInput(f"model config {path} is not valid JSON (line {e.lineno}: {e.msg})") from e
    if not isinstance(data, dict):
        raise InvalidInput(f"model config {path} must be a JSON object")
    # multimodal wrappers keep the language model under text_config
    if "num_hidden_layers" not in data and isinstance(data.get("text_config"), dict):
        merged = dict(data["text_config"])
        merged.setdefault("_name_or_path", data.get("_name_or_path"))
        data = merged
    data.setdefault("_kvctl_source", str(path))
    return data


def _field(cfg: Mapping[str, Any], name: str, source: str) -> int:
    value = cfg.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidInput(f"model config {source}: missing or invalid field '{name}'")
    return value


def kv_size(
    cfg: Mapping[str, Any], dtype: str | None = None, chunk_tokens: int = 256, tp: int = 1
) -> KvSize:
    """Bytes per token and per chunk for a parsed config (see module docstring)."""
    source = str(cfg.get("_kvctl_source", "<config>"))
    if chunk_tokens <= 0:
        raise InvalidInput(f"--chunk-tokens must be positive, got {chunk_tokens}")
    if tp <= 0:
        raise InvalidInput(f"--tp must be positive, got {tp}")
    if dtype is None:
        hf = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
        dtype = _HF_DTYPES.get(str(hf), "bf16")
    if dtype not in DTYPE_BYTES:
        raise InvalidInput(f"unknown dtype '{dtype}' (choose from {', '.join(DTYPE_BYTES)})")
    layers = _field(cfg, "num_hidden_layers", source)
    if cfg.get("kv_lora_rank"):
        attention = "mla"
        elems = _field(cfg, "kv_lora_rank", source) + _field(cfg, "qk_rope_head_dim", source)
    else:
        heads = _field(cfg, "num_attention_heads", source)
        kv_heads = cfg.get("num_key_value_heads", heads)
        if not isinstance(kv_heads, int) or kv_heads <= 0:
            raise InvalidInput(f"model config {source}: invalid field 'num_key_value_heads'")
        head_dim = cfg.get("head_dim") or _field(cfg, "hidden_size", source) // heads
        attention = "mha" if kv_heads == heads else "gqa"
        kv_heads_per_rank = max(1, -(-kv_heads // tp))
        elems = 2 * kv_heads_per_rank * head_dim
    bpt = float(layers * elems * DTYPE_BYTES[dtype])
    name = str(cfg.get("_name_or_path") or Path(source).stem)
    return KvSize(name, attention, layers, elems, dtype, tp, bpt, chunk_tokens, bpt * chunk_tokens)


def kv_size_from_file(path: Path | str, dtype: str | None = None, chunk_tokens: int = 256, tp: int = 1) -> KvSize:
    return kv_size(load_config(path), dtype=dtype, chunk_tokens=chunk_tokens, tp=tp)
