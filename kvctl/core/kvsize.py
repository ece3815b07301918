"""KV bytes per token from a Hugging Face ``config.json``.

* MLA (DeepSeek-V2/V3 style, ``kv_lora_rank`` present): one latent of
  ``kv_lora_rank + qk_rope_head_dim`` elements per layer, replicated on every
  rank, so tensor parallelism does not divide it.
* MLA with a sparse-attention indexer (DeepSeek-V3.2, GLM-5: ``index_head_dim``
  beside ``kv_lora_rank``): the latent row of vLLM's sparse MLA backend
  (FLASHMLA_SPARSE) in every layer -- ``--dtype fp8`` is its ``fp8_ds_mla``
  row, 656 bytes (512 fp8 NoPE, 4 fp32 scales, 64 bf16 RoPE), bf16/fp16 the
  576-element latent -- plus, in every layer whose indexer runs, the
  indexer's keys: ``index_head_dim`` fp8 bytes and one fp32 scale per 128
  (132 bytes for 128), whatever ``--dtype`` (vLLM: ``DeepseekV32IndexerCache``,
  uint8). s is what vLLM's page arithmetic gives for the two specs of the
  model's KV cache group (``tests/core/test_kvsize.py`` computes it with vLLM's
  own spec classes). Replicated on every rank, like MLA.
* GQA/MHA: ``2 × num_key_value_heads × head_dim`` elements per layer (K and V);
  KV heads are split across TP ranks (replicated when there are fewer heads
  than ranks). ``head_dim`` defaults to ``hidden_size / num_attention_heads``.

Two quantities, never one name for both (issue 13):

* ``bytes_per_token`` is s of the cost model (paper §4): the whole model's KV
  bytes per token, what loading one prompt token moves through the tier with
  every rank's share counted. B* = s·R and ρ = λ·n·s/B compare it with the
  WHOLE tier's bandwidth (the sum over instances). With KV heads replicated
  (``--tp`` a multiple of the KV heads) every rank stores and loads its own
  copy, so s counts each copy (``kv_head_copies``).
* ``bytes_per_token_per_rank`` = s / tp is one rank's share, what it moves
  through its own instance of a rank-partitioned tier (GQA/MHA: its KV heads;
  MLA: the sharded store's every tp-th chunk). Compare it with ONE instance's
  bandwidth, never with the tier's sum.

``chunk_bytes`` is one stored chunk value: a rank's heads for GQA/MHA (per-rank
bytes × chunk tokens), the whole latent for MLA (one chunk, one owner).
  As in vLLM, ``--tp`` must divide the attention heads, and either divide the KV
  heads or be a multiple of them; a config with more KV heads than attention
  heads, or attention heads that are not a multiple of the KV heads, is refused.

The KV cache has the model's dtype (vLLM's ``--kv-cache-dtype auto``), and with
no ``--dtype`` the model's dtype is what vLLM's ``--dtype auto`` picks on an
Ampere-or-newer GPU (``_resolve_auto_dtype`` in vllm/config/model.py): a float32
(or undeclared) checkpoint is served in bfloat16, float16 stays float16 except
for models vLLM will not run in float16, anything else falls back to bfloat16.

A config.json is read by :func:`load_config` alone (a regular file, a size cap, UTF-8, the JSON depth
bound), and every field used here is an integer within its bound in ``kvctl/core/thresholds.py``
(``MODEL_MAX_*``: e.g. 1 to 10,000 layers) before any arithmetic: a string, a bool, NaN, a fraction or a
number past its bound is one line naming the key and the file (exit 2), never a wrong size, a crash or
a walk over two billion layers. The s a config gives is at most ``BYTES_PER_TOKEN_MAX``, the cap of
``--bytes-per-token`` itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from kvctl.core import files
from kvctl.core.errors import InvalidInput
from kvctl.core.thresholds import (
    BYTES_PER_TOKEN_MAX, CHUNK_TOKENS, MODEL_CONFIG_MAX_BYTES, MODEL_MAX_HEAD_DIM, MODEL_MAX_HEADS, MODEL_MAX_HIDDEN_SIZE,
    MODEL_MAX_LAYERS, MODEL_MAX_NAME_CHARS, MODEL_MAX_TOPK,
)

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
# model types vLLM refuses to run in float16 (numerical instability); --dtype auto gives them bfloat16
FP16_UNSUPPORTED_MODEL_TYPES = ("gemma2", "gemma3", "gemma3_text", "glm4")


@dataclass(frozen=True)
class KvSize:
    model: str
    attention: str  # "mla", "mla+indexer" (a sparse-attention indexer beside MLA), "gqa" or "mha"
    layers: int
    elements_per_token_per_layer: int
    dtype: str
    tp: int
    bytes_per_token: float  # whole model: one token's KV over all ranks (s of B* = s·R, compared with the tier's sum)
    bytes_per_token_per_rank: float  # one rank's share, bytes_per_token / tp (compared with one instance's bandwidth)
    chunk_tokens: int
    chunk_bytes: float  # one stored chunk value: a rank's heads (GQA/MHA) or the whole latent (MLA)
    dtype_source: str = "--dtype"  # how the dtype was chosen: --dtype, or vLLM's --dtype auto rule and why
    kv_head_copies: int = 1  # ranks holding each KV head (tp / KV heads when tp exceeds them); s counts every copy
    latent_row_bytes: int | None = None  # MLA: one token's latent row in one layer (fp8_ds_mla: 656)
    indexer_layers: int = 0  # MLA with a sparse-attention indexer: the layers whose indexer keeps keys
    indexer_row_bytes: int = 0  # one token's indexer keys in one layer (fp8 values + fp32 scales)
    indexer_bytes_per_token: float = 0.0  # the indexer's share of bytes_per_token (every indexer layer)


# --- reading a config.json: the one reader, every field typed and bounded ----------------------------


def load_config(path: Path | str) -> dict[str, Any]:
    """Read a config.json: the one reader of every ``--model-config`` (cost, bench, diagnose, simulate, plan, drill).

    :func:`kvctl.core.files.read_json`: a regular file of at most MODEL_CONFIG_MAX_BYTES, UTF-8, nested at most
    JSON_MAX_DEPTH levels; a JSON object. InvalidInput, one line naming the file, otherwise. The fields are checked
    where they are used (:func:`kv_size`), each against its bound in ``kvctl/core/thresholds.py``.
    """
    path = Path(path)
    data = files.read_json(path, "model config", MODEL_CONFIG_MAX_BYTES, kind="a JSON model config")
    if not isinstance(data, dict):
        raise InvalidInput(f"model config {path} must be a JSON object, not a JSON {type(data).__name__}")
    # multimodal wrappers keep the language model under text_config
    if "num_hidden_layers" not in data and isinstance(data.get("text_config"), dict):
        merged = dict(data["text_config"])
        merged.setdefault("_name_or_path", data.get("_name_or_path"))
        data = merged
    data["_kvctl_source"] = str(path)  # the file's own name for itself is never taken
    return data


_REQUIRED = object()


def _shown(v: Any) -> str:
    """A value for an error message, one line and short (a 400-digit integer is not quoted whole)."""
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10**30:
        return f"a {len(str(abs(v)))}-digit integer"
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _int(cfg: Mapping[str, Any], key: str, source: str, hi: int, lo: int = 1, default: Any = _REQUIRED) -> Any:
    """``cfg[key]``, an integer in [lo, hi]: an int (not a bool), or a float that is a whole number; absent or null
    gives ``default`` (refused when there is none). InvalidInput naming the key and the file otherwise."""
    v = cfg.get(key)
    if v is None:
        if default is _REQUIRED:
            raise InvalidInput(f"model config {source}: missing field '{key}' (an integer in [{lo:,}, {hi:,}])")
        return default
    n = int(v) if isinstance(v, float) and math.isfinite(v) and v.is_integer() else v
    if not isinstance(n, int) or isinstance(n, bool) or not lo <= n <= hi:
        raise InvalidInput(f"model config {source}: '{key}' must be an integer in [{lo:,}, {hi:,}], got {_shown(v)}")
    return n


def _text(cfg: Mapping[str, Any], key: str, source: str) -> str | None:
    """``cfg[key]``: absent, null or a printable string of at most MODEL_MAX_NAME_CHARS (it is printed)."""
    v = cfg.get(key)
    if v is None:
        return None
    if not isinstance(v, str) or len(v) > MODEL_MAX_NAME_CHARS or not v.isprintable():
        raise InvalidInput(f"model config {source}: '{key}' must be a printable string of at most {MODEL_MAX_NAME_CHARS} "
                           f"characters, got {_shown(v)}")
    return v


def _present(cfg: Mapping[str, Any], key: str) -> bool:
    return cfg.get(key) is not None


def kv_size(
    cfg: Mapping[str, Any], dtype: str | None = None, chunk_tokens: int = CHUNK_TOKENS, tp: int = 1
) -> KvSize:
    """Bytes per token and per chunk for a parsed config (see module docstring).

    Every field used is an integer within its bound (``MODEL_MAX_*``) before any arithmetic, and the s it gives is
    at most BYTES_PER_TOKEN_MAX (``--bytes-per-token``'s own cap); InvalidInput naming the key and the file otherwise.
    """
    source = str(cfg.get("_kvctl_source", "<config>"))
    if chunk_tokens <= 0:
        raise InvalidInput(f"--chunk-tokens must be positive, got {chunk_tokens}")
    if tp <= 0:
        raise InvalidInput(f"--tp must be positive, got {tp}")
    dtype_source = "--dtype"
    if dtype is None:
        dtype, dtype_source = auto_dtype(cfg)
    if dtype not in DTYPE_BYTES:
        raise InvalidInput(f"unknown dtype '{dtype}' (choose from {', '.join(DTYPE_BYTES)})")
    layers = _int(cfg, "num_hidden_layers", source, MODEL_MAX_LAYERS)
    name = _text(cfg, "_name_or_path", source) or Path(source).stem
    copies = 1
    latent_rank = _int(cfg, "kv_lora_rank", source, MODEL_MAX_HEAD_DIM, lo=0, default=0)  # absent, null or 0: no latent
    if latent_rank and (_present(cfg, "index_head_dim") or _present(cfg, "index_topk")):
        res = _sparse_mla_size(cfg, dtype, dtype_source, chunk_tokens, tp, layers, name, source)
    elif latent_rank:
        attention = "mla"
        elems = latent_rank + _int(cfg, "qk_rope_head_dim", source, MODEL_MAX_HEAD_DIM)
        if _present(cfg, "num_attention_heads"):
            _check_tp(_int(cfg, "num_attention_heads", source, MODEL_MAX_HEADS), None, tp, name, source)
        bpt = float(layers * elems * DTYPE_BYTES[dtype])  # one latent, shared: tp does not multiply it
        res = KvSize(name, attention, layers, elems, dtype, tp, bpt, bpt / tp, chunk_tokens, bpt * chunk_tokens,
                     dtype_source, copies, elems * DTYPE_BYTES[dtype])
    else:
        heads = _int(cfg, "num_attention_heads", source, MODEL_MAX_HEADS)
        kv_heads = _int(cfg, "num_key_value_heads", source, MODEL_MAX_HEADS, default=heads)
        _check_tp(heads, kv_heads, tp, name, source)
        head_dim = _int(cfg, "head_dim", source, MODEL_MAX_HEAD_DIM, default=None)
        if head_dim is None:
            hidden = _int(cfg, "hidden_size", source, MODEL_MAX_HIDDEN_SIZE)
            head_dim = hidden // heads
            if head_dim < 1:
                raise InvalidInput(f"model config {source}: 'hidden_size' {hidden:,} is smaller than the {heads:,} attention "
                                   f"heads (no head_dim given: it would be hidden_size / num_attention_heads = 0)")
        attention = "mha" if kv_heads == heads else "gqa"
        kv_heads_per_rank = max(1, -(-kv_heads // tp))
        copies = max(1, tp // kv_heads)
        elems = 2 * kv_heads_per_rank * tp * head_dim  # all ranks' heads, each replicated copy counted
        per_rank = float(layers * 2 * kv_heads_per_rank * head_dim * DTYPE_BYTES[dtype])
        res = KvSize(name, attention, layers, elems, dtype, tp, per_rank * tp, per_rank, chunk_tokens,
                     per_rank * chunk_tokens, dtype_source, copies)
    if res.bytes_per_token > BYTES_PER_TOKEN_MAX:
        raise InvalidInput(f"model config {source}: its fields give {res.bytes_per_token:,.0f} KV bytes per token at --tp {tp}, "
                           f"past the {BYTES_PER_TOKEN_MAX:,.0f}-byte cap on bytes per token (no model comes near it)")
    return res


INDEXER_QUANT_BLOCK = 128  # the indexer's keys: one fp32 scale per 128 fp8 values (vLLM deepseek_v32/attention.py:90-97)
DS_MLA_ROW_BYTES = 656  # fp8_ds_mla: 512 fp8 NoPE + 4 fp32 scales + 64 bf16 RoPE (vLLM flashmla_sparse.py:80-88)


def _topk_pattern(cfg: Mapping[str, Any], source: str) -> str | list[str] | None:
    """``index_topk_pattern``: absent or null, or a string or a list of strings (one entry a layer, "S": the layer
    skips its top-k) of at most MODEL_MAX_LAYERS entries."""
    pattern = cfg.get("index_topk_pattern")
    if pattern is None:
        return None
    if (not isinstance(pattern, (str, list)) or len(pattern) > MODEL_MAX_LAYERS
            or (isinstance(pattern, list) and not all(isinstance(x, str) and len(x) <= MODEL_MAX_NAME_CHARS for x in pattern))):
        raise InvalidInput(f"model config {source}: 'index_topk_pattern' must be a string or a list of strings, one entry "
                           f"a layer (at most {MODEL_MAX_LAYERS:,}), got {_shown(pattern)}")
    return pattern


def indexer_layers(cfg: Mapping[str, Any], layers: int, source: str = "<config>") -> int:
    """How many of ``layers`` keep an indexer K cache: vLLM's rule (models/deepseek_v32/attention.py:165-190).

    A layer skips its top-k (and has no indexer) when ``index_topk_pattern[i]`` is "S", else, without a
    pattern, when ``max(i - index_skip_topk_offset + 1, 0) % index_topk_freq != 0`` (freq 1: none skips).
    Every field is checked first (``index_topk_freq`` and ``index_skip_topk_offset`` integers of at most
    MODEL_MAX_LAYERS, the pattern :func:`_topk_pattern`), and at most MODEL_MAX_LAYERS layers are walked.
    """
    if not isinstance(layers, int) or isinstance(layers, bool) or not 0 <= layers <= MODEL_MAX_LAYERS:
        raise InvalidInput(f"model config {source}: 'num_hidden_layers' must be an integer in [1, {MODEL_MAX_LAYERS:,}], "
                           f"got {_shown(layers)}")
    pattern = _topk_pattern(cfg, source)
    freq = _int(cfg, "index_topk_freq", source, MODEL_MAX_LAYERS, default=1)
    offset = _int(cfg, "index_skip_topk_offset", source, MODEL_MAX_LAYERS, lo=0, default=2)
    n = 0
    for i in range(layers):
        if pattern is None:
            skip = max(i - offset + 1, 0) % freq != 0
        else:
            skip = i < len(pattern) and pattern[i] == "S"
        n += not skip
    return n


def _sparse_mla_size(cfg: Mapping[str, Any], dtype: str, dtype_source: str, chunk_tokens: int, tp: int, layers: int,
                     name: str, source: str) -> KvSize:
    """KvSize of MLA with a sparse-attention indexer (see the module docstring)."""
    rank = _int(cfg, "kv_lora_rank", source, MODEL_MAX_HEAD_DIM)
    rope = _int(cfg, "qk_rope_head_dim", source, MODEL_MAX_HEAD_DIM)
    latent = rank + rope
    if _present(cfg, "num_attention_heads"):
        _check_tp(_int(cfg, "num_attention_heads", source, MODEL_MAX_HEADS), None, tp, name, source)
    _int(cfg, "index_topk", source, MODEL_MAX_TOPK, default=None)  # a flag here, but a number in vLLM: typed all the same
    if dtype == "fp32":
        raise InvalidInput(f"{name}: vLLM's sparse MLA backends keep a bf16/fp16 or fp8 (fp8_ds_mla) latent, not fp32")
    if dtype == "fp8":
        if (rank, rope) != (512, 64):
            raise InvalidInput(f"{name}: fp8_ds_mla is the row of a 512 + 64 latent, not {rank} + {rope}")
        row = DS_MLA_ROW_BYTES
        dtype_source += "; fp8 is FLASHMLA_SPARSE's fp8_ds_mla row (656 B: 512 fp8, 4 fp32 scales, 64 bf16)"
    else:
        row = latent * DTYPE_BYTES[dtype]
    head = _int(cfg, "index_head_dim", source, MODEL_MAX_HEAD_DIM)
    if head % INDEXER_QUANT_BLOCK:
        raise InvalidInput(f"model config {source}: index_head_dim {head} is not a multiple of {INDEXER_QUANT_BLOCK}")
    idx_row = head + head // INDEXER_QUANT_BLOCK * 4
    n_idx = indexer_layers(cfg, layers, source)
    idx_bpt = float(n_idx * idx_row)
    bpt = float(layers * row) + idx_bpt  # one latent and one indexer key set, shared: tp does not multiply them
    return KvSize(name, "mla+indexer", layers, latent, dtype, tp, bpt, bpt / tp, chunk_tokens, bpt * chunk_tokens,
                  dtype_source, 1, row, n_idx, idx_row, idx_bpt)


def auto_dtype(cfg: Mapping[str, Any]) -> tuple[str, str]:
    """(kvctl dtype, why) for vLLM's ``--dtype auto`` on a GPU that has bfloat16 (Ampere or newer)."""
    source = str(cfg.get("_kvctl_source", "<config>"))
    torch_dtype, plain_dtype = _text(cfg, "torch_dtype", source), _text(cfg, "dtype", source)
    raw = torch_dtype or plain_dtype
    name = raw.lower().removeprefix("torch.") if raw else None
    model_type = _text(cfg, "model_type", source)
    if name is None:
        return "bf16", "vLLM --dtype auto: the config names no dtype, read as float32 and served in bfloat16"
    if name in ("float32", "float"):
        return "bf16", f"vLLM --dtype auto: a {raw} checkpoint is served at 16 bit (bfloat16)"
    if name == "bfloat16":
        return "bf16", "vLLM --dtype auto: the config's bfloat16"
    if name in ("float16", "half"):
        if model_type in FP16_UNSUPPORTED_MODEL_TYPES:
            return "bf16", f"vLLM --dtype auto: {model_type} does not run in float16, so bfloat16"
        return "fp16", "vLLM --dtype auto: the config's float16"
    return "bf16", f"vLLM --dtype auto: {raw} is not a dtype vLLM computes in, so bfloat16 (give --dtype fp8 for an engine run with --kv-cache-dtype fp8)"


def _check_tp(heads: int, kv_heads: int | None, tp: int, name: str, source: str = "<config>") -> None:
    """InvalidInput unless vLLM can shard these heads over ``tp`` ranks (see the module docstring)."""
    if kv_heads is not None and kv_heads > heads:
        raise InvalidInput(f"model config {source} ({name}): {kv_heads} KV heads but {heads} attention heads "
                           f"('num_key_value_heads' over 'num_attention_heads': a KV head serves one or more attention heads)")
    if kv_heads is not None and heads % kv_heads:
        raise InvalidInput(f"model config {source} ({name}): the {heads} attention heads are not a multiple of the {kv_heads} "
                           f"KV heads ('num_attention_heads' and 'num_key_value_heads')")
    if heads % tp:
        raise InvalidInput(f"--tp {tp} does not divide the {heads} attention heads of {name} (vLLM needs an even split): use a divisor of {heads}")
    if kv_heads is not None and kv_heads % tp and tp % kv_heads:
        raise InvalidInput(
            f"--tp {tp} and the {kv_heads} KV heads of {name} do not fit: vLLM splits KV heads evenly over the ranks "
            f"(--tp dividing {kv_heads}) or replicates them (--tp a multiple of {kv_heads})"
        )


def kv_size_from_file(path: Path | str, dtype: str | None = None, chunk_tokens: int = CHUNK_TOKENS, tp: int = 1) -> KvSize:
    return kv_size(load_config(path), dtype=dtype, chunk_tokens=chunk_tokens, tp=tp)
