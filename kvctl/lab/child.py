"""The process that holds one ``vllm.LLM`` for :class:`kvctl.lab.engine.LLMProcess` (run as ``python -P -m kvctl.lab.child SPEC``).

It builds the engine from the spec (a JSON file: ``llm_kwargs`` and an optional
``kv_transfer_config``), answers ``{"op": "ready", ...}`` and then serves one
command per line on stdin, one JSON answer per command on the file descriptor
named by ``KVCTL_LAB_REPLY_FD`` (stdout and stderr are the engine's log):

* ``generate``: ``prompts`` (token-id lists), ``max_tokens``, ``logprobs``;
  ``each`` (default true) times each prompt alone (one ``generate`` call per
  prompt, CLOCK_MONOTONIC before and after), else one call for all;
  answers per prompt the generated tokens, their logprobs, vLLM's
  ``num_cached_tokens`` and the timings.
* ``reset_prefix_cache``: drop vLLM's own prefix cache (the next request of a
  prompt must come from the connector, or be recomputed).
* ``metrics``: the engine's counters and gauges whose name starts with one of
  ``prefixes`` (``vllm:``, ``kvctl:``), summed over labels.
* ``shutdown``: vLLM's own shutdown of the engine core (graceful: the
  connector drains its saves), then the process exits.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

from kvctl.connector import metric_names as N


def _reply(fd: int, obj: dict) -> None:
    os.write(fd, (json.dumps(obj, separators=(",", ":"), default=str) + "\n").encode())


def _generate(llm, cmd: dict) -> list[dict]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=int(cmd.get("max_tokens", 1)), temperature=0.0,
                            logprobs=cmd.get("logprobs"), ignore_eos=True)
    prompts = [{"prompt_token_ids": list(map(int, p))} for p in cmd["prompts"]]
    batches = [[p] for p in prompts] if cmd.get("each", True) else [prompts]
    out = []
    for batch in batches:
        t0 = time.monotonic()
        results = llm.generate(batch, params, use_tqdm=False)
        t1 = time.monotonic()
        for r in results:
            comp = r.outputs[0]
            lps = []
            for tok, lp in zip(comp.token_ids, comp.logprobs or []):
                entry = lp.get(tok) if lp else None
                lps.append(None if entry is None else float(entry.logprob))
            out.append({"tokens": list(comp.token_ids), "logprobs": lps, "cached": int(r.num_cached_tokens or 0),
                        "prompt_tokens": len(r.prompt_token_ids or []), "t0": t0, "t1": t1, "wall_s": t1 - t0})
    return out


def _metrics(prefixes: list[str]) -> dict:
    """Counters (``name_total``) and gauges of this process's Prometheus registry (where vLLM's stat
    loggers and the kvctl connector's counters live when stats are on), summed over labels."""
    from prometheus_client import REGISTRY

    totals: dict[str, float] = {}
    for metric in REGISTRY.collect():
        if not any(metric.name.startswith(p) for p in prefixes) or metric.type not in ("counter", "gauge"):
            continue
        for sample in metric.samples:
            if metric.type == "counter" and not sample.name.endswith("_total"):
                continue
            totals[sample.name] = totals.get(sample.name, 0.0) + float(sample.value)
    return totals


def main(argv: list[str]) -> int:
    reply_fd = int(os.environ["KVCTL_LAB_REPLY_FD"])
    spec = json.loads(open(argv[1]).read())
    t0 = time.monotonic()
    try:
        from vllm import LLM
        from vllm.config import KVTransferConfig

        kwargs = dict(spec.get("llm_kwargs") or {})
        kwargs.setdefault("disable_log_stats", False)  # the metrics command reads the stat loggers' registry
        cfg = spec.get("kv_transfer_config")
        if cfg:
            kwargs["kv_transfer_config"] = KVTransferConfig(**cfg)
        llm = LLM(model=spec["model"], **kwargs)
    except BaseException as exc:  # noqa: BLE001 - the parent reads why
        _reply(reply_fd, {"op": "ready", "ok": False, "error": f"{type(exc).__name__}: {exc}",
                          "traceback": traceback.format_exc()[-4000:]})
        return 1
    _reply(reply_fd, {"op": "ready", "ok": True, "start_s": time.monotonic() - t0, "pid": os.getpid()})
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        op = cmd.get("op")
        try:
            if op == "generate":
                _reply(reply_fd, {"op": op, "ok": True, "results": _generate(llm, cmd)})
            elif op == "reset_prefix_cache":
                _reply(reply_fd, {"op": op, "ok": bool(llm.reset_prefix_cache())})
            elif op == "metrics":
                _reply(reply_fd, {"op": op, "ok": True, "metrics": _metrics(cmd.get("prefixes", [N.PREFIX]))})
            elif op == "shutdown":
                ts = time.monotonic()
                llm.llm_engine.engine_core.shutdown()
                _reply(reply_fd, {"op": op, "ok": True, "shutdown_s": time.monotonic() - ts})
                return 0
            else:
                _reply(reply_fd, {"op": op, "ok": False, "error": f"unknown op {op!r}"})
        except BaseException as exc:  # noqa: BLE001 - one failed command, reported; the engine may still serve
            _reply(reply_fd, {"op": op, "ok": False, "error": f"{type(exc).__name__}: {exc}",
                              "traceback": traceback.format_exc()[-4000:]})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
