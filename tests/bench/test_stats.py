"""The one percentile definition: linear interpolation between closest ranks."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvctl.records.stats import latency_by_class, mean, percentile


def test_known_values():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert percentile([5.0], 99) == 5.0
    assert percentile([3.0, 1.0, 2.0], 0) == 1.0 and percentile([3.0, 1.0, 2.0], 100) == 3.0
    assert percentile([], 50) is None and mean([]) is None


@pytest.mark.parametrize("q", [-1, 101, float("nan")])
def test_bad_q(q):
    with pytest.raises(ValueError):
        percentile([1.0], q)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), st.floats(0, 100))
def test_matches_numpy_linear(xs, q):
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q, method="linear")), rel=1e-9, abs=1e-6)


def test_latency_by_class_each_class_alone_and_an_empty_one():
    by = latency_by_class([1.0, 3.0, 2.0], [])
    assert by["hit"] == {"requests": 3, "p50_s": 2.0, "p90_s": pytest.approx(2.8), "p99_s": pytest.approx(2.98)}
    assert by["miss"] == {"requests": 0, "p50_s": None, "p90_s": None, "p99_s": None}


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0, 1e3), max_size=40), st.lists(st.floats(0, 1e3), max_size=40))
def test_latency_by_class_with_numpy_percentiles_is_the_same(hits, misses):
    def np_pct(xs, q):
        return float(np.percentile(np.asarray(xs, dtype=float), q)) if len(xs) else None

    a, b = latency_by_class(hits, misses), latency_by_class(hits, misses, pct=np_pct)
    for cls in ("hit", "miss"):
        assert a[cls]["requests"] == b[cls]["requests"]
        for k in ("p50_s", "p90_s", "p99_s"):
            assert (a[cls][k] is None) == (b[cls][k] is None)
            if a[cls][k] is not None:
                assert a[cls][k] == pytest.approx(b[cls][k], rel=1e-9, abs=1e-9)
