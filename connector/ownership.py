"""Chunk ownership for the sharded MLA KV store (paper §5.1-§5.3). Pure functions.

A prompt of ``n`` tokens is cut into ``N = ceil(n / chunk_tokens)`` chunks;
chunk ``c`` starts at token ``c * chunk_tokens`` and is owned by rank
``owner(c, W) = c mod W``. Each rank stores, looks up and loads only its own
chunks.

* Synchronous lookup: rank ``r`` answers ``a_r`` = the first chunk it owns
  that is missing, or ``N``; the scheduler's ``min_r a_r`` equals
  :func:`longest_prefix` (the proposition of §5.1).
* Asynchronous lookup: rank ``r`` passes :func:`cumulative_lengths` (start
  token of its k-th owned chunk, then the prompt length) and the storage
  layer's :func:`contiguous_hit_tokens` is ``a_r`` in tokens. A rank with no
  hits reports the first entry of the vector, not 0.
* Keys: :func:`chunk_keys` is the one key builder for lookup, get and put,
  sync and async; keys always carry the worker-0 name, so a key never
  depends on the rank that wrote it (bug 3 of §5.4 cannot happen).
* Parts: a chunk of a model whose KV cache holds two kinds of layers (MLA
  with a sparse-attention indexer) is stored as one value per part, under
  :func:`part_key` of the chunk's key (:class:`ChunkParts`); a chunk is
  present only when every part is.
* What a key covers: the model name, the KV format, every token up to the end
  of its chunk, and a request's :class:`KeyExtra` -- whatever else vLLM's own
  block hash covers (LoRA adapter, ``cache_salt``, multimodal inputs, prompt
  embeddings). kvctl hashes these itself rather than reusing vLLM's block
  hashes, which start from a per-process random seed unless PYTHONHASHSEED is
  fixed: kvctl's keys must survive restarts and be shared between engines.
* A key is an injective function of what it covers: text fields (model
  name, format, part name) are percent-encoded by :func:`key_field`, the
  extras are canonical JSON under their own personalised hashes, and names
  that were already safe keep their keys.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from array import array
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from .urls import expand_url  # re-exported: part of this module's public API

__all__ = [
    "KEY_WORKER_ID",
    "ChunkParts",
    "KeyExtra",
    "chunk_keys",
    "chunk_start_token",
    "contiguous_hit_tokens",
    "cumulative_lengths",
    "expand_url",
    "key_extra",
    "key_field",
    "longest_prefix",
    "lookup_answer",
    "num_chunks",
    "owned_chunks",
    "owner",
    "part_key",
    "stored_value",
]

KEY_WORKER_ID = 0  # every rank writes under worker 0's name (§5.1 "Remote keys")
_KEY_HASH_BYTES = 16  # blake2b digest size: 128 bits, 32 hex chars


def _check_world(rank: int, world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")


def owner(chunk: int, world_size: int) -> int:
    """The rank that owns chunk ``chunk``: ``chunk mod world_size``."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if chunk < 0:
        raise ValueError(f"chunk index must be >= 0, got {chunk}")
    return chunk % world_size


def num_chunks(num_tokens: int, chunk_tokens: int) -> int:
    """Chunks in a prompt of ``num_tokens`` tokens (the last one may be partial)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return -(-num_tokens // chunk_tokens)


def owned_chunks(n_chunks: int, rank: int, world_size: int) -> range:
    """Indexes of the chunks among ``0..n_chunks-1`` that ``rank`` owns, ascending."""
    _check_world(rank, world_size)
    return range(rank, max(n_chunks, 0), world_size)


def chunk_start_token(chunk: int, chunk_tokens: int, num_tokens: int) -> int:
    """First token of chunk ``chunk``, clamped to ``num_tokens`` (chunk ``N`` = end of prompt)."""
    return min(chunk * chunk_tokens, num_tokens)


def lookup_answer(present: Sequence[bool], rank: int, world_size: int) -> int:
    """``a_r`` in chunks: the first chunk owned by ``rank`` that is missing, or ``N``.

    ``present[c]`` says whether chunk ``c`` is stored (on its owner). Only the
    entries this rank owns are read, as a real rank only sees its own.
    """
    _check_world(rank, world_size)
    n = len(present)
    for c in range(rank, n, world_size):
        if not present[c]:
            return c
    return n


def longest_prefix(present: Sequence[bool]) -> int:
    """Length in chunks of the longest prefix whose chunks are all present."""
    for c, hit in enumerate(present):
        if not hit:
            return c
    return len(present)


def cumulative_lengths(num_tokens: int, rank: int, world_size: int, chunk_tokens: int) -> list[int]:
    """The async-lookup vector of ``rank``: start token of each owned chunk, then ``num_tokens``.

    Entry ``k`` is the start token of the rank's k-th owned chunk; the final
    entry (prompt length) is what a rank reports when all its chunks hit.
    Outside shard mode (``world_size == 1``) this is the usual
    ``[0, chunk_tokens, 2*chunk_tokens, ..., num_tokens]``.
    """
    _check_world(rank, world_size)
    n = num_chunks(num_tokens, chunk_tokens)
    starts = [c * chunk_tokens for c in owned_chunks(n, rank, world_size)]
    starts.append(num_tokens)
    return starts


def contiguous_hit_tokens(cum_lengths: Sequence[int], hits: Sequence[bool]) -> int:
    """Tokens covered by the leading run of hits: ``cum_lengths[h]``, h = leading hits.

    ``hits[k]`` is whether the rank's k-th owned chunk was found (prefetch may
    report fewer entries than chunks; unreported ones count as misses). With
    no hits this is ``cum_lengths[0]`` -- the first owned chunk's start -- not 0.
    """
    if not cum_lengths:
        raise ValueError("cumulative-length vector is empty")
    if len(hits) > len(cum_lengths) - 1:
        raise ValueError(f"{len(hits)} hit flags for a vector of {len(cum_lengths) - 1} chunks")
    h = 0
    for hit in hits:
        if not hit:
            break
        h += 1
    return cum_lengths[h]


@dataclass(frozen=True)
class KeyExtra:
    """What a request's chunk keys cover beyond its tokens (vLLM's block-hash "extra keys").

    ``seed`` enters the hash chain before chunk 0, so it reaches every chunk
    key of the prompt (LoRA adapter, ``cache_salt``); ``chunks`` holds
    ``(chunk index, material)`` pairs that enter the chain at that chunk and,
    the chain being a prefix chain, every later one too (multimodal inputs
    overlapping the chunk, prompt embeddings). Built by :func:`key_extra`;
    the scheduler builds it once per request and it travels to the workers in
    the connector's metadata, so lookup, load and store use the same keys.
    """

    seed: bytes = b""
    chunks: tuple[tuple[int, bytes], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.seed or self.chunks)


def _canon(value: Any) -> bytes:
    """A deterministic encoding of str/int/None/lists (no Python hash(), stable across processes and hosts)."""
    return json.dumps(value, ensure_ascii=True, separators=(",", ":"), sort_keys=True).encode()


def key_extra(chunk_tokens: int, *, cache_salt: str | None = None, lora: Sequence[str] | None = None,
              mm: Iterable[tuple[str, int, int]] = (),
              chunk_material: Mapping[int, Sequence[Any]] | None = None) -> KeyExtra | None:
    """The :class:`KeyExtra` of one request, or None when it has nothing beyond its tokens.

    * ``cache_salt`` and ``lora`` (the adapter's name and path, as vLLM keys
      it) go into the seed: they change every chunk key. vLLM salts only its
      first block and relies on its chained hash; kvctl's keys are chained
      too, so the seed reaches every chunk the same way.
    * ``mm``: ``(identifier, offset, length)`` of each multimodal input, its
      placeholder tokens at ``offset .. offset+length-1`` of the prompt. The
      identifier and the offset enter the chain at every chunk the
      placeholder overlaps (the same item at another position is another key).
    * ``chunk_material``: more material per chunk index (prompt-embedding
      digests, token kinds), JSON-encodable values.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    seed_parts = {}
    if cache_salt:
        seed_parts["cache_salt"] = str(cache_salt)
    if lora:
        seed_parts["lora"] = [str(x) for x in lora]
    per_chunk: dict[int, list[Any]] = {}
    for identifier, offset, length in mm:
        offset, length = int(offset), int(length)
        if length <= 0:
            continue
        for c in range(offset // chunk_tokens, (offset + length - 1) // chunk_tokens + 1):
            per_chunk.setdefault(c, []).append(["mm", str(identifier), offset, length])
    for c, items in (chunk_material or {}).items():
        per_chunk.setdefault(int(c), []).extend(items)
    if not seed_parts and not per_chunk:
        return None
    return KeyExtra(_canon(seed_parts) if seed_parts else b"",
                    tuple((c, _canon(per_chunk[c])) for c in sorted(per_chunk)))


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int64 bytes (stable across hosts)."""
    arr = array("q", token_ids)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


#: characters a key field keeps as they are: printable ASCII but for the separator '@' and the escape '%'
_KEY_SAFE = frozenset(chr(c) for c in range(0x21, 0x7F)) - {"@", "%"}


def key_field(text: str, unsafe: str = "") -> str:
    """``text`` as one field of a key, injectively: each character outside :data:`_KEY_SAFE`, or in ``unsafe``,
    becomes ``%XX`` for each byte of its UTF-8 (surrogates included), so ``%`` itself becomes ``%25``.

    A text of safe characters is its own field (keys stored before the escaping keep hitting);
    ``urllib.parse.unquote(field, errors="surrogatepass")`` gives the text back. The fields never hold '@',
    a space, a control character or non-ASCII: a key is printable ASCII, split on '@' into its fields.
    """
    if not isinstance(text, str):
        raise TypeError(f"a key field is text, got {type(text).__name__}")
    if all(ch in _KEY_SAFE and ch not in unsafe for ch in text):
        return text
    return "".join(ch if ch in _KEY_SAFE and ch not in unsafe
                   else "".join(f"%{b:02X}" for b in ch.encode("utf-8", "surrogatepass")) for ch in text)


def chunk_keys(token_ids: Sequence[int], chunk_tokens: int, model_name: str, fmt: str,
               extra: KeyExtra | None = None) -> list[str]:
    """Remote keys of every chunk of a prompt, in chunk order.

    Key ``c`` hashes the whole token prefix up to the end of chunk ``c`` (a
    chained hash: chunk c's digest covers chunk c-1's digest and chunk c's
    tokens), together with the model name and KV format, so equal keys mean
    equal prefixes. The key carries worker 0's name whatever rank builds it:
    ``{model}@{format}@w0@{hex digest}``. A trailing partial chunk gets a key
    too. Use this one function for lookup, get and put, sync and async.

    The model name and the format go in through :func:`key_field` (the format
    with '/' escaped too: :func:`part_key` puts a part's name after one), in
    the key's text and in the hashed header alike: any name is accepted and
    two names never share a key (``llama@prod`` is ``llama%40prod``,
    ``llama_prod`` stays itself), and a name of printable ASCII without '@',
    '%' (or, in a format, '/') keeps the key it always had.

    ``extra`` (see :class:`KeyExtra`) folds the request's extra keys into the
    chain: its seed right after the header, chunk c's material just before
    chunk c's tokens, each through a differently personalised BLAKE2b so it
    cannot be confused with token data. Without it (None or empty) the keys
    are exactly the token-only keys of earlier releases, so stored chunks
    still hit.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    model_field, fmt_field = key_field(model_name), key_field(fmt, unsafe="/")
    data = _token_bytes(token_ids)
    step = chunk_tokens * 8
    header = f"kvctl-chunk\0{model_field}\0{fmt_field}\0".encode()  # fields hold no NUL: one header per pair
    prev = hashlib.blake2b(header, digest_size=_KEY_HASH_BYTES).digest()
    material: dict[int, bytes] = {}
    if extra:
        if extra.seed:
            prev = hashlib.blake2b(prev + extra.seed, digest_size=_KEY_HASH_BYTES, person=b"kvctl-key-seed").digest()
        material = dict(extra.chunks)
    keys: list[str] = []
    prefix = f"{model_field}@{fmt_field}@w{KEY_WORKER_ID}@"
    for off in range(0, len(data), step):
        more = material.get(off // step)
        if more is not None:
            prev = hashlib.blake2b(prev + more, digest_size=_KEY_HASH_BYTES, person=b"kvctl-key-chunk").digest()
        h = hashlib.blake2b(prev, digest_size=_KEY_HASH_BYTES)
        h.update(data[off : off + step])
        prev = h.digest()
        keys.append(prefix + prev.hex())
    return keys


def part_key(key: str, part: str) -> str:
    """The key of part ``part`` of the chunk keyed ``key``: ``{model}@{fmt}/{part}@w0@{digest}``.

    The part's name (through :func:`key_field`, '/' escaped) goes into the
    format field after the one '/' a format field may hold, so a part is never
    read as another part, nor as a chunk of one part, nor as a chunk of another
    format; the digest (which covers the chunk's format, every part named in
    it) is the chunk's. A part key is not a chunk key: it has no parts.
    """
    if not isinstance(part, str) or not part:
        raise ValueError(f"a part name is a non-empty string, got {part!r}")
    fields = key.split("@")
    if len(fields) != 4 or "/" in fields[1]:
        raise ValueError(f"not a chunk key: {key!r}")
    model, fmt, worker, digest = fields
    return f"{model}@{fmt}/{key_field(part, unsafe='/')}@{worker}@{digest}"


@dataclass(frozen=True)
class ChunkParts:
    """A chunk stored as ``len(names)`` values: part ``i`` is bytes ``offsets[i] .. offsets[i] + sizes[i]``.

    The parts tile the chunk's bytes (one buffer, one pinned slot, one L1
    entry); by default they lie one after another in part order, and
    ``offsets`` places them otherwise (layer groups list their parts group by
    group, each a range of the chunk's layer-major bytes:
    :mod:`kvctl.connector.layer_groups`). The tier holds each part under its
    own :func:`part_key`. A lookup, a GET and the agreed-prefix load count a
    chunk as present only when every part is: a chunk whose part was evicted
    or deleted is a miss.
    """

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    offsets: tuple[int, ...] | None = None  # None: one after another, in part order

    def __post_init__(self) -> None:
        if len(self.names) != len(self.sizes) or len(self.names) < 2:
            raise ValueError(f"parts {self.names} of sizes {self.sizes}: two or more, one size each")
        if len(set(self.names)) != len(self.names) or any(s <= 0 for s in self.sizes):
            raise ValueError(f"parts {self.names} of sizes {self.sizes}: distinct names, positive sizes")
        for n in self.names:
            part_key("m@f@w0@0", n)  # the same rule for a name
        if self.offsets is None:
            object.__setattr__(self, "offsets", tuple(sum(self.sizes[:i]) for i in range(len(self.sizes))))
        offsets = tuple(int(o) for o in self.offsets)
        object.__setattr__(self, "offsets", offsets)
        end = 0
        for off, size in sorted(zip(offsets, self.sizes)):
            if off != end:
                raise ValueError(f"parts of sizes {self.sizes} at offsets {offsets} do not tile the chunk's bytes")
            end = off + size

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)

    def keys(self, key: str) -> list[str]:
        """The parts' keys of the chunk keyed ``key``, in part order."""
        return [part_key(key, n) for n in self.names]

    def views(self, buffer: Any) -> list[memoryview]:
        """The parts' byte ranges of one chunk's buffer (bytes-like, ``nbytes`` long), in part order."""
        mv = memoryview(buffer)
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        if len(mv) != self.nbytes:
            raise ValueError(f"a buffer of {len(mv)} bytes for a chunk of {self.nbytes}")
        return [mv[off : off + size] for off, size in zip(self.offsets, self.sizes)]


_DIGEST = re.compile(r"[0-9a-f]{%d}" % (2 * _KEY_HASH_BYTES))


def stored_value(key: str) -> tuple[str, str, str | None] | None:
    """``(model field, format field, part or None)`` of a value KvctlConnector stores (:func:`chunk_keys`,
    :func:`part_key`); None for any other key (LMCache's, a benchmark's, one with a character no key field holds)."""
    if not (key.isascii() and key.isprintable()) or " " in key:
        return None
    fields = key.split("@")
    if len(fields) != 4 or fields[2] != f"w{KEY_WORKER_ID}" or not _DIGEST.fullmatch(fields[3]):
        return None
    model, fmt = fields[0], fields[1]
    fmt, _, part = fmt.partition("/")
    if not model or not fmt:
        return None
    return model, fmt, part or None

