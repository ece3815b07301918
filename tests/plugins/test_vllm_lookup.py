"""Scheduler-side lookup against two real Valkey instances, and the load-or-recompute policy."""

from __future__ import annotations

import os
import signal
import time

import pytest

from kvctl.connector.ownership import chunk_keys
from kvctl.connector.resp import RespClient
from kvctl.connector.lookup import TierLookup, loadable_chunks

CT = 4
MODEL, FMT = "m", "f"


@pytest.fixture
def two(valkey_factory):
    servers = [valkey_factory(), valkey_factory()]
    lk = TierLookup([s.url for s in servers], CT, MODEL, FMT, timeout_s=1.0)
    yield servers, lk
    lk.close()


def put_chunks(servers, tokens, chunks):
    """Store chunk c (of ``chunks``) on instance c % 2, as the workers do."""
    keys = chunk_keys(tokens[: (len(tokens) // CT) * CT], CT, MODEL, FMT)
    for c in chunks:
        with RespClient(servers[c % 2].url) as cl:
            cl.batched_set([keys[c]], [b"x" * 8])
    return keys


def test_loadable_never_includes_the_last_token():
    assert loadable_chunks(16, 4) == 3  # 16 tokens: chunk 3 holds the last token -> 3 loadable
    assert loadable_chunks(17, 4) == 4
    assert loadable_chunks(0, 4) == 0 and loadable_chunks(1, 4) == 0


@pytest.mark.parametrize("vector", [False, True])
def test_min_over_ranks_from_a_chunk_offset(two, vector):
    servers, lk = two
    tokens = list(range(100, 123))  # 23 tokens: 5 full chunks, all loadable (22 // 4 = 5)
    put_chunks(servers, tokens, [0, 1, 2, 3, 4])
    assert lk.lookup(tokens, 0, vector).hit_chunks == 5
    keys = chunk_keys(tokens[:20], CT, MODEL, FMT)
    with RespClient(servers[1].url) as cl:
        cl.delete([keys[3]])  # chunk 3 lives on instance 1
    r = lk.lookup(tokens, 0, vector)
    assert (r.hit_chunks, r.loadable, r.failed_ranks) == (3, 5, ())
    # from offset 2 (chunks 0, 1 held locally): chunk 2 on rank 0 present, chunk 3 missing -> 3
    assert lk.lookup(tokens, 2, vector).hit_chunks == 3
    with RespClient(servers[0].url) as cl:
        cl.delete([keys[0]])
    assert lk.lookup(tokens, 0, vector).hit_chunks == 0
    # the offset skips chunk 0: it is not asked for
    assert lk.lookup(tokens, 1, vector).hit_chunks == 3
    assert lk.lookup(tokens, 5, vector).hit_chunks == 5  # nothing left to load


def test_vector_rank_with_no_hit_reports_its_first_owned_chunk(two):
    servers, lk = two
    tokens = list(range(23))
    put_chunks(servers, tokens, [0, 2, 4])  # rank 0 has all its chunks, rank 1 none
    # rank 1's vector starts at chunk 1 (token 4): min(a_0 = 5, a_1 = 1) = 1, not 0
    assert lk.lookup(tokens, 0, vector=True).hit_chunks == 1
    assert lk.lookup(tokens, 0, vector=False).hit_chunks == 1


def test_stopped_instance_is_a_bounded_miss(two):
    servers, lk = two
    tokens = list(range(23))
    put_chunks(servers, tokens, range(5))
    os.kill(servers[1].pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        r = lk.lookup(tokens, 0)
        elapsed = time.monotonic() - t0
    finally:
        os.kill(servers[1].pid, signal.SIGCONT)
    assert r.failed_ranks == (1,) and r.hit_chunks == 0
    assert elapsed < 1.0 * 1.5 + 0.5  # timeout_s 1.0, the wait is capped at 1.5 x


def test_a_failed_instance_is_skipped_for_a_while_then_asked_again(valkey_factory):
    servers = [valkey_factory(), valkey_factory()]
    lk = TierLookup([s.url for s in servers], CT, MODEL, FMT, timeout_s=0.5, down_for_s=2.0)
    tokens = list(range(23))
    put_chunks(servers, tokens, range(5))
    os.kill(servers[0].pid, signal.SIGSTOP)
    try:
        assert lk.lookup(tokens).failed_ranks == (0,)
        t0 = time.monotonic()
        assert lk.lookup(tokens).failed_ranks == (0,)  # not asked: answered at once
        assert time.monotonic() - t0 < 0.3
    finally:
        os.kill(servers[0].pid, signal.SIGCONT)
    time.sleep(2.1)
    assert lk.lookup(tokens).hit_chunks == 5  # asked again after down_for_s
    lk.close()
