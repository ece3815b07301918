"""KvctlConnector builds its load policy with W, the ranks loading in parallel (issue 13).

The connector's scheduler side is real (KvctlConnector.without_engine), on two real Valkey instances.
"""

import pytest

pytestmark = pytest.mark.engine


def test_connector_judges_w_times_the_summed_bandwidth(valkey_factory):
    """KvctlConnector's scheduler (real, on two real Valkey instances, W = 2) builds the policy with W.

    The scheduler set-up of tests/plugins/scheduler_helpers.py: MLA, 2 layers × head_size 6 × 4 B
    (float32) = 48 B/token, 4-token chunks, 16 loadable tokens; R = 1000 tok/s: recomputing 16 tokens is 16 ms.
    The workers report 30000 B in 1.0 s summed over the 2 ranks: 30 kB/s per rank, the tier 2 × 30 = 60 kB/s.
    Loading 16 × 48 = 768 B at 60 kB/s: 12.8 ms < 16 ms, load (at 30 kB/s it would read 25.6 ms: a wrong veto).
    """
    pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from types import SimpleNamespace  # noqa: PLC0415

    from kvctl.plugins.vllm_stats import KvctlConnectorStats  # noqa: PLC0415
    from tests.plugins.scheduler_helpers import req, scheduler, store_all  # noqa: PLC0415

    tier = [valkey_factory(), valkey_factory()]
    conn = scheduler([s.url for s in tier], load_policy={"prefill_tokens_per_s": 1000, "reprobe_after_s": 1e6})
    try:
        store_all(tier, conn.spec.fmt)
        conn.update_connector_output(SimpleNamespace(kv_connector_stats=KvctlConnectorStats(
            data={"kvctl:l2_get_bytes": 30000, "kvctl:l2_get_seconds": 1.0})))
        assert abs(conn.scheduler.policy.measured_gbps - 60e3 / 1e9) < 1e-15
        assert conn.get_num_new_matched_tokens(req("r"), 0) == (16, False)
    finally:
        conn.shutdown()
