"""Sample statistics used by every kvctl summary: one definition, in one place."""

from __future__ import annotations

import math
from typing import Callable, Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0 ≤ q ≤ 100) by linear interpolation between closest ranks.

    The definition the paper uses (NumPy's default ``linear``, Excel's
    ``PERCENTILE.INC``): sort the n samples, take rank ``h = (n − 1)·q/100``
    and interpolate between ``x[floor(h)]`` and ``x[ceil(h)]``. None for no samples.
    """
    if not 0 <= q <= 100 or math.isnan(q):
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    if not values:
        return None
    xs = sorted(values)
    h = (len(xs) - 1) * q / 100.0
    lo = math.floor(h)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (h - lo) * (xs[hi] - xs[lo])


def mean(values: Sequence[float]) -> float | None:
    """Arithmetic mean, None for no samples."""
    return sum(values) / len(values) if values else None


#: the percentiles :func:`latency_by_class` gives each class
CLASS_PERCENTILES = (50, 90, 99)


def latency_by_class(hits: Sequence[float], misses: Sequence[float], pct: Callable[[Sequence[float], float], float | None] = percentile
                     ) -> dict[str, dict[str, float | int | None]]:
    """Latency percentiles of the hits and of the misses apart.

    ``{"hit": {"requests": n, "p50_s": …, "p90_s": …, "p99_s": …}, "miss": {…}}``; a class without samples has
    ``requests`` 0 and None percentiles. ``pct`` computes one percentile (default :func:`percentile`; a caller
    with NumPy arrays passes NumPy's, the same definition).
    """
    return {name: {"requests": len(xs), **{f"p{q}_s": pct(xs, q) for q in CLASS_PERCENTILES}}
            for name, xs in (("hit", hits), ("miss", misses))}
