"""Layer groups: a chunk kept as one value per group of layers, so a hit can be loaded group by group (pure).

A stored chunk is layer-major: ``(layers, tokens, ...)`` for a dense chunk (:mod:`kvctl.connector.layouts`),
the latent rows then the indexer's keys, each ``(layers, tokens, row)``, for a sparse-MLA chunk
(:mod:`kvctl.connector.sparse_mla`). So layers ``lo..hi-1`` of each kind of rows are one byte range of the
chunk, and with ``layer_groups`` G > 1 the connector stores a chunk as one value per (group, kind of rows):
part ``L{lo}-{hi-1}`` of a dense chunk, ``mla.L{lo}-{hi-1}`` and ``idx.L{lo}-{hi-1}`` of a sparse one, listed
group by group (:class:`~kvctl.connector.ownership.ChunkParts` with offsets). The chunk's bytes do not change,
only how the tier holds them; a load that GETs group 0 of every chunk first has the first layers' KV in the
paged cache while the rest is still on the wire (:mod:`kvctl.connector.pipeline`).

With G = 1 nothing changes: a dense chunk is one value, a sparse one the two parts ``mla`` and ``idx`` of
earlier releases, so a tier written before keeps hitting. G is part of the keys (through the part names):
engines that share a tier must use the same G, as they must use the same ``chunk_tokens``.

The scheduler, which has no caches, and every worker build the parts from the same description (the kinds
of rows, their layer counts and bytes per layer and token), so they name the same values.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from dataclasses import dataclass
from typing import Sequence

from .ownership import ChunkParts

__all__ = ["Grouping", "Plane", "Unit", "group_part", "grouped", "layer_ids", "part_span", "spans"]


_LAYER_ID = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_ids(names: Sequence[str]) -> tuple[int, ...] | None:
    """The model layer of each of vLLM's layer names (``model.layers.12.self_attn.attn`` -> 12), None where a name
    carries no layer number or they are not ascending (then the plane is placed by position only)."""
    out = []
    for n in names:
        m = _LAYER_ID.search(n)
        if m is None:
            return None
        out.append(int(m.group(1)))
    return tuple(out) if out == sorted(set(out)) else None


_GROUP_PART = re.compile(r"(?:^|\.)L(\d+)-(\d+)$")


def group_part(plane: str, lo: int, hi: int) -> str:
    """The part name of layers ``lo..hi-1`` of a plane: ``L{lo}-{hi-1}``, or ``{plane}.L{lo}-{hi-1}`` for a named one."""
    return f"{plane}.L{lo}-{hi - 1}" if plane else f"L{lo}-{hi - 1}"


def part_span(part: str) -> tuple[int, int] | None:
    """``(lo, hi - 1)`` of a part :func:`group_part` named, None for any other part (``mla``, ``idx``)."""
    m = _GROUP_PART.search(part)
    return (int(m.group(1)), int(m.group(2))) if m else None


def spans(num_layers: int, groups: int) -> tuple[tuple[int, int], ...]:
    """``min(groups, num_layers)`` consecutive ranges ``(lo, hi)`` of layers, sizes differing by at most one."""
    if num_layers < 1:
        raise ValueError(f"a chunk of {num_layers} layers")
    g = max(1, min(int(groups), num_layers))
    base, extra = divmod(num_layers, g)
    out, lo = [], 0
    for i in range(g):
        hi = lo + base + (1 if i < extra else 0)
        out.append((lo, hi))
        lo = hi
    return tuple(out)


@dataclass(frozen=True)
class Plane:
    """One kind of rows of a chunk: ``layers`` layers of ``layer_token_bytes`` bytes per token, layer-major.

    ``name`` prefixes its parts' names: "" for a dense chunk (one kind), ``mla`` / ``idx`` for sparse MLA.
    ``layer_ids``: the model layer of each of its layers, ascending (a sparse model's indexer skips some
    layers: vLLM's ``index_topk_freq`` / ``index_topk_pattern``); None: layers 0..layers-1."""

    name: str
    layers: int
    layer_token_bytes: int
    layer_ids: tuple[int, ...] | None = None

    def ids(self) -> tuple[int, ...]:
        return tuple(range(self.layers)) if self.layer_ids is None else tuple(self.layer_ids)


@dataclass(frozen=True)
class Unit:
    """What one group of layers holds of one chunk: its parts (in the order a load lays them out) and sizes.

    The unit covers model layers ``lo..hi-1``; ``rows[p]`` is the range of plane p's layers it holds (a plane
    with none there has no part in it). Its bytes are its parts one after another: for a dense chunk one part,
    the layout of those layers (:meth:`KVLayout.layers`); for a sparse one its latent rows then its indexer keys,
    the chunk of :meth:`SparseMLALayout.rows`."""

    lo: int
    hi: int
    names: tuple[str, ...]
    sizes: tuple[int, ...]
    rows: tuple[tuple[int, int], ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)


@dataclass(frozen=True)
class Grouping:
    """How a chunk is stored: ``parts`` (None: one value) and the ``units`` a load moves group by group."""

    parts: ChunkParts | None
    units: tuple[Unit, ...]

    @property
    def groups(self) -> int:
        return len(self.units)


def grouped(planes: Sequence[Plane], chunk_tokens: int, groups: int) -> Grouping:
    """The parts and units of a chunk of ``planes`` (in the chunk's byte order) split into ``groups`` groups.

    The groups are spans of model layers (:func:`spans` of the first plane's); each plane gives a group its
    layers in that span. Fewer groups than asked where the model has fewer layers; one group (today's parts)
    where ``groups`` is 1 or the planes' layers cannot be told apart (different counts without ``layer_ids``).
    """
    planes = list(planes)
    if not planes or any(p.layers < 1 or p.layer_token_bytes < 1 for p in planes):
        raise ValueError(f"planes {planes}: at least one, each of layers and bytes")
    if len(planes) > 1 and (len({p.name for p in planes}) != len(planes) or any(not p.name for p in planes)):
        raise ValueError(f"planes {planes}: several kinds of rows need distinct names")
    ids = [p.ids() for p in planes]
    if any(len(i) != p.layers or list(i) != sorted(set(i)) or (i and i[0] < 0) for i, p in zip(ids, planes)):
        raise ValueError(f"planes {planes}: layer_ids must be one ascending id a layer")
    whole = [p.layers * p.layer_token_bytes * chunk_tokens for p in planes]
    starts = [sum(whole[:i]) for i in range(len(planes))]
    n_model = planes[0].layers
    # the first plane (the latent rows, a dense chunk's KV) has every model layer; the others are placed by id
    mapped = ids[0] == tuple(range(n_model)) and (
        all(p.layer_ids is not None for p in planes[1:]) or len({p.layers for p in planes}) == 1)
    if int(groups) <= 1 or n_model < 2 or not mapped:
        names = tuple(p.name for p in planes)
        parts = ChunkParts(names, tuple(whole)) if len(planes) > 1 else None
        return Grouping(parts, (Unit(0, n_model, names if parts else (), tuple(whole),
                                     tuple((0, p.layers) for p in planes)),))
    names, sizes, offsets, units = [], [], [], []
    for lo, hi in spans(n_model, groups):
        u_names, u_sizes, u_rows = [], [], []
        for p, start, layer_ids in zip(planes, starts, ids):
            a, b = bisect_left(layer_ids, lo), bisect_left(layer_ids, hi)
            u_rows.append((a, b))
            if b == a:
                continue  # none of this plane's layers in the span (an indexer that skips them)
            name = group_part(p.name, lo, hi)
            size = (b - a) * p.layer_token_bytes * chunk_tokens
            names.append(name)
            sizes.append(size)
            offsets.append(start + a * p.layer_token_bytes * chunk_tokens)
            u_names.append(name)
            u_sizes.append(size)
        units.append(Unit(lo, hi, tuple(u_names), tuple(u_sizes), tuple(u_rows)))
    return Grouping(ChunkParts(tuple(names), tuple(sizes), tuple(offsets)), tuple(units))
