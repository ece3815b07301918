"""What an engine step costs besides its prefill tokens, in the what-if model (``--step-s``, ``--graph-tokens``,
``--graph-jump-s``, ``--fit-steps``; issue 46).

vLLM runs a prefill in steps of at most ``max_num_batched_tokens`` tokens. Each step costs a fixed ``a`` (the
scheduler, the sampler, the launch: about 25 ms on an H100 in vLLM's default compiled mode, 2026-12-06), and a step
above vLLM's largest CUDA graph (``max_cudagraph_capture_size``: 512 tokens there) runs op by op and costs ``J``
more (about 30 ms). The connector's decision prices a recompute in those steps
(:func:`kvctl.connector.policy.prefill_s`); the model of ``kvctl simulate`` and ``kvctl plan`` does the same with a
:class:`StepCost`: each step of the engine's model costs ``a`` (plus ``J`` above the graphs) on top of its tokens / R,
and ``--policy on`` prices a recompute in those steps. With no step cost (the default) the model is the paper's,
tokens / R alone.

:func:`fit_steps` fits ``a``, ``J`` and R from a connector trace's ``step`` events (``KVCTL_CONNECTOR_TRACE``: each
step's prefill tokens, seconds and whether it was above the graphs) with the connector's own fit
(:class:`kvctl.connector.calibration.Calibration`), the graph size from the largest step that ran as a graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvctl.connector.policy import step_costs
from kvctl.core.errors import InvalidInput

__all__ = ["StepCost", "StepFit", "fit_steps"]


@dataclass(frozen=True)
class StepCost:
    """A step's cost besides its tokens: ``step_s`` each, ``graph_jump_s`` more where it computes more than
    ``graph_tokens`` tokens (0: no graphs, no jump)."""

    step_s: float = 0.0
    graph_tokens: int = 0
    graph_jump_s: float = 0.0

    @property
    def active(self) -> bool:
        return self.step_s > 0 or (self.graph_jump_s > 0 and self.graph_tokens > 0)

    def of(self, tokens: float) -> float:
        """The fixed cost of one step that computes ``tokens`` prefill tokens."""
        return self.step_s + (self.graph_jump_s if self.graph_tokens and tokens > self.graph_tokens else 0.0)

    def prefill(self, tokens: float, budget: float | None) -> float:
        """The fixed costs of computing ``tokens`` alone, in steps of at most ``budget`` tokens (None or 0: one
        step); 0 for nothing to compute. :func:`kvctl.connector.policy.prefill_s` without its tokens / R (the
        connector's own step count, :func:`kvctl.connector.policy.step_costs`)."""
        if tokens <= 0:
            return 0.0
        full, last = step_costs(tokens, budget or 0, self.step_s, self.graph_tokens, self.graph_jump_s)
        return full + last

    def prefill_many(self, tokens: np.ndarray, budget: float | None) -> np.ndarray:
        """:meth:`prefill` of each of ``tokens`` (the model's per-request costs, without a Python loop: a million
        requests are a million prompts)."""
        t = np.asarray(tokens, dtype=float)
        pos = t > 0
        size = np.where(pos, budget, 1.0) if budget and budget > 0 else np.where(pos, t, 1.0)
        full = np.where(pos, np.floor_divide(t, size), 0.0)  # Python's // (connector.policy.step_costs)
        last = t - full * size
        last = np.where(last < 1e-6, 0.0, last)
        g, j = self.graph_tokens, self.graph_jump_s

        def step(n: np.ndarray) -> np.ndarray:
            return self.step_s + (np.where(n > g, j, 0.0) if g else 0.0)
        return np.where(pos, full * step(size) + np.where(last > 0, step(last), 0.0), 0.0)

    def check(self) -> None:
        for name, v in (("--step-s", self.step_s), ("--graph-jump-s", self.graph_jump_s)):
            if not (isinstance(v, (int, float)) and 0.0 <= v <= 3600.0):
                raise InvalidInput(f"{name} must be seconds in [0, 3600], got {v!r}")
        if not (isinstance(self.graph_tokens, int) and not isinstance(self.graph_tokens, bool) and self.graph_tokens >= 0):
            raise InvalidInput(f"--graph-tokens must be a whole number ≥ 0, got {self.graph_tokens!r}")


@dataclass(frozen=True)
class StepFit:
    """What :func:`fit_steps` found: the step cost, R (tokens/s) and how many steps it saw."""

    cost: StepCost
    prefill_rate: float | None
    steps: int

    def note(self, path: str) -> str:
        r = f", R {self.prefill_rate:,.0f} tokens/s (--prefill-rate is used)" if self.prefill_rate else ""
        jump = (f", {self.cost.graph_jump_s * 1e3:.1f} ms more above {self.cost.graph_tokens} tokens"
                if self.cost.graph_jump_s > 0 else ", no jump above the graphs")
        return f"--fit-steps {path}: {self.steps} steps: a step costs {self.cost.step_s * 1e3:.1f} ms besides its tokens{jump}{r}"


def fit_steps(path: str) -> StepFit:
    """The step cost of a connector trace's ``step`` events (see the module docstring); InvalidInput for a trace
    with none (the engine traced no step: an older connector, or no prefill)."""
    from kvctl.connector.calibration import Calibration  # noqa: PLC0415 - the connector's own fit, torch-free
    from kvctl.records.connector_trace import read_events  # noqa: PLC0415

    def number(v: object) -> float:  # a field as the connector writes it, else 0 (the event is left out)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else 0.0

    steps = [e for e in read_events(path, "--fit-steps trace")[0] if e["ev"] == "step"]
    timed = [(number(e.get("prefill_tokens")), number(e.get("s")), e.get("above_graphs") is True) for e in steps]
    timed = [t for t in timed if t[0] > 0 and t[1] > 0]
    if not timed:
        raise InvalidInput(f"--fit-steps: {path} has no timed step with prefill tokens (a connector trace of an engine's prefills)")
    graphs = max((t for t, _, above in timed if not above), default=0)
    cal = Calibration(1, graph_tokens=int(graphs), step_budget=0)
    for tokens, seconds, above in timed:
        cal.observe_steps(1, tokens, seconds, 1.0 if above else 0.0)
    est = cal.estimates()
    jump = est.graph_jump_s if est.graph_tokens else 0.0
    return StepFit(StepCost(est.step_s, int(graphs) if jump > 0 else 0, jump), est.prefill_tokens_per_s, len(timed))
