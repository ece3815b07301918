"""ShardedStore: L1 LRU, per-rank L2 on real Valkey, agreed-prefix load, async prefetch, policy.

Single-process tests build one store per rank in this process (store, lookup
and prefetch need no process group) and a world-1 gloo group for ``load``;
the slow tests spawn W gloo ranks, each with its own real Valkey.
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

torch = pytest.importorskip("torch")

from tests.connector.ranks import spawn_ranks  # noqa: E402

pytestmark = pytest.mark.engine

CT = 4  # tokens per chunk
SHAPE = (2, 3, 4)
DTYPE = torch.float16
NBYTES = 2 * 3 * 4 * 2


def make_store(rank, world, url, budget=1 << 20, **kw):
    from kvctl.connector.store import ShardedStore

    kw.setdefault("timeout_s", 2.0)
    return ShardedStore(rank, world, url, budget, SHAPE, DTYPE, chunk_tokens=CT, model_name="m", fmt="f", **kw)


def prompt(seed, n_tokens):
    rng = random.Random(seed)
    tokens = [rng.randrange(30_000) for _ in range(n_tokens)]
    gen = torch.Generator().manual_seed(seed)
    chunks = [torch.randn(SHAPE, generator=gen).to(DTYPE) for _ in range(n_tokens // CT)]
    return tokens, chunks


def as_bytes(t):
    return bytes(t.contiguous().view(torch.uint8).flatten().tolist())


@pytest.fixture
def world1_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield None
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------- L1 LRU
def _item(n):
    buf = bytearray(n)
    return buf, torch.frombuffer(buf, dtype=torch.uint8)


def test_lru_evicts_least_recently_used_within_budget():
    from kvctl.connector.prefetch import LRUCache

    lru = LRUCache(300)
    for k in "abc":
        assert lru.put(k, *_item(100))
    assert lru.used_bytes == 300 and len(lru) == 3
    assert lru.get("a") is not None  # a becomes most recent
    assert lru.put("d", *_item(100))  # evicts b, the least recent
    assert lru.keys() == ["c", "a", "d"] and "b" not in lru
    assert lru.put("e", *_item(250))  # needs 3 evictions
    assert lru.keys() == ["e"] and lru.used_bytes == 250 and lru.evictions == 4
    assert not lru.put("huge", *_item(301)) and "huge" not in lru
    assert lru.put("e", *_item(50)) and lru.used_bytes == 50  # refresh replaces the size
    assert lru.pop("e") and not lru.pop("e") and lru.used_bytes == 0


def test_l1_is_one_wth_of_the_budget_and_holds_only_owned_chunks(valkey_server):
    st = make_store(1, 4, valkey_server.url, budget=4 * 10 * NBYTES)
    try:
        assert st.l1.capacity_bytes == 10 * NBYTES
        tokens, chunks = prompt(1, 9 * CT + 2)  # 9 full chunks + a partial one
        res = st.store(tokens, chunks)
        assert res.owned_chunks == 2 and res.l2_chunks == 2 and res.l2_error is None  # chunks 1 and 5
        keys = st.keys(tokens)
        assert len(keys) == 9
        assert set(st.l1.keys()) == {keys[1], keys[5]}
        for _ in range(20):  # a full L1 never exceeds its slice
            t, c = prompt(random.randrange(1 << 30), 8 * CT)
            st.store(t, c)
        assert st.l1.used_bytes <= st.l1.capacity_bytes
    finally:
        st.close()


# -------------------------------------------------- lookup, load (one rank)
def test_roundtrip_lookup_and_load_world1(valkey_server, world1_group):
    import redis

    st = make_store(0, 1, valkey_server.url)
    try:
        tokens, chunks = prompt(2, 6 * CT + 3)
        st.store(tokens, chunks)
        assert st.lookup(tokens) == 6 * CT  # the partial tail is never a hit
        res = st.load(tokens)
        assert res.prefix == 6 and [as_bytes(t) for t in res.chunks] == [as_bytes(t) for t in chunks]
        # evicted from both tiers: the hit and the load stop there
        keys = st.keys(tokens)
        st.l1.pop(keys[3])
        redis.Redis(host=valkey_server.host, port=valkey_server.port).delete(keys[3])
        assert st.lookup(tokens) == 3 * CT
        res = st.load(tokens)
        assert res.prefix == 3 and [as_bytes(t) for t in res.chunks] == [as_bytes(t) for t in chunks[:3]]
        # L1 lost everything: chunks come back from L2 and refill L1
        for k in keys:
            st.l1.pop(k)
        assert st.lookup(tokens) == 3 * CT
        res = st.load(tokens, max_tokens=2 * CT + 1)
        assert res.prefix == 2 and keys[0] in st.l1 and keys[1] in st.l1
        assert st.measured_gbps is not None and st.measured_gbps > 0
    finally:
        st.close()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_min_over_ranks_is_longest_prefix_sync_and_async(world, valkey_factory):
    """Random presence patterns over W in-process stores with their own instances."""
    import redis

    from kvctl.connector.ownership import longest_prefix

    servers = [valkey_factory() for _ in range(world)]
    stores = [make_store(r, world, [s.url for s in servers], budget=world * 6 * NBYTES) for r in range(world)]
    admins = [redis.Redis(host=s.host, port=s.port, socket_timeout=5) for s in servers]
    rng = random.Random(world)
    try:
        for trial in range(25):
            n_tokens = rng.randint(0, 14 * CT)
            tokens, chunks = prompt(rng.randrange(1 << 30), n_tokens)
            for st in stores:
                st.store(tokens, chunks)
            keys = stores[0].keys(tokens)
            present = [rng.random() > 0.15 for _ in keys]
            for c, p in enumerate(present):
                o = c % world
                if not p:
                    stores[o].l1.pop(keys[c])
                    admins[o].delete(keys[c])
                elif rng.random() < 0.5:
                    stores[o].l1.pop(keys[c])  # L2 only
            n_chunks = -(-n_tokens // CT)
            present_all = present + [False] * (n_chunks - len(keys))  # partial tail is a miss
            expected = min(longest_prefix(present_all) * CT, n_tokens)
            sync = [st.lookup(tokens) for st in stores]
            assert min(sync) == expected, (trial, sync, present_all)
            reqs = [st.prefetch(tokens) for st in stores]
            async_ = [st.lookup_async(req, timeout_s=5.0) for st, req in zip(stores, reqs)]
            assert async_ == sync, (trial, async_, sync)
            assert all(req.done and req.error is None for req in reqs)
    finally:
        for st in stores:
            st.close()
        for a in admins:
            a.close()


# ------------------------------------------------------------- async prefetch
def test_prefetch_timeout_reports_contiguous_so_far_and_stays_local(valkey_server):
    st = make_store(1, 2, valkey_server.url, timeout_s=1.0)
    try:
        slow_tokens, slow_chunks = prompt(3, 8 * CT)  # rank 1 owns chunks 1, 3, 5, 7
        fast_tokens, fast_chunks = prompt(4, 8 * CT)
        st.store(slow_tokens, slow_chunks)
        st.store(fast_tokens, fast_chunks)
        slow_keys = st.keys(slow_tokens)
        st.l1.pop(slow_keys[3])  # chunk 1 in L1, chunk 3 onwards only in L2
        st.l1.pop(slow_keys[5])
        st.l1.pop(slow_keys[7])
        os.kill(valkey_server.pid, signal.SIGSTOP)  # the L2 instance stops answering
        try:
            t0 = time.monotonic()
            slow = st.prefetch(slow_tokens)
            fast = st.prefetch(fast_tokens)  # all of it in L1
            assert time.monotonic() - t0 < 0.5, "prefetch must return at once"
            t0 = time.monotonic()
            assert st.lookup_async(fast, timeout_s=2.0) == 8 * CT
            assert time.monotonic() - t0 < 0.5, "an L1-resident request waited on another's prefetch"
            t0 = time.monotonic()
            assert st.lookup_async(slow, timeout_s=0.3) == 3 * CT  # chunk 1 hit, chunk 3 not yet
            assert 0.25 <= time.monotonic() - t0 < 1.0
            # with no hit at all, rank 1 reports its first owned chunk's start, not 0
            st.l1.pop(slow_keys[1])
            empty = st.prefetch(slow_tokens)
            assert st.lookup_async(empty, timeout_s=0.1) == 1 * CT
            assert slow.wait(5.0) and slow.error is not None  # the client timed out: this request only
        finally:
            os.kill(valkey_server.pid, signal.SIGCONT)
        # the tier is back and the store works again
        again = st.prefetch(slow_tokens)
        assert st.lookup_async(again, timeout_s=5.0) == 8 * CT and again.error is None
        assert st.lookup(slow_tokens) == 8 * CT
    finally:
        st.close()


def test_failed_prefetch_of_one_request_does_not_touch_another(valkey_server):
    import redis

    st = make_store(0, 1, valkey_server.url)
    try:
        a_tokens, a_chunks = prompt(5, 6 * CT)
        b_tokens, b_chunks = prompt(6, 6 * CT)
        st.store(a_tokens, a_chunks)
        st.store(b_tokens, b_chunks)
        for k in st.keys(a_tokens) + st.keys(b_tokens):
            st.l1.pop(k)
        # request A's chunk 2 has the wrong size in L2: a miss there, nothing else
        redis.Redis(host=valkey_server.host, port=valkey_server.port).set(st.keys(a_tokens)[2], b"x" * 7)
        ra, rb = st.prefetch(a_tokens), st.prefetch(b_tokens)
        assert st.lookup_async(ra, timeout_s=5.0) == 2 * CT
        assert st.lookup_async(rb, timeout_s=5.0) == 6 * CT
    finally:
        st.close()


# ---------------------------------------------------------------- policy
def test_policy_reports_zero_when_loading_is_slower(valkey_server):
    from kvctl.core import cost
    from kvctl.connector.store import LoadPolicy

    s, r, t0 = 48.4e3, 52.2e3, 0.33  # GLM-5.3 FP8 on B300 (paper §4)
    fast = LoadPolicy(s, r, t0, bandwidth_gbps=10.76)
    assert not fast.load_wins(16_000, None)  # below n* = R*T0 ~ 17k: never
    assert fast.load_wins(64_000, None)
    assert not LoadPolicy(s, r, t0, bandwidth_gbps=2.0).load_wins(10**7, None)  # B < B* = 2.53 GB/s
    for n in (1, 1000, 17_000, 30_000, 10**6):
        want = cost.load_s(n, s, 10.76, t0) <= cost.recompute_s(n, r)
        assert fast.load_wins(n, None) == want
    # monotone in n: once loading wins it keeps winning (why per-rank vetoes stay consistent)
    wins = [fast.load_wins(n, None) for n in range(1, 200_000, 997)]
    assert wins == sorted(wins)
    # no measured bandwidth yet and none configured: no veto
    assert LoadPolicy(s, r, t0).load_wins(10, None)

    tokens, chunks = prompt(7, 8 * CT)
    off = make_store(0, 1, valkey_server.url)
    slow = make_store(0, 1, valkey_server.url, policy=LoadPolicy(1e6, 1e9, 0.0, bandwidth_gbps=0.001))
    quick = make_store(0, 1, valkey_server.url, policy=LoadPolicy(1.0, 1.0, 0.0, bandwidth_gbps=1000.0))
    try:
        off.store(tokens, chunks)
        assert off.lookup(tokens) == 8 * CT
        assert slow.lookup(tokens) == 0  # L2 has it, but loading is predicted slower
        assert slow.lookup_async(slow.prefetch(tokens), timeout_s=5.0) == 0
        assert quick.lookup(tokens) == 8 * CT
    finally:
        for st in (off, slow, quick):
            st.close()


# ------------------------------------------------------- multi-process load
def store_worker(rank: int, world: int, urls: list[str], seed: int, budget_s: float) -> dict:
    import redis
    import torch.distributed as dist

    from kvctl.connector.urls import parse_resp_url

    st = make_store(rank, world, urls, budget=world * 12 * NBYTES)  # small L1: LRU evictions happen
    u = parse_resp_url(urls[rank])
    admin = redis.Redis(host=u.host, port=u.port, socket_timeout=5)
    out = {"trials": 0, "lookups": [], "async": [], "prefixes": [], "expected": [], "errors": []}
    start = time.monotonic()
    trial = 0
    while True:
        stop = torch.tensor([1 if time.monotonic() - start > budget_s else 0])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item():
            break
        rng = random.Random(f"{seed}/{trial}")
        n_tokens = rng.randint(0, 16 * CT)
        tokens, chunks = prompt(rng.randrange(1 << 30), n_tokens)
        st.store(tokens, chunks)
        keys = st.keys(tokens)
        present = [rng.random() > 0.1 for _ in keys]
        for c in range(rank, len(keys), world):
            if not present[c]:
                st.l1.pop(keys[c])
                admin.delete(keys[c])
            elif rng.random() < 0.3:
                st.l1.pop(keys[c])
        expected = next((c for c, p in enumerate(present) if not p), len(keys))
        out["lookups"].append(st.lookup(tokens))
        out["async"].append(st.lookup_async(st.prefetch(tokens), timeout_s=5.0))
        res = st.load(tokens)
        out["prefixes"].append(res.prefix)
        out["expected"].append(expected)
        if [as_bytes(t) for t in res.chunks] != [as_bytes(t) for t in chunks[: res.prefix]]:
            out["errors"].append(f"trial {trial}: loaded bytes differ from stored bytes")
        trial += 1
    out["trials"] = trial
    st.close()
    admin.close()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_sharded_store_load_across_ranks(world, valkey_factory):
    servers = [valkey_factory() for _ in range(world)]
    out = spawn_ranks(store_worker, world, ([s.url for s in servers], 77 + world, 3.0), timeout_s=90)
    assert not [e for o in out for e in o["errors"]]
    trials = out[0]["trials"]
    assert trials >= 20 and all(o["trials"] == trials for o in out)
    for t in range(trials):
        expected = out[0]["expected"][t]
        assert all(o["prefixes"][t] == expected for o in out), t  # same agreed prefix on every rank
        assert min(o["lookups"][t] for o in out) == expected * CT, t  # scheduler min = longest prefix
        assert [o["async"][t] for o in out] == [o["lookups"][t] for o in out], t


def two_group_worker(rank: int, world: int, urls: list[str], rounds: int) -> dict:
    """Each round: this thread loads prompt A over the store's group while a side thread loads B over its own."""
    import threading

    from kvctl.connector.protocol import member_group

    st = make_store(rank, world, urls)  # group None: the default (world) group
    side_group = member_group(range(world))
    tokens_a, chunks_a = prompt(11, 6 * CT)
    tokens_b, chunks_b = prompt(22, 5 * CT)
    st.store(tokens_a, chunks_a)
    st.store(tokens_b, chunks_b)
    stored = st.keys(tokens_a) + st.keys(tokens_b)
    both = threading.Barrier(2, timeout=20)
    side: dict = {}

    def side_load():
        try:
            both.wait()
            side["res"] = st.load(tokens_b, group=side_group)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            side["error"] = repr(exc)

    out = {"a": [], "b": [], "groups": [], "errors": []}
    for _ in range(rounds):
        for k in stored:
            st.l1.pop(k)  # every chunk comes from Valkey: the two loads overlap longer
        side.clear()
        t = threading.Thread(target=side_load, daemon=True)
        t.start()
        both.wait()
        res_a = st.load(tokens_a)
        t.join(timeout=20)
        if "res" not in side:
            out["errors"].append(side.get("error", "side load did not finish"))
            break
        res_b = side["res"]
        out["a"].append((res_a.prefix, [as_bytes(c) for c in res_a.chunks] == [as_bytes(c) for c in chunks_a]))
        out["b"].append((res_b.prefix, [as_bytes(c) for c in res_b.chunks] == [as_bytes(c) for c in chunks_b]))
        out["groups"].append(st.group)
    st.close()
    return out


def test_concurrent_loads_on_two_groups_keep_their_own(valkey_factory):
    """Two loads at once on every rank, each over its own gloo group (the engine's sync path and a
    background load): each gets its own prompt's chunks, and the store's group is never changed."""
    servers = [valkey_factory() for _ in range(2)]
    out = spawn_ranks(two_group_worker, 2, ([s.url for s in servers], 4), timeout_s=60)
    for o in out:
        assert o["errors"] == []
        assert o["a"] == [(6, True)] * 4  # prompt A: 6 full chunks of CT tokens, all loaded, the stored bytes
        assert o["b"] == [(5, True)] * 4  # prompt B: 5
        assert o["groups"] == [None] * 4


def test_close_finishes_prefetches_it_cancels(valkey_server):
    """A prefetch still queued when the store closes is finished (done, no more hits), not left open."""
    import threading

    st = make_store(0, 1, valkey_server.url, prefetch_workers=1)
    gate = threading.Event()
    try:
        tokens, chunks = prompt(7, 4 * CT)
        st.store(tokens, chunks)
        for k in st.keys(tokens):
            st.l1.pop(k)
        st._executor.submit(gate.wait, 10)  # occupy the only prefetch worker
        req = st.prefetch(tokens)
        assert not req.done
    finally:
        st.close()
        gate.set()
    assert req.wait(2.0) and req.done
    assert req.error is not None
    assert st.lookup_async(req) == 0
