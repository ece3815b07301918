"""What one bench moves: the value size, s for the verdict, and the parameters its report records.

From the options as given: ``--chunk-bytes``, else one chunk of ``--model-config`` (``--dtype``, ``--tp``,
``--chunk-tokens``), else the paper's 12.4 MB; s from ``--bytes-per-token``, else the model's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
