"""Captures of the committed H200 runs R2 and R4 (benchmarks/results/paper_gpu-h200-2026-12-02), rebuilt from what
the run directory holds, for ``kvctl diagnose --from``.

The live diagnose of those runs saved no capture (paper_gpu ran it without ``--save``): the directory holds its JSON
(``R2.diagnose.json``: finished, waiting + running at both samples, hit tokens, L2 bytes/s, B, each instance's GETs)
and the replay's run file (``R2.jsonl``: each request's send, first-token and finish times, its cached tokens). The
engine's /metrics at any moment is rebuilt from the run file the way vLLM 0.32 publishes it:

* a step ends where requests finish together (a batch of finish times within 5 ms); vLLM publishes its counters and
  gauges there, and they count the scheduler's state as the step began, i.e. at the publish before: finished by
  now + waiting + running = the requests sent by the previous publish (R2's state at 30.22 s, 21 + 46 = 67, is the 67
  requests sent by 26.67 s: the committed diagnose saw exactly that);
* a request is admitted (prefix-cache queries and hits counted) at the step that starts its prefill: a miss at the
  step that finishes it, a hit two steps before (admitted, loaded in the next step, computed in the one after:
  the connector's "receive" path); its L2 bytes (tokens × s) and GET seconds (bytes / B) count when its load ends,
  one step before it finishes;
* Valkey INFO holds the GET calls, µs and bytes the committed diagnose read over its window.

The two samples lie where the committed numbers put them (the first one whose finished count and queues match
diagnose's), with engine reads every second between them (what ``kvctl diagnose`` now takes). ``truth`` gives what
the run file says ρ was over that window: arrivals × the mean L2 bytes of an arriving request / B.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvctl.diagnose.capture import Capture, Sample

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / "benchmarks" / "results" / "paper_gpu-h200-2026-12-02"
BATCH_S = 0.005
HIT_LAG, LOAD_LAG = 2, 1  # publishes between a hit's admission and its finish; between its load's end and its finish


@dataclass(frozen=True)
class Run:
    rows: list[dict]
    diagnose: dict
    bytes_per_token: float
    publishes: list[float]  # step ends: the last finish of each batch
    started_s: float  # when paper_gpu started diagnose, in the run's clock


def load(name: str) -> Run:
    lines = (RUNS / f"{name}.jsonl").read_text().splitlines()
    rows = [r for r in map(json.loads, lines) if "index" in r]
    pubs: list[float] = []
    for f in sorted(r["finished_s"] for r in rows):
        if pubs and f - pubs[-1] <= BATCH_S:
            pubs[-1] = f
        else:
            pubs.append(f)
    meta = json.loads((RUNS / "meta.json").read_text())
    info = json.loads((RUNS / f"{name}.info.json").read_text())
    return Run(rows, json.loads((RUNS / f"{name}.diagnose.json").read_text()), float(meta["bytes_per_token"]), pubs,
               float(info["diagnose_window"]["from_s"]))


def _pub_of(run: Run, t: float) -> int:
    """Index of the publish of a request finishing at ``t``."""
    return max(k for k, p in enumerate(run.publishes) if p <= t + 1e-9)


def state(run: Run, t: float) -> dict[str, float]:
    """The engine's published counters and gauges at time ``t`` (the state of the last publish at or before it)."""
    ks = [k for k, p in enumerate(run.publishes) if p <= t]
    if not ks:
        return dict(F=0, W=0, R=0, steps=0, hits=0, queried=0, loads=0, lookups=0)
    k = ks[-1]
    tau, sigma = run.publishes[k], run.publishes[k - 1] if k else 0.0
    sent = [r for r in run.rows if r["sent_s"] <= sigma]
    finished = [r for r in run.rows if r["finished_s"] <= tau + 1e-9]
    hit = lambda r: r["cached_tokens"] > 0  # noqa: E731
    admitted = [r for r in sent if _pub_of(run, r["finished_s"]) - (HIT_LAG if hit(r) else 0) <= k]
    loaded = [r for r in admitted if hit(r) and _pub_of(run, r["finished_s"]) - LOAD_LAG <= k]
    queue = len(sent) - len(finished)
    running = min(queue, sum(1 for r in run.rows if k + 1 < len(run.publishes) and _pub_of(run, r["finished_s"]) == k + 1))
    return dict(F=len(finished), W=queue - running, R=running, steps=k + 1, hits=sum(r["cached_tokens"] for r in admitted if hit(r)),
                queried=sum(r["prompt_tokens"] for r in admitted), loads=len(loaded), loaded_tokens=sum(r["cached_tokens"] for r in loaded))


def metrics_text(run: Run, t: float) -> str:
    s = state(run, t)
    p = run.rows[0]["prompt_tokens"]
    b = run.diagnose["bandwidth_gbps"] * 1e9
    l2_bytes = s.get("loaded_tokens", 0) * run.bytes_per_token
    lines = [
        "# TYPE vllm:request_success counter", f'vllm:request_success_total{{finished_reason="length",model_name="m"}} {s["F"]}',
        "# TYPE vllm:num_requests_waiting gauge", f'vllm:num_requests_waiting{{model_name="m"}} {s["W"]}',
        "# TYPE vllm:num_requests_running gauge", f'vllm:num_requests_running{{model_name="m"}} {s["R"]}',
        "# TYPE vllm:prompt_tokens counter", f'vllm:prompt_tokens_total{{model_name="m"}} {s["F"] * p}',
        "# TYPE vllm:generation_tokens counter", f'vllm:generation_tokens_total{{model_name="m"}} {s["F"]}',
        "# TYPE vllm:prefix_cache_queries counter", f'vllm:prefix_cache_queries_total{{model_name="m"}} {s["queried"]}',
        "# TYPE vllm:prefix_cache_hits counter", 'vllm:prefix_cache_hits_total{model_name="m"} 0',
        "# TYPE vllm:external_prefix_cache_queries counter", f'vllm:external_prefix_cache_queries_total{{model_name="m"}} {s["queried"]}',
        "# TYPE vllm:external_prefix_cache_hits counter", f'vllm:external_prefix_cache_hits_total{{model_name="m"}} {s["hits"]}',
        "# TYPE vllm:iteration_tokens_total histogram", f'vllm:iteration_tokens_total_count{{model_name="m"}} {s["steps"]}',
        f'vllm:iteration_tokens_total_sum{{model_name="m"}} {s["steps"]}', f'vllm:iteration_tokens_total_bucket{{le="+Inf",model_name="m"}} {s["steps"]}',
        "# TYPE vllm:request_prompt_tokens histogram",
        'vllm:request_prompt_tokens_bucket{le="10000.0",model_name="m"} 0', f'vllm:request_prompt_tokens_bucket{{le="20000.0",model_name="m"}} {s["F"]}',
        f'vllm:request_prompt_tokens_bucket{{le="+Inf",model_name="m"}} {s["F"]}',
        f'vllm:request_prompt_tokens_count{{model_name="m"}} {s["F"]}', f'vllm:request_prompt_tokens_sum{{model_name="m"}} {s["F"] * p}',
        "# TYPE kvctl:ranks gauge", "kvctl:ranks 1",
        "# TYPE kvctl:l2_get_bytes counter", f"kvctl:l2_get_bytes_total {l2_bytes}",
        "# TYPE kvctl:l2_get_seconds counter", f"kvctl:l2_get_seconds_total {l2_bytes / b}",
        "# TYPE kvctl:loads counter", f"kvctl:loads_total {s['loads']}",
    ]
    return "\n".join(lines) + "\n"


def window(run: Run) -> tuple[float, float]:
    """(first, last) sample times in the run's clock: of those whose finished count and queues are diagnose's, the
    nearest to when paper_gpu started it (``R2.info.json``: diagnose_window.from_s, 1.8 s after the replay)."""
    e = run.diagnose["engines"][0]
    w = e["window_s"]
    fits = []
    for i in range(0, 600):
        t_a = i / 100
        a, b = state(run, t_a), state(run, t_a + w)
        if (b["F"] - a["F"], a["W"] + a["R"], b["W"] + b["R"]) == (e["finished"], e["queue_start"], e["queue_end"]):
            fits.append(t_a)
    assert fits, "no window reproduces what diagnose recorded"
    t_a = min(fits, key=lambda t: abs(t - run.started_s))
    return t_a, t_a + w


def _info(calls: float, usec: float, out: float) -> dict:
    return {"cmdstat_get": {"calls": calls, "usec": usec}, "total_net_output_bytes": out, "cmdstat_info": {"calls": 1}, "evicted_keys": 0}


def capture(name: str, poll_s: float = 1.0) -> Capture:
    run = load(name)
    t_a, t_b = window(run)
    insts = run.diagnose["instances"]
    zero = [_info(0, 0, 0) for _ in insts]
    end = [_info(i["get_calls"], i["usec_per_get"] * i["get_calls"], i["bytes_out"]) for i in insts]
    samples = [Sample(t_a, [metrics_text(run, t_a)], zero, engine_t_s=[t_a], valkey_t_s=[t_a] * len(insts))]
    t = t_a + poll_s
    while t < t_b - poll_s / 2:
        samples.append(Sample(t, [metrics_text(run, t)], [], engine_t_s=[t], engines_only=True))
        t += poll_s
    samples.append(Sample(t_b, [metrics_text(run, t_b)], end, engine_t_s=[t_b], valkey_t_s=[t_b] * len(insts)))
    k = max(1, len(insts))
    return Capture(["http://engine"], [i["url"] for i in insts], samples, {"bytes_per_token": run.bytes_per_token},
                   run.diagnose["created_at"], instances_per_rank=k)


def truth(name: str) -> dict[str, float]:
    """What the run file says over the window: λ (arrivals / window), L2 bytes per arriving request, ρ with B as measured."""
    run = load(name)
    t_a, t_b = window(run)
    came = [r for r in run.rows if t_a <= r["sent_s"] < t_b]
    per_loaded = run.bytes_per_token * next(r["cached_tokens"] for r in run.rows if r["cached_tokens"] > 0)
    l2 = per_loaded * sum(1 for r in came if r["cached_tokens"] > 0) / len(came)
    lam = len(came) / (t_b - t_a)
    return {"arrivals": len(came), "lambda": lam, "l2_bytes_per_request": l2, "rho": lam * l2 / (run.diagnose["bandwidth_gbps"] * 1e9)}
