"""Worker side of KvctlConnector over W real gloo ranks and W real Valkey instances.

Each rank builds the connector's worker half around a real paged cache
(tensors shaped like vLLM's CPU MLA / GQA caches) and the real protocol,
store and RESP client. vLLM's own GroupCoordinator needs a full engine
start, and its prefill-context-parallel group cannot run on CPU at all
(config/vllm.py refuses PCP on the V1 CPU runner), so a stand-in object
carrying the gloo group plays vLLM's TP or PCP coordinator here.
"""

from __future__ import annotations


import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")


pytestmark = pytest.mark.engine

from tests.plugins.worker_rig import BS, CT, N_TOKENS, ROW, fill, make_worker, token_value  # noqa: E402,F401


def worker(rank, world, urls, kind, mla):
    from kvctl.connector.ownership import chunk_keys
    from kvctl.connector.resp import RespClient
    from kvctl.plugins.vllm import LoadSpec, SaveSpec
    from kvctl.connector.layouts import slots_for

    conn, caches = make_worker(rank, world, urls, kind, mla)
    tokens = list(range(500, 500 + N_TOKENS))
    blocks_a = [15, 3, 8, 1, 12, 6, 9, 0, 4]  # 9 blocks of 2 = 18 tokens
    fill(conn, blocks_a, rank)
    conn.worker.save(SaveSpec("a", tokens[:16], blocks_a[:8]))
    assert conn.worker.saver.wait_idle(20)  # saves are queued in order: wait for ours
    keys = chunk_keys(tokens[:16], CT, "m", conn.spec.fmt)
    with RespClient(urls[rank]) as cl:
        held = cl.batched_exists(keys)

    # load chunks 1..3 into fresh blocks; tokens 0..5 are "in vLLM's prefix cache" (skip 6: mid chunk 1)
    for t in caches.values():
        t.zero_()
    blocks_b = [2, 5, 7, 10, 11, 13, 14, 4, 9]
    conn.worker.load(LoadSpec("b", tokens[:16], first_chunk=1, end_chunk=4, skip_tokens=6, block_ids=blocks_b),
                     conn.worker.group)
    lay = conn.worker.layout
    got = lay.extract(slots_for(blocks_b, BS, 0, 16))
    first_errors = sorted(conn.get_block_ids_with_load_errors())

    # chunk 3 vanishes from its owner between lookup and load: the agreed prefix stops at chunk 3
    if rank == 3 % world:
        with RespClient(urls[rank]) as cl:
            cl.delete([keys[3]])
    torch.distributed.barrier()
    for t in caches.values():
        t.zero_()
    conn.worker.load(LoadSpec("c", tokens[:16], first_chunk=1, end_chunk=4, skip_tokens=4, block_ids=blocks_b),
                     conn.worker.group)
    got_short = lay.extract(slots_for(blocks_b, BS, 0, 16))
    errors = sorted(conn.get_block_ids_with_load_errors())
    stats = conn.get_kv_connector_stats()
    conn.shutdown()
    return {"held": held, "got": got.tolist(), "first_errors": first_errors, "got_short": got_short.tolist(),
            "errors": errors, "stats": dict(stats.data) if stats else {}}


def expected_token(t, layer, rank, mla):
    return token_value(t, layer, 0) + (0 if mla else 1000 * rank)


@pytest.mark.parametrize("kind,world,mla", [("pcp", 2, True), ("tp", 3, True), ("tp", 2, False)])
def test_worker_store_owner_pattern_offset_load_and_load_errors(kind, world, mla, valkey_factory, rank_pool):
    servers = [valkey_factory() for _ in range(world)]
    out = rank_pool(world).run(worker, ([s.url for s in servers], kind, mla), timeout_s=120)
    for r, res in enumerate(out):
        # instance r holds exactly the chunks c with c % W == r (4 full chunks)
        assert res["held"] == [c % world == r for c in range(4)], (r, res["held"])
        got = torch.tensor(res["got"])
        for t in range(16):
            for layer in range(2):
                want = expected_token(t, layer, r, mla) if t >= 6 else 0.0  # tokens < 6 untouched
                assert got[layer, t].flatten()[0].item() == want, (r, t, layer)
        assert res["first_errors"] == []
        # second load: chunks 1, 2 agreed (tokens 4..11), chunk 3 (tokens 12..15 = blocks_b[6], [7]) failed
        short = torch.tensor(res["got_short"])
        for t in range(16):
            want = expected_token(t, 0, r, mla) if 4 <= t < 12 else 0.0
            assert short[0, t].flatten()[0].item() == want, (r, t)
        assert res["errors"] == [4, 14]
    # counted once, on group rank 0: 3 chunks planned, 2 agreed
    assert out[0]["stats"]["kvctl:agreed_prefix_shortfall_chunks"] == 1
    assert out[0]["stats"]["kvctl:load_errors"] == 1
    assert "kvctl:load_errors" not in out[1]["stats"]
    # GET bytes: each rank read its own owned chunks of loads 1 and 2
    assert sum(o["stats"]["kvctl:l2_get_bytes"] for o in out) > 0


def test_shard_group_kind():
    from kvctl.plugins.vllm import shard_group_kind
    from kvctl.connector.settings import ConnectorConfigError

    assert shard_group_kind(2, 1, 1) == "tp" and shard_group_kind(1, 4, 1) == "pcp" and shard_group_kind(1, 1, 1) == "tp"
    with pytest.raises(ConnectorConfigError, match="not both"):
        shard_group_kind(2, 2, 1)
    with pytest.raises(ConnectorConfigError, match="pipeline"):
        shard_group_kind(2, 1, 2)


def test_shard_group_size_is_tp_or_pcp():
    """W (the `kvctl:ranks` gauge and the store's world size): TP=2 -> 2 ranks; PCP=4 (TP=1) -> 4; a bare engine -> 1."""
    from types import SimpleNamespace

    from kvctl.plugins.vllm_meta import shard_group

    def pc(tp, pcp, pp=1):
        return SimpleNamespace(tensor_parallel_size=tp, prefill_context_parallel_size=pcp, pipeline_parallel_size=pp)

    assert shard_group(pc(2, 1)) == ("tp", 2)
    assert shard_group(pc(1, 4)) == ("pcp", 4)
    assert shard_group(pc(1, 1)) == ("tp", 1)
    assert shard_group(SimpleNamespace(tensor_parallel_size=8, pipeline_parallel_size=1)) == ("tp", 8)  # no PCP field


def insert_fails_worker(rank, world, urls, exc_name="RuntimeError"):
    """GQA, W=2: every rank stores, then loads chunks 1..3 while rank 1's cache write fails.

    The agreed prefix is 3 chunks on both ranks; only rank 1 could not write them. Both
    ranks must then keep the same "loaded up to" mark (chunk 1 + 3 = 4): the next save of
    the request runs an all-gather of KV heads on every rank or on none.
    """
    from kvctl.plugins.vllm import LoadSpec, SaveSpec

    conn, caches = make_worker(rank, world, urls, "tp", mla=False)
    tokens = list(range(700, 700 + N_TOKENS))
    blocks = [15, 3, 8, 1, 12, 6, 9, 0, 4]
    fill(conn, blocks, rank)
    conn.worker.save(SaveSpec("s", tokens[:16], blocks[:8]))
    assert conn.worker.saver.wait_idle(20)
    torch.distributed.barrier()
    exc_type = {"RuntimeError": RuntimeError, "KeyboardInterrupt": KeyboardInterrupt}[exc_name]
    if rank == 1:
        def broken_insert(slots, data):
            raise exc_type("injected cache-write failure")
        conn.worker.layout.insert = broken_insert
    raised = None
    try:
        conn.worker.load(LoadSpec("d", tokens[:16], first_chunk=1, end_chunk=4, skip_tokens=4, block_ids=blocks),
                         conn.worker.group)
    except KeyboardInterrupt as exc:  # re-raised, but only after the blocks were marked bad
        raised = type(exc).__name__
    errors = sorted(conn.get_block_ids_with_load_errors())
    loaded_end = conn.worker.loaded_end["d"]
    conn.worker.save(SaveSpec("d", tokens[:16], blocks[:8]))  # nothing left to store: must not enter a collective alone
    assert conn.worker.saver.wait_idle(20)
    total = torch.tensor([rank + 1])
    torch.distributed.all_reduce(total)  # both ranks reach this: 1 + 2 = 3
    conn.shutdown()
    return {"errors": errors, "loaded_end": loaded_end, "sum": int(total.item()), "raised": raised}


@pytest.mark.parametrize("exc_name", ["RuntimeError", "KeyboardInterrupt"])
def test_a_cache_write_failing_on_one_rank_keeps_the_ranks_in_step(exc_name, valkey_factory, rank_pool):
    """Before the fix rank 1 marked 0 chunks loaded (rank 0: 3) and its next save entered the GQA all-gather alone;
    a KeyboardInterrupt left its blocks unmarked, so vLLM would have used a half-written cache."""
    servers = [valkey_factory() for _ in range(2)]
    r0, r1 = rank_pool(2).run(insert_fails_worker, ([s.url for s in servers], exc_name), timeout_s=90)
    assert r0["raised"] is None and r1["raised"] == (exc_name if exc_name == "KeyboardInterrupt" else None)
    assert r0["loaded_end"] == r1["loaded_end"] == 4
    assert r0["errors"] == [] and r0["sum"] == r1["sum"] == 3
    # rank 1 recomputes from chunk 1, token 4 (skip_tokens) = block 2 of 2-token blocks, up to token 16 = block 8
    assert r1["errors"] == sorted([8, 1, 12, 6, 9, 0]), r1["errors"]


def striped_worker(rank, world, rank_urls):
    """W ranks, K = 2 instances a rank: a save lands by (c // W) mod K, a load reads it back, phases counted."""
    from kvctl.connector.ownership import chunk_keys
    from kvctl.connector.resp import RespClient
    from kvctl.plugins.vllm import LoadSpec, SaveSpec
    from kvctl.connector.layouts import slots_for

    conn, caches = make_worker(rank, world, rank_urls, "tp", mla=True)
    assert conn.spec.settings.instances_per_rank == 2
    tokens = list(range(900, 900 + N_TOKENS))
    blocks = [15, 3, 8, 1, 12, 6, 9, 0, 4]
    fill(conn, blocks, rank)
    conn.worker.save(SaveSpec("a", tokens[:16], blocks[:8]))
    assert conn.worker.saver.wait_idle(20)
    keys = chunk_keys(tokens[:16], CT, "m", conn.spec.fmt)
    held = []
    for url in rank_urls[rank]:
        with RespClient(url) as cl:
            held.append(cl.batched_exists(keys))
    torch.distributed.barrier()
    for t in caches.values():
        t.zero_()
    conn.worker.load(LoadSpec("b", tokens[:16], first_chunk=0, end_chunk=4, skip_tokens=0, block_ids=blocks),
                     conn.worker.group)
    got = conn.worker.layout.extract(slots_for(blocks, BS, 0, 16))
    stats = conn.get_kv_connector_stats()
    conn.shutdown()
    return {"held": held, "got": got.tolist(), "errors": sorted(conn.get_block_ids_with_load_errors()),
            "stats": dict(stats.data) if stats else {}}


def test_two_instances_per_rank_hold_the_partition_and_load_back(valkey_factory, rank_pool):
    world = 2
    servers = [valkey_factory() for _ in range(2 * world)]
    rank_urls = [[servers[2 * r].url, servers[2 * r + 1].url] for r in range(world)]
    out = rank_pool(world).run(striped_worker, (rank_urls,), timeout_s=120)
    for r, res in enumerate(out):
        for i in range(2):
            # instance i of rank r holds exactly the chunks c with c % W == r and (c // W) % 2 == i
            assert res["held"][i] == [c % world == r and (c // world) % 2 == i for c in range(4)], (r, i, res["held"])
        got = torch.tensor(res["got"])
        assert all(got[layer, t, 0].item() == expected_token(t, layer, r, True) for t in range(16) for layer in range(2))
        assert res["errors"] == []
        st = res["stats"]
        assert st["kvctl:loads"] == 1 and st["kvctl:chunks_stored"] == 2
        assert st["kvctl:load_seconds"] >= st["kvctl:load_get_seconds"] > 0


def drain_worker(rank, world, url, pid):
    """Saves queued behind a stopped instance: shutdown abandons them after save_drain_s and says so."""
    import logging
    import os
    import signal
    import time

    from kvctl.plugins.vllm import SaveSpec

    records = []

    class Grab(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("vllm").addHandler(Grab())
    conn, caches = make_worker(rank, world, [url], "tp", mla=True, save_drain_s=0.5, timeout_s=5.0)
    blocks = [15, 3, 8, 1, 12, 6, 9, 0, 4]
    fill(conn, blocks, rank)
    os.kill(pid, signal.SIGSTOP)
    try:
        for i in range(3):  # three prompts' saves: the first blocks in its SET, two wait behind it
            conn.worker.save(SaveSpec(f"r{i}", list(range(100 * i, 100 * i + 16)), blocks[:8]))
        t0 = time.monotonic()
        conn.shutdown()
        took = time.monotonic() - t0
    finally:
        os.kill(pid, signal.SIGCONT)
    stats = conn.stats.take()
    return {"took": took, "logs": records, "abandoned": (stats.data if stats else {}).get("kvctl:saves_abandoned")}


def save_queue_worker(rank, world, url, pid):
    """Saves behind a stopped instance with save_queue_bytes of one prompt: the first is taken, the next two are
    dropped at once (counted, logged once); once the tier answers, the first prompt's chunks are in it."""
    import logging
    import os
    import signal
    import time

    from kvctl.plugins.vllm import SaveSpec

    records = []

    class Grab(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("vllm").addHandler(Grab())
    one_prompt = 2 * 16 * ROW * 4  # both layers of a 16-token prompt's rows, float32: MLA's extracted bytes
    conn, caches = make_worker(rank, world, [url], "tp", mla=True, save_queue_bytes=one_prompt, timeout_s=5.0)
    blocks = [15, 3, 8, 1, 12, 6, 9, 0, 4]
    fill(conn, blocks, rank)
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        for i in range(3):
            conn.worker.save(SaveSpec(f"r{i}", list(range(100 * i, 100 * i + 16)), blocks[:8]))
        took = time.monotonic() - t0
        pending = conn.worker.saver.pending_bytes
    finally:
        os.kill(pid, signal.SIGCONT)
    idle = conn.worker.saver.wait_idle(10.0)
    stats = conn.stats.take()
    conn.shutdown()
    data = stats.data if stats else {}
    return {"took": took, "pending": pending, "one_prompt": one_prompt, "idle": idle, "logs": records,
            "dropped": data.get("kvctl:saves_dropped"), "stored_chunks": data.get("kvctl:chunks_stored")}


def test_saves_past_save_queue_bytes_are_dropped_at_once_and_counted(valkey_factory, rank_pool):
    server = valkey_factory()
    (res,) = rank_pool(1).run(save_queue_worker, (server.url, server.pid), timeout_s=60)
    assert res["took"] < 1.0, res  # the engine's step never waits for the stopped tier
    assert res["pending"] == res["one_prompt"], res
    assert res["dropped"] == 2 and res["idle"], res
    assert res["stored_chunks"] == 16 // CT, res  # the one prompt taken reached the tier
    assert sum("a save dropped" in m for m in res["logs"]) == 1, res["logs"]


def test_shutdown_abandons_pending_saves_within_its_bound_and_says_how_many(valkey_factory, rank_pool):
    server = valkey_factory()
    (res,) = rank_pool(1).run(drain_worker, (server.url, server.pid), timeout_s=60)
    assert res["took"] < 2.0, res
    assert res["abandoned"] == 3
    assert any("3 abandoned after save_drain_s=0.5" in m for m in res["logs"]), res["logs"]
