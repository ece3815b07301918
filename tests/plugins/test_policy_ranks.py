"""The engine's load-or-recompute policy judges each rank's share at that rank's bandwidth (issues 13, 46).

The W ranks load in parallel, each its own chunks from its own instances: a load takes as long as its slowest
rank's share. Workers that report no rank of their own (the summed bytes and seconds) give every rank
Σbytes / Σseconds, and the tier W times it.
"""

from kvctl.connector.calibration import Calibration
from kvctl.connector.policy import LOAD, RECOMPUTE, HitShape, TierQueue, decide


def test_llama_tp8_policy_uses_each_ranks_bandwidth_for_its_share():
    """Llama-3.1-8B bf16: s = 2 × 32 × 8 × 128 × 2 = 131072 B/token (whole model); R = 1e5 tok/s: 10 µs/token.

    1000 tokens in 8 chunks of 125, one a rank: 16.384e6 B each, the 8 ranks loading in parallel.
    * 2 GB/s a rank (the workers' summed bytes / summed seconds): 8.192 ms < 1000 / 1e5 = 10 ms: load. (The
      whole prompt's bytes at one rank's bandwidth, 65.5 ms, would be a wrong veto.)
    * 1 GB/s a rank: 16.384 ms > 10 ms: recompute.
    """
    hit = HitShape(first=0, end=8, skip=0, chunk_tokens=125, chunk_bytes=125 * 131072, world=8)
    fast = Calibration(8, prefill_tokens_per_s=1e5, t0_s=0.0)
    fast.observe_tier(get_bytes=8 * 16.384e6, get_seconds=8 * 0.008192)
    assert abs(fast.measured_gbps - 16.0) < 1e-9
    d = decide(hit, fast.estimates(), TierQueue((0,) * 8))
    assert d.decision == LOAD and abs(d.load_s - 0.008192) < 1e-12

    slow = Calibration(8, prefill_tokens_per_s=1e5, t0_s=0.0)
    slow.observe_tier(get_bytes=8 * 16.384e6, get_seconds=8 * 0.016384)
    assert abs(slow.measured_gbps - 8.0) < 1e-9
    assert decide(hit, slow.estimates(), TierQueue((0,) * 8)).decision == RECOMPUTE


def test_one_rank_is_the_default():
    c = Calibration(1)
    c.observe_tier(get_bytes=3e9, get_seconds=1.5)  # 2 GB/s, one rank
    assert abs(c.measured_gbps - 2.0) < 1e-9


def test_one_smoothing_rule_for_the_store_and_the_scheduler():
    """Issue 22: the store's per-rank GET bandwidth and the scheduler's estimate are smoothed by one rule.

    Worked by hand with the newest measurement weighted 0.3: 10 GB/s, then 20 GB/s -> 0.7 × 10 + 0.3 × 20 = 13.
    """
    from kvctl.connector.policy import BANDWIDTH_EWMA_NEW, ewma

    assert BANDWIDTH_EWMA_NEW == 0.3
    c = Calibration(1)
    c.observe_gets(0, get_bytes=10e9, get_seconds=1.0)
    c.observe_gets(0, get_bytes=20e9, get_seconds=1.0)
    assert abs(c.measured_gbps - 13.0) < 1e-9
    assert abs(ewma(ewma(None, 10.0), 20.0) - 13.0) < 1e-9


def test_lookup_and_policy_import_without_torch():
    """The scheduler-side modules stay torch-free (issue 22: they could not be imported without torch)."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None\n"
            "import kvctl.connector.lookup, kvctl.connector.policy\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
