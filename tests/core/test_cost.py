"""The cost model reproduces the paper's §4 figures."""

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvctl.core import cost
from kvctl.core.errors import InvalidInput

S, R = 48437.5, 52200.0  # GLM-5.3 FP8: 12.4 MB per 256-token chunk; B300 prefill rate


def test_breakeven_matches_paper():
    assert cost.breakeven_gbps(S, R) == pytest.approx(2.53, abs=0.005)
    assert cost.min_hit_tokens(R, 0.33) == pytest.approx(17226)


def test_fit_t0_and_predict_match_paper():
    t0 = cost.fit_t0(0.40, 0.79e9, 10.76)
    assert t0 == pytest.approx(0.3266, abs=1e-4)
    # predicts 0.79 s at 1.71 GB/s (measured 0.83–0.88)
    assert cost.load_s(16384, S, 1.71, t0) == pytest.approx(0.79, abs=0.005)


def test_rho_matches_paper():
    assert cost.rho(1.21, 0.79e9, 0.85) == pytest.approx(1.12, abs=0.01)
    assert cost.rho(1.21, 0.79e9, 10.76) == pytest.approx(0.09, abs=0.005)
    r = cost.summarize_rho(1.21, 0.79e9, 0.85)
    assert not r.stable and r.instances_for_rho_target == 3
    assert cost.rho(1.21, 0.79e9, 0.85 * r.instances_for_rho_target) <= 0.5


@given(
    s=st.floats(1e3, 1e6), r=st.floats(1e2, 1e6), b=st.floats(0.01, 100), t0=st.floats(0, 2), n=st.integers(1, 10**6)
)
def test_verdict_is_consistent_with_crossover(s, r, b, t0, n):
    (p,) = cost.predict([n], s, r, b, t0)
    cross = cost.crossover_tokens(s, r, b, t0)
    if b <= cost.breakeven_gbps(s, r):
        assert cross is None and p.verdict == "recompute"
    elif not math.isclose(n, cross, rel_tol=1e-6):
        assert (p.verdict == "load") == (n > cross)


@given(rho_now=st.floats(0.01, 50), target=st.floats(0.05, 0.95))
def test_instances_for_rho_is_minimal(rho_now, target):
    k = cost.instances_for_rho(rho_now, target)
    assert rho_now / k <= target + 1e-9
    assert k == 1 or rho_now / (k - 1) > target


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf")])
def test_bad_rates_rejected(bad):
    with pytest.raises(InvalidInput, match="prefill-rate"):
        cost.summarize_breakeven(S, bad)


def test_report_pairing_shape():
    rep = cost.summarize_pairing("x", S, R, 0.33, [0.85, 10.76], [4096, 65536])
    assert [len(b.predictions) for b in rep.bandwidths] == [2, 2]
    assert rep.bandwidths[0].crossover_tokens is None  # 0.85 < B*
    assert rep.bandwidths[1].predictions[1].verdict == "load"
    json.dumps(cost.PAPER_PAIRING)
