"""The load-or-recompute decision where vLLM makes it: at the head of the scheduler's waiting line (issue 46).

vLLM asks a KV connector about a request (``get_num_new_matched_tokens``) only when its scheduler reaches that
request in the waiting line, inside a step's token budget. An async load does not take budget, so the scheduler goes
on to the next request; a recompute of a long prompt takes the whole budget, and the line waits a step. At the head
of the line the work ahead of a request is gone: recomputing it looks as cheap as on an idle engine, while each
request behind it waits its whole recompute. ``kvctl simulate`` and the drill decide on arrival, seeing the whole
queue; this model decides where vLLM does, with the connector's own :func:`kvctl.connector.policy.decide`.

The model (one engine, one rank, time in seconds, no randomness beyond the Poisson arrivals of ``--seed``):

* steps back to back while there is work: a step's time is ``a + its prefill tokens / R``, plus ``--jump-s``
  where its tokens pass vLLM's largest CUDA graph (``--graph-tokens``; 0: no jump); each step's budget
  ``--budget`` tokens goes to prefill in progress, then to hits whose load finished (their rest), then to the
  waiting line in order; a request finishes (its first token) at the end of the step that computes its last token;
* the tier is one FIFO at ``--tier-gbps`` with ``T0`` per load (what four instances behind links give a lone load,
  as the engine measured them on 2026-12-06); a load's budget is the decision's ``budget_s``: what the tier has not
  delivered by then is recomputed (the worker's deadline);
* the decision sees what KvctlConnector sees: R, T0, the bandwidth and the received hit's step ``a`` (calibrated,
  exact here), the loads planned and not finished, the prefill left of requests already scheduled, and (rule
  ``credit``) how long the request waited to be asked.

vLLM reports a load received at the end of the step in which it finished: until then the connector has it planned.
Rules: ``off`` (every hit loads), ``head`` (the decision, no credit: what ran on 2026-12-06 once its estimates are
right), ``whole`` (the credit, with every planned load counted whole until vLLM reports it, as the connector did
first), ``credit`` (the connector now: the credit, ``Line``, and the queue less what the tier served of it since,
``tier_backlog``). Printed per rule: p50,
p90, p99, p50 by third of the run (a queue that grows shows here), the share of hits loaded and the tier's GB/s over
the run.

    .venv/bin/python benchmarks/head_of_line.py [--rate 7.7] [--requests 110] [--tier-gbps 2.55] [--json OUT]
    .venv/bin/python benchmarks/head_of_line.py --arrivals RUN.jsonl --tier-gbps 4.0 --t0 0.005 --graph-tokens 512 --jump-s 0.045

Two options bring the model nearer a GPU run (2026-12-06, seventh: results/paper_gpu-h100-2026-12-06g-sat-800-on):
``--sched-lag 1``, vLLM's async scheduling (its default on CUDA: a step is planned while the one before it runs, so
an arrival or a finished load is scheduled a step later; an idle engine sees it at once), and ``--est-prefill-rate``,
the R the decision believes where the engine's own differs (with work queued the seventh run's decision priced a 16k
recompute at 0.171 s of GPU, where each ran a step of its own at 0.235-0.245 s).

``--reprice TRACE`` decides a GPU run's traced decisions again with this tree's decision and the figures each was
made with (2026-12-06, eighth: the seventh run's 40 ``tier_queue`` recomputes, priced in steps, load 13; the
eighth's own run comes out decision for decision).

With ``--arrivals`` the send times of a GPU run's replay (``paper_gpu.py``'s ``R5.jsonl``) replace the Poisson
arrivals: with the figures that run's trace measured, the rule ``off`` lands within 7 % of the run that loaded every
hit (results/paper_gpu-h100-2026-12-06d-sat-1200-off).

Defaults: the H100 of 2026-12-06 (``results/paper_gpu-h100-2026-12-06c-*``): 16,384-token prompts of which 15,872
tokens (62 chunks of 7.96 MB) are in the tier, R = 74k tokens/s, a = 24 ms, T0 = 7 ms, a budget of 16,384 tokens.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvctl.connector.policy import NO_LINE, Estimates, HitShape, Line, TierQueue, decide  # noqa: E402
from kvctl.connector.tier_queue import plan_ends, tier_backlog  # noqa: E402
from kvctl.core.errors import InvalidInput  # noqa: E402
from kvctl.plugins.vllm_policy import ArrivalRate  # noqa: E402
from kvctl.records.connector_trace import read_events  # noqa: E402
from kvctl.records.runfile import read_run  # noqa: E402

RULES = ("off", "head", "whole", "credit")


@dataclass
class Req:
    i: int
    arrival: float
    tokens: int
    hit: int  # tokens the tier holds (whole chunks)
    left: int = 0  # prefill tokens still to compute once scheduled
    loaded: int = 0
    done: float | None = None


@dataclass
class Model:
    r: float
    a: float
    t0: float
    bps: float
    chunk_tokens: int
    chunk_bytes: int
    budget: int
    rule: str
    graph_tokens: int = 0
    jump_s: float = 0.0
    arrivals: ArrivalRate = field(default_factory=ArrivalRate)  # the connector's estimate, from the requests asked
    tier_free: float = 0.0
    planned: dict = field(default_factory=dict)  # request -> (predicted ends, bytes) of loads not reported received
    predicted_free: list = field(default_factory=lambda: [float("-inf")])  # the connector's plan_ends state
    loaded_bytes: float = 0.0
    est_r: float | None = None  # the R the decision believes (None: the engine's own, exact)

    def decide(self, q: Req, now: float, running_left: int, others: bool) -> tuple[int, float | None]:
        """Chunks of ``q``'s hit to load and the load's budget (the rule's answer); ``others``: other requests in
        the engine (the connector counts the line's credit only then)."""
        k_all = q.hit // self.chunk_tokens
        if self.rule == "off" or k_all == 0:
            return k_all, None
        shape = HitShape(0, k_all, 0, self.chunk_tokens, self.chunk_bytes, 1, prompt=q.tokens)
        est = Estimates(self.est_r or self.r, self.t0, (self.bps,), graph_tokens=self.graph_tokens, graph_jump_s=self.jump_s,
                        hit_step_s=self.a, step_s=self.a, step_budget=self.budget)
        if self.rule == "whole":  # every load planned counted whole until vLLM reports it (the connector before)
            queue = TierQueue((sum(b for _, b in self.planned.values()),), len(self.planned))
        else:  # what the tier has not served of them by now, as the connector counts it
            queue = tier_backlog([(e, (b,)) for e, b in self.planned.values()], now, (self.bps,))
        credit = self.rule in ("credit", "whole") and others
        line = Line(now - q.arrival, self.arrivals.rate()) if credit else NO_LINE
        d = decide(shape, est, queue, float(running_left), line)
        return d.tokens // self.chunk_tokens, d.budget_s

    def start_load(self, q: Req, k: int, now: float, budget_s: float | None) -> float:
        """Queue the load of k chunks; returns when the request's rest can be scheduled, and sets ``q.loaded``."""
        start = max(now, self.tier_free)
        per = self.chunk_bytes / self.bps
        end = start + self.t0 + k * per
        if budget_s is not None and end > now + budget_s:  # the deadline: what arrived by then is kept
            k = max(0, min(k, int((now + budget_s - start - self.t0) / per)))
            end = now + budget_s
        self.tier_free = max(self.tier_free, start + self.t0 + k * per)
        self.planned[q.i] = (plan_ends(self.predicted_free, now, self.t0, (k * self.chunk_bytes,), (self.bps,)),
                             k * self.chunk_bytes)
        self.loaded_bytes += k * self.chunk_bytes
        q.loaded = k * self.chunk_tokens
        return end


def run(rule: str, a, sent: list[float] | None = None) -> dict:
    """One rule over ``a``'s workload: the send times ``sent`` (s, from 0) where given, else Poisson at ``a.rate``."""
    if sent is not None:
        arrivals = np.array(sent)
    else:
        rng = np.random.default_rng(a.seed)
        arrivals = np.cumsum(rng.exponential(1.0 / a.rate, a.requests))
    # the last prompt token is always computed: at most the whole chunks before it come from the tier
    hit = min(a.hit_tokens, (a.prompt_tokens - 1) // a.chunk_tokens * a.chunk_tokens) // a.chunk_tokens * a.chunk_tokens
    reqs = [Req(i, float(t), a.prompt_tokens, hit) for i, t in enumerate(arrivals)]
    m = Model(a.prefill_rate, a.step_s, a.t0, a.tier_gbps * 1e9, a.chunk_tokens, a.chunk_tokens * a.bytes_per_token,
              a.budget, rule, a.graph_tokens, a.jump_s, est_r=a.est_prefill_rate)
    waiting: list[Req] = []
    loading: list[tuple[float, int]] = []  # (ready time, request index) heap
    running: list[Req] = []  # prefill in progress, in order
    nxt, now = 0, 0.0
    lag = a.sched_lag
    seen = 0.0  # what the scheduler knows of by now: with --sched-lag 1, only what happened before the last step began
    while any(q.done is None for q in reqs):
        while nxt < len(reqs) and reqs[nxt].arrival <= seen:
            waiting.append(reqs[nxt])
            nxt += 1
        ready = []
        while loading and loading[0][0] <= seen:
            ready.append(reqs[heapq.heappop(loading)[1]])
        for q in ready:
            m.planned.pop(q.i, None)
            q.left = q.tokens - q.loaded
            running.append(q)
        budget, step_tokens = a.budget, 0
        sched: list[tuple[Req, int]] = []
        for q in running:  # prefill in progress and received hits first
            if budget <= 0:
                break
            take = min(budget, q.left)
            sched.append((q, take))
            budget -= take
        while waiting and budget > 0:
            q = waiting[0]
            m.arrivals.arrived(str(q.i), q.arrival)
            left_ahead = sum(x.left - t for x, t in sched)  # the connector counts a scheduled chunk as computed
            others = bool(running or loading or len(waiting) > 1)
            k, budget_s = m.decide(q, now, left_ahead, others) if q.hit else (0, None)
            waiting.pop(0)
            if k:
                heapq.heappush(loading, (m.start_load(q, k, now, budget_s), q.i))
                continue
            q.left = q.tokens
            running.append(q)
            take = min(budget, q.left)
            sched.append((q, take))
            budget -= take
        step_tokens = sum(t for _, t in sched)
        if step_tokens == 0:  # idle: to the next arrival or finished load
            events = ([reqs[nxt].arrival] if nxt < len(reqs) else []) + ([loading[0][0]] if loading else [])
            now = seen = max(now, min(events))  # an idle engine sees the next event at once
            continue
        if lag:  # the next step is planned now, while this one runs
            seen = now
        now += a.step_s + step_tokens / a.prefill_rate + (a.jump_s if a.graph_tokens and step_tokens > a.graph_tokens else 0.0)
        for q, t in sched:
            q.left -= t
            if q.left <= 0:
                q.done = now
        running = [q for q in running if q.done is None]
        if not lag:
            seen = now
    lat = np.array([q.done - q.arrival for q in reqs])
    thirds = [float(np.median(x)) for x in np.array_split(lat, 3)]
    span = max(q.done for q in reqs) - reqs[0].arrival
    hits = [q for q in reqs if q.hit]
    return {"rule": rule, "p50_s": float(np.percentile(lat, 50)), "p90_s": float(np.percentile(lat, 90)),
            "p99_s": float(np.percentile(lat, 99)), "thirds_p50_s": thirds,
            "loaded_share": sum(q.loaded for q in hits) / max(1, sum(q.hit for q in hits)),
            "tier_gbps_over_run": m.loaded_bytes / span / 1e9}


def reprice(trace: Path, a) -> dict:
    """Each decision a GPU run's connector traced (``KVCTL_CONNECTOR_TRACE``), decided again by this tree's
    :func:`decide` from the figures it was decided with (R, T0, the received hit's step, the step's a and vLLM's budget
    where traced, else that step and ``--budget``, the graph jump, the tier's bandwidth, the queue, the prefill work
    ahead, the line), the prompt ``--prompt-tokens`` long (``--graph-tokens``: vLLM's largest CUDA graph where the
    trace had a jump). Counts of
    (the run's decision, its reason, the decision now); the decisions the run made before it had measured are left
    out. Each is decided alone: a load it turns into would queue the tier for those after it, which this does not
    follow (the model above does)."""
    counts: dict[str, int] = {}
    for e in read_events(str(trace))[0]:  # kvctl's trace reader: a regular file, bounded; InvalidInput otherwise
        if e["ev"] != "decision" or None in (e.get("prefill_tokens_per_s"), e.get("t0_s"), e.get("tier_gbps")):
            continue
        shape = HitShape(0, e["found"] // a.chunk_tokens, 0, a.chunk_tokens, a.chunk_tokens * a.bytes_per_token, 1,
                         prompt=a.prompt_tokens)
        jump = e.get("graph_jump_s") or 0.0
        # a trace from before 2026-12-06 (eighth) has no step_s or step_budget: the received hit's step and --budget
        est = Estimates(e["prefill_tokens_per_s"], e["t0_s"], (e["tier_gbps"] * 1e9,), a.graph_tokens if jump else 0,
                        jump, e["hit_step_s"], e.get("step_s", e["hit_step_s"]), e.get("step_budget") or a.budget)
        line_ = Line(e["line_wait_s"], e["arrival_rate"]) if e.get("arrival_rate") else NO_LINE
        d = decide(shape, est, TierQueue((e["queued_bytes"],), e["loads_ahead"]), float(e["engine_tokens"]), line_)
        key = f"{e['decision']}/{e['reason']} -> {d.decision}"
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def read_arrivals(path: Path) -> list[float]:
    """The send times (s) of a replay's requests (``kvctl replay``'s run file, read by kvctl's own reader: bounded,
    every row checked; InvalidInput names the line), sorted, from the first."""
    sent = sorted(float(row["sent_s"]) for row in read_run(path).rows if row.get("sent_s") is not None)
    if len(sent) < 3:
        raise ValueError(f"{path}: fewer than 3 requests with sent_s")
    return [t - sent[0] for t in sent]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=7.7, help="requests/s (Poisson)")
    ap.add_argument("--requests", type=int, default=110)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--prompt-tokens", type=int, default=16384)
    ap.add_argument("--hit-tokens", type=int, default=15872, help="tokens of each prompt in the tier (whole chunks)")
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--bytes-per-token", type=int, default=31104)
    ap.add_argument("--prefill-rate", type=float, default=74_000.0, help="R, tokens/s")
    ap.add_argument("--step-s", type=float, default=0.024, help="a: what a step costs besides its tokens")
    ap.add_argument("--t0", type=float, default=0.007, help="a load's fixed time besides its transfer")
    ap.add_argument("--tier-gbps", type=float, default=2.55, help="what one load gets from the tier")
    ap.add_argument("--budget", type=int, default=16384, help="vLLM's max_num_batched_tokens")
    ap.add_argument("--graph-tokens", type=int, default=0, help="vLLM's largest CUDA graph (tokens; 0: no jump)")
    ap.add_argument("--jump-s", type=float, default=0.0, help="what a step above --graph-tokens costs more")
    ap.add_argument("--arrivals", type=Path, help="a replay's JSONL (paper_gpu.py's RUN.jsonl): its send times "
                    "instead of Poisson arrivals at --rate")
    ap.add_argument("--est-prefill-rate", type=float, default=None,
                    help="the R the decision believes, where it differs from the engine's (--prefill-rate): a "
                         "decision that prices a recompute cheaper than the engine's steps cost")
    ap.add_argument("--sched-lag", type=int, choices=(0, 1), default=0,
                    help="1: vLLM's async scheduling (its default on CUDA): a step is planned while the one before it "
                         "runs, so an arrival or a finished load is scheduled one step later")
    ap.add_argument("--reprice", type=Path, help="a GPU run's connector trace (paper_gpu.py's R5.connector-trace.jsonl): "
                    "decide each of its decisions again with this tree's decision and the figures it was made with, "
                    "and print how many change (each decision's hit as traced, in prompts of --prompt-tokens)")
    ap.add_argument("--rules", default=",".join(RULES))
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    rules = [r for r in a.rules.split(",") if r]
    if not rules or any(r not in RULES for r in rules) or min(a.rate, a.prefill_rate, a.tier_gbps) <= 0 or a.requests < 3 \
            or a.graph_tokens < 0 or a.jump_s < 0 or (a.est_prefill_rate is not None and a.est_prefill_rate <= 0):
        ap.error(f"--rules of {','.join(RULES)}; --rate, --prefill-rate, --est-prefill-rate, --tier-gbps positive; "
                 "--requests >= 3; "
                 "--graph-tokens, --jump-s not negative")
    if a.reprice is not None:
        try:
            counts = reprice(a.reprice, a)
        except InvalidInput as exc:
            ap.error(f"--reprice: {exc}")
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            ap.error(f"--reprice: {a.reprice}: a decision the trace does not hold whole ({exc!r})")
        for key, n in counts.items():
            print(f"{key:<45} {n}")
        if a.json:
            a.json.write_text(json.dumps({"reprice": str(a.reprice), "counts": counts}, indent=1) + "\n")
        return 0
    sent = None
    if a.arrivals is not None:
        try:
            sent = read_arrivals(a.arrivals)
        except (InvalidInput, ValueError) as exc:
            ap.error(f"--arrivals: {exc}")
        a.requests = len(sent)
    out = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
           "runs": [run(r, a, sent) for r in rules]}
    src = f"arrivals of {a.arrivals}" if a.arrivals else f"rate {a.rate}/s"
    print(f"{src}, {a.requests} requests, tier {a.tier_gbps} GB/s a load, R {a.prefill_rate:g}, a {a.step_s} s, "
          f"T0 {a.t0} s, budget {a.budget}" + (f", graphs to {a.graph_tokens} tokens, jump {a.jump_s} s" if a.graph_tokens else ""))
    print("rule     p50 s   p90 s   p99 s   p50 by third (s)        loaded  tier GB/s")
    for r in out["runs"]:
        th = " / ".join(f"{x:.3f}" for x in r["thirds_p50_s"])
        print(f"{r['rule']:<7} {r['p50_s']:7.3f} {r['p90_s']:7.3f} {r['p99_s']:7.3f}   {th:<24} {r['loaded_share']:6.2f}  "
              f"{r['tier_gbps_over_run']:9.2f}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
