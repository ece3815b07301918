"""layout_for() on CUDA caches: every layout x backend, fp8 padded pages, kernel blocks, round trips.

The GPU host has no vLLM: the caches come from kvctl.connector.kv_views
(the torch-only twin of vLLM's placement and create_kv_cache_views, checked
against vLLM's own functions on CPU in tests/plugins/test_layouts.py), and
this module imports nothing from vllm. The fill and the backends' readings
are those of the CPU tests (tests/plugins/kv_fill.py). Skipped without CUDA;
run with ``python -m pytest -m gpu tests/gpu/test_layouts_gpu.py``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvctl.connector.layouts import BACKENDS, KVLayoutError, layout_for, slots_for  # noqa: E402
from kvctl.connector.kv_views import CacheSpec, build_caches  # noqa: E402
from tests.plugins.kv_fill import (  # noqa: E402
    GQA_BACKENDS,
    LAYOUTS,
    MLA_BACKENDS,
    check_extract_insert,
    fill,
    reading,
)

pytestmark = [pytest.mark.gpu, pytest.mark.engine]

L, BLOCKS, BS = 4, 10, 16
SLOTS = slots_for([7, 2, 9, 0], BS, 3, 61)

SPECS = {
    "gqa": CacheSpec(BS, 2, 64, torch.bfloat16),
    "gqa_fp8": CacheSpec(BS, 4, 128, torch.uint8, cache_dtype_str="fp8_e4m3"),
    "mla": CacheSpec(BS, 1, 576, torch.bfloat16, head_size_v=0),
    # FP8 latent rows of 576 bytes; 16-token pages of 9216 bytes padded to 9728
    "mla_fp8_padded": CacheSpec(BS, 1, 576, torch.uint8, head_size_v=0, page_size_padded=9728, cache_dtype_str="fp8"),
}


@pytest.fixture(scope="module")
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch.device("cuda")


def caches_for(spec, layout, device, kernel_block_size=None):
    try:
        return build_caches(spec, layout, L, BLOCKS, device=device, kernel_block_size=kernel_block_size)
    except ValueError as exc:  # vLLM cannot split these blocks in this layout either
        pytest.skip(str(exc))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", GQA_BACKENDS + MLA_BACKENDS)
def test_extract_and_insert_on_cuda(cuda, layout, backend):
    spec = SPECS["mla" if backend in MLA_BACKENDS else "gqa"]
    raw, caches = caches_for(spec, layout, cuda)
    if BACKENDS[backend].layouts is not None and layout not in BACKENDS[backend].layouts:
        with pytest.raises(KVLayoutError, match=f"{backend}.*{layout}"):
            layout_for(caches, spec, layout, backend)
        return
    check_extract_insert(raw, caches, spec, layout, backend, SLOTS)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("spec_name,backend,kernel_block_size", [
    ("mla_fp8_padded", "FLASHMLA", None),
    ("mla", "CUTLASS_MLA", 8),
    ("gqa", "FLASH_ATTN", 8),
    ("gqa_fp8", "FLASHINFER", None),
])
def test_fp8_padded_pages_and_kernel_blocks_on_cuda(cuda, layout, spec_name, backend, kernel_block_size):
    spec = SPECS[spec_name]
    raw, caches = caches_for(spec, layout, cuda, kernel_block_size)
    check_extract_insert(raw, caches, spec, layout, backend, SLOTS)


def test_cpu_attn_lbhnc_host_chunk_into_flash_attn_blnhc_on_cuda(cuda):
    """Extract on the host (CPU_ATTN, LBHNC), insert into CUDA caches (FLASH_ATTN, BLNHC): K and V match everywhere."""
    spec = SPECS["gqa"]
    _, src = build_caches(spec, "LBHNC", L, BLOCKS)
    fill(src, "CPU_ATTN", spec.head_size)
    _, dst = caches_for(spec, "BLNHC", cuda)
    src_slots, dst_slots = slots_for([3, 8, 1], BS, 0, 48), slots_for([9, 0, 4], BS, 0, 48)
    chunk = layout_for(src, spec, "LBHNC", "CPU_ATTN").extract(src_slots).pin_memory()
    layout_for(dst, spec, "BLNHC", "FLASH_ATTN").insert(dst_slots, chunk)
    torch.cuda.synchronize()
    sb, so = src_slots // BS, src_slots % BS
    db, do = (dst_slots // BS).to(cuda), (dst_slots % BS).to(cuda)
    for layer in range(L):
        sk, sv = reading(src[layer], "CPU_ATTN", spec.head_size)
        dk, dv = reading(dst[layer], "FLASH_ATTN", spec.head_size)
        assert torch.equal(dk[db, :, do].cpu(), sk[sb, :, so]) and torch.equal(dv[db, :, do].cpu(), sv[sb, :, so])


def test_mla_fp8_padded_round_trip_between_backends_on_cuda(cuda):
    spec = SPECS["mla_fp8_padded"]
    _, src = caches_for(spec, "BLHNC", cuda)
    fill(src, "FLASHMLA", spec.head_size)
    raw, dst = caches_for(spec, "LBHNC", cuda)
    src_slots, dst_slots = slots_for([5, 2], BS, 0, 32), slots_for([1, 6], BS, 0, 32)
    chunk = layout_for(src, spec, "BLHNC", "FLASHMLA").extract(src_slots)
    assert chunk.device == src[0].device  # extract stays on the caches' device
    layout_for(dst, spec, "LBHNC", "TRITON_MLA").insert(dst_slots, chunk)
    for layer in range(L):
        assert torch.equal(dst[layer][dst_slots // BS, 0, dst_slots % BS],
                           src[layer][src_slots // BS, 0, src_slots % BS])
