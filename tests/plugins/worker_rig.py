"""The worker half of KvctlConnector around real paged caches, for the worker tests (tests/plugins/test_vllm_*.py).

A stand-in object carrying the gloo group plays vLLM's TP or PCP coordinator (vLLM's own GroupCoordinator needs a
full engine start); the caches are shaped like vLLM's CPU MLA / GQA caches.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

CT, BS, ROW, N_BLOCKS = 4, 2, 6, 16
N_TOKENS = 18  # 4 full chunks of 4 tokens + 2


def token_value(t: int, layer: int, col: int) -> float:
    return float(t * 100 + layer * 10 + col)


def make_worker(rank, world, urls, kind, mla=True, heads=1, **extra):
    import torch.distributed as dist
    from vllm.distributed import parallel_state as ps

    from kvctl.plugins.vllm import KvctlConnector

    coordinator = SimpleNamespace(rank_in_group=rank, world_size=world, cpu_group=dist.group.WORLD, ranks=list(range(world)))
    setattr(ps, "_PCP" if kind == "pcp" else "_TP", coordinator)  # the connector finds it where vLLM keeps it
    if mla:
        caches = {n: torch.zeros(N_BLOCKS, BS, ROW) for n in ("l0", "l1")}
    else:
        caches = {n: torch.zeros(N_BLOCKS, heads, BS, 2 * ROW) for n in ("l0", "l1")}
    conn = KvctlConnector.without_engine(
        {"urls": urls, "chunk_tokens": CT, "timeout_s": 2.0, **extra}, world_size=world, layer_names=["l0", "l1"],
        spec=SimpleNamespace(head_size=ROW, num_kv_heads=heads, dtype=torch.float32), block_size=BS,
        use_mla=mla, kv_caches=caches, model_name="m", group_kind=kind)
    return conn, caches


def fill(conn, block_ids, rank):
    """Write token t's KV into the request's slots (MLA: same on every rank; GQA: rank's own heads)."""
    from kvctl.connector.layouts import slots_for

    slots = slots_for(block_ids, BS, 0, N_TOKENS)
    lay = conn.worker.layout
    shape = lay.chunk_shape(N_TOKENS, 1)  # this rank's share
    data = torch.zeros(shape)
    for layer in range(shape[0]):
        for t in range(N_TOKENS):
            data[layer, t] = token_value(t, layer, 0) + (0 if conn.spec.use_mla else 1000 * rank)
    lay.insert(slots, data)
