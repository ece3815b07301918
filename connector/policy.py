"""Load or recompute (paper §4 cost model, §7's suggestion): torch-free, for the scheduler side and the CLI.

* :class:`LoadPolicy` -- the one cost test: load ``n`` tokens only when
  ``T0 + n*s/B <= n/R``.
* :class:`PolicyState` -- the vLLM scheduler's policy with one bandwidth
  estimate for all ranks, re-probed after a veto so it cannot lock itself out.
* :func:`ewma` -- the one smoothing rule for measured GET bandwidth (the store's
  per-rank figure and the scheduler's engine-wide one).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from kvctl.core.cost import load_s as _load_s, recompute_s as _recompute_s  # pure: connector/ may import the cost model

__all__ = ["BANDWIDTH_EWMA_NEW", "LoadPolicy", "PolicyState", "ewma"]

#: weight of the newest GET-bandwidth measurement in the running estimate
BANDWIDTH_EWMA_NEW = 0.3


def ewma(old: float | None, new: float) -> float:
    """The running bandwidth estimate after one more measurement (the first one is taken as it is)."""
    return new if old is None else (1.0 - BANDWIDTH_EWMA_NEW) * old + BANDWIDTH_EWMA_NEW * new


@dataclass(frozen=True)
class LoadPolicy:
    """Load-or-recompute (paper §4 cost model, §7's suggestion).

    ``bandwidth_gbps``: the tier bandwidth one prompt sees (all ranks together,
    1e9 bytes/s); None = this rank's measured L2 GET bandwidth x W, and no
    veto until something has been measured.
    """

    bytes_per_token: float
    prefill_tokens_per_s: float
    t0_s: float
    bandwidth_gbps: float | None = None

    def load_wins(self, tokens: int, bandwidth_gbps: float | None) -> bool:
        """True when loading ``tokens`` is predicted no slower than recomputing them."""
        bw = self.bandwidth_gbps if self.bandwidth_gbps is not None else bandwidth_gbps
        if tokens <= 0 or bw is None:
            return True
        if bw <= 0:
            return False
        return _load_s(tokens, self.bytes_per_token, bw, self.t0_s) <= _recompute_s(tokens, self.prefill_tokens_per_s)


class PolicyState:
    """Load-or-recompute with one bandwidth estimate for all ranks that cannot lock itself out.

    The estimate is the engine-wide GET bandwidth the workers report (bytes
    and seconds summed over ranks, so every rank's load is judged by the
    same number, and the scheduler's one decision holds for all ranks). The
    ``ranks`` load in parallel, each its own share from its own instance, so
    Σbytes / Σseconds is one rank's bandwidth and the tier's is ``ranks`` times
    it: that is what the whole model's ``bytes_per_token`` is judged against. A
    veto lets no loads through, so no new measurement would ever raise a low
    estimate: after ``reprobe_after_s`` without a measurement one load is let
    through (a re-probe) and the estimate it produces replaces the old one.
    """

    def __init__(self, bytes_per_token: float, prefill_tokens_per_s: float, t0_s: float = 0.0,
                 bandwidth_gbps: float | None = None, reprobe_after_s: float = 30.0, clock=time.monotonic,
                 ranks: int = 1) -> None:
        self.bytes_per_token, self.rate, self.t0_s, self.ranks = bytes_per_token, prefill_tokens_per_s, t0_s, max(1, ranks)
        self._cost = LoadPolicy(bytes_per_token, prefill_tokens_per_s, t0_s, bandwidth_gbps)  # the one cost test
        self.fixed_gbps, self.reprobe_after_s, self.clock = bandwidth_gbps, reprobe_after_s, clock
        self.measured_gbps: float | None = None
        self._last_measured = clock()
        self._lock = threading.Lock()
        self.vetoes = 0
        self.probes = 0

    def observe(self, get_bytes: float, get_seconds: float) -> None:
        """Fold in one interval's GET bytes and seconds, each summed over the ranks (tier GB/s = ranks × Σbytes/Σseconds)."""
        if get_bytes <= 0 or get_seconds <= 0:
            return
        gbps = self.ranks * get_bytes / get_seconds / 1e9
        with self._lock:
            self.measured_gbps = ewma(self.measured_gbps, gbps)
            self._last_measured = self.clock()

    def allow(self, tokens: int) -> bool:
        """True when loading ``tokens`` should go ahead (predicted faster, unknown yet, or a re-probe)."""
        if self._cost.load_wins(tokens, self.measured_gbps):  # also True with no estimate yet
            return True
        with self._lock:
            if self.fixed_gbps is None and self.clock() - self._last_measured >= self.reprobe_after_s:
                self._last_measured = self.clock()  # one probe per period
                self.probes += 1
                return True
            self.vetoes += 1
            return False
