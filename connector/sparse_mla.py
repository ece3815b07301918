"""MLA with a sparse-attention indexer (DeepSeek-V3.2, GLM-5 ``GlmMoeDsaForCausalLM``): one chunk, two parts (torch only).

What vLLM 0.32 does with these models (its CUDA and CPU builds share this Python code):

* **One KV cache group, two kinds of layers.** Every attention layer has an
  MLA latent cache (``MLAAttention.get_kv_cache_spec``,
  ``model_executor/layers/attention/mla_attention.py:1350-1381``:
  ``MLAAttentionSpec``, ``cache_role`` SPARSE) and every layer whose indexer
  runs has the indexer's K cache (``DeepseekV32IndexerCache``,
  ``model_executor/models/deepseek_v2.py:638-667``: ``MLAAttentionSpec`` of
  ``head_size`` 132 bytes, uint8, ``cache_role`` INDEXER; which layers run
  one: ``models/deepseek_v32/attention.py:165-200``). Both are MLA specs of
  one block size, so ``get_kv_cache_groups``
  (``v1/core/kv_cache_utils.py:2184-2193``) puts them in one group, a
  ``UniformTypeKVCacheSpecs`` (``v1/kv_cache_interface.py:1225-1306``):
  **one block table** for both, one KVCacheTensor of layers per spec in one
  allocation (``get_kv_cache_config_from_groups``,
  ``kv_cache_utils.py:1642-1678``), each spec's views made with its own spec
  (``allocate_kv_cache``, ``v1/worker/utils.py:600-624``). Only HiSparse splits them into groups
  (``v1/hisparse/layout.py:95-150``); kvctl refuses that (several groups).
* **The latent row** (FLASHMLA_SPARSE): kv-cache dtype auto/bfloat16: 576
  bf16 (512 ``kv_c`` + 64 ``k_pe``) a token; fp8 (any fp8 name) is served as
  ``fp8_ds_mla`` (``mla_attention.py:358-374``,
  ``_canonicalize_sparse_mla_kv_cache_dtype``): 656 bytes a token, 512 fp8
  NoPE, 4 fp32 scales, 64 bf16 RoPE
  (``v1/attention/backends/mla/flashmla_sparse.py:80-88``), the spec's
  ``state_content_bytes`` (``mla_attention.py:1362-1367``). Rows are read
  per token (``flat_kv_row_view``, ``v1/attention/backends/mla/sparse_utils.py:50-70``).
* **The indexer's page** (one kernel block of N tokens, N the view's): the N
  tokens' 128 fp8 values first (token t at byte ``t * 128``), then their N
  fp32 scales (token t at ``N * 128 + t * 4``):
  ``_fp8_quant_and_cache_write`` (``models/deepseek_v32/common/kernels.py:77-114``,
  unshuffled on CUDA: ``DeepseekV32IndexerCache.uses_shuffled_layout``,
  ``deepseek_v2.py:671-673``) and ``indexer_k_quant_and_cache_triton``
  (``v1/attention/ops/rocm_aiter_mla_sparse.py:176-191``: "the first portion
  as kv cache value and second portion as kv cache scale"). The indexer's
  backend is DEEPSEEK_V32_INDEXER (``v1/attention/backends/mla/indexer.py:279-285``),
  kernel blocks of 64 tokens on CUDA.

**The chunk.** Part ``mla``: ``(latent layers, tokens, row)`` of the latent's
dtype, as an MLA chunk; part ``idx``: ``(indexer layers, tokens, 132)`` uint8,
each token's 128 value bytes then its 4 scale bytes (whatever the page's
kernel block size). A chunk's bytes are the two parts in this order; the tier
holds each under its own key (:class:`~kvctl.connector.ownership.ChunkParts`),
and a chunk is present only when both are. The format names both parts
(``mla656-L78-fp8_ds_mla+idx132-L78-fp8_e4m3``), so a chunk of one part never
loads as the other, nor as a dense MLA chunk.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import torch

from .layouts import LAYOUTS, KVLayout, KVLayoutError, dtype_tag, slots_on, spec_text, stacked_layers, widest_word
from .ownership import ChunkParts

__all__ = ["INDEXER_BACKENDS", "INDEXER_PART", "LATENT_PART", "SPARSE_BACKENDS", "IndexerLayout", "SparseGroup",
           "SparseKV", "SparseMLALayout", "flattened_sparse_group", "sparse_format", "sparse_group", "sparse_layout_for"]

SPARSE_BACKENDS = ("FLASHMLA_SPARSE",)  # the sparse MLA backends whose latent rows kvctl reads
INDEXER_BACKENDS = ("DEEPSEEK_V32_INDEXER",)
LATENT_PART, INDEXER_PART = "mla", "idx"
LATENT_HEAD_SIZE = 576  # kv_lora_rank 512 + qk_rope_head_dim 64 (FlashMLASparseBackend.get_supported_head_sizes)
INDEXER_QUANT_BLOCK = 128  # one fp32 scale per 128 fp8 values (deepseek_v32/attention.py:90-97)
_INDEXER_BLOCK_BYTES = INDEXER_QUANT_BLOCK + 4  # 128 fp8 values and their fp32 scale
_LATENT_CACHE_DTYPES = {"auto": None, "bfloat16": "bfloat16", "fp8_ds_mla": "fp8_ds_mla"}
_DS_MLA_ROW = 656  # fp8_ds_mla: 512 fp8 + 4 fp32 + 64 bf16 (flashmla_sparse.py:80-88)
# other sparse backends and why kvctl does not store them (each is refused at start, by name)
_NOT_STORED = {
    "FLASHINFER_MLA_SPARSE": "it runs on SM100 (Blackwell) only (flashinfer_mla_sparse.py:107-108), not on an H200, "
                             "and kvctl has not read or run its cache",
    "FLASH_ATTN_MLA_SPARSE": "kvctl has not read or run its cache (vLLM's first choice on SM90 for a bf16 cache: "
                             "start vLLM with --attention-backend FLASHMLA_SPARSE)",
}


def _role(spec: Any) -> str | None:
    role = getattr(spec, "cache_role", None)
    return None if role is None else str(getattr(role, "name", role)).upper()


@dataclass(frozen=True)
class SparseGroup:
    """The layers of one sparse-MLA KV cache group, by kind, in the group's order, with each kind's spec."""

    latent_names: tuple[str, ...]
    indexer_names: tuple[str, ...]
    latent_spec: Any
    indexer_spec: Any


def sparse_group(spec: Any, layer_names: Sequence[str]) -> SparseGroup | None:
    """The group's :class:`SparseGroup` when ``spec`` holds sparse MLA and indexer layers; None for one spec.

    ``spec``: vLLM's group spec (duck-typed); a group of several layer specs
    is vLLM's ``UniformTypeKVCacheSpecs`` (``kv_cache_specs``: layer -> spec).
    Any other group of several specs is refused (:class:`KVLayoutError`).
    """
    specs = getattr(spec, "kv_cache_specs", None)
    if specs is None:
        return None
    names = [n for n in layer_names if n in specs]
    kinds = {"SPARSE": [], "INDEXER": []}
    for n in names:
        role = _role(specs[n])
        if role not in kinds:
            raise KVLayoutError(f"KvctlConnector: a KV cache group of layers with several specs ({spec_text(specs[n])}"
                                " among them): only MLA with a sparse-attention indexer is stored")
        kinds[role].append(n)
    if not kinds["SPARSE"] or not kinds["INDEXER"]:
        raise KVLayoutError("KvctlConnector: a KV cache group of several specs without both sparse MLA and indexer "
                            f"layers ({len(kinds['SPARSE'])} and {len(kinds['INDEXER'])}): not stored")
    for role, group in kinds.items():
        first = specs[group[0]]
        if any(specs[n] != first for n in group):
            raise KVLayoutError(f"KvctlConnector: the {role.lower()} layers of the group have different specs: not stored")
    return SparseGroup(tuple(kinds["SPARSE"]), tuple(kinds["INDEXER"]), specs[kinds["SPARSE"][0]],
                       specs[kinds["INDEXER"][0]])


def flattened_sparse_group(spec: Any, layer_names: Sequence[str], tensors: Sequence[Any]) -> SparseGroup | None:
    """The :class:`SparseGroup` of a sparse-MLA group as vLLM's scheduler holds it; None for a one-spec group.

    vLLM hands its scheduler (and the scheduler's connector) a copy of the KV
    cache config in which a ``UniformTypeKVCacheSpecs`` group is replaced by
    its first layer's spec (``generate_scheduler_kv_cache_config``,
    ``v1/core/kv_cache_utils.py:2287-2296``). For DeepSeek-V3.2 and GLM-5 that
    is the indexer's spec: ``DeepseekV2MLAAttention`` builds its ``Indexer``
    before its MLA attention (``models/deepseek_v2.py:1179-1215``). What the
    copy keeps is the placement, ``kv_cache_tensors``: one ``KVCacheTensor``
    per spec of the group, in the order of the group's specs (``get_kv_cache_config_from_groups``,
    ``kv_cache_utils.py:1643-1678``); the representative's is the one whose
    page is its ``page_size_bytes`` (else the first). A tensor's page is its ``block_stride``
    for a layer-outer layout and its ``layer_stride`` for a block-outer one
    (``KVCacheTensor``, ``v1/kv_cache_interface.py:1409-1428``): the smaller of
    the two. The other kind's spec is rebuilt from its page: the indexer's
    row is page / block size bytes of uint8; a latent row of 1152 bytes is
    576 bf16, one of 656 bytes FLASHMLA_SPARSE's ``fp8_ds_mla``.

    ``tensors``: vLLM's ``KVCacheTensor`` list (``layers``, ``layer_stride``,
    ``block_stride``), duck-typed. :class:`KVLayoutError` for a group whose
    layers lie in several tensors but not as one sparse-MLA group.
    """
    names = list(layer_names)
    member = set(names)
    sets = [(t, [n for n in t.layers if n in member]) for t in tensors]
    sets = [(t, ls) for t, ls in sets if ls]
    role = _role(spec)
    pages = [min(int(t.layer_stride), int(t.block_stride)) for t, _ in sets]
    if role != "INDEXER" and (role != "SPARSE" or len(sets) != 2 or len(set(pages)) == 1):
        return None  # one spec for the whole group (MLA specs default to cache_role SPARSE: dense MLA too)
    bs = int(spec.block_size)
    if len(sets) != 2:
        raise KVLayoutError(f"KvctlConnector: a KV cache group of {len(sets)} kinds of layers (the scheduler's "
                            f"representative spec {spec_text(spec)}): only MLA with a sparse-attention indexer is stored")
    mine = getattr(spec, "page_size_bytes", None)
    first = 1 if mine is not None and pages[1] == mine != pages[0] else 0  # the representative's tensor
    (_, own), (_, other_names) = sets[first], sets[1 - first]
    page = pages[1 - first]
    if page % bs:
        raise KVLayoutError(f"KvctlConnector: the sparse-MLA group's pages of {page} bytes do not hold whole rows "
                            f"of {bs} tokens")
    row = page // bs
    if role == "SPARSE":
        rebuilt = _FlatSpec(block_size=bs, head_size=row, dtype=torch.uint8, cache_role="INDEXER")
        return SparseGroup(tuple(own), tuple(other_names), spec, rebuilt)
    if row == 2 * LATENT_HEAD_SIZE:
        rebuilt = _FlatSpec(block_size=bs, head_size=LATENT_HEAD_SIZE, dtype=torch.bfloat16)
    elif row == _DS_MLA_ROW:
        rebuilt = _FlatSpec(block_size=bs, head_size=LATENT_HEAD_SIZE, dtype=torch.uint8,
                            cache_dtype_str="fp8_ds_mla", state_content_bytes=_DS_MLA_ROW)
    else:
        raise KVLayoutError(f"KvctlConnector: the sparse-MLA group's latent rows are {row} bytes (stored: "
                            f"{2 * LATENT_HEAD_SIZE} bf16, {_DS_MLA_ROW} fp8_ds_mla)")
    return SparseGroup(tuple(other_names), tuple(own), rebuilt, spec)


@dataclass(frozen=True)
class _FlatSpec:
    """A layer spec the scheduler's copy of the config dropped, rebuilt from its page (what ``_check_specs`` reads)."""

    block_size: int
    head_size: int
    dtype: torch.dtype
    cache_role: str = "SPARSE"
    num_kv_heads: int = 1
    cache_dtype_str: str | None = None
    state_content_bytes: int | None = None


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _latent_cache_dtype(spec: Any, cache_dtype: str | None) -> str:
    """The latent's kv-cache dtype: the spec's (vLLM rewrites fp8 to fp8_ds_mla there), else the engine's."""
    cdt = getattr(spec, "cache_dtype_str", None) or cache_dtype or "auto"
    return str(cdt)


def _check_specs(group: SparseGroup, cache_dtype: str | None) -> tuple[int, str, int]:
    """(latent row elements, latent tag, indexer row bytes) of the group's specs, or :class:`KVLayoutError`."""
    lat, idx = group.latent_spec, group.indexer_spec

    def refuse(spec: Any, why: str) -> KVLayoutError:
        return KVLayoutError(f"KvctlConnector: cannot store the sparse-MLA KV cache group (spec {spec_text(spec)}): {why}")

    cdt = _latent_cache_dtype(lat, cache_dtype)
    if cdt not in _LATENT_CACHE_DTYPES:
        raise refuse(lat, f"latent kv-cache dtype {cdt!r} (stored: {', '.join(_LATENT_CACHE_DTYPES)}; fp8 is served "
                          "as fp8_ds_mla by FLASHMLA_SPARSE)")
    if lat.head_size != LATENT_HEAD_SIZE:
        raise refuse(lat, f"latent head_size {lat.head_size}, not {LATENT_HEAD_SIZE} (512 + 64 rope)")
    if cdt == "fp8_ds_mla":
        if lat.dtype != torch.uint8 or getattr(lat, "state_content_bytes", None) != _DS_MLA_ROW:
            raise refuse(lat, f"fp8_ds_mla rows of {getattr(lat, 'state_content_bytes', None)} bytes, not {_DS_MLA_ROW}")
        row = _DS_MLA_ROW
    else:
        if lat.dtype not in (torch.bfloat16, torch.float16) or getattr(lat, "state_content_bytes", None) is not None:
            raise refuse(lat, f"a latent cache of {lat.dtype} (state_content_bytes "
                              f"{getattr(lat, 'state_content_bytes', None)}): FLASHMLA_SPARSE keeps bf16 rows")
        row = lat.head_size
    if idx.dtype != torch.uint8 or idx.head_size % _INDEXER_BLOCK_BYTES:
        raise refuse(idx, f"an indexer cache of {idx.head_size} x {idx.dtype}, not fp8 keys with one fp32 scale per "
                          f"{INDEXER_QUANT_BLOCK}")
    for spec in (lat, idx):
        if getattr(spec, "num_head_slots", None) is not None or getattr(spec, "tokens_per_state", 1) != 1:
            raise refuse(spec, "packed head slots or compressed states")
        if getattr(spec, "num_kv_heads", 1) != 1:
            raise refuse(spec, f"{spec.num_kv_heads} head slots, expected 1")
    if lat.block_size != idx.block_size:
        raise refuse(idx, f"block sizes {lat.block_size} and {idx.block_size} (one block table for both)")
    tag = "fp8_ds_mla" if cdt == "fp8_ds_mla" else dtype_tag(lat.dtype, cdt)
    return row, tag, idx.head_size


def sparse_format(group: SparseGroup, chunk_tokens: int, cache_dtype: str | None = None) -> tuple[str, ChunkParts]:
    """(chunk format, the chunk's parts) of a sparse-MLA group: what the scheduler keys and looks up, from specs alone."""
    row, tag, idx_row = _check_specs(group, cache_dtype)
    n_lat, n_idx = len(group.latent_names), len(group.indexer_names)
    fmt = f"mla{row}-L{n_lat}-{tag}+idx{idx_row}-L{n_idx}-fp8_e4m3"
    lat_bytes = n_lat * chunk_tokens * row * _elem(group.latent_spec.dtype)
    return fmt, ChunkParts((LATENT_PART, INDEXER_PART), (lat_bytes, n_idx * chunk_tokens * idx_row))


class IndexerLayout:
    """The indexer's K cache pages <-> ``(layers, tokens, value + scale bytes)`` chunks (see the module docstring).

    Each layer's view ``[B, 1, N, C]`` (uint8, C = values + scales of one
    token) is read as two strided views of the same pages: values
    ``[B, N, V]`` at page byte ``t * V``, scales ``[B, N, S]`` at
    ``N * V + t * S``. A page is one kernel block's ``N * C`` contiguous bytes.
    """

    def __init__(self, views: list[torch.Tensor], *, value_bytes: int, backend: str, layout: str) -> None:
        v0 = views[0]
        _, _, n_tok, content = v0.shape
        self.backend, self.layout = backend, layout
        self.device, self.dtype = v0.device, v0.dtype
        self.num_layers, self.kernel_block_size, self.row = len(views), n_tok, content
        self.value_bytes, self.scale_bytes = value_bytes, content - value_bytes
        runs = []
        for width, at in ((self.value_bytes, 0), (self.scale_bytes, n_tok * self.value_bytes)):
            cells = [torch.as_strided(v, (v.shape[0], n_tok, width), (v.stride(0), width, 1), v.storage_offset() + at)
                     for v in views]
            word = widest_word(cells)
            if word is not None:
                cells = [c.view(word) for c in cells]
            runs.append((cells, stacked_layers(cells), word))
        self._runs = runs
        self.fused = all(stacked is not None for _, stacked, _ in runs)

    def fmt(self) -> str:
        return f"idx{self.row}-L{self.num_layers}-fp8_e4m3"

    def layers(self, lo: int, hi: int) -> "IndexerLayout":
        """Layers ``lo..hi-1`` of the same pages as a layout of their own (see :meth:`KVLayout.layers`)."""
        if not 0 <= lo < hi <= self.num_layers:
            raise ValueError(f"layers {lo}..{hi - 1} of an indexer layout of {self.num_layers}")
        sub = copy.copy(self)
        sub.num_layers = hi - lo
        sub._runs = [(cells[lo:hi], stacked[lo:hi] if stacked is not None else None, word)
                     for cells, stacked, word in self._runs]
        return sub

    def chunk_shape(self, tokens: int) -> tuple[int, ...]:
        return (self.num_layers, tokens, self.row)

    def _index(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = slots_on(slots, self.device)
        return s // self.kernel_block_size, s % self.kernel_block_size

    def extract(self, slots: torch.Tensor) -> torch.Tensor:
        """A new ``(layers, tokens, C)`` uint8 tensor: each token's values, then its scales."""
        idx = self._index(slots)
        out = []
        for cells, stacked, word in self._runs:
            got = stacked[(slice(None), *idx)] if stacked is not None else torch.stack([c[idx] for c in cells])
            out.append(got.view(torch.uint8) if word is not None else got)
        return torch.cat(out, dim=-1)

    def insert(self, slots: torch.Tensor, chunk: torch.Tensor) -> None:
        """Write ``chunk`` (``(layers, tokens, C)`` uint8, token i into ``slots[i]``) into the pages."""
        want = self.chunk_shape(int(torch.as_tensor(slots).numel()))
        if chunk.dtype != torch.uint8 or tuple(chunk.shape) != want:
            raise ValueError(f"indexer chunk of {tuple(chunk.shape)} {chunk.dtype} for {want} uint8")
        data = chunk.to(self.device, non_blocking=True)
        idx = self._index(slots)
        bounds = (0, self.value_bytes, self.row)
        for (cells, stacked, word), lo, hi in zip(self._runs, bounds[:-1], bounds[1:]):
            part = data[..., lo:hi].contiguous()
            if word is not None:
                part = part.view(word)
            if stacked is not None:
                stacked[(slice(None), *idx)] = part
                continue
            for layer, c in enumerate(cells):
                c[idx] = part[layer]


class SparseKV(NamedTuple):
    """The KV of some tokens of a sparse-MLA group: the latent rows and the indexer's keys."""

    latent: torch.Tensor  # (latent layers, tokens, row), the latent cache's dtype
    indexer: torch.Tensor  # (indexer layers, tokens, 132) uint8


class SparseMLALayout:
    """Chunks <-> a sparse-MLA group's two kinds of caches, through one block table (see the module docstring).

    The data path's interface (``kvctl.connector.datapath``): ``extract``
    gives a :class:`SparseKV`, ``chunks_of`` packs it into flat uint8 chunks
    (part ``mla`` then part ``idx``), ``join_chunks`` and ``insert`` go back.
    """

    mla = True  # every rank holds the same latent and indexer KV: chunks are sharded, never gathered

    def __init__(self, latent: KVLayout, indexer: IndexerLayout) -> None:
        self.latent, self.indexer = latent, indexer
        self.backend, self.layout, self.device = latent.backend, latent.layout, latent.device
        self.dtype = torch.uint8
        self.num_layers = latent.num_layers
        self.fused = latent.fused and indexer.fused
        self._lat_token = latent.num_layers * latent.row * _elem(latent.dtype)
        self._idx_token = indexer.num_layers * indexer.row

    def fmt(self, world_size: int = 1) -> str:
        return f"{self.latent.fmt(world_size)}+{self.indexer.fmt()}"

    def rows(self, ranges: Sequence[tuple[int, int]]):
        """The layout of one layer group (:class:`~kvctl.connector.layer_groups.Unit` ``rows``): its latent layers
        and indexer layers, chunks ``[latent | indexer]``; only its latent layers where the indexer skips them all."""
        (a, b), (c, d) = ranges
        if d <= c:
            return self.latent.layers(a, b)
        return SparseMLALayout(self.latent.layers(a, b), self.indexer.layers(c, d))

    def parts(self, tokens: int) -> ChunkParts:
        return ChunkParts((LATENT_PART, INDEXER_PART), (self._lat_token * tokens, self._idx_token * tokens))

    def chunk_shape(self, tokens: int, world_size: int = 1) -> tuple[int, ...]:
        return ((self._lat_token + self._idx_token) * tokens,)

    def to_local(self, chunk: torch.Tensor, rank: int) -> torch.Tensor:
        return chunk

    def extract(self, slots: torch.Tensor) -> SparseKV:
        return SparseKV(self.latent.extract(slots), self.indexer.extract(slots))

    def insert(self, slots: torch.Tensor, kv: SparseKV, rank: int = 0) -> None:
        self.latent.insert(slots, kv.latent)
        self.indexer.insert(slots, kv.indexer)

    def chunks_of(self, kv: SparseKV, chunk_tokens: int) -> list[torch.Tensor]:
        """Flat chunks of ``chunk_tokens`` tokens each from ``kv`` (whole chunks), new memory."""
        n = kv.latent.shape[1] // chunk_tokens
        a = self._lat_token * chunk_tokens
        out = torch.empty((n, a + self._idx_token * chunk_tokens), dtype=torch.uint8, device=kv.latent.device)
        for i in range(n):
            part = slice(i * chunk_tokens, (i + 1) * chunk_tokens)
            lat, idx = self._split(out[i], chunk_tokens)
            lat.copy_(kv.latent[:, part])
            idx.copy_(kv.indexer[:, part])
        return list(out)

    def join_chunks(self, chunks: Sequence[torch.Tensor], skip: int = 0, rank: int = 0) -> SparseKV:
        """The KV of consecutive flat chunks, without their first ``skip`` tokens."""
        ct = int(chunks[0].numel()) // (self._lat_token + self._idx_token)
        parts = [self._split(c, ct) for c in chunks]
        lat = torch.cat([p[0] for p in parts], dim=1) if len(parts) > 1 else parts[0][0]
        idx = torch.cat([p[1] for p in parts], dim=1) if len(parts) > 1 else parts[0][1]
        return SparseKV(lat[:, skip:], idx[:, skip:])

    def _split(self, chunk: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        a = self._lat_token * tokens
        flat = chunk.reshape(-1)
        lat = flat[:a].view(self.latent.dtype).view(self.latent.num_layers, tokens, self.latent.row)
        idx = flat[a:].view(self.indexer.num_layers, tokens, self.indexer.row)
        return lat, idx


def _refuse(backend: str, layout: str, spec: Any, why: str) -> KVLayoutError:
    return KVLayoutError(f"KvctlConnector: cannot address the KV cache of backend {backend}, layout {layout}, "
                         f"spec {spec_text(spec)}: {why}")


def check_sparse_backend(backend: str, layout: str, spec: Any) -> None:
    """:class:`KVLayoutError` naming ``backend`` unless kvctl stores this sparse MLA backend's latent rows."""
    if backend in SPARSE_BACKENDS:
        return
    why = _NOT_STORED.get(backend, "kvctl has not read or run its cache")
    raise _refuse(backend, layout, spec, f"sparse MLA backend {backend} is not stored ({why}; stored: "
                                         f"{', '.join(SPARSE_BACKENDS)})")


def _views(caches: Sequence[torch.Tensor], spec: Any, backend: str, layout: str, row: int) -> list[torch.Tensor]:
    views = [c.unsqueeze(1) if c.dim() == 3 else c for c in caches]
    if not views:
        raise _refuse(backend, layout, spec, "no KV cache tensors")
    v0 = views[0]
    if any(v.dim() != 4 or v.shape != v0.shape or v.dtype != v0.dtype or v.device != v0.device for v in views):
        raise _refuse(backend, layout, spec, "the layers' caches differ in shape, dtype or device, or are not [B, H, N, C]")
    if v0.shape[1] != 1 or v0.shape[3] != row or v0.dtype != spec.dtype:
        raise _refuse(backend, layout, spec, f"views of {tuple(v0.shape)} {v0.dtype}, expected [B, 1, N, {row}] {spec.dtype}")
    if any(v.stride(-1) != 1 or v.stride(2) != row for v in views):
        raise _refuse(backend, layout, spec, f"a token's row is not contiguous (strides {v0.stride()})")
    block_size = int(spec.block_size)
    if block_size % v0.shape[2]:
        raise _refuse(backend, layout, spec, f"blocks of {v0.shape[2]} tokens in the views do not divide {block_size}")
    return views


def sparse_layout_for(group: SparseGroup, latent_caches: Sequence[torch.Tensor], indexer_caches: Sequence[torch.Tensor],
                      layout: Any, latent_backend: str, indexer_backend: str = "DEEPSEEK_V32_INDEXER", *,
                      cache_dtype: str | None = None, indexer_shuffled: bool = False) -> SparseMLALayout:
    """The :class:`SparseMLALayout` of a sparse-MLA group, or :class:`KVLayoutError` naming backend, layout and spec.

    ``latent_caches`` / ``indexer_caches``: the views vLLM registers for
    ``group.latent_names`` / ``group.indexer_names``; ``latent_backend`` and
    ``indexer_backend``: their layers' backends' ``get_name()``;
    ``indexer_shuffled``: the indexer cache's ``uses_shuffled_layout`` (ROCm's
    tiled pages: refused).
    """
    lname = str(getattr(layout, "name", layout))
    lat_spec, idx_spec = group.latent_spec, group.indexer_spec
    check_sparse_backend(str(latent_backend), lname, lat_spec)
    if indexer_backend not in INDEXER_BACKENDS:
        raise _refuse(str(indexer_backend), lname, idx_spec, f"indexer backend {indexer_backend} is not stored "
                                                             f"(stored: {', '.join(INDEXER_BACKENDS)})")
    if indexer_shuffled:
        raise _refuse(str(indexer_backend), lname, idx_spec, "the indexer's pages are in the shuffled (tiled) layout")
    if lname not in LAYOUTS:
        raise _refuse(str(latent_backend), lname, lat_spec, f"unknown KV cache layout (supported: {', '.join(LAYOUTS)})")
    row, _, idx_row = _check_specs(group, cache_dtype)
    lat_views = _views(latent_caches, lat_spec, str(latent_backend), lname, row)
    idx_views = _views(indexer_caches, idx_spec, str(indexer_backend), lname, idx_row)
    if len(lat_views) != len(group.latent_names) or len(idx_views) != len(group.indexer_names):
        raise _refuse(str(latent_backend), lname, lat_spec, f"{len(lat_views)} latent and {len(idx_views)} indexer "
                                                            f"caches for {len(group.latent_names)} and "
                                                            f"{len(group.indexer_names)} layers")
    cdt = _latent_cache_dtype(lat_spec, cache_dtype)
    latent = KVLayout(lat_views, mla=True, kv="", head_size=row, block_size=int(lat_spec.block_size), cache_dtype=cdt,
                      backend=str(latent_backend), layout=lname)
    value_bytes = idx_row // _INDEXER_BLOCK_BYTES * INDEXER_QUANT_BLOCK
    indexer = IndexerLayout(idx_views, value_bytes=value_bytes, backend=str(indexer_backend), layout=lname)
    return SparseMLALayout(latent, indexer)
