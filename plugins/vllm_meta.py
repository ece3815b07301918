"""The connector's plans, passed from the scheduler side to the workers every step (pure, picklable)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvctl.connector.ownership import KeyExtra

from kvctl.connector.settings import ConnectorConfigError

__all__ = ["KvctlConnectorMetadata", "LoadSpec", "ReqState", "SaveSpec", "shard_group", "shard_group_kind"]


@dataclass
class LoadSpec:
    req_id: str
    token_ids: list[int]  # prompt tokens up to the end of the hit
    first_chunk: int  # first chunk to load (the ones before are in vLLM's prefix cache)
    end_chunk: int  # the hit ends here (exclusive)
    skip_tokens: int  # tokens already computed locally (block-aligned, may be mid-chunk)
    block_ids: list[int]
    is_async: bool = False  # loaded on the worker's load thread while vLLM steps on (else in the step, blocking it)
    key_extra: KeyExtra | None = None  # LoRA/cache_salt/mm material of the keys (plugins/vllm_keys.py)
    # vLLM waits for it as a remote receive (the scheduler answered load_async): the worker reports it finished
    # in get_finished, whichever way it loaded it (always for async; for sync on the "receive" path)
    report_done: bool = False
    # an async load may take this long from the step that starts it, its wait for the loader included (its predicted
    # recompute time, connector/policy.py): no GET starts after it, the agreed prefix ends where the ranks got to and
    # the rest is recomputed; None: no bound but the tier's timeout_s (and for a sync load, which blocks the step)
    budget_s: float | None = None


@dataclass
class SaveSpec:
    req_id: str
    token_ids: list[int]  # the prompt's full chunks
    block_ids: list[int]
    key_extra: KeyExtra | None = None  # the same material the scheduler's lookup used
    # chunks before it are in the tier already: the lookup found them and the decision recomputed them
    first_chunk: int = 0


@dataclass
class KvctlConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    # the step, numbered by the scheduler side, and the prompt tokens it computes (the workers time the
    # forward of a step with prefill tokens: the prefill rate R of the load-or-recompute decision)
    step: int = 0
    prefill_tokens: int = 0
    step_tokens: int = 0  # every token the step computes (decodes too): above vLLM's largest CUDA graph or not


@dataclass
class ReqState:
    """What the scheduler side keeps of a request it scheduled: its prompt, blocks, save and prefill progress."""

    prompt: list[int]
    block_ids: list[int]
    saved: bool = False
    key_extra: KeyExtra | None = None
    in_tier: int = 0  # chunks its lookup found in the tier (not saved again)
    computed: int = 0  # tokens computed once the last scheduled step has run (its prefill left: prompt - computed)


def shard_group(parallel_config) -> tuple[str, int]:
    """``(kind, W)``: the vLLM group the chunks are sharded over ("tp" or "pcp") and its size."""
    pcp = getattr(parallel_config, "prefill_context_parallel_size", 1)
    kind = shard_group_kind(parallel_config.tensor_parallel_size, pcp, parallel_config.pipeline_parallel_size)
    return kind, parallel_config.tensor_parallel_size if kind == "tp" else pcp


def shard_group_kind(tp: int, pcp: int, pp: int) -> str:
    """Which vLLM group the chunks are sharded over: "tp" or "pcp" (one of them may be > 1)."""
    if pp > 1:
        raise ConnectorConfigError("KvctlConnector: pipeline parallelism (pipeline_parallel_size > 1) is not supported")
    if tp > 1 and pcp > 1:
        raise ConnectorConfigError(
            "KvctlConnector: shards over the TP group or the prefill-context-parallel group, not both "
            f"(tensor_parallel_size={tp}, prefill_context_parallel_size={pcp})"
        )
    return "pcp" if pcp > 1 else "tp"
