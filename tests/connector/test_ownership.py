"""Ownership math of the sharded store (paper §5.1, §5.3): exhaustive and property tests."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvctl.connector.ownership import (
    chunk_keys,
    chunk_start_token,
    contiguous_hit_tokens,
    cumulative_lengths,
    longest_prefix,
    lookup_answer,
    num_chunks,
    owned_chunks,
    owner,
)

WORLD_SIZES = (2, 3, 4, 8)


def _scheduler_min(present: list[bool], world_size: int) -> int:
    """What the vLLM scheduler computes: the minimum of every rank's answer."""
    return min(lookup_answer(present, r, world_size) for r in range(world_size))


def _async_answer_tokens(present: list[bool], rank: int, world_size: int, chunk_tokens: int, num_tokens: int) -> int:
    """Rank ``rank``'s async answer: prefetch its own chunks, contiguous hits over its vector."""
    cum = cumulative_lengths(num_tokens, rank, world_size, chunk_tokens)
    hits = [present[c] for c in owned_chunks(len(present), rank, world_size)]
    return contiguous_hit_tokens(cum, hits)


def test_owner_is_chunk_mod_world_size():
    assert [owner(c, 4) for c in range(9)] == [0, 1, 2, 3, 0, 1, 2, 3, 0]
    assert owner(7, 1) == 0
    with pytest.raises(ValueError):
        owner(1, 0)
    with pytest.raises(ValueError):
        owner(-1, 2)


def test_lookup_answer_examples():
    # chunk 2 missing: rank 0 owns 0,2,4 -> 2 ; rank 1 owns 1,3 -> N
    present = [True, True, False, True, True]
    assert lookup_answer(present, 0, 2) == 2
    assert lookup_answer(present, 1, 2) == 5
    assert lookup_answer([], 0, 2) == 0
    assert longest_prefix(present) == 2
    with pytest.raises(ValueError):
        lookup_answer(present, 2, 2)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_min_of_rank_answers_is_longest_prefix_exhaustive(world_size):
    """The proposition of §5.1 for every presence pattern of up to 10 chunks."""
    checked = 0
    for n in range(0, 11):
        for pattern in itertools.product((False, True), repeat=n):
            present = list(pattern)
            assert _scheduler_min(present, world_size) == longest_prefix(present), present
            checked += 1
    assert checked == sum(2**n for n in range(11))


@settings(max_examples=300, deadline=None)
@given(
    world_size=st.sampled_from(WORLD_SIZES),
    present=st.lists(st.booleans(), max_size=800),
)
def test_min_of_rank_answers_is_longest_prefix_property(world_size, present):
    assert _scheduler_min(present, world_size) == longest_prefix(present)


@settings(max_examples=300, deadline=None)
@given(
    world_size=st.sampled_from(WORLD_SIZES),
    n=st.integers(min_value=0, max_value=800),
    hit_rate=st.floats(min_value=0.5, max_value=1.0),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
)
def test_min_is_longest_prefix_with_long_hit_runs(world_size, n, hit_rate, seed):
    """Random booleans rarely give long prefixes; bias toward hits to cover them."""
    rng = random.Random(seed)
    present = [rng.random() < hit_rate for _ in range(n)]
    assert _scheduler_min(present, world_size) == longest_prefix(present)


def test_cumulative_lengths_shape():
    # 1000 tokens, chunks of 256 -> 4 chunks (last partial); rank 1 of 2 owns 1, 3
    assert cumulative_lengths(1000, 1, 2, 256) == [256, 768, 1000]
    assert cumulative_lengths(1000, 0, 2, 256) == [0, 512, 1000]
    # outside shard mode it is the usual vector, first entry 0
    assert cumulative_lengths(1000, 0, 1, 256) == [0, 256, 512, 768, 1000]
    # a rank owning no chunk of a short prompt reports the whole prompt
    assert cumulative_lengths(100, 3, 4, 256) == [100]


def test_no_hits_reports_first_entry_not_zero():
    """§5.3 edge case: rank 1's first owned chunk missing -> 256 tokens, not 0."""
    cum = cumulative_lengths(2048, 1, 2, 256)
    assert contiguous_hit_tokens(cum, [False, True, True, True]) == 256
    assert contiguous_hit_tokens(cum, []) == 256
    assert contiguous_hit_tokens(cum, [True, True, True, True]) == 2048
    assert contiguous_hit_tokens(cum, [True, False]) == 768
    with pytest.raises(ValueError):
        contiguous_hit_tokens(cum, [True] * 5)


def test_async_equals_sync_over_thousands_of_patterns():
    """§5.3 property: async contiguous hits == a_r in tokens, and the mins agree, 3,000 patterns."""
    rng = random.Random(20240531)
    chunk_tokens = 256
    for _ in range(3000):
        world_size = rng.choice(WORLD_SIZES)
        n_chunks = rng.randint(0, 64)
        last_partial = rng.randint(1, chunk_tokens) if n_chunks else 0
        num_tokens = max(0, (n_chunks - 1) * chunk_tokens + last_partial) if n_chunks else 0
        assert num_chunks(num_tokens, chunk_tokens) == n_chunks
        p_hit = rng.choice((0.3, 0.8, 0.97, 1.0))
        present = [rng.random() < p_hit for _ in range(n_chunks)]
        answers = []
        for rank in range(world_size):
            tokens = _async_answer_tokens(present, rank, world_size, chunk_tokens, num_tokens)
            sync_tokens = chunk_start_token(lookup_answer(present, rank, world_size), chunk_tokens, num_tokens)
            assert tokens == sync_tokens, (present, rank, world_size)
            answers.append(tokens)
        assert min(answers) == chunk_start_token(longest_prefix(present), chunk_tokens, num_tokens)


def test_chunk_keys_identify_whole_prefix():
    a = list(range(1000))
    b = list(range(1000))
    b[10] = 99999  # differs inside chunk 0 only
    ka = chunk_keys(a, 256, "glm-5.3", "fp8-mla")
    kb = chunk_keys(b, 256, "glm-5.3", "fp8-mla")
    assert len(ka) == 4  # last chunk partial
    assert len(set(ka)) == 4
    # chunk 1..3 have identical tokens but a different prefix: different keys
    assert all(x != y for x, y in zip(ka, kb))
    # a change after chunk 1 leaves chunks 0 and 1 alone
    c = list(a)
    c[600] = -1
    kc = chunk_keys(c, 256, "glm-5.3", "fp8-mla")
    assert kc[:2] == ka[:2] and kc[2:] != ka[2:]
    # a prefix of the prompt shares the keys of its full chunks
    assert chunk_keys(a[:512], 256, "glm-5.3", "fp8-mla") == ka[:2]


def test_chunk_keys_depend_on_model_and_format_and_are_worker0():
    toks = list(range(512))
    base = chunk_keys(toks, 256, "m", "fp8")
    assert chunk_keys(toks, 256, "m2", "fp8") != base
    assert chunk_keys(toks, 256, "m", "bf16") != base
    assert all("@w0@" in k for k in base)
    assert chunk_keys(toks, 256, "m", "fp8") == base  # deterministic
    assert chunk_keys([], 256, "m", "fp8") == []
    # a separator in a name is escaped, never refused nor folded (tests/connector/test_key_injective.py)
    assert chunk_keys(toks, 256, "a@b", "fp8")[0].startswith("a%40b@fp8@w0@")


def test_one_key_builder_has_no_rank_input():
    """Bug 3 of §5.4: keys cannot depend on the rank, because the builder never sees one."""
    import inspect

    params = set(inspect.signature(chunk_keys).parameters)
    assert params == {"token_ids", "chunk_tokens", "model_name", "fmt", "extra"}  # extra: the request's, not the rank's


def test_a_chunks_parts_have_keys_of_their_own_and_split_its_bytes():
    from kvctl.connector.ownership import ChunkParts, part_key

    (key,) = chunk_keys(list(range(4)), 4, "m", "mla656-L2-fp8_ds_mla+idx132-L2-fp8_e4m3")
    model, fmt, worker, digest = key.split("@")
    assert part_key(key, "idx") == f"{model}@{fmt}/idx@{worker}@{digest}"
    parts = ChunkParts(("mla", "idx"), (6, 2))
    assert parts.keys(key) == [part_key(key, "mla"), part_key(key, "idx")] and parts.nbytes == 8
    buf = bytearray(range(8))
    a, b = parts.views(buf)
    assert (bytes(a), bytes(b)) == (bytes(range(6)), bytes([6, 7]))
    b[0] = 99  # views of the chunk's own buffer, not copies
    assert buf[6] == 99
    with pytest.raises(ValueError):
        part_key(key, "")
    assert part_key(key, "a/b") == f"{model}@{fmt}/a%2Fb@{worker}@{digest}"  # escaped, so a part is one field
    assert part_key(key, "a@b") == f"{model}@{fmt}/a%40b@{worker}@{digest}"
    with pytest.raises(ValueError):
        part_key("not-a-key", "idx")
    with pytest.raises(ValueError):
        parts.views(bytearray(7))
    with pytest.raises(ValueError):
        ChunkParts(("mla",), (8,))
