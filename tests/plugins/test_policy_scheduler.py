"""The queue-aware decision in KvctlConnector's scheduler side (issue 46 items 1-3), on two real Valkey instances.

The scheduler set-up of tests/plugins/scheduler_helpers.py: W = 2, MLA, a 4-token chunk is 192 B (2 layers × 6 ×
float32), all of it on its owner; 17-token prompts hit 4 chunks (16 tokens), 2 on each rank. vLLM's records are
SimpleNamespaces; the tier, the lookups, the decision and the connector are real.
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from kvctl.connector import metric_names as M  # noqa: E402
from kvctl.connector.policy import TierQueue  # noqa: E402
from tests.plugins.scheduler_helpers import TOKENS, req, sched_out, scheduler, store_all  # noqa: E402

pytestmark = pytest.mark.engine


def rank_gets(bps: float, seconds: float = 1.0) -> dict:
    """The workers' per-rank GET figures of one interval: both ranks at ``bps`` bytes/s."""
    return {M.labelled(M.RANK_GET_BYTES, r): bps * seconds for r in range(2)} | \
        {M.labelled(M.RANK_GET_SECONDS, r): seconds for r in range(2)}


def output(data=None, finished=()):
    from kvctl.plugins.vllm_stats import KvctlConnectorStats

    return SimpleNamespace(kv_connector_stats=KvctlConnectorStats(data=dict(data or {})) if data else None,
                           finished_recving=set(finished))


def blocks(n=9):
    return SimpleNamespace(get_block_ids=lambda: (list(range(n)),))


class FrozenClock:
    """The decision's clock, moved by hand: a load planned drains from the queue only as the test advances it."""

    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def frozen(conn) -> FrozenClock:
    clock = FrozenClock()
    conn.scheduler.policy.clock = clock
    return clock


def events(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def decision_events(path):
    """The trace's ``decision`` events by request."""
    return {e["req"]: e for e in events(path) if e["ev"] == "decision"}


@pytest.fixture
def tier(valkey_factory):
    return [valkey_factory(), valkey_factory()]


def sync_behind_a(tier):
    """A sync scheduler side (R = 1000 tok/s, T0 0, each rank measured at 40 kB/s, the clock frozen) whose first
    request, a, hit all 16 tokens and has its load planned."""
    conn = scheduler([s.url for s in tier], load_policy={"prefill_tokens_per_s": 1000, "t0_s": 0.0})
    frozen(conn)
    try:
        store_all(tier, conn.spec.fmt)
        conn.update_connector_output(output(rank_gets(40_000)))
        assert conn.get_num_new_matched_tokens(req("a"), 0) == (16, False)
        conn.update_state_after_alloc(req("a"), blocks(), 16)
    except BaseException:
        conn.shutdown()
        raise
    return conn


def test_a_load_queued_ahead_turns_the_next_hit_into_a_recompute_until_it_is_done(tier, tmp_path, monkeypatch):
    """R = 1000 tok/s (given), T0 0; each rank measured at 40 kB/s. A hit moves 2 chunks a rank, 384 B: 9.6 ms idle
    against 16 ms of recompute: load. With that load planned, the next hit waits behind it on both ranks:
    (384 + 384) / 40k = 19.2 ms > 16 ms: recompute (tier queue). Once the step that loads it is back, the queue is
    empty and the next hit loads again. Counted by decision and reason, and traced with the predictions."""
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("KVCTL_CONNECTOR_TRACE", str(trace))
    conn = sync_behind_a(tier)
    try:
        assert conn.get_num_new_matched_tokens(req("b"), 0) == (0, False)  # queued behind a
        conn.update_state_after_alloc(req("b"), blocks(), 0)
        meta = conn.build_connector_meta(sched_out())
        (spec,) = meta.loads
        assert spec.req_id == "a" and spec.budget_s is None  # a sync load is judged, never cut short
        assert conn.get_num_new_matched_tokens(req("c"), 0) == (0, False)  # a's step is not back yet
        conn.update_connector_output(output())  # a's step is done
        assert conn.get_num_new_matched_tokens(req("c"), 0) == (16, False)
        conn.update_state_after_alloc(req("c"), blocks(), 16)
        data = conn.get_kv_connector_stats().data
        assert data[M.labelled(M.LOAD_DECISIONS, "load", "wins")] == 2
        assert data[M.labelled(M.LOAD_DECISIONS, "recompute", "tier_queue")] == 1
    finally:
        conn.shutdown()
        conn.trace.close()
    decisions = decision_events(trace)
    assert decisions["a"]["predicted_load_s"] == pytest.approx(0.0096) and decisions["a"]["tokens"] == 16
    assert decisions["b"]["reason"] == "tier_queue" and decisions["b"]["predicted_load_s"] == pytest.approx(0.0192)
    assert decisions["b"]["loads_ahead"] == 1 and decisions["b"]["queued_bytes"] == 384
    assert decisions["b"]["tier_gbps"] == pytest.approx(80e3 / 1e9)
    lookups = [e for e in events(trace) if e["ev"] == "lookup"]
    assert lookups and all(len(e["key0"]) == 16 and len(e["tok0"]) == 16 for e in lookups)
    # kvctl explain reads the trace this scheduler side wrote
    from kvctl.ops.explain import LOADED, POLICY, explain

    stories = {st.req: st for st in explain(trace).requests}
    assert stories["b"].cause == POLICY and "queue" in stories["b"].detail and stories["b"].found_tokens == 16
    assert stories["a"].cause == stories["c"].cause == LOADED and stories["a"].loaded_tokens == 16


def test_a_hit_the_decision_recomputes_is_not_saved_again_and_a_loaded_one_saves_from_its_load(tier):
    """A vetoed hit (b, behind a's load) is recomputed whole: its 4 chunks are in the tier (the lookup found them),
    so its save starts after them and sends nothing. A loaded hit (a) and a miss (m) save from chunk 0: the
    worker starts after what the load wrote, so a chunk that went between lookup and load is saved again."""
    conn = sync_behind_a(tier)
    try:
        assert conn.get_num_new_matched_tokens(req("b"), 0) == (0, False)
        conn.update_state_after_alloc(req("b"), blocks(), 0)
        other = list(range(500, 517))
        assert conn.get_num_new_matched_tokens(req("m", other), 0) == (0, False)
        conn.update_state_after_alloc(req("m", other), blocks(), 0)
        meta = conn.build_connector_meta(sched_out(new=[("a", TOKENS, list(range(9)), 16), ("b", TOKENS, list(range(9)), 0),
                                                        ("m", other, list(range(9)), 0)],
                                                   scheduled={"a": 1, "b": 17, "m": 17}))
        saves = {sp.req_id: sp for sp in meta.saves}
        assert {r: saves[r].first_chunk for r in saves} == {"a": 0, "b": 4, "m": 0}
        assert all(len(sp.token_ids) == 16 for sp in saves.values())
    finally:
        conn.shutdown()


def test_a_load_planned_drains_from_the_queue_at_the_measured_bandwidth_before_vllm_reports_it(tier):
    """vLLM reports an async load received only at the end of the step in which it finished. Each rank at 40 kB/s:
    a's 384 B a rank take 9.6 ms. Asked 5 ms after a was planned, b waits behind the 4.6 ms left of it (184 B a
    rank): 14.2 ms of load, under its 16 ms of recompute, so it loads (counted whole, a would have made it 19.2 ms: a veto). Asked
    10 ms after (both done by the tier's account, neither reported), c waits behind nothing; the queue is empty."""
    conn = scheduler([s.url for s in tier], async_loading=True, load_policy={"prefill_tokens_per_s": 1000, "t0_s": 0.0})
    clock = frozen(conn)
    try:
        store_all(tier, conn.spec.fmt)
        conn.update_connector_output(output(rank_gets(40_000)))
        assert wait_answer(conn, req("a")) == (16, True)
        conn.update_state_after_alloc(req("a"), blocks(), 16)
        q = conn.scheduler.policy.queue()
        assert (q.loads, q.rank_bytes) == (1, (384, 384))
        clock.t += 0.005
        q = conn.scheduler.policy.queue()
        assert q.loads == 1 and q.rank_bytes == (pytest.approx(184, abs=1), pytest.approx(184, abs=1))
        assert wait_answer(conn, req("b")) == (16, True)
        conn.update_state_after_alloc(req("b"), blocks(), 16)
        clock.t += 0.020
        assert conn.scheduler.policy.queue() == TierQueue((0, 0), 0)
        assert wait_answer(conn, req("c")) == (16, True)
        data = conn.get_kv_connector_stats().data
        assert data[M.labelled(M.LOAD_DECISIONS, "load", "wins")] == 2
    finally:
        conn.shutdown()


def wait_answer(conn, r, local=0, timeout_s=10.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        answer = conn.get_num_new_matched_tokens(r, local)
        if answer[0] is not None:
            return answer
        time.sleep(0.01)
    raise AssertionError("no answer")


def test_an_async_hit_below_break_even_loads_the_prefix_the_engine_queue_hides(tier):
    """Each rank at 10 kB/s: a chunk takes 19.2 ms to load, 4 ms to recompute (below break-even), so a hit alone is
    recomputed. With 12 prompt tokens still to compute in the engine (a scheduled 20-token prompt, 8 done), an async
    load waits for them anyway: 2 chunks (one a rank, 19.2 ms) against (8 + 12) / 1000 = 20 ms wins, 3 chunks
    (38.4 ms against 24 ms) does not: 8 of the 16 tokens load."""
    conn = scheduler([s.url for s in tier], async_loading=True,
                     load_policy={"prefill_tokens_per_s": 1000, "t0_s": 0.0})
    frozen(conn)
    try:
        store_all(tier, conn.spec.fmt)
        conn.update_connector_output(output(rank_gets(10_000)))
        assert wait_answer(conn, req("alone")) == (0, False)
        conn.update_state_after_alloc(req("alone"), blocks(), 0)
        other = list(range(900, 920))
        conn.update_state_after_alloc(req("p", other), blocks(10), 0)
        conn.build_connector_meta(sched_out(new=[("p", other, list(range(10)), 0)], scheduled={"p": 8}))
        assert wait_answer(conn, req("r")) == (8, True)
        conn.update_state_after_alloc(req("r"), blocks(), 8)
        meta = conn.build_connector_meta(sched_out())
        (spec,) = meta.loads
        assert (spec.first_chunk, spec.end_chunk, spec.is_async) == (0, 2, True)
        assert spec.budget_s == pytest.approx(0.02)
        data = conn.get_kv_connector_stats().data
        assert data[M.labelled(M.LOAD_DECISIONS, "recompute", "below_breakeven")] == 1
        assert data[M.labelled(M.LOAD_DECISIONS, "partial", "below_breakeven")] == 1
        # the async load stays queued until vLLM reports it received
        assert conn.scheduler.policy.queue().loads == 1
        conn.update_connector_output(output(finished={"r"}))
        assert conn.scheduler.policy.queue().loads == 0
    finally:
        conn.shutdown()


def arrived_ago(r, now: float, ago: float):
    """The request ``r``, arrived ``ago`` seconds before ``now`` (vLLM's ``arrival_time``, wall clock)."""
    r.arrival_time = now - ago
    return r


def behind_one_load(tier, conn, now: float, shorts) -> None:
    """The line's set-up: the hits stored, each rank measured at 40 kB/s, request "a" (arrived 9 s ago) asked and its
    async load of 16 tokens planned, then each of ``shorts`` ((name, seconds ago)), too short to hit, asked."""
    store_all(tier, conn.spec.fmt)
    conn.update_connector_output(output(rank_gets(40_000)))
    assert wait_answer(conn, arrived_ago(req("a"), now, 9.0)) == (16, True)
    conn.update_state_after_alloc(req("a"), blocks(), 16)
    for rid, ago in shorts:
        assert conn.get_num_new_matched_tokens(arrived_ago(req(rid, TOKENS[:3]), now, ago), 0) == (0, False)


def test_an_async_hit_that_waited_in_vllms_line_loads_behind_a_busy_tier(tier, tmp_path, monkeypatch):
    """vLLM asks about a request at the head of its waiting line. R = 1000 tok/s, T0 0, each rank at 40 kB/s: a hit
    (2 chunks a rank, 384 B) loads in 9.6 ms idle against 16 ms of recompute. With one async load in flight it
    waits behind it: 19.2 ms > 16 ms. Five requests arrived over 9 s (two of them too short to hit): one that just
    arrived recomputes (asked before the one that waited: 3/9 per s, a credit of 0.33 × 16 ms × (0 + 16 ms), 0.09
    ms: tier queue); one that waited 7 s to be asked has about three requests behind it, and its credit is capped at
    1.5 × its recompute: 16 + 24 = 40 ms, it loads with that as its deadline. The wait and the rate are traced; a sync engine never counts them."""
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("KVCTL_CONNECTOR_TRACE", str(trace))
    conn = scheduler([s.url for s in tier], async_loading=True, load_policy={"prefill_tokens_per_s": 1000, "t0_s": 0.0})
    frozen(conn)
    now = time.time()

    def arrived(r, ago):
        return arrived_ago(r, now, ago)

    try:
        behind_one_load(tier, conn, now, (("short1", 8.5), ("short2", 8.0)))
        waited, fresh = arrived(req("waited"), 7.0), arrived(req("fresh"), 0.0)
        assert conn.scheduler.policy.arrivals.rate() == 0.0  # three arrivals so far: too few to tell
        assert wait_answer(conn, fresh) == (0, False)
        conn.update_state_after_alloc(fresh, blocks(), 0)
        assert conn.scheduler.policy.arrivals.rate() == pytest.approx(3 / 9, rel=0.01)  # waited: not asked yet
        assert wait_answer(conn, waited) == (16, True)
        conn.update_state_after_alloc(waited, blocks(), 16)
        loads = {spec.req_id: spec for spec in conn.build_connector_meta(sched_out()).loads}
        assert set(loads) == {"a", "waited"} and loads["waited"].budget_s == pytest.approx(0.040)
        data = conn.get_kv_connector_stats().data
        assert data[M.labelled(M.LOAD_DECISIONS, "load", "wins")] == 2
        assert data[M.labelled(M.LOAD_DECISIONS, "recompute", "tier_queue")] == 1
    finally:
        conn.shutdown()
        conn.trace.close()
    decisions = decision_events(trace)
    assert decisions["waited"]["line_wait_s"] == pytest.approx(7.0, abs=1.0)
    assert decisions["waited"]["arrival_rate"] == pytest.approx(4 / 9, abs=0.01)
    assert decisions["waited"]["predicted_recompute_s"] == pytest.approx(0.040)
    assert decisions["fresh"]["line_wait_s"] < 1.0 and decisions["fresh"]["reason"] == "tier_queue"
    sync = scheduler([s.url for s in tier], load_policy={"prefill_tokens_per_s": 1000, "t0_s": 0.0})
    frozen(sync)  # the tier serves nothing of "a"'s load while the others are asked (5 ms of it would flip "old")
    try:
        sync.update_connector_output(output(rank_gets(40_000)))
        for rid, ago in (("a", 9.0), ("s1", 8.5), ("s2", 8.0)):
            sync.get_num_new_matched_tokens(arrived(req(rid), ago), 0)
            sync.update_state_after_alloc(req(rid), blocks(), 16 if rid == "a" else 0)
        # a sync load holds the step: no credit, however long it waited
        assert sync.get_num_new_matched_tokens(arrived(req("old"), 7.0), 0) == (0, False)
    finally:
        sync.shutdown()


@pytest.mark.parametrize("cap, answer, recompute_s", [(None, (16, True), 0.040), (0.5, (16, True), 0.024),
                                                      (0.1, (0, False), 0.0176), (0.0, (0, False), 0.016)])
def test_load_policy_line_credit_cap_caps_what_the_line_lends_a_load(tier, tmp_path, monkeypatch, cap, answer,
                                                                      recompute_s):
    """The set-up above, the request that waited 7 s asked behind one async load (19.2 ms against 16 ms of
    recompute): the connector's cap of 1.5 prices its recompute at 16 + 24 ms, ``load_policy.line_credit_cap`` 0.5
    at 16 + 8 ms, and both load it; 0.1 gives 16 + 1.6 ms and 0 no credit at all: both recompute it (tier queue)."""
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("KVCTL_CONNECTOR_TRACE", str(trace))
    policy = {"prefill_tokens_per_s": 1000, "t0_s": 0.0} | ({} if cap is None else {"line_credit_cap": cap})
    conn = scheduler([s.url for s in tier], async_loading=True, load_policy=policy)
    frozen(conn)
    now = time.time()
    try:
        behind_one_load(tier, conn, now, (("short1", 8.5), ("short2", 8.0), ("short3", 0.0)))
        waited = arrived_ago(req("waited"), now, 7.0)
        assert wait_answer(conn, waited) == answer
        conn.update_state_after_alloc(waited, blocks(), answer[0])
        conn.build_connector_meta(sched_out())
    finally:
        conn.shutdown()
        conn.trace.close()
    d = decision_events(trace)["waited"]
    assert d["predicted_recompute_s"] == pytest.approx(recompute_s)
    assert d["reason"] == ("wins" if answer[1] else "tier_queue")


def test_the_prefill_rate_comes_from_the_steps_the_workers_time(tier):
    """Metadata carries each step's prompt tokens (what the workers time); the workers' step figures give R:
    1000 tokens in 0.05 s, then 3000 in 0.15 s: 20k tokens/s. Before any: no veto (no data)."""
    conn = scheduler([s.url for s in tier])
    try:
        m1 = conn.build_connector_meta(sched_out(new=[("p", TOKENS, [1, 2, 3, 4], 0)], scheduled={"p": 8}))
        m2 = conn.build_connector_meta(sched_out(cached=[("p", [5, 6, 7, 8, 9], 8, False)], scheduled={"p": 9}))
        m3 = conn.build_connector_meta(sched_out(cached=[("p", None, 17, False)], scheduled={"p": 1}))  # a decode
        assert [(m.step, m.prefill_tokens) for m in (m1, m2, m3)] == [(1, 8), (2, 9), (3, 0)]
        assert conn.scheduler.policy.cal.estimates().prefill_tokens_per_s is None
        conn.update_connector_output(output({M.STEPS_TIMED: 1, M.STEP_PREFILL_TOKENS: 1000, M.STEP_SECONDS: 0.05}))
        conn.update_connector_output(output({M.STEPS_TIMED: 1, M.STEP_PREFILL_TOKENS: 3000, M.STEP_SECONDS: 0.15}))
        assert conn.scheduler.policy.cal.estimates().prefill_tokens_per_s == pytest.approx(20_000)
        conn.update_connector_output(output({M.TIMED_LOADS: 2, M.LOAD_FIXED_SECONDS: 0.01}))
        assert conn.scheduler.policy.cal.estimates().t0_s == pytest.approx(0.005)
    finally:
        conn.shutdown()


def test_load_policy_false_loads_every_hit_and_counts_it_off(tier):
    conn = scheduler([s.url for s in tier], load_policy=False)
    try:
        store_all(tier, conn.spec.fmt)
        conn.update_connector_output(output(rank_gets(100) | {M.STEPS_TIMED: 1, M.STEP_PREFILL_TOKENS: 1e6,
                                                              M.STEP_SECONDS: 1.0}))
        assert conn.get_num_new_matched_tokens(req("r"), 0) == (16, False)  # 100 B/s would be a veto
        conn.update_state_after_alloc(req("r"), blocks(), 16)
        assert conn.get_kv_connector_stats().data[M.labelled(M.LOAD_DECISIONS, "load", "off")] == 1
        (spec,) = conn.build_connector_meta(sched_out()).loads
        assert spec.budget_s is None  # off: no deadline either
    finally:
        conn.shutdown()


def test_the_decisions_reach_prometheus_as_one_series_per_decision_and_reason():
    """KvctlPromMetrics (what vLLM registers in the process serving /metrics): a labelled counter's series are made
    as the stats bring them, beside the engine's own labels; the unlabelled counters as before."""
    from types import SimpleNamespace as NS

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from kvctl.plugins.vllm_stats import KvctlConnectorStats, KvctlPromMetrics

    reg = CollectorRegistry()

    def bind(cls):
        return lambda *a, **kw: cls(*a, registry=reg, **{k: v for k, v in kw.items() if k != "multiprocess_mode"})

    prom = KvctlPromMetrics(NS(kv_transfer_config=None), {Gauge: bind(Gauge), Counter: bind(Counter),
                                                          Histogram: bind(Histogram)},
                            ["model_name", "engine"], {0: ["tiny", "0"]}, ranks=2)
    a = KvctlConnectorStats(data={M.labelled(M.LOAD_DECISIONS, "load", "wins"): 2, M.CHUNKS_HIT: 3})
    b = KvctlConnectorStats(data={M.labelled(M.LOAD_DECISIONS, "load", "wins"): 1,
                                  M.labelled(M.LOAD_DECISIONS, "recompute", "tier_queue"): 1})
    prom.observe(a.aggregate(b).data)  # the workers' and the scheduler's stats, summed the way vLLM does
    text = generate_latest(reg).decode()
    assert 'kvctl:load_decisions_total{decision="load",engine="0",model_name="tiny",reason="wins"} 3.0' in text
    assert 'kvctl:load_decisions_total{decision="recompute",engine="0",model_name="tiny",reason="tier_queue"} 1.0' in text
    assert 'kvctl:chunks_hit_total{engine="0",model_name="tiny"} 3.0' in text


def test_the_line_wait_is_wall_clock_since_arrival_and_nothing_else():
    """``arrival_time`` is the wall clock where vLLM took the request in: now − it, or 0 where it is missing, not a
    number, in the future, or so far back that it is another clock (a monotonic reading against time.time())."""
    from kvctl.plugins.vllm_scheduler import MAX_LINE_WAIT_S, line_wait

    now = 1_800_000_000.0
    at = lambda t: SimpleNamespace(arrival_time=t)  # noqa: E731
    assert line_wait(at(now - 2.5), now) == pytest.approx(2.5)
    assert line_wait(SimpleNamespace(), now) == 0.0
    assert [line_wait(at(t), now) for t in (None, "x", True, 0, now + 5, 12_345.0, now - MAX_LINE_WAIT_S - 1)] == [0.0] * 7
