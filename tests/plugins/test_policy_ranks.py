"""The engine's load-or-recompute policy judges the tier's bandwidth, not one rank's (issue 13).

The connector's stats sum GET bytes and GET seconds over the W ranks, which load
in parallel (each its own chunks from its own instance), so Σbytes / Σseconds is
one rank's bandwidth; the whole model's s must be compared with W times that.
"""

from kvctl.connector.policy import PolicyState


def test_llama_tp8_policy_uses_w_times_the_per_rank_bandwidth():
    """Llama-3.1-8B bf16: s = 2 × 32 × 8 × 128 × 2 = 131072 B/token (whole model); R = 1e5 tok/s: 10 µs/token.

    8 ranks, each reading its 16384 B/token share: 1000 tokens = 16.384e6 B per rank.
    * 2 GB/s per rank: 8 × 16.384e6 B in 8 × 8.192 ms summed; tier 16 GB/s: 1000 × 131072 / 16e9 = 8.192 ms
      < 1000 / 1e5 = 10 ms: load. (Σbytes/Σseconds alone, 2 GB/s, would read 65.5 ms: a wrong veto.)
    * 1 GB/s per rank: tier 8 GB/s: 16.384 ms > 10 ms: recompute.
    """
    fast = PolicyState(bytes_per_token=131072, prefill_tokens_per_s=1e5, t0_s=0.0, ranks=8)
    fast.observe(get_bytes=8 * 16.384e6, get_seconds=8 * 0.008192)
    assert fast.measured_gbps == 16.0 or abs(fast.measured_gbps - 16.0) < 1e-9
    assert fast.allow(1000) and fast.vetoes == 0

    slow = PolicyState(bytes_per_token=131072, prefill_tokens_per_s=1e5, t0_s=0.0, ranks=8, reprobe_after_s=1e9)
    slow.observe(get_bytes=8 * 16.384e6, get_seconds=8 * 0.016384)
    assert abs(slow.measured_gbps - 8.0) < 1e-9
    assert not slow.allow(1000) and slow.vetoes == 1


def test_one_rank_is_the_default():
    p = PolicyState(bytes_per_token=1000, prefill_tokens_per_s=1000)
    p.observe(get_bytes=3e9, get_seconds=1.5)  # 2 GB/s, one rank
    assert abs(p.measured_gbps - 2.0) < 1e-9



def test_one_smoothing_rule_for_the_store_and_the_scheduler():
    """Issue 22: the store's per-rank GET bandwidth and the scheduler's estimate are smoothed by one rule.

    Worked by hand with the newest measurement weighted 0.3: 10 GB/s, then 20 GB/s -> 0.7 × 10 + 0.3 × 20 = 13.
    """
    from kvctl.connector.policy import BANDWIDTH_EWMA_NEW, ewma

    assert BANDWIDTH_EWMA_NEW == 0.3
    p = PolicyState(bytes_per_token=1.0, prefill_tokens_per_s=1.0, ranks=1)
    p.observe(get_bytes=10e9, get_seconds=1.0)
    p.observe(get_bytes=20e9, get_seconds=1.0)
    assert abs(p.measured_gbps - 13.0) < 1e-9
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
