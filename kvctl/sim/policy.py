"""The kvctl connector's load-or-recompute decision in the what-if model (``--policy on``, issue 46).

The engine side decides per hit (:func:`kvctl.connector.policy.decide`, docs/connector.md "Load or recompute");
this is the same test over a simulated workload, run before the simulation proper: it turns each request's hit
tokens into the tokens it loads, and the simulation then serves what was loaded and recomputes the rest.

* **sync** (the load holds the engine step, judged against its own tokens; vLLM's scheduler decides when it
  schedules the request, with nothing of its own still loading): load the hit when ``T0 + h·s/B ≤ h/R``, else
  nothing (with no queue a shorter prefix never wins where the whole hit loses).
* **async** (decided at the lookup, on arrival): the predicted load is ``T0 + the tier's backlog + k chunks' transfer``
  (the tier is the FIFO of the loads decided so far, exactly the one the simulation then serves), the predicted
  recompute ``(k chunks' tokens) / R + the engine's backlog`` (the compute queued on the request's engine: a fluid
  FIFO, in arrival order, of what was decided before it, its waits for the tier left out: an estimate, as the
  connector's is; the engine itself decides later, when vLLM's scheduler reaches the request at the head of its
  waiting line, and makes up for the queue it can no longer see with the line's credit,
  :class:`kvctl.connector.policy.Line`; ``benchmarks/head_of_line.py`` models that). The whole hit when it wins, else the
  longest whole-chunk prefix that wins, else nothing. The model has no deadline: its predictions of the tier are
  exact, so no load it starts outlives its recompute time on the tier's account (the engine's batching aside).

With a step cost (``--step-s``, ``--fit-steps``: :mod:`kvctl.sim.steps`) a recompute is priced as the connector prices
it (:func:`kvctl.connector.policy.prefill_s`): the prompt's steps less those of the rest a load would leave, and an
async hit waits one more step than its recompute (vLLM receives it, then computes its rest: the step's cost once).

Each decision is counted as the connector counts it (``decision/reason``: ``load/wins``, ``partial/tier_queue``,
``recompute/below_breakeven``, ...), in :attr:`kvctl.sim.simulate.SimResult.decisions`.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np

from kvctl.connector.policy import BELOW_BREAKEVEN, BELOW_N_STAR, LOAD, PARTIAL, RECOMPUTE, TIER_QUEUE, WINS
from kvctl.core.thresholds import CHUNK_TOKENS
from kvctl.sim.steps import StepCost

POLICIES = ("off", "on")


def _why(backlog: float, idle_wins: bool, per_token: float, prefill_rate: float) -> str:
    if backlog > 0 and idle_wins:
        return TIER_QUEUE
    return BELOW_BREAKEVEN if per_token >= 1.0 / prefill_rate else BELOW_N_STAR


def decided_hits(arrival: np.ndarray, tokens: np.ndarray, hit_tokens: np.ndarray, transfer: np.ndarray,
                 t0: np.ndarray | float, prefill_rate: float, loading: str, held_t0: np.ndarray | float = 0.0,
                 engine_of: np.ndarray | None = None, engines: int = 1, load_s: float = 0.0,
                 steps: tuple[StepCost, int | None] | None = None) -> tuple[np.ndarray, dict[str, int]]:
    """(the tokens each request loads, the decisions counted ``{"decision/reason": hits}``); see the module docstring.

    ``transfer``: each hit's seconds on the tier at its bandwidth (0 for a miss); ``held_t0``: the part of T0 that
    holds the engine after a load (the simulation's, for the engine's backlog); ``engine_of``: each request's engine;
    ``load_s``: what each async load holds the tier's loader besides its transfer (its FIFO's backlog counts it);
    ``steps``: (the step's own cost, vLLM's token budget a step) where a step costs more than its tokens."""
    cost, budget = steps if steps is not None and steps[0].active else (StepCost(), None)

    def compute_s(tokens: float) -> float:  # the engine's time for ``tokens`` prefill tokens alone, in steps
        return tokens / prefill_rate + cost.prefill(tokens, budget) if cost.active else tokens / prefill_rate

    def saved_s(tokens: float, h: float) -> float:  # what loading h of them saves the engine (no step cost: h / R)
        return compute_s(tokens) - compute_s(tokens - h) if cost.active else h / prefill_rate
    n = len(arrival)
    t0s = np.broadcast_to(np.asarray(t0, dtype=float), (n,))
    held = np.broadcast_to(np.asarray(held_t0, dtype=float), (n,))
    loaded = np.zeros(n)
    counts: Counter[str] = Counter()
    hit = hit_tokens > 0
    if loading == "sync":
        rest = tokens - hit_tokens
        saved = (tokens / prefill_rate + cost.prefill_many(tokens, budget) - (rest / prefill_rate + cost.prefill_many(rest, budget))
                 if cost.active else hit_tokens / prefill_rate)
        wins = hit & (t0s + transfer <= saved)
        loaded[wins] = hit_tokens[wins]
        per_token = np.divide(transfer, hit_tokens, out=np.zeros(n), where=hit)
        counts[f"{LOAD}/{WINS}"] = int(wins.sum())
        lost = hit & ~wins
        above = per_token >= 1.0 / prefill_rate
        counts[f"{RECOMPUTE}/{BELOW_BREAKEVEN}"] = int((lost & above).sum())
        counts[f"{RECOMPUTE}/{BELOW_N_STAR}"] = int((lost & ~above).sum())
        return loaded, {k: v for k, v in counts.items() if v}
    eng = np.zeros(n, dtype=np.int64) if engine_of is None else np.asarray(engine_of, dtype=np.int64)
    eng_free = [-math.inf] * max(1, engines)
    tier_free = -math.inf
    a_l, n_l, h_l, x_l, t0_l, held_l, e_l = (arrival.tolist(), tokens.tolist(), hit_tokens.tolist(), transfer.tolist(),
                                             t0s.tolist(), held.tolist(), eng.tolist())
    r = prefill_rate
    for i in range(n):
        a, h, e = a_l[i], h_l[i], e_l[i]
        take = 0.0
        if h > 0:
            backlog, eng_backlog = max(0.0, tier_free - a), max(0.0, eng_free[e] - a)
            x, fixed = x_l[i], t0_l[i] + cost.step_s  # a received hit: one more step than its recompute
            whole = saved_s(n_l[i], h)
            if fixed + backlog + x <= whole + eng_backlog:
                take, what = h, f"{LOAD}/{WINS}"
            else:
                per = x / h
                why = _why(backlog, fixed + x <= whole + eng_backlog, per, r)
                if per > 1.0 / r:  # a longer prefix loses more: the longest that still wins, in whole chunks
                    k = math.floor((eng_backlog - fixed - backlog) / (CHUNK_TOKENS * (per - 1.0 / r)))
                    take = float(min(max(k, 0) * CHUNK_TOKENS, h))
                    # the steps' cost counted: the longest whole-chunk prefix that still wins, from there down
                    while cost.active and take > 0 and fixed + backlog + x * take / h > saved_s(n_l[i], take) + eng_backlog:
                        take -= CHUNK_TOKENS
                    take = max(take, 0.0)
                what = f"{PARTIAL if take > 0 else RECOMPUTE}/{why}"
            counts[what] += 1
        if take > 0:
            tier_free = max(tier_free, a) + x_l[i] * take / h + load_s
        # the engine's backlog is compute queued ahead, in arrival order (what the connector counts: the prompt
        # tokens of the requests it has looked up and not seen computed), never its waits for the tier
        hold = held_l[i] + compute_s(n_l[i] - take) if take > 0 else compute_s(n_l[i])
        eng_free[e] = max(eng_free[e], a) + hold
        loaded[i] = take
    return loaded, dict(counts)
