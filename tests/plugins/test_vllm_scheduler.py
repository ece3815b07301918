"""Scheduler side of KvctlConnector against two real Valkey instances.

vLLM's Request / SchedulerOutput / KVCacheBlocks are plain records here
(SimpleNamespace with the fields the connector reads); the tier, the keys
and the connector code are real.
"""

from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from kvctl.connector.resp import RespClient  # noqa: E402
from tests.plugins.scheduler_helpers import TOKENS, req, sched_out, scheduler, store_all  # noqa: E402

pytestmark = pytest.mark.engine


@pytest.fixture
def tier(valkey_factory):
    return [valkey_factory(), valkey_factory()]


def test_lookup_is_min_over_ranks_block_aligned_and_never_the_whole_prompt(tier):
    conn = scheduler([s.url for s in tier])
    keys = store_all(tier, conn.spec.fmt)
    assert conn.get_num_new_matched_tokens(req("r"), 0) == (16, False)
    assert conn.get_num_new_matched_tokens(req("r"), 0) == (16, False)  # asking again changes nothing
    # vLLM's prefix cache already holds 6 tokens (3 blocks): 16 - 6 = 10 more from the tier
    assert conn.get_num_new_matched_tokens(req("r"), 6) == (10, False)
    # a 16-token prompt: its last token is always computed -> (16 - 1) // 4 = 3 chunks = 12 tokens
    assert conn.get_num_new_matched_tokens(req("s", TOKENS[:16]), 0) == (12, False)
    with RespClient(tier[0].url) as cl:
        cl.delete([keys[2]])
    # a new request sees the gap ("r", still waiting, keeps its answer: see the EXISTS-count test)
    assert conn.get_num_new_matched_tokens(req("t"), 0) == (8, False)
    assert conn.get_num_new_matched_tokens(req("t"), 8) == (0, False)
    conn.shutdown()


def exists_calls(servers):
    import redis

    out = []
    for s in servers:
        with redis.Redis(host=s.host, port=s.port, socket_timeout=5) as r:
            out.append(int(r.info("commandstats").get("cmdstat_exists", {}).get("calls", 0)))
    return out


def test_a_waiting_request_is_looked_up_once_until_its_tokens_change_or_timeout_s(tier):
    import redis

    timeout_s = 1.0
    conn = scheduler([s.url for s in tier], timeout_s=timeout_s)
    store_all(tier, conn.spec.fmt)
    for s in tier:
        with redis.Redis(host=s.host, port=s.port, socket_timeout=5) as r:
            r.config_resetstat()
    # 17 tokens: loadable chunks 0..3; rank 0's instance owns chunks 0 and 2, rank 1's 1 and 3:
    # one lookup = 2 EXISTS on each instance
    w = req("w")
    for _ in range(5):  # vLLM asks at every step while it cannot schedule the request
        assert conn.get_num_new_matched_tokens(w, 0) == (16, False)
    assert exists_calls(tier) == [2, 2]
    # a larger local prefix (2 chunks = 8 tokens) narrows the same answer: no new lookup
    assert conn.get_num_new_matched_tokens(w, 8) == (8, False)
    assert exists_calls(tier) == [2, 2]
    # another request has its own answer: + 2 per instance
    assert conn.get_num_new_matched_tokens(req("x"), 0) == (16, False)
    assert exists_calls(tier) == [4, 4]
    # the request's token count changes (e.g. resumed after a preemption with output tokens): asked again
    w.num_tokens = len(TOKENS) + 3
    assert conn.get_num_new_matched_tokens(w, 0) == (16, False)
    assert exists_calls(tier) == [6, 6]
    assert conn.get_num_new_matched_tokens(w, 0) == (16, False)
    assert exists_calls(tier) == [6, 6]
    # older than timeout_s: asked again
    time.sleep(timeout_s + 0.1)
    assert conn.get_num_new_matched_tokens(w, 0) == (16, False)
    assert exists_calls(tier) == [8, 8]
    # scheduled (allocated with no external tokens): its answer is dropped, the next ask looks up again
    conn.update_state_after_alloc(w, SimpleNamespace(get_block_ids=lambda: ([],)), 0)
    assert conn.get_num_new_matched_tokens(w, 0) == (16, False)
    assert exists_calls(tier) == [10, 10]
    # finished: dropped too
    conn.request_finished(w, [])
    assert len(conn.scheduler.sync_answers) == 1  # only "x" (still waiting) is kept
    conn.shutdown()


def test_alloc_plans_an_offset_load_and_prefill_completion_plans_the_save(tier):
    from kvctl.plugins.vllm import KvctlConnectorMetadata

    conn = scheduler([s.url for s in tier])
    store_all(tier, conn.spec.fmt)
    r = req("r")
    assert conn.get_num_new_matched_tokens(r, 6) == (10, False)
    blocks = [11, 3, 7, 9, 2, 5, 8, 1, 4]
    conn.update_state_after_alloc(r, SimpleNamespace(get_block_ids=lambda: (blocks,)), 10)
    meta = conn.build_connector_meta(sched_out(new=[("r", TOKENS, blocks, 16)], scheduled={"r": 1}))
    assert isinstance(meta, KvctlConnectorMetadata)
    (load,) = meta.loads
    # chunks 1..3 (chunk 0 is local), tokens 6.. written (4, 5 are local too)
    assert (load.first_chunk, load.end_chunk, load.skip_tokens, load.block_ids) == (1, 4, 6, blocks)
    assert load.token_ids == TOKENS[:16] and not load.is_async
    (save,) = meta.saves  # 16 + 1 scheduled = the whole prompt: store its 4 full chunks (8 blocks)
    assert save.token_ids == TOKENS[:16] and save.block_ids == blocks[:8]
    stats = conn.get_kv_connector_stats().data
    # 10 tokens = 2 chunks of the 3 past chunk 0; one lookup of the tier, timed
    lookup_s = stats.pop("kvctl:lookup_seconds")
    # and the decision: nothing measured yet, so the hit loads (issue 46: no veto on no data)
    from kvctl.connector.metric_names import LOAD_DECISIONS, labelled

    assert stats == {"kvctl:chunks_hit": 2, "kvctl:chunks_missed": 1, "kvctl:remote_hit_tokens": 10, "kvctl:lookups": 1,
                     labelled(LOAD_DECISIONS, "load", "no_data"): 1}
    assert 0 < lookup_s < 5
    assert conn.build_connector_meta(sched_out()).loads == []  # planned once
    conn.shutdown()


def test_chunked_prefill_preemption_and_finish(tier):
    conn = scheduler([s.url for s in tier])
    # vLLM calls update_state_after_alloc for every request it schedules from the waiting queue
    conn.update_state_after_alloc(req("p"), SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4],)), 0)
    # step 1 of a chunked prefill: 8 of 17 tokens -> nothing to save yet
    m1 = conn.build_connector_meta(sched_out(new=[("p", TOKENS, [1, 2, 3, 4], 0)], scheduled={"p": 8}))
    assert m1.saves == []
    # step 2: 9 more tokens with 5 new blocks -> the prompt is done: save its 4 chunks = blocks 1..8
    m2 = conn.build_connector_meta(sched_out(cached=[("p", [5, 6, 7, 8, 9], 8, False)], scheduled={"p": 9}))
    (save,) = m2.saves
    assert save.block_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    # preempted and resumed: the resumed request carries all its new blocks; saved once only
    m3 = conn.build_connector_meta(sched_out(cached=[("p", [20, 21, 22, 23, 24, 25, 26, 27, 28], 0, True)],
                                             scheduled={"p": 17}))
    assert m3.saves == [] and conn.scheduler.requests["p"].block_ids == [20, 21, 22, 23, 24, 25, 26, 27, 28]
    # finish (or abort) forgets the request
    conn.request_finished(req("p"), [])
    assert "p" not in conn.scheduler.requests
    conn.build_connector_meta(sched_out(new=[("q", TOKENS, [1], 0)], scheduled={"q": 2}))
    conn.build_connector_meta(sched_out(finished=["q"]))
    assert "q" not in conn.scheduler.requests
    conn.shutdown()


def test_async_lookup_answers_later_and_a_stopped_instance_recomputes(tier):
    conn = scheduler([s.url for s in tier], async_loading=True)
    store_all(tier, conn.spec.fmt)
    r = req("a")
    answer, deadline = (None, False), time.monotonic() + 10
    while answer[0] is None and time.monotonic() < deadline:
        answer = conn.get_num_new_matched_tokens(r, 0)
        time.sleep(0.01)
    assert answer == (16, True)
    os.kill(tier[1].pid, signal.SIGSTOP)
    try:
        r2 = req("b")
        t0 = time.monotonic()
        answer = conn.get_num_new_matched_tokens(r2, 0)
        assert answer == (None, False)  # still asking: the scheduler tries again next step
        while answer[0] is None and time.monotonic() - t0 < 10:
            time.sleep(0.05)
            answer = conn.get_num_new_matched_tokens(r2, 0)
        elapsed = time.monotonic() - t0
    finally:
        os.kill(tier[1].pid, signal.SIGCONT)
    assert answer == (0, False)
    assert elapsed < 2 * 1.0 + 1.0  # 2 x timeout_s, then recompute
    assert conn.get_kv_connector_stats().data["kvctl:lookup_timeouts"] == 1
    conn.shutdown()


def test_load_policy_vetoes_on_the_engine_wide_estimate_and_reprobes(tier):
    from kvctl.plugins.vllm_stats import KvctlConnectorStats

    # chunk = 2 layers x 4 tokens x 6 x 4 bytes = 192 B -> s = 48 B/token; R = 1000 tok/s -> B* = 48 kB/s
    conn = scheduler([s.url for s in tier], load_policy={"prefill_tokens_per_s": 1000, "reprobe_after_s": 0.5})
    store_all(tier, conn.spec.fmt)
    assert conn.get_num_new_matched_tokens(req("r"), 0) == (16, False)  # nothing measured yet
    # the workers report 1000 B in 1 s summed over their 2 ranks: 2 x 1 kB/s = 2 kB/s < B*, loading 16 tokens is slower
    conn.update_connector_output(SimpleNamespace(kv_connector_stats=KvctlConnectorStats(
        data={"kvctl:l2_get_bytes": 1000, "kvctl:l2_get_seconds": 1.0})))
    assert conn.get_num_new_matched_tokens(req("r"), 0) == (0, False)
    time.sleep(0.6)
    assert conn.get_num_new_matched_tokens(req("r"), 0) == (16, False)  # re-probe: not locked out
    assert conn.get_num_new_matched_tokens(req("r"), 0) == (16, False)  # asked again before it is scheduled: the same
    assert conn.get_num_new_matched_tokens(req("r2"), 0) == (0, False)  # one probe per period
    conn.shutdown()


def test_a_reprobe_of_a_long_hit_loads_a_few_chunks_a_rank_not_the_whole_hit(tier):
    """20 chunks held; the tier at 1 kB/s a rank (B* = 48 kB/s): the re-probe loads the floor, 4 chunks a rank (8 chunks,
    32 tokens; each rank's 4 GETs measure it again), since a ninth chunk's excess over its recompute (0.96 s) passes
    50 ms. It loaded all 80 tokens before, holding a sync engine for 10 x 0.19 s."""
    from kvctl.plugins.vllm_stats import KvctlConnectorStats

    tokens = list(range(300, 381))  # 81 tokens: 20 loadable chunks
    conn = scheduler([s.url for s in tier], load_policy={"prefill_tokens_per_s": 1000, "reprobe_after_s": 0.5})
    store_all(tier, conn.spec.fmt, tokens[:80])
    conn.update_connector_output(SimpleNamespace(kv_connector_stats=KvctlConnectorStats(
        data={"kvctl:l2_get_bytes": 1000, "kvctl:l2_get_seconds": 1.0})))
    assert conn.get_num_new_matched_tokens(req("long", tokens), 0) == (0, False)  # vetoed
    time.sleep(0.6)
    assert conn.get_num_new_matched_tokens(req("long", tokens), 0) == (32, False)  # the bounded probe
    conn.shutdown()
