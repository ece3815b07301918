"""The extra key material of a vLLM request: what vLLM's prefix cache keys on besides the tokens.

vLLM's block hash covers, besides the token ids (vllm/v1/core/kv_cache_utils.py,
``generate_block_hash_extra_keys``): the LoRA adapter (name and path), the
request's ``cache_salt``, the multimodal inputs whose placeholder tokens fall in
the block (identifier and offset), and a digest of the block's prompt
embeddings. Two requests that differ in any of these must not share KV, so
kvctl's chunk keys cover the same things.

kvctl does not reuse vLLM's block hashes: they start from a random NONE_HASH in
every process unless PYTHONHASHSEED is fixed, and kvctl's keys must be the same
after a restart and on every engine. Instead :func:`request_key_extra` turns the
request's fields into a :class:`~kvctl.connector.ownership.KeyExtra` (plain
strings and integers, hashed with BLAKE2b by ``chunk_keys``). The scheduler
builds it once per request, uses it for its lookup, and sends it to the
workers in each ``LoadSpec``/``SaveSpec``, so lookup, load and store agree.

The LoRA adapter is keyed by name and path, as vLLM keys it, not by its integer
id: ``vllm serve`` hands out ids from a per-process counter as adapters are
loaded, so the same adapter may have another id after a restart or on another
engine, and the id adds nothing the name and path do not already pin down.
"""

from __future__ import annotations

import hashlib
from typing import Any

from kvctl.connector.ownership import KeyExtra, key_extra

__all__ = ["request_key_extra"]


def _embeds_digest(embeds: Any) -> str:
    """sha256 of a slice of prompt embeddings: dtype, shape and raw bytes."""
    import torch  # noqa: PLC0415 - only requests with prompt embeddings need it

    t = embeds.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{t.dtype}:{tuple(t.shape)}:".encode())
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def request_key_extra(request: Any, chunk_tokens: int) -> KeyExtra | None:
    """The :class:`KeyExtra` of a vLLM ``Request`` (or ``NewRequestData``), None when it has only tokens.

    Reads ``cache_salt``, ``lora_request``, ``mm_features`` (identifier and
    placeholder range), ``prompt_embeds`` and ``prompt_is_token_ids``; a field
    the object lacks counts as unset.
    """
    lora = getattr(request, "lora_request", None)
    lora_id = (str(lora.lora_name), str(getattr(lora, "lora_path", "") or "")) if lora is not None else None
    mm = []
    for f in getattr(request, "mm_features", None) or ():
        pos = f.mm_position
        ident = getattr(f, "identifier", None) or getattr(f, "mm_hash", None)
        if ident is None:
            raise ValueError("a multimodal input without an identifier: its KV cannot be keyed")
        mm.append((str(ident), int(pos.offset), int(pos.length)))
    material: dict[int, list[Any]] = {}
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is not None:
        kinds = getattr(request, "prompt_is_token_ids", None)
        n = int(embeds.shape[0])
        for c, start in enumerate(range(0, n, chunk_tokens)):
            items: list[Any] = [["prompt_embeds", _embeds_digest(embeds[start : start + chunk_tokens])]]
            if kinds is not None:
                items.append(["token_kinds", "".join("t" if k else "e" for k in kinds[start : start + chunk_tokens])])
            material[c] = items
    return key_extra(chunk_tokens, cache_salt=getattr(request, "cache_salt", None), lora=lora_id, mm=mm,
                     chunk_material=material)
