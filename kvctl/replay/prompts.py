"""Build the prompt the engine sees for each trace request, with exact token counts.

Prompts that a trace describes by length (Mooncake ``hash_ids`` blocks, ``prompt_tokens: n``) are
sent as token ids, so the engine counts exactly the trace's tokens. The ids come from a pool of real
token ids of the engine's tokenizer: the ids of :data:`SEED_TEXT`, read through the engine's
``/tokenize`` endpoint or a local tokenizer (``--tokenizer PATH``, transformers imported lazily).

A block with hash id h is the same ``block_tokens`` ids in every request (drawn from a generator
seeded by ``(seed, h)``), so requests that share a hash id share those tokens and hit the prefix
cache as in the original trace. Tokens a request needs beyond its blocks, and prompts given only by
a count, are unique to that request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvctl.core.errors import InvalidInput
from kvctl.records.trace import TraceRequest

#: Ordinary text whose token ids make the pool (every tokenizer splits it into many distinct ids).
SEED_TEXT = (
    "the cache tier stores key value blocks for prompts that repeat across requests; valkey serves get "
    "and set over resp while lmcache moves chunks between host memory and the remote store. Prefill engines "
    "recompute tokens when a lookup misses and load them when it hits: bandwidth, latency, queue, rank, owner, "
    "chunk, prefix, token, model, layer, head, batch, stream, engine, server, client, metric. "
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 42 256 512 1024 and words like apple river mountain quiet yellow "
    "window garden silver thunder planet coffee morning history science music paper table orange."
)
_UNIQUE_TAG = 1 << 40  # keeps per-request generators apart from block generators


@dataclass(frozen=True)
class TokenPool:
    ids: tuple[int, ...]
    source: str  # "engine /tokenize" or "tokenizer PATH"


def pool_from_ids(ids: Sequence[int], source: str) -> TokenPool:
    """Distinct ids, sorted; InvalidInput when the tokenizer gave too few to build prompts from."""
    uniq = tuple(sorted(set(int(i) for i in ids)))
    if len(uniq) < 8:
        raise InvalidInput(f"the tokenizer ({source}) gave only {len(uniq)} distinct token ids for the seed text")
    return TokenPool(uniq, source)


def pool_from_tokenizer(path: str) -> TokenPool:
    """Token pool from a local Hugging Face tokenizer directory (needs transformers: the engine extra)."""
    try:
        from transformers import AutoTokenizer  # noqa: PLC0415 - heavy and optional
    except ImportError as e:
        raise InvalidInput("--tokenizer needs the transformers package (from kvctl's checkout: pip install '.[engine]')") from e
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise InvalidInput(f"cannot load tokenizer {path}: {e}") from e
    return pool_from_ids(tok(SEED_TEXT, add_special_tokens=False)["input_ids"], f"tokenizer {path}")


def _hash_seed(seed: int, h: int) -> list[int]:
    return [seed & 0xFFFFFFFF, h & 0xFFFFFFFFFFFFFFFF, 1 if h < 0 else 0]


class PromptBuilder:
    """Prompts for trace requests: text as is, token ids for everything described by length."""

    def __init__(self, pool: TokenPool | None, block_tokens: int, seed: int = 0) -> None:
        if block_tokens < 1:
            raise InvalidInput(f"--block-tokens must be positive, got {block_tokens}")
        self.pool = pool
        self._ids = np.asarray(pool.ids, dtype=np.int64) if pool else None
        self.block_tokens = block_tokens
        self.seed = seed

    def _draw(self, key: list[int], n: int) -> np.ndarray:
        assert self._ids is not None
        rng = np.random.default_rng(key)
        return self._ids[rng.integers(0, len(self._ids), size=n)]

    def block(self, hash_id: int) -> list[int]:
        """The tokens of the block with this hash id (the same in every request)."""
        return self._draw(_hash_seed(self.seed, hash_id), self.block_tokens).tolist()

    def needs_pool(self, req: TraceRequest) -> bool:
        return req.prompt is None and req.prompt_token_ids is None

    def build(self, req: TraceRequest) -> str | list[int]:
        if req.prompt is not None:
            return req.prompt
        if req.prompt_token_ids is not None:
            return list(req.prompt_token_ids)
        if self._ids is None:
            raise InvalidInput(
                "prompts given by length need the engine's tokenizer: the engine's /tokenize did not answer; "
                "pass --tokenizer PATH"
            )
        n = req.input_length or 0
        tokens: list[int] = []
        for h in req.hash_ids or ():
            if len(tokens) >= n:
                break
            tokens.extend(self.block(h))
        if len(tokens) < n:
            tokens.extend(self._draw([self.seed & 0xFFFFFFFF, _UNIQUE_TAG + req.index, 2], n - len(tokens)).tolist())
        return tokens[:n]
