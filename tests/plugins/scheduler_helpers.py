"""The scheduler side of KvctlConnector on real Valkey instances, with vLLM's records as SimpleNamespaces.

Shared by tests/plugins/test_vllm_scheduler.py and test_policy_ranks_connector.py. vLLM's Request /
SchedulerOutput are plain records here (the fields the connector reads); the tier, the keys and the
connector are real. Import it after checking that torch and vLLM import.
"""

from __future__ import annotations

from types import SimpleNamespace

from kvctl.connector.ownership import chunk_keys
from kvctl.connector.resp import RespClient

CT, BS = 4, 2
TOKENS = list(range(300, 317))  # 17 tokens: 4 full chunks, all loadable ((17 - 1) // 4 = 4)


def scheduler(urls, **extra):
    """KvctlConnector's scheduler side without an engine: W = 2, MLA, 2 layers × head_size 6 × float32, CT-token chunks."""
    import torch  # noqa: PLC0415 - the caller has checked that torch and vLLM import
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: PLC0415

    from kvctl.plugins.vllm import KvctlConnector  # noqa: PLC0415

    return KvctlConnector.without_engine(
        {"urls": urls, "chunk_tokens": CT, "timeout_s": 1.0, **extra}, world_size=2, layer_names=["l0", "l1"],
        spec=SimpleNamespace(head_size=6, num_kv_heads=1, dtype=torch.float32), block_size=BS, use_mla=True,
        model_name="m", role=KVConnectorRole.SCHEDULER)


def store_all(servers, fmt, tokens=TOKENS):
    """Every full chunk of ``tokens`` (TOKENS: 16 of its 17), chunk c on instance c mod 2."""
    keys = chunk_keys(tokens[:len(tokens) // CT * CT], CT, "m", fmt)
    for c, k in enumerate(keys):
        with RespClient(servers[c % 2].url) as cl:
            cl.batched_set([k], [b"kv"])
    return keys


def req(rid, tokens=TOKENS, preemptions=0):
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(tokens), num_preemptions=preemptions)


def sched_out(new=(), cached=(), scheduled=None, finished=()):
    cached = list(cached)
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, prompt_token_ids=t, block_ids=(b,), num_computed_tokens=n)
                            for r, t, b, n in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[c[0] for c in cached], resumed_req_ids={c[0] for c in cached if c[3]},
                                              new_block_ids=[(c[1],) if c[1] is not None else None for c in cached],
                                              num_computed_tokens=[c[2] for c in cached]),
        num_scheduled_tokens=dict(scheduled or {}), finished_req_ids=set(finished))
