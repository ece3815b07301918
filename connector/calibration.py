"""The load-or-recompute decision's estimates (:class:`Calibration`): R, T0, the step fit and each rank's
bandwidth, measured by the engine itself and re-probed after a veto so the decision cannot lock itself out
(:func:`kvctl.connector.policy.decide` judges with them). Torch-free."""

from __future__ import annotations

import threading
import time

from kvctl.connector.policy import Estimates, ewma

__all__ = ["Calibration", "SMALL_STEP_TOKENS", "STEP_FIT_DECAY", "STEP_FIT_MIN_SPREAD", "T0_EWMA_NEW"]

#: weight of the newest interval in the running T0 estimate, and how fast the step fit forgets (per interval)
T0_EWMA_NEW = 0.3
STEP_FIT_DECAY = 0.97
#: the step fit y = a·steps + x/R needs prompts of different sizes: below this conditioning, x/R alone (a = 0)
STEP_FIT_MIN_SPREAD = 0.05
#: until the fit has a line, the cheapest step stands for a; only steps of at most this many prefill tokens a step
#: (vLLM's largest CUDA graph where it has graphs) count: a full-budget step is mostly its tokens, not a. An H100
#: engine of 2026-12-06 whose warm-up were 16k-token prefills (0.23 s a step) counted 0.23 s for every received
#: hit's step, and recomputed 16k hits its tier loaded in 0.19 s.
SMALL_STEP_TOKENS = 512


def _solve3(m: tuple, v: tuple) -> tuple[float, float, float] | None:
    """x with m·x = v (3×3, symmetric positive semi-definite normal equations, by Cramer's rule); None where m is
    ill-conditioned (its determinant below STEP_FIT_MIN_SPREAD² of its diagonal's product: a column the data
    cannot tell from the others, e.g. every step above the graphs)."""
    def det(a):
        return (a[0][0] * (a[1][1] * a[2][2] - a[1][2] * a[2][1]) - a[0][1] * (a[1][0] * a[2][2] - a[1][2] * a[2][0])
                + a[0][2] * (a[1][0] * a[2][1] - a[1][1] * a[2][0]))

    d = det(m)
    diag = m[0][0] * m[1][1] * m[2][2]
    if diag <= 0 or d <= STEP_FIT_MIN_SPREAD ** 2 * diag:
        return None
    out = []
    for col in range(3):
        mc = [list(row) for row in m]
        for i in range(3):
            mc[i][col] = v[i]
        out.append(det(mc) / d)
    return out[0], out[1], out[2]


class Calibration:
    """The decision's estimates, measured by the engine itself and overridden by the config's values.

    * R: the workers time each step's forward with prefill tokens (rank 0); per interval the scheduler
      gets (steps, of them above vLLM's largest CUDA graph, prefill tokens, seconds) and fits
      seconds = a·steps + J·steps above + tokens/R by least squares with forgetting (a: what a step costs
      besides its prefill tokens, decodes included; J: what a step vLLM cannot run as a graph costs more,
      fitted once both kinds were timed, else 0); where every step had about the same tokens, R =
      tokens/seconds. On an H200 in vLLM's default compiled mode (2026-12-05) a 512-token prefill took 31 ms
      and a 1024-token one 77 ms (graphs up to 512 tokens): a line alone put the second at 44 ms.
    * T0: per serial load, its time minus its GET time, averaged per interval and smoothed. With ``hit_step``,
      apart (:attr:`Estimates.hit_step_s`, once a hit, never once per load queued ahead), the step fit's a: the
      fixed cost of the extra step a received hit waits in (on an H200, 2026-12-05, in vLLM's default async
      scheduling that step made 512-token prompts with 256 tokens from the tier 1.57× their recompute). Until the
      fit has a line (every step timed had about the same prefill tokens) the cheapest step seen of at most
      :data:`SMALL_STEP_TOKENS` (or the largest CUDA graph's) tokens stands for a, whole: an upper bound that leans
      to recomputing short hits; none seen, none counted. On an H100 (2026-12-05)
      an engine that saw only hits timed 27 steps of 256 tokens, never a line, counted no step, and loaded 256
      tokens of a 512-token prompt in 1.20× its recompute.
    * bandwidth per rank: its GET bytes / GET seconds per interval, smoothed (:func:`ewma`); where the
      workers report no rank of their own, the summed bytes / summed seconds for every rank.
    * the steps a recompute takes (:func:`kvctl.connector.policy.prefill_s`): ``step_budget``, vLLM's
      ``max_num_batched_tokens`` (0: not known, one step), and :attr:`Estimates.step_s`, the step fit's a (until the
      fit has a line, the cheapest step seen, as for the received hit's step).

    ``probe_due`` says when a veto should let one load through: after ``reprobe_after_s`` without a new
    bandwidth measurement (never with a configured bandwidth), one load per period.
    """

    def __init__(self, world: int, *, prefill_tokens_per_s: float | None = None, t0_s: float | None = None,
                 tier_gbps: float | None = None, reprobe_after_s: float = 30.0, hit_step: bool = False,
                 graph_tokens: int = 0, step_budget: int = 0, clock=time.monotonic) -> None:
        self.world = max(1, world)
        self.graph_tokens = max(0, int(graph_tokens))  # vLLM's max_cudagraph_capture_size (0: no graphs)
        self.step_budget = max(0, int(step_budget))  # vLLM's max_num_batched_tokens (0: not known)
        # a hit vLLM waits for as a receive (async loading, or sync under async scheduling) takes one more engine
        # step than recomputing it: T0 then counts that step's fixed cost (step_cost_s), unless T0 is configured
        self.hit_step = hit_step
        self.fixed_r, self.fixed_t0, self.fixed_gbps = prefill_tokens_per_s, t0_s, tier_gbps
        self.reprobe_after_s, self.clock = reprobe_after_s, clock
        self._lock = threading.Lock()
        self._bps: list[float | None] = [None] * self.world
        self._t0: float | None = None
        self._fit = [0.0] * 9  # decayed sums: k·k, k·x, x·x, k·y, x·y, u·u, u·k, u·x, u·y (u: steps above graphs)
        self._xy = [0.0, 0.0]  # decayed sums of x and y
        self._min_step: float | None = None  # the cheapest interval's seconds a step: a is no more
        self._last_measured = clock()
        self.probes = 0
        self.vetoes = 0

    def observe_steps(self, steps: float, tokens: float, seconds: float, above: float = 0.0) -> None:
        """One interval's timed steps: how many, their prefill tokens, their seconds, and how many of them were
        above vLLM's largest CUDA graph."""
        if steps <= 0 or tokens <= 0 or seconds <= 0:
            return
        u = min(max(0.0, above), steps)
        with self._lock:
            f, d = self._fit, STEP_FIT_DECAY
            for i, v in enumerate((steps * steps, steps * tokens, tokens * tokens, steps * seconds, tokens * seconds,
                                   u * u, u * steps, u * tokens, u * seconds)):
                f[i] = f[i] * d + v
            self._xy = [self._xy[0] * d + tokens, self._xy[1] * d + seconds]
            if tokens / steps <= (self.graph_tokens or SMALL_STEP_TOKENS):
                per = seconds / steps
                self._min_step = per if self._min_step is None else min(self._min_step, per)

    def observe_loads(self, loads: float, fixed_seconds: float) -> None:
        """One interval's serial loads and their time besides GETs (summed over ranks)."""
        if loads <= 0 or fixed_seconds < 0:
            return
        with self._lock:
            new = fixed_seconds / loads
            self._t0 = new if self._t0 is None else (1 - T0_EWMA_NEW) * self._t0 + T0_EWMA_NEW * new

    def observe_gets(self, rank: int, get_bytes: float, get_seconds: float) -> None:
        """One interval's GETs of rank ``rank``'s instances."""
        if get_bytes <= 0 or get_seconds <= 0 or not 0 <= rank < self.world:
            return
        with self._lock:
            self._bps[rank] = ewma(self._bps[rank], get_bytes / get_seconds)
            self._last_measured = self.clock()

    def observe_tier(self, get_bytes: float, get_seconds: float) -> None:
        """GETs summed over the ranks, for workers that report no rank: every rank gets Σbytes / Σseconds."""
        for rank in range(self.world):
            self.observe_gets(rank, get_bytes, get_seconds)

    def _step_line(self) -> tuple[float, float, float] | None:
        """(a, 1/R, J) of the step fit seconds = a·steps + J·steps above graphs + tokens/R (J = 0 until steps of
        both kinds were timed, or where the fit with J is not well posed or gives a negative term); None until
        prompts of different sizes were timed."""
        with self._lock:
            kk, kx, xx, ky, xy, uu, uk, ux, uy = self._fit
        jumped = _solve3(((kk, uk, kx), (uk, uu, ux), (kx, ux, xx)), (ky, uy, xy)) if uu > 0 else None
        if jumped is not None:
            a, j, b = jumped
            if a >= 0 and b > 0 and j >= 0:
                return a, b, j
        det = kk * xx - kx * kx
        if kk > 0 and xx > 0 and det > STEP_FIT_MIN_SPREAD * kk * xx:
            a = (xx * ky - kx * xy) / det
            b = (kk * xy - kx * ky) / det
            if a >= 0 and b > 0:
                return a, b, 0.0
        return None

    def _rate(self, line: tuple[float, float, float] | None) -> float | None:
        if self.fixed_r is not None:
            return self.fixed_r
        with self._lock:
            x, y = self._xy
        if x <= 0 or y <= 0:
            return None
        return 1.0 / line[1] if line else x / y

    def step_cost_s(self) -> float | None:
        """What a step costs besides its prefill tokens (the step fit's a); None until the fit has it."""
        line = self._step_line()
        return line[0] if line else None

    def estimates(self) -> Estimates:
        line = self._step_line()  # once a decision: R and the received hit's step both come from it
        # a: the fit's; no line yet (steps of one size): the cheapest step seen, whole, the least upper bound of a it
        # has. It prices the received hit's step and a recompute's extra steps alike (Estimates.hit_step_s, step_s):
        # neither side of the decision counts a step the other does not
        a = line[0] if line else self._min_step
        step = a if self.hit_step and self.fixed_t0 is None else None
        with self._lock:
            t0 = self.fixed_t0 if self.fixed_t0 is not None else self._t0
            bps = tuple([self.fixed_gbps * 1e9 / self.world] * self.world) if self.fixed_gbps is not None else tuple(self._bps)
        if step is not None and t0 is None:
            t0 = 0.0  # the step alone is a fixed cost measured: the decision may judge
        jump = line[2] if line and self.graph_tokens else 0.0
        return Estimates(self._rate(line), t0, bps, self.graph_tokens if jump else 0, jump, step or 0.0, a or 0.0,
                         self.step_budget)

    @property
    def measured_gbps(self) -> float | None:
        """The tier's bandwidth as measured (GB/s, every rank's together)."""
        return self.estimates().tier_gbps

    def probe_due(self) -> bool:
        """Whether a veto now should let the load through (one re-probe per ``reprobe_after_s``)."""
        if self.fixed_gbps is not None:
            return False
        with self._lock:
            if self.clock() - self._last_measured >= self.reprobe_after_s:
                self._last_measured = self.clock()
                self.probes += 1
                return True
            return False
