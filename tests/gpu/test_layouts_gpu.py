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


# -- MLA with a sparse-attention indexer (FLASHMLA_SPARSE + the indexer's pages), one group, one block table ---------
SPARSE_BS = 64  # the indexer's kernel blocks on CUDA are 64 tokens


def sparse_caches(fp8: bool, layout: str, device, kernel_block_size=None, bs: int = SPARSE_BS):
    from kvctl.connector.kv_views import build_group_caches

    lat = (CacheSpec(bs, 1, 576, torch.uint8, head_size_v=0, cache_dtype_str="fp8_ds_mla", state_content_bytes=656)
           if fp8 else CacheSpec(bs, 1, 576, torch.bfloat16, head_size_v=0, block_stride_alignment=1152,
                                 cache_dtype_str="auto"))
    idx = CacheSpec(bs, 1, 132, torch.uint8, head_size_v=0)
    try:
        raw, (lv, iv) = build_group_caches([(lat, L), (idx, L - 1)], layout, BLOCKS, device=device,
                                           kernel_block_size=kernel_block_size)
    except ValueError as exc:  # vLLM refuses mixed page sizes in this layout, or cannot split the blocks
        pytest.skip(str(exc))
    from kvctl.connector.sparse_mla import SparseGroup

    group = SparseGroup(tuple(f"a{i}" for i in range(L)), tuple(f"i{i}" for i in range(L - 1)), lat, idx)
    return raw, lv, iv, group


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "BLHNC", "BLNHC"])
@pytest.mark.parametrize("fp8,bs,kbs", [(False, 64, None), (True, 64, None), (True, 128, 64)])
def test_sparse_mla_extract_insert_and_chunks_on_cuda(cuda, layout, fp8, bs, kbs):
    from kvctl.connector.sparse_mla import sparse_layout_for
    from tests.plugins.kv_fill import expected_sparse, fill_sparse, int_view, read_back_sparse

    raw, lv, iv, group = sparse_caches(fp8, layout, cuda, kbs, bs)
    fill_sparse(lv, iv)
    lay = sparse_layout_for(group, lv, iv, layout, "FLASHMLA_SPARSE")
    slots = slots_for([7, 2, 9, 0], bs, 3, 3 * bs + 5)
    want_lat, want_idx = expected_sparse(slots, lv, iv)
    kv = lay.extract(slots)
    assert kv.latent.device == raw.device and torch.equal(int_view(kv.latent), want_lat) and torch.equal(kv.indexer, want_idx)
    n = (len(slots) // bs) * bs
    chunks = lay.chunks_of(lay.extract(slots[:n]), bs)  # flat uint8 chunks on the device, part mla then part idx
    snapshot = raw.clone()
    raw.zero_()
    lay.insert(slots[:n], lay.join_chunks([c.cpu() for c in chunks]))  # host chunks go back to the device
    got_lat, got_idx = read_back_sparse(lv, iv, slots[:n])
    assert torch.equal(got_lat, want_lat[:, :n]) and torch.equal(got_idx, want_idx[:, :n])
    written = raw != 0
    assert torch.equal(raw[written], snapshot[written])


@pytest.mark.parametrize("spec_name,backend", [("mla", "FLASHMLA"), ("gqa", "FLASH_ATTN")])
def test_extract_and_insert_queue_their_work_without_holding_the_host(cuda, spec_name, backend):
    """The save's extract runs in vLLM's wait_for_save, right after the step's forward is queued: a copy of the slots
    from pageable memory there held the engine's thread until that forward had run. Under CUDA's sync debug mode
    "error" any synchronizing call raises; a sleep kernel queued first shows the host did not wait for it."""
    spec = SPECS[spec_name]
    layout = "LBHNC" if spec_name == "mla" else "LBNHC"
    raw, caches = caches_for(spec, layout, cuda)
    fill(caches, backend, spec.head_size)
    lay = layout_for(caches, spec, layout, backend)
    want = lay.extract(SLOTS)  # the first call pins its host buffer; the steady state is what the engine sees
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued ahead, as a step's forward is
        got = lay.extract(SLOTS)
        lay.insert(SLOTS, got)
        queued = torch.cuda.current_stream().query()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not queued  # the host came back while the sleep still ran
    torch.cuda.synchronize()
    assert torch.equal(got, want)
