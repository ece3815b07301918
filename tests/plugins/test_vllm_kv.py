"""vLLM paged-cache layouts <-> chunks: slots, MLA rows, CPU GQA planes (K rows then V rows)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvctl.connector.layouts import GQALayout, MLALayout, slots_for  # noqa: E402

pytestmark = pytest.mark.engine


def test_slots_follow_the_block_table():
    # block size 4, blocks [7, 2, 9]: token 5 is offset 1 of the 2nd block (id 2) -> slot 2*4+1 = 9
    assert slots_for([7, 2, 9], 4, 3, 9).tolist() == [31, 8, 9, 10, 11, 36]
    assert slots_for([7], 4, 2, 2).numel() == 0


def test_mla_insert_then_extract_and_raw_rows():
    n_blocks, bs, row = 4, 4, 6
    caches = [torch.zeros(n_blocks, bs, row) for _ in range(2)]  # vLLM's CPU MLA: (blocks, block, 576)
    lay = MLALayout(caches, bs, row)
    slots = slots_for([3, 1], bs, 2, 6)  # tokens 2..5 -> block 3 offsets 2,3; block 1 offsets 0,1
    data = torch.arange(2 * 4 * row, dtype=torch.float32).view(2, 4, row)
    lay.insert(slots, data)
    # token 2 -> cache[3, 2]; token 5 -> cache[1, 1], layer 1 = second cache
    assert torch.equal(caches[0][3, 2], data[0, 0]) and torch.equal(caches[1][1, 1], data[1, 3])
    assert torch.equal(lay.extract(slots), data)
    assert caches[0][0].abs().sum() == 0  # nothing else touched
    assert lay.chunk_shape(64) == (2, 64, 6)


def test_gqa_layout_matches_vllm_cpu_key_value_split():
    n_blocks, heads, bs, hs = 3, 2, 4, 5
    # what vLLM's CPU backend allocates per layer; it reads K/V as below (cpu_attn.py forward)
    cache = torch.zeros(n_blocks, heads, bs, 2 * hs)
    lay = GQALayout([cache], bs, heads, hs)
    slots = slots_for([2, 0], bs, 3, 5)  # token 3 -> block 2 offset 3; token 4 -> block 0 offset 0
    data = torch.randn(1, 2, heads, 2, hs)
    lay.insert(slots, data)
    key_cache, value_cache = cache.view(n_blocks, heads, bs * 2, hs).chunk(2, dim=2)
    assert torch.equal(key_cache[2, 1, 3], data[0, 0, 1, 0])  # token 3, head 1, K
    assert torch.equal(value_cache[0, 0, 0], data[0, 1, 0, 1])  # token 4, head 0, V
    assert torch.equal(lay.extract(slots), data)


def test_gqa_rank_takes_its_heads_from_a_full_chunk():
    lay = GQALayout([torch.zeros(2, 1, 4, 6)], 4, 1, 3)  # 1 KV head per rank
    full = torch.arange(1 * 4 * 2 * 2 * 3).view(1, 4, 2, 2, 3)  # (layers, tokens, W*heads = 2, K/V, hs)
    assert torch.equal(lay.to_local(full, 1), full[:, :, 1:2])
    assert lay.chunk_shape(4, world_size=2) == (1, 4, 2, 2, 3)
