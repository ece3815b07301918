"""Fill vLLM-shaped KV caches so every element encodes its place, read as each backend reads it (torch only).

Shared by tests/plugins/test_layouts.py (caches from vLLM's own
create_kv_cache_views) and tests/gpu/test_layouts_gpu.py (CUDA caches from
kvctl.connector.kv_views, no vLLM). The readings below are written from
each backend's source in vLLM 0.32, independently of kvctl.connector.layouts:

* CPU_ATTN (cpu_attn.py forward): ``cache.view(B, H, 2*N, D).chunk(2, dim=2)``
* FLASH_ATTN / TRITON_ATTN (``kv_cache.transpose(1, 2).split(head_size, -1)``)
  and FLASHINFER (``kv_cache.permute(...).split(head_size, -1)``): K and V
  halves of C; the transpose/permute only reorders the logical axes.
* MLA backends (mla_attention.py bind_kv_cache): ``kv_cache.squeeze(1)``,
  one latent row per (block, token).

An element's code is a hash of (layer, block, head, token, K/V, channel),
masked so that float patterns stay finite, written and compared through an
integer view of the same width (byte-exact).
"""

from __future__ import annotations

import torch

GQA_BACKENDS = ("CPU_ATTN", "FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")
MLA_BACKENDS = ("CPU_MLA", "AMX_MLA", "FLASHMLA", "FLASH_ATTN_MLA", "CUTLASS_MLA", "TRITON_MLA", "FLASHINFER_MLA")
LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
_MASK = {1: 0xFF, 2: 0x3FFF, 4: 0x3FFFFFFF}  # 16/32-bit floats: top exponent bit clear, so never inf/nan


def int_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT[t.element_size()])


def code(layer, block, head, token, kv, chan, nbytes: int, device) -> torch.Tensor:
    """The code of each element (broadcast over the index tensors), as the integer type of ``nbytes``."""
    c = (torch.as_tensor(layer, device=device) * 7919 + torch.as_tensor(block, device=device) * 104729
         + torch.as_tensor(head, device=device) * 1299709 + torch.as_tensor(token, device=device) * 15485863
         + torch.as_tensor(kv, device=device) * 32452843 + torch.as_tensor(chan, device=device) * 49979687 + 12345)
    c = (c * 2654435761) >> 9
    return (c & _MASK[nbytes]).to(_INT[nbytes])


def reading(cache: torch.Tensor, backend: str, head_size: int) -> tuple[torch.Tensor, ...]:
    """``(K, V)`` as ``[B, H, N, D]`` views for GQA backends, ``(rows,)`` as ``[B, N, C]`` for MLA ones."""
    if backend in MLA_BACKENDS:
        return (cache.squeeze(1),)
    if backend == "CPU_ATTN":
        b, h, n, _ = cache.shape
        k, v = cache.view(b, h, 2 * n, -1).chunk(2, dim=2)
        return k, v
    k, v = cache.split(head_size, dim=-1)
    return k, v


def fill(caches: list[torch.Tensor], backend: str, head_size: int) -> None:
    """Write every element's code into the caches through the backend's reading."""
    for layer, cache in enumerate(caches):
        parts = reading(cache, backend, head_size)
        nbytes, dev = cache.element_size(), cache.device
        for kv, part in enumerate(parts):
            if part.dim() == 3:  # MLA rows [B, N, C]
                b, n, c = part.shape
                grid = code(layer, torch.arange(b, device=dev)[:, None, None], 0,
                            torch.arange(n, device=dev)[None, :, None], 0, torch.arange(c, device=dev), nbytes, dev)
            else:
                b, h, n, d = part.shape
                grid = code(layer, torch.arange(b, device=dev)[:, None, None, None],
                            torch.arange(h, device=dev)[None, :, None, None],
                            torch.arange(n, device=dev)[None, None, :, None], kv, torch.arange(d, device=dev),
                            nbytes, dev)
            int_view(part).copy_(grid)


def expected_chunk(slots: torch.Tensor, caches: list[torch.Tensor], mla: bool, head_size: int) -> torch.Tensor:
    """The integer chunk a correct extract returns for ``slots``: MLA (L, T, C); GQA (L, T, H, 2, D)."""
    c0 = caches[0]
    dev, nbytes = c0.device, c0.element_size()
    n_tok = c0.shape[-2]
    s = slots.to(dev)
    b, n = s // n_tok, s % n_tok
    layer = torch.arange(len(caches), device=dev)
    if mla:
        width = c0.shape[-1]
        return code(layer[:, None, None], b[None, :, None], 0, n[None, :, None], 0,
                    torch.arange(width, device=dev), nbytes, dev)
    heads = c0.shape[1]
    return code(layer[:, None, None, None, None], b[None, :, None, None, None],
                torch.arange(heads, device=dev)[None, None, :, None, None], n[None, :, None, None, None],
                torch.arange(2, device=dev)[None, None, None, :, None], torch.arange(head_size, device=dev),
                nbytes, dev)


def read_back(caches: list[torch.Tensor], backend: str, head_size: int, slots: torch.Tensor) -> torch.Tensor:
    """What the backend would read at ``slots`` (integer view), in the chunk's shape."""
    n_tok = caches[0].shape[-2]
    s = slots.to(caches[0].device)
    b, n = s // n_tok, s % n_tok
    out = []
    for cache in caches:
        parts = reading(cache, backend, head_size)
        if len(parts) == 1:
            out.append(int_view(parts[0])[b, n])
        else:
            k, v = (int_view(p)[b, :, n] for p in parts)  # (T, H, D)
            out.append(torch.stack([k, v], dim=2))
    return torch.stack(out)


def check_extract_insert(raw: torch.Tensor, caches: list[torch.Tensor], spec, layout: str, backend: str,
                         slots: torch.Tensor, cache_dtype: str | None = None) -> None:
    """Byte-exact extract on the caches' device, then an insert into zeroed caches writes exactly those cells."""
    from kvctl.connector.layouts import layout_for

    mla = backend in MLA_BACKENDS
    fill(caches, backend, spec.head_size)
    lay = layout_for(caches, spec, layout, backend, cache_dtype=cache_dtype)
    assert lay.fused  # vLLM's layers sit a constant stride apart: one gather for all of them
    want = expected_chunk(slots, caches, mla, spec.head_size)
    got = lay.extract(slots)
    assert got.device == caches[0].device and got.dtype == spec.dtype
    assert tuple(got.shape) == lay.chunk_shape(len(slots))
    assert torch.equal(int_view(got), want)
    snapshot = raw.clone()
    raw.zero_()
    lay.insert(slots, got.cpu())  # a host chunk goes to the caches' device
    assert torch.equal(read_back(caches, backend, spec.head_size, slots), want)
    written = raw != 0
    assert torch.equal(raw[written], snapshot[written])  # no byte outside those cells (padding included)
    assert int(written.sum()) <= got.numel() * got.element_size()


# -- MLA with a sparse-attention indexer (kvctl.connector.sparse_mla) ------------------------------------------
# The latent rows are read as every MLA backend reads them (squeeze(1), FLASHMLA_SPARSE's flat_kv_row_view is the
# same rows). The indexer's page, as vLLM 0.32 writes it (models/deepseek_v32/common/kernels.py
# _fp8_quant_and_cache_write, unshuffled): a kernel block of N tokens is N*C contiguous bytes, token t's 128 fp8
# values at byte t*128, its fp32 scale at byte N*128 + t*4.
INDEXER_VALUES = 128
_INDEXER_LAYER0 = 1000  # indexer layers' codes start here (never equal to a latent layer's)


def indexer_pages(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values [B, N, 128], scales [B, N, C - 128])`` of one indexer layer's ``[B, 1, N, C]`` uint8 view."""
    c = cache.squeeze(1)  # DeepseekV32IndexerCache.bind_kv_cache
    b, n, width = c.shape
    pages = torch.as_strided(c, (b, n * width), (c.stride(0), 1))  # block i's page: n * width bytes from c[i, 0, 0]
    return pages[:, : n * INDEXER_VALUES].view(b, n, INDEXER_VALUES), pages[:, n * INDEXER_VALUES :].view(b, n, -1)


def fill_sparse(latent: list[torch.Tensor], indexer: list[torch.Tensor]) -> None:
    """Every latent element and every indexer byte encodes (layer, block, token, value/scale, byte)."""
    fill(latent, "FLASHMLA", 0)
    for layer, cache in enumerate(indexer):
        for kind, run in enumerate(indexer_pages(cache)):
            b, n, w = run.shape
            dev = run.device
            run.copy_(code(_INDEXER_LAYER0 + layer, torch.arange(b, device=dev)[:, None, None], 0,
                           torch.arange(n, device=dev)[None, :, None], kind, torch.arange(w, device=dev), 1, dev))


def expected_sparse(slots: torch.Tensor, latent: list[torch.Tensor], indexer: list[torch.Tensor]):
    """``(latent (L, T, row) ints, indexer (L_idx, T, C) uint8)`` a correct extract returns after :func:`fill_sparse`."""
    lat = expected_chunk(slots, latent, True, 0)
    c0 = indexer[0]
    dev, n_tok, width = c0.device, c0.shape[-2], c0.shape[-1]
    s = slots.to(dev)
    b, n = (s // n_tok)[None, :, None], (s % n_tok)[None, :, None]
    layer = torch.arange(len(indexer), device=dev)[:, None, None] + _INDEXER_LAYER0
    values = code(layer, b, 0, n, 0, torch.arange(INDEXER_VALUES, device=dev), 1, dev)
    scales = code(layer, b, 0, n, 1, torch.arange(width - INDEXER_VALUES, device=dev), 1, dev)
    return lat, torch.cat([values, scales], dim=-1)


def read_back_sparse(latent: list[torch.Tensor], indexer: list[torch.Tensor], slots: torch.Tensor):
    """What FLASHMLA_SPARSE and the indexer's kernels would read at ``slots``: ``(latent ints, indexer bytes)``."""
    lat = read_back(latent, "FLASHMLA", 0, slots)
    n_tok = indexer[0].shape[-2]
    s = slots.to(indexer[0].device)
    b, n = s // n_tok, s % n_tok
    idx = torch.stack([torch.cat([run[b, n] for run in indexer_pages(cache)], dim=-1) for cache in indexer])
    return lat, idx
