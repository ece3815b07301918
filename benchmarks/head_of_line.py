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
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvctl.connector import policy  # noqa: E402
from kvctl.connector.policy import NO_LINE, Estimates, HitShape, Line, TierQueue, decide  # noqa: E402
from kvctl.core.errors import InvalidInput  # noqa: E402
from kvctl.records.connector_trace import read_events  # noqa: E402
from kvctl.records.runfile import read_run  # noqa: E402
from kvctl.sim.steps import StepCost  # noqa: E402
from kvctl.sim.vllm_line import RULES, LineConfig, run_line  # noqa: E402

def run(rule: str, a, sent: list[float] | None = None, credit_cap: float = policy.CREDIT_CAP) -> dict:
    """One rule over ``a``'s workload: the send times ``sent`` (s, from 0) where given, else Poisson at ``a.rate``
    (the engine: :func:`kvctl.sim.vllm_line.run_line`), the line's credit capped at ``credit_cap``."""
    if sent is not None:
        arrivals = np.array(sent)
    else:
        rng = np.random.default_rng(a.seed)
        arrivals = np.cumsum(rng.exponential(1.0 / a.rate, a.requests))
    n = len(arrivals)
    cfg = LineConfig(a.prefill_rate, a.tier_gbps * 1e9, a.t0, a.budget, a.chunk_tokens, a.bytes_per_token, rule,
                     StepCost(a.step_s, a.graph_tokens, a.jump_s), a.sched_lag, a.est_prefill_rate, credit_cap=credit_cap)
    res = run_line(arrivals, np.full(n, a.prompt_tokens), np.full(n, a.hit_tokens), cfg)
    lat = res.done - arrivals
    hit = float(res.hit.sum())  # the whole chunks before each prompt's last token
    span = float(res.done.max() - arrivals[0])
    return {"rule": rule, "p50_s": float(np.percentile(lat, 50)), "p90_s": float(np.percentile(lat, 90)),
            "p99_s": float(np.percentile(lat, 99)), "thirds_p50_s": [float(np.median(x)) for x in np.array_split(lat, 3)],
            "loaded_share": float(res.loaded.sum()) / hit if hit else 0.0,
            "tier_gbps_over_run": res.loaded_bytes / span / 1e9}


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


def runs_of(rule: str, a, sent) -> list[dict]:
    """:func:`run` of ``rule``; rule credit once per ``--credit-caps`` cap, its row named ``credit@CAP``."""
    if rule != "credit" or a.credit_caps is None:
        return [run(rule, a, sent)]
    return [{**run(rule, a, sent, cap), "rule": f"credit@{cap:g}", "credit_cap": cap} for cap in a.credit_caps]


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
    ap.add_argument("--credit-caps", type=lambda v: [float(x) for x in v.split(",") if x],
                    help="rule credit once per cap (kvctl.connector.policy.CREDIT_CAP, the line's credit at most this x "
                         "the recompute; the connector's is 1.5), e.g. 0.5,1,1.5: which cap suits a design")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    rules = [r for r in a.rules.split(",") if r]
    if not rules or any(r not in RULES for r in rules) or min(a.rate, a.prefill_rate, a.tier_gbps) <= 0 or a.requests < 3 \
            or a.graph_tokens < 0 or a.jump_s < 0 or (a.est_prefill_rate is not None and a.est_prefill_rate <= 0) \
            or (a.credit_caps is not None and (not a.credit_caps or min(a.credit_caps) < 0)):
        ap.error(f"--rules of {','.join(RULES)}; --rate, --prefill-rate, --est-prefill-rate, --tier-gbps positive; "
                 "--requests >= 3; "
                 "--graph-tokens, --jump-s, --credit-caps not negative")
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
           "runs": [row for r in rules for row in runs_of(r, a, sent)]}
    src = f"arrivals of {a.arrivals}" if a.arrivals else f"rate {a.rate}/s"
    print(f"{src}, {a.requests} requests, tier {a.tier_gbps} GB/s a load, R {a.prefill_rate:g}, a {a.step_s} s, "
          f"T0 {a.t0} s, budget {a.budget}" + (f", graphs to {a.graph_tokens} tokens, jump {a.jump_s} s" if a.graph_tokens else ""))
    print("rule        p50 s   p90 s   p99 s   p50 by third (s)        loaded  tier GB/s")
    for r in out["runs"]:
        th = " / ".join(f"{x:.3f}" for x in r["thirds_p50_s"])
        print(f"{r['rule']:<10} {r['p50_s']:7.3f} {r['p90_s']:7.3f} {r['p99_s']:7.3f}   {th:<24} {r['loaded_share']:6.2f}  "
              f"{r['tier_gbps_over_run']:9.2f}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
