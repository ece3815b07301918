"""The one percentile definition: linear interpolation between closest ranks."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvctl.bench.stats import mean, percentile


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
