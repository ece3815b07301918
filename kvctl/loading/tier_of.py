"""Which tier an engine's config names: the Valkey instances ``kvctl loading sync`` and ``kvctl doctor`` look up the
saved diagnosis of (:func:`kvctl.diagnose.saved.find`), so another tier's diagnosis is never theirs.

LMCache: ``extra_config.kvctl_remote_urls`` (a per-rank list), ``extra_config.remote_storage_plugin.kvctl.url`` (a
``{rank}`` template) with its instances per rank, or ``remote_url``; its env form ``LMCACHE_REMOTE_URL``. kvctl's
vLLM connector: ``kv_connector_extra_config.urls`` or ``url`` with ``instances_per_rank``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Sequence

from kvctl.connector import config_keys as K
from kvctl.core.errors import KvctlError
from kvctl.diagnose.saved import tier_urls

Tier = tuple[list[str], list[tuple[str, int]]]  # (instance URLs, ({rank} template, instances per rank))
_ENV_URL = re.compile(r"^[ \t]*(?:export[ \t]+)?LMCACHE_REMOTE_URL[ \t]*=[ \t]*([\"']?)(?P<url>[^\"'\s#]*)\1", re.M)


def join(*tiers: Tier) -> Tier:
    return [u for t in tiers for u in t[0]], [x for t in tiers for x in t[1]]


def of_lmcache(cfg: dict[str, Any] | None) -> Tier:
    """The tier an LMCache config names (its plugin's URLs first; ``remote_url`` when no plugin URL is given)."""
    if not isinstance(cfg, dict):
        return [], []
    extra = cfg.get("extra_config") if isinstance(cfg.get("extra_config"), dict) else {}
    k = extra.get(K.plugin_key("instances_per_rank"))
    plugin = join(tier_urls(extra.get(K.URL_LIST_KEY), k), tier_urls(extra.get(K.plugin_key("url")), k))
    return plugin if plugin != ([], []) else tier_urls(cfg.get("remote_url"))


def of_kv_transfer(cfg: dict[str, Any] | None) -> Tier:
    """The tier vLLM's ``--kv-transfer-config`` for kvctl's connector names."""
    extra = cfg.get(K.EXTRA) if isinstance(cfg, dict) else None
    if not isinstance(extra, dict):
        return [], []
    k = extra.get(K.INSTANCES_PER_RANK)
    return join(tier_urls(extra.get(K.URLS), k), tier_urls(extra.get(K.URL), k))


def of_sources(sources: Sequence[tuple[str, str]]) -> Tier:
    """The tier the files of ``kvctl loading`` (``(path, detected kind)``) name; a file that names none adds nothing."""
    from kvctl.loading import edit, vllm  # noqa: PLC0415

    found: list[Tier] = []
    for path, kind in sources:
        try:
            text = edit.read_text(path)
            if kind == "yaml":
                found.append(of_lmcache(edit.parse_yaml(text, str(path))))
            elif kind == "env":
                found.append(([m.group("url")] if (m := _last(_ENV_URL.finditer(text))) and m.group("url") else [], []))
            else:
                found.append(of_kv_transfer(vllm.read_config(text, kind, str(path))[0]))
        except KvctlError:  # the flip itself refuses a bad file, naming it
            continue
    urls, templates = join(*found) if found else ([], [])
    return list(dict.fromkeys(urls)), list(dict.fromkeys(templates))


def _last(matches: Any) -> Any:
    last = None
    for last in matches:  # noqa: B007 - the last assignment wins, as in a shell
        pass
    return last


def no_saved(tier: Tier, paths: Sequence[str | Path], engine_urls: Sequence[str] = ()) -> str:
    """Why no saved diagnosis is the files' own, for a message: the tier they name (and the engines given) has none,
    or they name no Valkey URL to find one by."""
    from kvctl.connector.urls import redact_url_text  # noqa: PLC0415

    named = [*tier[0], *(t for t, _ in tier[1])]
    engines = f" or of the engines {', '.join(redact_url_text(u) for u in engine_urls)}" if engine_urls else ""
    if not named and not engine_urls:
        return (f"{', '.join(map(str, paths))}: no Valkey URL named, so no saved diagnosis of its tier "
                "(give --engine-url ENGINE to use the engines' saved diagnosis)")
    return f"no saved diagnosis of the tier {', '.join(redact_url_text(u) for u in named) or '(none named)'}{engines}"
