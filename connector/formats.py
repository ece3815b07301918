"""A chunk format string -> how the tier holds a chunk of it, for tools that hold only the format.

The connector logs its chunk format (``mla576-L27-bfloat16``, ``gqa8x128-L32-bfloat16``,
``mla656-L78-fp8_ds_mla+idx132-L78-fp8_e4m3``: :func:`kvctl.connector.layouts.chunk_fmt`,
:func:`kvctl.connector.sparse_mla.sparse_format`); benchmarks and test hooks that copy, wait for or delete a
chunk's values rebuild its parts from that string and the engine's ``layer_groups`` here, through the same
:func:`~kvctl.connector.layer_groups.grouped` the connector runs.
"""

from __future__ import annotations

from .layer_groups import Grouping, Plane, grouped
from .ownership import ChunkParts
from .sparse_mla import INDEXER_PART, LATENT_PART

__all__ = ["format_grouping", "format_parts"]

_TAG_BYTES = {"bfloat16": 2, "float16": 2, "fp8_ds_mla": 1}


def format_parts(fmt: str, chunk_tokens: int) -> ChunkParts | None:
    """The parts of a chunk of format ``fmt`` (what :func:`sparse_format` wrote), None for a one-part format.

    For tools outside the engine that hold only the format the connector logs (benchmarks, test hooks)."""
    if "+idx" not in fmt:
        return None
    latent, indexer = fmt.split("+", 1)
    try:
        row, n_lat, tag = latent.removeprefix("mla").split("-", 2)
        idx_row, n_idx, _ = indexer.removeprefix("idx").split("-", 2)
        lat_bytes = int(row) * int(n_lat.removeprefix("L")) * _TAG_BYTES[tag] * chunk_tokens
        idx_bytes = int(idx_row) * int(n_idx.removeprefix("L")) * chunk_tokens
    except (KeyError, ValueError):
        raise ValueError(f"not a sparse-MLA chunk format: {fmt!r}") from None
    return ChunkParts((LATENT_PART, INDEXER_PART), (lat_bytes, idx_bytes))


_DENSE_TAG_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8_e4m3": 1, "fp8_e5m2": 1, "uint8": 1}


def format_grouping(fmt: str, chunk_tokens: int, layer_groups: int = 1) -> Grouping:
    """How a chunk of format ``fmt`` is stored with ``layer_groups`` (the values and parts the connector uses).

    For tools outside the engine that hold only the format the connector logs and its ``layer_groups``
    (benchmarks, test hooks): the same :func:`~kvctl.connector.layer_groups.grouped` the connector runs."""
    parts = format_parts(fmt, chunk_tokens)
    try:
        if parts is not None:
            latent, indexer = fmt.split("+", 1)
            n_lat = int(latent.split("-")[1].removeprefix("L"))
            n_idx = int(indexer.split("-")[1].removeprefix("L"))
            if n_lat != n_idx and layer_groups > 1:  # which layers the indexer skips is not in the format
                raise ValueError(f"{fmt!r}: an indexer on {n_idx} of {n_lat} layers; its layer groups need the "
                                 "engine's layer names (kvctl.connector.layer_groups.layer_ids)")
            planes = [Plane(parts.names[0], n_lat, parts.sizes[0] // (n_lat * chunk_tokens)),
                      Plane(parts.names[1], n_idx, parts.sizes[1] // (n_idx * chunk_tokens))]
        else:
            head, layers, tag = fmt.split("-", 2)
            n = int(layers.removeprefix("L"))
            if head.startswith("mla"):
                row = int(head.removeprefix("mla"))
            else:
                heads, size = head.removeprefix("gqa").split("x")
                row = 2 * int(heads) * int(size)
            planes = [Plane("", n, row * _DENSE_TAG_BYTES[tag])]
    except (KeyError, IndexError):
        raise ValueError(f"not a chunk format kvctl writes: {fmt!r}") from None
    return grouped(planes, chunk_tokens, layer_groups)
