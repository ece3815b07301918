"""``kvctl doctor``'s line on how the tier holds KvctlConnector's chunks against the engine config's ``layer_groups``.

``layer_groups`` names the values a chunk is stored as (``kvctl.connector.layer_groups``): with G > 1 one value per
group of layers, part ``L{lo}-{hi-1}`` of the chunk's key, with 1 the whole chunk. Engines that share a tier with
different G build the same keys and store other values, so each one's lookups miss everything the others wrote, with
no error anywhere (kvctl's own GPU fault test did this on 2026-12-05: a whole-chunk writer, a two-group reader, 0
cached). Doctor reads the part names of the random keys it samples on each instance and says when they disagree with
the config.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any, Iterable, Mapping

from kvctl.connector import config_keys as K
from kvctl.connector.layer_groups import part_span, spans
from kvctl.connector.ownership import stored_value
from kvctl.connector.settings import DEFAULT_LAYER_GROUPS
from kvctl.tier.check_types import OK, WARNING, Check

__all__ = ["stored_groups_check"]

_LAYERS = re.compile(r"-L(\d+)-")  # a chunk format's layer count: mla576-L27-bfloat16


def _ranges(layers: int, groups: int) -> set[tuple[int, int]]:
    return {(lo, hi - 1) for lo, hi in spans(layers, groups)}


def _described(layers: int | None, seen: set[tuple[int, int]], whole: bool) -> str:
    """How the sampled values of one format were stored, in words: whole chunks, G groups, or a mix."""
    if whole and seen:
        return "both whole and in layer groups (engines with different layer_groups write it)"
    if whole or not seen:
        return "as whole chunks (layer_groups 1)"
    if layers:
        for g in range(2, layers + 1):
            if seen <= _ranges(layers, g):
                return f"in {g} layer groups (layer_groups {g})"
    return f"in layer groups {sorted(seen)}"


def stored_groups_check(kvt: Mapping[str, Any] | None, sampled_keys: Iterable[str]) -> Check | None:
    """The chunks among ``sampled_keys`` (random keys of the tier's instances) against ``kvt``'s ``layer_groups``;
    None without a KvctlConnector config or without any of its chunks sampled."""
    extra = (kvt or {}).get("kv_connector_extra_config") or {}
    if not isinstance(extra, Mapping) or not str((kvt or {}).get("kv_connector", "")).startswith("Kvctl"):
        return None
    g = extra.get(K.LAYER_GROUPS, DEFAULT_LAYER_GROUPS)
    if isinstance(g, bool) or not isinstance(g, int) or g < 1:
        return None  # the settings check names a bad value; nothing to compare here
    groups_seen: dict[tuple[str, str], set[tuple[int, int]]] = defaultdict(set)  # (model, format) -> layer ranges
    whole_seen: set[tuple[str, str]] = set()  # (model, format) with a value that is no layer group's
    for key in sampled_keys:
        v = stored_value(key)
        if v is None:
            continue
        span = part_span(v[2]) if v[2] else None
        if span is None:
            whole_seen.add(v[:2])
        else:
            groups_seen[v[:2]].add(span)
    families = sorted(whole_seen | set(groups_seen))
    if not families:
        return None
    off, fine = [], []
    for model, fmt in families:
        seen, whole = groups_seen.get((model, fmt), set()), (model, fmt) in whole_seen
        m = _LAYERS.search(f"-{fmt}-")
        layers = int(m.group(1)) if m else None
        groups = min(g, layers) if layers else g
        want = _ranges(layers, groups) if layers and groups > 1 else set()
        ok = (not seen) if groups == 1 else (not whole and bool(seen) and (not layers or seen <= want))
        (fine if ok else off).append(f"{model}@{fmt} {_described(layers, seen, whole)}")
    ev = {"layer_groups": g, "formats": len(families), "disagree": off}
    if off:
        return Check("config", "stored_layer_groups", WARNING,
                     f"layer_groups {g} in this config, but the tier holds " + "; ".join(off)
                     + ": an engine of that model and format with this config looks up values no other engine wrote "
                       "(every lookup misses, no error)",
                     f"give every engine that shares the tier the same {K.LAYER_GROUPS} "
                     "(kv_connector_extra_config), or flush the tier's old chunks", ev)
    return Check("config", "stored_layer_groups", OK, f"the sampled chunks are stored as layer_groups {g} says: "
                 + "; ".join(fine), evidence=ev)
