"""The load-or-recompute decision as pure functions (issue 46 items 1-2): kvctl.connector.policy.

Every number below is worked by hand in its docstring. A chunk of ``CT`` tokens is ``CB`` bytes, all of it
on its owner rank ``c mod W``; bandwidths are per rank (bytes/s), R in tokens/s.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings, strategies as st

from kvctl.connector.calibration import Calibration
from kvctl.connector.policy import (BELOW_BREAKEVEN, BELOW_N_STAR, LOAD, NO_DATA, PARTIAL, PROBE, RECOMPUTE, TIER_QUEUE, WINS,
                                    CREDIT_CAP, Estimates, HitShape, Line, TierQueue, as_probe, decide, owned_in)
from kvctl.connector.tier_queue import plan_ends, tier_backlog

CT, CB = 100, 100_000  # 1000 bytes a token


def shape(chunks: int, world: int = 1, first: int = 0, skip: int = 0) -> HitShape:
    return HitShape(first=first, end=first + chunks, skip=skip, chunk_tokens=CT, chunk_bytes=CB, world=world)


def idle(world: int) -> TierQueue:
    return TierQueue((0,) * world)


def test_a_hit_that_wins_is_loaded_whole_with_its_recompute_time_as_budget():
    """10 chunks = 1000 tokens = 1 MB at 100 MB/s: 10 ms + T0 5 ms = 15 ms; recompute 1000 / 20k = 50 ms: load."""
    d = decide(shape(10), Estimates(20_000.0, 0.005, (1e8,)), idle(1))
    assert (d.found, d.tokens, d.decision, d.reason) == (1000, 1000, LOAD, WINS)
    assert d.load_s == pytest.approx(0.015) and d.recompute_s == pytest.approx(0.05) and d.budget_s == pytest.approx(0.05)


def test_nothing_measured_loads_and_r_alone_still_bounds_the_wait():
    """No bandwidth yet (no veto on no data); R known: the budget is the recompute time, 1000 / 20k = 50 ms."""
    d = decide(shape(10), Estimates(20_000.0, None, (None,)), idle(1))
    assert (d.tokens, d.decision, d.reason) == (1000, LOAD, NO_DATA) and d.budget_s == pytest.approx(0.05)
    d = decide(shape(10), Estimates(None, None, (1e8,)), idle(1))
    assert (d.tokens, d.reason, d.budget_s) == (1000, NO_DATA, None)
    # W = 2: rank 1 not measured yet and the hit reads it
    d = decide(shape(10, world=2), Estimates(20_000.0, 0.0, (1e8, None)), idle(2))
    assert d.reason == NO_DATA


def test_bandwidth_below_break_even_recomputes():
    """B* = s·R = 1000 B/token × 20k tok/s = 20 MB/s; at 10 MB/s 1000 tokens load in 100 ms > 50 ms, at any length."""
    d = decide(shape(10), Estimates(20_000.0, 0.0, (1e7,)), idle(1))
    assert (d.tokens, d.decision, d.reason) == (0, RECOMPUTE, BELOW_BREAKEVEN)
    assert d.load_s == pytest.approx(0.1) and d.budget_s is None


def test_a_hit_below_n_star_recomputes():
    """100 MB/s > B*, but T0 = 0.1 s: n* = T0 / (1/R - s/B) = 0.1 / (50 µs - 10 µs) = 2500 tokens; 1000 recompute."""
    d = decide(shape(10), Estimates(20_000.0, 0.1, (1e8,)), idle(1))
    assert (d.decision, d.reason) == (RECOMPUTE, BELOW_N_STAR)
    assert decide(shape(30), Estimates(20_000.0, 0.1, (1e8,)), idle(1)).decision == LOAD  # 3000 > n*


def test_the_tier_queue_turns_a_winning_hit_into_a_recompute():
    """Idle: 15 ms < 50 ms. 4 MB queued ahead (40 ms) and 2 loads (T0 each): 5 + 5 + 5 + 40 + 10 = 65 ms > 50 ms."""
    d = decide(shape(10), Estimates(20_000.0, 0.005, (1e8,)), TierQueue((4_000_000,), loads=2))
    assert (d.tokens, d.decision, d.reason) == (0, RECOMPUTE, TIER_QUEUE)
    assert d.load_s == pytest.approx(0.065)


#: the H100 of 2026-12-06 (benchmarks/results/paper_gpu-h100-2026-12-06-sat-*): DeepSeek-V2-Lite's 31,104 B/token,
#: 256-token chunks; a primed document's hit is 62 chunks (15,872 tokens, 494 MB)
H100_CT, H100_CB, DOC = 256, 256 * 31_104, 62


def test_a_received_hits_step_is_paid_once_not_once_per_load_queued_ahead():
    """T0 2 ms a load, the received hit's step 25 ms, 3 loads queued (no bytes: they are just starting) and 10 chunks
    at 100 MB/s (10 ms): 2 × 4 + 25 + 10 = 43 ms, under the 50 ms recompute: load. Counted as part of T0 the step
    was paid four times: 27 × 4 + 10 = 118 ms, a veto."""
    est = Estimates(20_000.0, 0.002, (1e8,), hit_step_s=0.025)
    d = decide(shape(10), est, TierQueue((0,), loads=3))
    assert (d.decision, d.load_s) == (LOAD, pytest.approx(0.043))
    assert decide(shape(10), Estimates(20_000.0, 0.027, (1e8,)), TierQueue((0,), loads=3)).decision == RECOMPUTE


def test_full_budget_steps_do_not_stand_for_a_received_hits_step():
    """The saturated-tier runs (2026-12-06): the engine's first steps were the priming's 16k-token prefills, 0.227 s
    each, so the fit had no line and the cheapest step, 0.227 s, stood for the received hit's step: a 16k hit from
    four 1200 MB/s links (3.9 GB/s: 494 MB in 127 ms, T0 7 ms) was predicted at 0.36 s against 0.22 s of recompute,
    and recomputed. A step of 16k tokens is its tokens, not a fixed cost: none is counted until a small step
    (at most 512 tokens, or vLLM's largest CUDA graph) was timed, then that one."""
    c = Calibration(1, hit_step=True, graph_tokens=512)
    for _ in range(20):
        c.observe_steps(1, 16384, 0.227, above=1)
    c.observe_loads(1, 0.007)
    c.observe_gets(0, 3.9e9, 1.0)
    est = c.estimates()
    assert (est.hit_step_s, est.t0_s) == (0.0, pytest.approx(0.007))
    r = est.prefill_tokens_per_s
    assert r == pytest.approx(16384 / 0.227)
    d = decide(HitShape(0, DOC, 0, H100_CT, H100_CB, 1, prompt=16384), est, idle(1))
    assert d.decision == LOAD and d.load_s == pytest.approx(0.007 + DOC * H100_CB / 3.9e9)
    c.observe_steps(1, 512, 0.031)  # a suffix step: small, so it counts; it also gives the fit its line
    assert c.estimates().hit_step_s == pytest.approx(c.step_cost_s()) and 0.0 < c.estimates().hit_step_s < 0.031
    eager = Calibration(1, hit_step=True)  # no graphs: steps of at most 512 tokens count
    eager.observe_steps(1, 16384, 0.227)
    eager.observe_steps(1, 16384, 0.229)
    assert eager.estimates().hit_step_s == 0.0
    eager.observe_steps(3, 512 * 3, 0.09)  # three 512-token steps: the cheapest small step, until the line's a
    assert eager.step_cost_s() is not None and eager.estimates().hit_step_s == pytest.approx(eager.step_cost_s())


def test_the_line_behind_a_request_lets_it_load_behind_a_busy_tier():
    """vLLM asks about a request at the head of its waiting line, where recomputing a 16k document takes 15,872 /
    72.2k = 0.220 s. The tier (3.9 GB/s, T0 7 ms) already loads one document: 14 + 253 = 267 ms, a veto (no prefix
    wins either: a chunk loads in 2.0 ms and recomputes in 3.5). The credit is what recomputing it costs the others:
    those that arrived while it waited (rate × its wait) and as many again as arrive in its own time (rate × 0.220)
    wait 0.220 s each: 0.220 × rate × (wait + 0.220) s, at most 1.5 × 0.220 = 0.330. At 0.5 request/s, asked at
    once: 24 ms, 0.244 s, still a veto. At 1/s after 0.5 s in the line: 158 ms, 0.378 s: load, with that as its
    deadline; two loads ahead (21 + 380 = 401 ms): recompute. After 2 s the credit is capped, 0.550 s: three loads
    ahead (534 ms) load, four (668 ms) never, however long the line. No arrival rate measured: no credit."""
    r, t0, bw = 16384 / 0.227, 0.007, 3.9e9
    est = Estimates(r, t0, (bw,))
    doc = HitShape(0, DOC, 0, H100_CT, H100_CB, 1)
    ahead = lambda n: TierQueue((n * DOC * H100_CB,), loads=n)  # noqa: E731
    rec = DOC * H100_CT / r
    assert Line(0.5, 1.0).credit_s(rec) == pytest.approx(rec * (0.5 + rec)) and Line(2.0, 1.0).credit_s(rec) == 1.5 * rec
    d = decide(doc, est, ahead(1))
    assert (d.decision, d.reason) == (RECOMPUTE, TIER_QUEUE) and d.load_s == pytest.approx(2 * t0 + 2 * DOC * H100_CB / bw)
    assert decide(doc, est, ahead(1), line=Line(0.0, 0.5)).decision == RECOMPUTE
    d = decide(doc, est, ahead(1), line=Line(0.5, 1.0))
    assert (d.decision, d.tokens) == (LOAD, DOC * H100_CT)
    assert d.recompute_s == pytest.approx(rec * (1.5 + rec)) and d.budget_s == d.recompute_s
    assert decide(doc, est, ahead(2), line=Line(0.5, 1.0)).decision == RECOMPUTE
    assert decide(doc, est, ahead(3), line=Line(2.0, 1.0)).decision == LOAD
    assert all(decide(doc, est, ahead(4), line=Line(w, 1.0)).decision == RECOMPUTE for w in (2.0, 50.0, 5000.0))
    assert decide(doc, est, ahead(1), line=Line(50.0, 0.0)).decision == RECOMPUTE
    assert decide(doc, est, idle(1)).decision == LOAD


def test_the_credit_keeps_a_hit_far_below_break_even_a_veto_however_long_the_line():
    """The cap's reason: the 2026-12-02 trace's lone 16k hit through one 600 MB/s link (0.49 GB: 0.82 s of transfer
    and T0) against 0.3 s of recompute is turned away even with the credit at its cap (0.3 + 1.5 × 0.3 = 0.75 s)."""
    r = 15872 / 0.3
    est = Estimates(r, 0.007, (0.6e9,))
    doc = HitShape(0, DOC, 0, H100_CT, H100_CB, 1)
    for w in (0.0, 2.0, 500.0):
        d = decide(doc, est, idle(1), line=Line(w, 10.0))
        assert d.decision == RECOMPUTE and d.load_s > d.recompute_s, d


def test_the_arrival_rate_counts_only_the_arrivals_near_the_newest():
    """The connector's arrival rate (kvctl.plugins.vllm_policy.ArrivalRate): (n - 1) / span over the latest 64
    arrivals within 10 s of the newest. A priming paced 0.3 s apart (3.3/s) then a run at 10/s: once the run's
    arrivals span 10 s the priming no longer counts (with the 64 latest alone, on the H100 of 2026-12-06, the rate
    read 3.3-4.5/s through most of a 10.3/s run). Fewer than 4 in the horizon, or a repeated request: no new rate."""
    from kvctl.plugins.vllm_policy import ArrivalRate

    rate = ArrivalRate()
    for i in range(40):
        rate.arrived(f"p{i}", 1000.0 + 0.3 * i)  # the priming: 1000.0 .. 1011.7
    assert rate.rate() == pytest.approx(1 / 0.3)
    for i in range(8):
        rate.arrived(f"r{i}", 1030.0 + 0.1 * i)  # 18 s later, a run at 10/s
    assert rate.rate() == pytest.approx(10.0)  # the priming is out of the horizon: the run's 8 alone
    rate.arrived("r0", 1031.0)  # asked again: counted once
    assert rate.rate() == pytest.approx(10.0)
    late = ArrivalRate()
    for i, t in enumerate((1000.0, 1001.0, 1002.0, 1020.0)):
        late.arrived(f"x{i}", t)
    assert late.rate() == 0.0  # one arrival within 10 s of the newest: too few to tell


def test_the_tier_backlog_is_what_the_ranks_have_not_served_yet():
    """Two ranks at 100 and 50 bytes/s, T0 1 s. Load A planned at 0 (100 B on each rank), B at 1 (100 B on rank 0
    only). Rank 0 serves A over 0-2 s (1 + 1), then B over 2-4 s, behind A; rank 1 serves A over 0-3 s (1 + 2).
    At 2.5: rank 0 has all of B's 100 B left (its T0 not over), rank 1 A's last 0.5 s, 25 B: both loads pending.
    At 3.5: rank 0 50 B of B, rank 1 done: one load. At 5: nothing, whether or not vLLM reported them. A rank
    whose bandwidth is not measured keeps its bytes whole."""
    free = [float("-inf")] * 2
    a = plan_ends(free, 0.0, 1.0, (100, 100), (100.0, 50.0))
    b = plan_ends(free, 1.0, 1.0, (100, 0), (100.0, 50.0))
    assert (a, b, free) == ((2.0, 3.0), (4.0, 0.0), [4.0, 3.0])
    loads = [(a, (100, 100)), (b, (100, 0))]
    assert tier_backlog(loads, 2.5, (100.0, 50.0)) == TierQueue((100, 25), 2)
    assert tier_backlog(loads, 3.5, (100.0, 50.0)) == TierQueue((50, 0), 1)
    assert tier_backlog(loads, 5.0, (100.0, 50.0)) == TierQueue((0, 0), 0)
    unmeasured = plan_ends([float("-inf")] * 2, 0.0, 1.0, (100, 100), (100.0, None))
    assert unmeasured == (2.0, None) and tier_backlog([(unmeasured, (100, 100))], 5.0, (100.0, None)) == TierQueue((0, 100), 1)
    assert tier_backlog([], 0.0, (1.0,)) == TierQueue((0,), 0)


def test_the_engine_queue_lets_the_longest_winning_prefix_load():
    """Below break-even (10 MB/s: a chunk 10 ms to load, 5 ms to recompute), with 2000 prefill tokens (100 ms)
    already waiting: k chunks load in 10k ms, recompute in (100k + 2000) / 20k s = 5k + 100 ms; wins up to k = 20
    of 30 (200 ms = 200 ms)."""
    d = decide(shape(30), Estimates(20_000.0, 0.0, (1e7,)), idle(1), engine_tokens=2000)
    assert (d.found, d.tokens, d.decision, d.reason) == (3000, 2000, PARTIAL, BELOW_BREAKEVEN)
    assert d.load_s == pytest.approx(0.2) and d.budget_s == pytest.approx(0.2)


def test_ranks_load_their_shares_in_parallel_and_the_slowest_decides():
    """W = 2, 10 chunks: 5 a rank. Rank 0 at 100 MB/s: 5 ms; rank 1 at 10 MB/s: 50 ms, the load takes 50 ms;
    recompute 1000 / 25k = 40 ms: not the whole hit. Shorter prefixes, k chunks: rank 1 holds k // 2 of them
    (10 ms each), recompute 4 ms a chunk: k = 2: 10 > 8 ms, 3: 10 < 12, 4: 20 > 16, 5: 20 = 20, 6: 30 > 24, and
    worse from there: the longest that wins is 5 chunks (not a leading range: every length is tried).
    With rank 1 at 20 MB/s: 25 ms: the whole hit."""
    d = decide(shape(10, world=2), Estimates(25_000.0, 0.0, (1e8, 1e7)), idle(2))
    assert (d.decision, d.tokens) == (PARTIAL, 500) and d.load_s == pytest.approx(0.02)
    d = decide(shape(10, world=2), Estimates(25_000.0, 0.0, (1e8, 2e7)), idle(2))
    assert d.decision == LOAD and d.load_s == pytest.approx(0.025)


def test_a_hit_at_a_chunk_offset_counts_only_what_it_loads():
    """Chunks 3..9 (7 chunks), 350 tokens local (mid chunk 3): 1000 - 350 = 650 tokens found, 7 chunks moved."""
    d = decide(HitShape(3, 10, 350, CT, CB, 1), Estimates(20_000.0, 0.0, (1e8,)), idle(1))
    assert d.found == 650 and d.load_s == pytest.approx(0.007) and d.recompute_s == pytest.approx(650 / 20_000)


def test_a_veto_becomes_a_probe():
    d = as_probe(decide(shape(10), Estimates(20_000.0, 0.0, (1e7,)), idle(1)))
    assert (d.tokens, d.decision, d.reason, d.budget_s) == (1000, LOAD, PROBE, pytest.approx(0.05))


def test_a_probe_with_the_hits_shape_loads_a_bounded_prefix():
    """10 MB/s, R 20k, T0 1 ms: k chunks load in 1 + 10k ms and recompute in 5k ms, an excess of 1 + 5k ms; at most
    PROBE_EXCESS_S = 50 ms: k = 9 of 60 (the rest recomputes; async, the deadline is 45 + 50 ms)."""
    est = Estimates(20_000.0, 0.001, (1e7,))
    vetoed = decide(shape(60), est, idle(1))
    assert vetoed.decision == RECOMPUTE
    d = as_probe(vetoed, shape(60), est, idle(1))
    assert (d.found, d.tokens, d.decision, d.reason) == (6000, 900, PARTIAL, PROBE)
    assert d.load_s == pytest.approx(0.091) and d.recompute_s == pytest.approx(0.045) and d.budget_s == pytest.approx(0.095)


def test_a_probe_loads_at_least_four_chunks_a_rank_and_the_whole_hit_when_its_excess_stays_small():
    """1 MB/s: every chunk's load exceeds its recompute by 95 ms, still 4 chunks (the floor) load. W = 2 at
    10 MB/s a rank (the tier at B* exactly): the excess never passes 6 ms, so the probe is the whole hit."""
    est = Estimates(20_000.0, 0.001, (1e6,))
    d = as_probe(decide(shape(60), est, idle(1)), shape(60), est, idle(1))
    assert (d.tokens, d.decision, d.reason) == (400, PARTIAL, PROBE)
    est2 = Estimates(20_000.0, 0.001, (1e7, 1e7))
    d = as_probe(decide(shape(60, world=2), est2, idle(2)), shape(60, world=2), est2, idle(2))
    assert (d.tokens, d.decision, d.reason) == (6000, LOAD, PROBE)
    d = as_probe(decide(shape(3), est, idle(1)), shape(3), est, idle(1))  # shorter than the floor: all of it
    assert (d.tokens, d.decision) == (300, LOAD)


def test_owned_in_counts_a_ranks_chunks():
    assert [owned_in(3, 10, r, 3) for r in range(3)] == [3, 2, 2]  # rank 0: 3, 6, 9; rank 1: 4, 7; rank 2: 5, 8
    assert sum(owned_in(5, 17, r, 4) for r in range(4)) == 12


def steps_s(tokens: float, r: float, est: Estimates) -> float:
    """The engine's time for ``tokens`` prefill tokens, its steps written out one by one: each takes at most the
    budget (none: all of them), costs its tokens / R, the step's a, and the jump where it is above the graphs."""
    t, left = 0.0, tokens
    while left > 1e-6:  # a float remnant of a hair is no step (as prefill_s)
        size = min(left, est.step_budget or left)
        t += size / r + est.step_s + (est.graph_jump_s if est.graph_tokens and size > est.graph_tokens else 0.0)
        left -= size
    return t


def brute(sh: HitShape, est: Estimates, q: TierQueue, engine: float, wait: float = 0.0, rate: float = 0.0) -> int:
    """The longest winning prefix, every length tried with the formula itself (the recompute: the engine's time for
    the work ahead and the prompt, less its time for the rest after loading k chunks, :func:`steps_s`; the
    received hit's step once; the line's credit, its wait and a step's arrivals, up to 1.5 × the recompute's own
    time: the prompt alone less its rest)."""
    r, t0 = est.prefill_tokens_per_s, est.t0_s or 0.0
    best = 0
    for k in range(1, sh.end - sh.first + 1):
        load = t0 * (q.loads + 1) + est.hit_step_s + max((qq + b) / bw if qq + b else 0.0
                                        for qq, b, bw in zip(q.rank_bytes, sh.rank_bytes(k), est.rank_bps))
        left = sh.prompt - sh.skip
        rest = steps_s(left - sh.tokens(k), r, est)
        own = steps_s(left, r, est) - rest
        if load <= steps_s(engine + left, r, est) - rest + min(CREDIT_CAP * own, rate * own * (wait + own)):
            best = k
    return best


@settings(max_examples=300, deadline=None)
@given(world=st.integers(1, 4), first=st.integers(0, 5), chunks=st.integers(1, 40), skip_in=st.integers(0, CT - 1),
       r=st.floats(1e3, 1e6), t0=st.floats(0.0, 0.5), bws=st.lists(st.floats(1e5, 1e10), min_size=4, max_size=4),
       queued=st.lists(st.integers(0, 10**7), min_size=4, max_size=4), loads=st.integers(0, 5),
       engine=st.one_of(st.just(0.0), st.floats(0.0, 1e5)), tail=st.integers(1, 3 * CT),
       graph_over_tail=st.one_of(st.none(), st.integers(0, 40 * CT)), jump=st.floats(0.0, 0.2),
       step=st.one_of(st.just(0.0), st.floats(0.0, 0.3)), wait=st.one_of(st.just(0.0), st.floats(0.0, 3.0)),
       rate=st.one_of(st.just(0.0), st.floats(0.0, 50.0)), a=st.one_of(st.just(0.0), st.floats(0.0, 0.1)),
       budget=st.one_of(st.just(0), st.integers(4 * CT, 60 * CT)))
def test_the_decision_is_the_longest_prefix_that_wins(world, first, chunks, skip_in, r, t0, bws, queued, loads, engine,
                                                       tail, graph_over_tail, jump, step, wait, rate, a, budget):
    """Whatever the inputs: the loaded length is the longest whole-chunk prefix whose predicted load is no slower
    than its recompute (every length tried), a whole hit says LOAD, a shorter one PARTIAL, none RECOMPUTE."""
    skip = first * CT + (skip_in if first else 0)
    sh = HitShape(first, first + chunks, skip, CT, CB, world, prompt=(first + chunks) * CT + tail)
    graph = 0 if graph_over_tail is None else tail + graph_over_tail  # no graphs, or the largest above the rest
    est = Estimates(r, t0, tuple(bws[:world]), graph, jump, step, a, budget)
    q = TierQueue(tuple(queued[:world]), loads)
    d = decide(sh, est, q, engine, Line(wait, rate))
    k = brute(sh, est, q, engine, wait, rate)
    assert d.found == sh.tokens(chunks)
    assert d.tokens == (sh.tokens(k) if k else 0)
    assert d.decision == (LOAD if k == chunks else PARTIAL if k else RECOMPUTE)
    if d.tokens:
        assert d.load_s <= d.recompute_s + 1e-12 and d.budget_s == d.recompute_s
    else:
        assert d.reason in (TIER_QUEUE, BELOW_BREAKEVEN, BELOW_N_STAR)


def test_calibration_fits_r_past_a_fixed_step_cost():
    """Steps cost 20 ms each plus 50 µs a prefill token (R = 20k): 1000 tokens in 70 ms, 4000 in 220 ms.
    tokens/seconds alone would say 14.3k (the fixed cost counted as prefill); the fit finds 20k."""
    c = Calibration(1)
    assert c.estimates().prefill_tokens_per_s is None
    c.observe_steps(1, 1000, 0.07)
    assert c.estimates().prefill_tokens_per_s == pytest.approx(1000 / 0.07)  # one size seen: tokens/seconds
    for _ in range(3):
        c.observe_steps(1, 4000, 0.22)
        c.observe_steps(2, 2000, 0.14)  # two steps of 1000 in one interval
    assert c.estimates().prefill_tokens_per_s == pytest.approx(20_000, rel=1e-6)


def test_a_received_hit_counts_the_step_it_waits_in_and_short_hits_are_recomputed():
    """The H200's short prompts of 2026-12-05 (vLLM's default async scheduling: a sync hit is a receive, one more
    step): steps cost a = 25 ms plus tokens / 55k; a load's own time besides GETs 2 ms (6.3 ms less 4.5 ms of GETs
    there), GETs 9.5 GB/s; s = 31,104 B/token. A 512-token prompt with 256 tokens from the tier: load 2 ms + 0.8 ms
    of GETs against 256 / 55k = 4.7 ms of recompute: without the step it loads (it took 1.57x its recompute there);
    with it, 27.8 ms: recompute. A 16k hit (16,128 tokens, 502 MB: 53 ms of GETs + 27 ms) against 293 ms: load
    either way. A configured T0 is the whole fixed cost: no step added."""
    a, r = 0.025, 55_000.0
    ct, cb = 256, 256 * 31_104
    cals = {}
    for hit_step in (False, True):
        c = Calibration(1, hit_step=hit_step)
        for _ in range(3):
            for tokens in (256, 8192, 32000):
                c.observe_steps(1, tokens, a + tokens / r)
        c.observe_loads(1, 0.002)
        c.observe_gets(0, 9.5e8, 0.1)
        cals[hit_step] = c
    assert cals[True].step_cost_s() == pytest.approx(a, rel=1e-6) and cals[True].estimates().prefill_tokens_per_s == pytest.approx(r)
    assert cals[False].estimates().t0_s == pytest.approx(0.002) and cals[False].estimates().hit_step_s == 0.0
    assert (cals[True].estimates().t0_s, cals[True].estimates().hit_step_s) == (pytest.approx(0.002), pytest.approx(0.025))
    short = HitShape(first=0, end=1, skip=0, chunk_tokens=ct, chunk_bytes=cb, world=1)
    assert decide(short, cals[False].estimates(), idle(1)).decision == LOAD
    d = decide(short, cals[True].estimates(), idle(1))
    assert (d.decision, d.reason, d.tokens) == (RECOMPUTE, BELOW_N_STAR, 0)
    long = HitShape(first=0, end=63, skip=0, chunk_tokens=ct, chunk_bytes=cb, world=1)
    assert decide(long, cals[True].estimates(), idle(1)).decision == LOAD
    configured = Calibration(1, t0_s=0.006, hit_step=True)
    for tokens in (256, 8192, 32000):
        configured.observe_steps(1, tokens, a + tokens / r)
    assert (configured.estimates().t0_s, configured.estimates().hit_step_s) == (0.006, 0.0)
    assert Calibration(1, hit_step=True).estimates().t0_s is None  # nothing fitted, nothing measured: no veto


def test_a_received_hit_counts_the_cheapest_step_until_the_steps_give_a_line():
    """The H100 run of 2026-12-05 (benchmarks/results/engine_gpu_layered-h100-2026-12-05.txt, serial): the hit
    engine saw only hits, each with a 256-token rest, so every timed step had 256 prefill tokens (29-38 ms) and
    the fit never had a line: no step was counted, R was tokens/seconds (8k), and the 512-token prompt loaded its
    256 tokens from the tier in 1.20x its recompute. The cheapest step (29 ms) now stands for a: 256 tokens are
    recomputed (3.3 + 29 + 1 ms against 31 ms), 768 loaded (against 93 ms). One recomputed 512-token step gives
    the fit its line, whose a takes over."""
    ct, cb = 256, 256 * 31_104
    cals = {}
    for hit_step in (False, True):
        c = Calibration(1, hit_step=hit_step)
        for t in (0.031, 0.029, 0.038, 0.030, 0.033, 0.031):
            c.observe_steps(1, 256, t)
        c.observe_loads(1, 0.0033)
        c.observe_gets(0, 8.2e8, 0.1)
        cals[hit_step] = c
    assert cals[True].step_cost_s() is None  # no line: every step the same size
    est = cals[True].estimates()
    assert (est.t0_s, est.hit_step_s) == (pytest.approx(0.0033), pytest.approx(0.029)) and est.prefill_tokens_per_s == pytest.approx(1536 / 0.192, rel=0.01)

    def hit(prompt: int) -> HitShape:
        return HitShape(0, (prompt - 1) // ct, 0, ct, cb, 1, prompt=prompt)

    assert decide(hit(512), cals[False].estimates(), idle(1)).decision == LOAD  # before: loaded
    assert decide(hit(512), est, idle(1)).decision == RECOMPUTE
    assert all(decide(hit(n), est, idle(1)).decision == LOAD for n in (1024, 2048, 8192, 32000))
    c = cals[True]
    c.observe_steps(1, 512, 0.037)  # the recomputed prompt: a second size, a line
    assert c.step_cost_s() is not None and c.estimates().hit_step_s == pytest.approx(c.step_cost_s())


#: the H200's compiled-mode recompute of 2026-12-05 (benchmarks/README.md): prompt tokens -> seconds; vLLM's
#: CUDA graphs went up to 512 tokens
H200_STEPS = {256: 0.028, 512: 0.031, 1024: 0.077, 2048: 0.082, 8192: 0.123, 16384: 0.248}


def h200_calibration(graph_tokens: int) -> Calibration:
    """The H200 steps (each interval one step, three rounds), 2 ms of load besides GETs, 9.5 GB/s, a received hit."""
    c = Calibration(1, hit_step=True, graph_tokens=graph_tokens)
    for _ in range(3):
        for n, t in H200_STEPS.items():
            c.observe_steps(1, n, t, above=int(bool(graph_tokens) and n > graph_tokens))
    c.observe_loads(1, 0.002)
    c.observe_gets(0, 9.5e8, 0.1)
    return c


def test_the_step_above_the_largest_cuda_graph_is_fitted_apart_and_short_hits_still_recompute():
    """In vLLM's compiled mode a 1024-token prefill (op by op) took 77 ms where 512 tokens (one CUDA graph) took 31:
    a line through the steps (a = 42 ms, R = 81k here) puts the jump into every step's fixed cost, so a received hit
    (T0 + a) loses up to 4k tokens. Fitted apart (a = 25 ms, J = 30 ms, R = 90k): the 512-token prompt (256 from the
    tier: 27 + 0.8 ms of load against 2.8 ms) is still recomputed, and the 1024-token one (768 from the tier, its
    256-token rest within a graph) loads: 29.8 ms against 8.5 + 30.5 ms (its hit took 0.77x its recompute there).
    A prompt whose rest is above the graphs too gets no jump; one behind queued prefill work does (its rest after the
    load alone would run as a graph), and behind a full step's work under vLLM's budget a step's a and jump more."""
    ct, cb = 256, 256 * 31_104
    line, split = h200_calibration(0), h200_calibration(512)
    a, b, j = split._step_line()
    assert (a, 1 / b, j) == (pytest.approx(0.0252, abs=5e-4), pytest.approx(90_100, rel=0.01), pytest.approx(0.0305, abs=5e-4))
    assert line.estimates().graph_jump_s == 0.0
    assert line.estimates().t0_s + line.estimates().hit_step_s == pytest.approx(0.042, abs=1e-3)
    est = split.estimates()
    assert (est.graph_tokens, est.t0_s + est.hit_step_s) == (512, pytest.approx(0.0272, abs=5e-4))

    def hit(prompt: int) -> HitShape:
        return HitShape(0, (prompt - 1) // ct, 0, ct, cb, 1, prompt=prompt)

    assert decide(hit(512), est, idle(1)).decision == RECOMPUTE
    d = decide(hit(1024), est, idle(1))
    assert (d.decision, d.tokens) == (LOAD, 768) and d.recompute_s == pytest.approx(768 / 90_100 + 0.0305, rel=0.02)
    assert all(decide(hit(n), est, idle(1)).decision == LOAD for n in (2048, 4096, 16384))
    assert decide(hit(1024), line.estimates(), idle(1)).decision == RECOMPUTE  # the line alone: recomputed
    assert decide(hit(4096), line.estimates(), idle(1)).decision == RECOMPUTE
    # the rest after the hit above the graphs too: no jump; queued prefill work: the jump still
    r = est.prefill_tokens_per_s
    far = HitShape(0, 2, 0, ct, cb, 1, prompt=2 * ct + 600)
    assert far.recompute_s(2, est, r, 0) == (pytest.approx(512 / r), pytest.approx(512 / r))
    assert hit(1024).recompute_s(3, est, r, 0) == (pytest.approx(768 / r + j), pytest.approx(768 / r + j))
    assert hit(1024).recompute_s(3, est, r, 100)[0] == pytest.approx(868 / r + j)
    # 1024 tokens of work ahead under a budget of 1024 tokens a step: the recompute takes a step of its own
    budgeted = replace(est, step_budget=1024)
    assert est.step_s == pytest.approx(a)
    assert hit(1024).recompute_s(3, budgeted, r, 1024) == (pytest.approx(1792 / r + a + 2 * j), pytest.approx(768 / r + j))


def test_the_jump_needs_steps_of_both_kinds():
    """Every step above the graphs (long prompts only), or none: no J (the line's a holds it, as before)."""
    long_only = Calibration(1, graph_tokens=512)
    short_only = Calibration(1, graph_tokens=512)
    for n, t in H200_STEPS.items():
        if n > 512:
            long_only.observe_steps(1, n, t, above=1)
        else:
            short_only.observe_steps(1, n, t)
    assert long_only.estimates().graph_jump_s == 0.0 and long_only.step_cost_s() == pytest.approx(0.0557, abs=1e-3)
    assert short_only.estimates().graph_jump_s == 0.0 and short_only.step_cost_s() == pytest.approx(0.025, abs=1e-4)
    assert long_only.estimates().graph_tokens == 0


def test_calibration_t0_and_per_rank_bandwidth_and_the_config_overrides():
    """T0: per load, its time besides GETs (2 loads, 30 ms: 15 ms). Bandwidth per rank from its own GETs."""
    c = Calibration(2)
    c.observe_loads(2, 0.03)
    c.observe_gets(0, 1e6, 0.01)  # 100 MB/s
    est = c.estimates()
    assert est.t0_s == pytest.approx(0.015) and est.rank_bps == (pytest.approx(1e8), None) and est.tier_gbps is None
    c.observe_gets(1, 2e6, 0.01)
    assert c.measured_gbps == pytest.approx(0.3)  # 100 + 200 MB/s
    fixed = Calibration(2, prefill_tokens_per_s=5000.0, t0_s=0.2, tier_gbps=1.0)
    fixed.observe_steps(1, 1000, 1.0)
    fixed.observe_loads(1, 9.0)
    fixed.observe_gets(0, 1.0, 1.0)
    assert fixed.estimates() == Estimates(5000.0, 0.2, (5e8, 5e8))


def test_a_veto_is_reprobed_once_per_period_and_never_with_a_configured_bandwidth():
    """After reprobe_after_s without a bandwidth measurement one load goes through (a veto cannot lock the tier
    out: no load, no new measurement); a measurement restarts the period."""
    now = [0.0]
    c = Calibration(1, reprobe_after_s=10.0, clock=lambda: now[0])
    c.observe_gets(0, 1e5, 1.0)
    now[0] = 9.9
    assert not c.probe_due()
    now[0] = 10.0
    assert c.probe_due() and c.probes == 1
    assert not c.probe_due()  # one per period
    now[0] = 15.0
    c.observe_gets(0, 1e5, 1.0)
    now[0] = 24.9
    assert not c.probe_due()
    fixed = Calibration(1, tier_gbps=0.0001, reprobe_after_s=1.0, clock=lambda: now[0])
    now[0] = 1000.0
    assert not fixed.probe_due() and fixed.probes == 0
