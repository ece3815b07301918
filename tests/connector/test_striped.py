"""Several Valkey instances per rank (issue 29, item 4): the partition, RankTier, the store and the lookup.

Real valkey-servers on loopback; chunk ``c`` of rank ``r`` must live on instance ``(c // W) mod K`` of
that rank and nowhere else, whoever writes it, and every read must go back to that instance.
"""

from __future__ import annotations

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st

from kvctl.connector.urls import (InvalidUrl, expand_rank_urls, flat_instance, instance_of, instances_in,
                                  parse_resp_url)


@given(st.integers(1, 8), st.integers(1, 8), st.integers(1, 400))
def test_each_rank_spreads_its_chunks_evenly_over_its_own_instances(w, k, n):
    for r in range(w):
        mine = list(range(r, n, w))
        counts = [0] * k
        for c in mine:
            counts[instance_of(c, w, k)] += 1
        # the rank's j-th owned chunk is on instance j mod K: no instance holds two more than another
        assert max(counts) - min(counts) <= 1
        assert [instance_of(c, w, k) for c in mine] == [j % k for j in range(len(mine))]


def test_instance_of_refuses_nonsense():
    with pytest.raises(ValueError):
        instance_of(-1, 2, 2)
    with pytest.raises(ValueError):
        instance_of(3, 0, 2)
    assert flat_instance(2, 1, 4) == 9


def test_templates_and_lists_name_the_instances_of_a_rank():
    assert expand_rank_urls("resp://v-{rank}-{instance}:6379", 1, 3) == [
        "resp://v-1-0:6379", "resp://v-1-1:6379", "resp://v-1-2:6379"]
    assert expand_rank_urls("resp://v-{rank}:6379", 2) == ["resp://v-2:6379"]
    assert expand_rank_urls([["resp://a:1", "resp://a:2"], ["resp://b:1", "resp://b:2"]], 1, 2) == [
        "resp://b:1", "resp://b:2"]
    assert expand_rank_urls(["resp://a:1", "resp://b:1"], 1) == ["resp://b:1"]
    assert instances_in([["resp://a:1", "resp://a:2"]]) == 2 and instances_in(["x"]) == 1
    assert instances_in("resp://v-{rank}") is None


@pytest.mark.parametrize("spec,rank,k,why", [
    ("resp://v-{rank}:6379", 0, 2, "need {instance}"),
    ([["resp://a:1"], ["resp://b:1", "resp://b:2"]], 1, 1, "expected 1"),
    ([["resp://a:{rank}"]], 0, 1, "placeholder"),
    ("resp://v:1", 0, 0, "1..64"),
    ("resp://v:1", 0, 65, "1..64"),
    ("resp://v:1", 0, True, "1..64"),
])
def test_bad_instance_specs_are_one_clear_error(spec, rank, k, why):
    with pytest.raises(InvalidUrl, match=why.replace("{", r"\{").replace("}", r"\}")):
        expand_rank_urls(spec, rank, k)


def test_mixed_list_lengths_are_refused():
    with pytest.raises(InvalidUrl, match="same number"):
        instances_in([["resp://a:1", "resp://a:2"], "resp://b:1"])


def test_a_url_left_with_a_placeholder_is_refused():
    with pytest.raises(InvalidUrl, match="instance"):
        parse_resp_url("resp://v-0-{instance}:6379")


@pytest.fixture
def two_instances(valkey_factory):
    procs = [valkey_factory(), valkey_factory()]
    yield [p.url for p in procs], [redis.Redis(host=p.host, port=p.port) for p in procs]


def test_rank_tier_routes_every_call_to_the_chunks_instance(two_instances):
    from kvctl.connector.striped import RankTier

    urls, raw = two_instances
    w = 3  # rank 1 of 3: owned chunks 1, 4, 7, 10, 13 -> instances 0, 1, 0, 1, 0
    tier = RankTier(urls, w, timeout_s=5.0)
    try:
        chunks = [1, 4, 7, 10, 13]
        keys = [f"k{c}" for c in chunks]
        vals = [bytes([c]) * 1000 for c in chunks]
        tier.set(chunks, keys, vals)
        for c, k in zip(chunks, keys):
            inst = (c // w) % 2
            assert raw[inst].exists(k) == 1 and raw[1 - inst].exists(k) == 0
        bufs = [bytearray(1000) for _ in chunks]
        assert tier.get(chunks, keys, bufs) == [True] * 5
        assert [bytes(b) for b in bufs] == vals
        raw[1].delete("k4")
        assert tier.exists(chunks, keys) == [True, False, True, True, True]
        assert tier.get([4, 7], ["k4", "k7"], [bytearray(1000), bytearray(1000)]) == [False, True]
        assert tier.delete(chunks, keys) == 4
        assert "more instances" in tier.url and "***" not in tier.url
    finally:
        tier.close()


def test_an_instance_down_raises_after_the_others_answered(valkey_factory):
    from kvctl.connector.resp import RespError
    from kvctl.connector.striped import RankTier

    up = valkey_factory()
    dead = valkey_factory()
    dead_url = dead.url
    dead.stop()
    tier = RankTier([up.url, dead_url], 1, timeout_s=1.0)
    try:
        with pytest.raises(RespError):
            tier.exists([0, 1, 2, 3], ["a", "b", "c", "d"])
        assert tier.exists([0, 2], ["a", "c"]) == [False, False]  # only instance 0: answered
    finally:
        tier.close()


def test_store_and_lookup_follow_the_partition_on_cpu(valkey_factory, tmp_path):
    """A 2-rank shard group with 2 instances a rank: saves land by (c // W) mod K, lookups and loads find them."""
    torch = pytest.importorskip("torch")
    from kvctl.connector.lookup import TierLookup
    from kvctl.connector.ownership import chunk_keys
    from kvctl.connector.store import ShardedStore

    procs = [valkey_factory() for _ in range(4)]  # rank r instance i = procs[2r + i]
    rank_urls = [[procs[0].url, procs[1].url], [procs[2].url, procs[3].url]]
    raw = [redis.Redis(host=p.host, port=p.port) for p in procs]
    ct, shape = 4, (2, 4, 3)
    tokens = list(range(9 * ct))  # 9 full chunks
    keys = chunk_keys(tokens, ct, "m", "f")
    chunks = [torch.full(shape, float(c)) for c in range(9)]
    for r in range(2):
        with ShardedStore(r, 2, rank_urls, 0, shape, torch.float32, chunk_tokens=ct, model_name="m", fmt="f",
                          instances_per_rank=2) as store:
            res = store.store(tokens, chunks)
            assert res.l2_chunks == len(range(r, 9, 2))
    for c, k in enumerate(keys):
        where = [i for i, cl in enumerate(raw) if cl.exists(k)]
        assert where == [2 * (c % 2) + (c // 2) % 2], (c, where)
    lookup = TierLookup(rank_urls, ct, "m", "f", 5.0)
    try:
        assert lookup.lookup(tokens + [1]).hit_chunks == 9
        raw[3].delete(keys[3])  # chunk 3: rank 1, owned #1 -> instance 1
        assert lookup.lookup(tokens + [1]).hit_chunks == 3
    finally:
        lookup.close()
    with ShardedStore(0, 1, [[procs[0].url, procs[1].url]], 0, shape, torch.float32, chunk_tokens=ct,
                      model_name="m", fmt="f", instances_per_rank=2) as one:
        # W=1 reads a K=2 tier written at W=2? No: the partition depends on W, so a W=1 engine finds
        # chunk 0 (instance 0 either way) and misses chunk 1 (on rank 1's instances)
        assert one.lookup(tokens) == ct
