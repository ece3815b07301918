"""What one bench moves: the value size, s for the verdict, the parameters its report records, the clients a
tier's instances are benched with, and the advice on an instance below what its server could give.

From the options as given: ``--chunk-bytes``, else one chunk of ``--model-config`` (``--dtype``, ``--tp``,
``--chunk-tokens``), else the paper's 12.4 MB; s from ``--bytes-per-token``, else the model's. Clients per
instance: ``--clients``, else with ``--dir`` one per I/O thread of the tier's instances, as many connections as an
engine's connector keeps busy on them (:func:`kvctl.tier.sizing.connections_for`), else 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from kvctl.core import thresholds
from kvctl.core.errors import InvalidInput
from kvctl.core.kvsize import kv_size_from_file


@dataclass(frozen=True)
class BenchSizes:
    chunk_bytes: int  # one value
    bytes_per_token: float | None  # s of the whole model, for the verdict
    parameters: dict[str, Any]  # what the report's metadata records


def bench_sizes(
    chunk_bytes: float | None, model_config: str | None, dtype: str | None, chunk_tokens: int, tp: int,
    bytes_per_token: float | None, prefill_rate: float | None,
) -> BenchSizes:
    """The value size and s of a bench (see the module docstring); InvalidInput when the verdict lacks s."""
    if model_config:
        size = kv_size_from_file(model_config, dtype=dtype, chunk_tokens=chunk_tokens, tp=tp)
        if chunk_bytes is None:
            chunk_bytes = size.chunk_bytes
        if bytes_per_token is None:
            bytes_per_token = size.bytes_per_token
    if prefill_rate is not None and bytes_per_token is None:
        raise InvalidInput("--prefill-rate needs --bytes-per-token or --model-config for the verdict")
    chunk = int(round(chunk_bytes if chunk_bytes is not None else thresholds.PAPER_CHUNK_BYTES))
    params: dict[str, Any] = {"model_config": model_config, "chunk_tokens": chunk_tokens if model_config else None,
                              "prefill_rate": prefill_rate, "bytes_per_token": bytes_per_token, "tp": tp,
                              "bytes_per_token_per_rank": bytes_per_token / tp if bytes_per_token else None}
    return BenchSizes(chunk, bytes_per_token, params)


def tier_clients(tier_dir: str | None) -> int | None:
    """Clients per instance for a bench of the local tier in ``tier_dir``: one per I/O thread its state file records
    (within the connector's bounds, as ``vllm-config`` writes connections_per_instance); None without a tier directory,
    or when the state file predates the io-threads record."""
    if not tier_dir:
        return None
    from kvctl.tier.sizing import connections_for  # noqa: PLC0415
    from kvctl.tier.state_file import load_tier  # noqa: PLC0415

    threads = load_tier(tier_dir).io_threads
    return connections_for(threads) if threads else None


def instance_advice(versions: Sequence[str], io_threads: Sequence[int | None], per_instance_gbps: float | None, local: bool,
                    instances: int) -> str | None:
    """The change to make before adding instances, when one instance of this tier measured (``per_instance_gbps``)
    well below what a 9.x server with the io-threads this host allows gives (:func:`kvctl.tier.sizing.first_step`), for
    the slowest-configured instance; None otherwise. ``local``: the instances run on this host (its cores size the
    io-threads), else a host of unknown cores."""
    from kvctl.tier.sizing import first_step, host_cores, parse_version  # noqa: PLC0415

    known = [(parse_version(v), t) for v, t in zip(versions, io_threads or [None] * len(versions)) if parse_version(v)]
    if not known:
        return None
    version, threads = min(known, key=lambda vt: (vt[0], vt[1] or 1))
    step = first_step(version, threads, host_cores() if local else None, instances if local else 1, per_instance_gbps)
    return step.text if step else None
