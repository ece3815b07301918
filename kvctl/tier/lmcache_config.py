"""The LMCache YAML that points each engine rank at its own Valkey instance (paper §5.2).

Keys checked against LMCache's ``lmcache/v1/config.py``: ``chunk_size`` (int,
default 256), ``local_cpu`` (bool), ``max_local_cpu_size`` (float, GB),
``remote_url`` (a string), ``remote_serde`` ("naive"), ``enable_async_loading``
(bool) and ``extra_config`` (a free-form dict passed to connectors). LMCache
drops unknown top-level keys with a warning and stringifies ``remote_url``, so
the two per-rank forms are:

* template: ``remote_url: resp://valkey-kv-{rank}.valkey-kv:6379`` where hosts
  differ by rank; kvctl's engine plugin replaces ``{rank}`` with the worker's rank;
* list: ``extra_config.kvctl_remote_urls: [url_rank0, url_rank1, ...]`` where
  ports differ (a local tier). This is kvctl's own extension key, not an
  LMCache one; ``remote_url`` then holds rank 0's URL so a stock LMCache still
  starts (every rank on instance 0).

With ``plugin=True`` the config names kvctl's LMCache remote-storage plugin
instead (``remote_storage_plugins: [kvctl]``, the template or list under
``extra_config``, no ``remote_url``); see kvctl.plugins.lmcache.

Plugin form: ``remote_storage_plugin.kvctl.pool_size`` is the plugin's threads, one connection per I/O thread of the
tier's instances plus one for lookups and saves (:func:`kvctl.tier.sizing.connections_for`; the plugin keeps
``pool_size - 1`` connections busy on a load).

K > 1 instances per rank (plugin form only: LMCache's own client talks to one URL):
``kvctl_remote_urls`` holds per rank the list of its K URLs (or the template has
``{instance}``) and ``remote_storage_plugin.kvctl.instances_per_rank`` is K.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

import yaml

# the plugin's keys and names have one home, shared with the reader (kvctl.connector.lmcache_settings)
from kvctl.connector.config_keys import (  # noqa: F401 - re-exported for the tier's callers
    PASSWORD_FILE_KEY, PLUGIN_CLASS, PLUGIN_MODULE, PLUGIN_NAME, URL_LIST_KEY, USERNAME_KEY, plugin_key,
)
from kvctl.connector.urls import RANK_PLACEHOLDER
from kvctl.core.errors import InvalidInput
from kvctl.tier.targets import check_instances
from kvctl.core.thresholds import CHUNK_TOKENS

@dataclass(frozen=True)
class LMCacheSettings:
    """Engine-side knobs that go with a tier."""

    chunk_size: int = CHUNK_TOKENS
    local_cpu: bool = True
    max_local_cpu_size_gb: float = 5.0
    remote_serde: str = "naive"
    enable_async_loading: bool = False
    connections_per_instance: int | None = None  # plugin form: pool_size = this + 1; None: the plugin's default


def lmcache_config(
    urls: str | Sequence[str] | Sequence[Sequence[str]],
    settings: LMCacheSettings = LMCacheSettings(),
    username: str | None = None,
    password_file: str | None = None,
    plugin: bool = False,
    instances_per_rank: int = 1,
) -> dict[str, Any]:
    """The config as a mapping: ``urls`` is a ``{rank}`` template or one URL per rank, or (``instances_per_rank``
    K > 1) per rank the list of its K URLs or a ``{rank}``/``{instance}`` template.

    ``plugin``: the remote-storage plugin form (``remote_storage_plugins: [kvctl]``,
    the URL template or list in ``extra_config``, no ``remote_url``: LMCache would
    build a second remote backend from it and write every chunk twice). K > 1 needs it.
    """
    check_instances(urls, instances_per_rank)
    if instances_per_rank > 1 and not plugin:
        raise InvalidInput(f"{instances_per_rank} instances per rank need kvctl's plugin form: LMCache's own client (--native) "
                           "talks to one remote_url, so every rank would use one instance; drop --native")
    if settings.chunk_size < 1:
        raise InvalidInput(f"chunk size must be at least 1, got {settings.chunk_size}")
    if settings.max_local_cpu_size_gb < 0:
        raise InvalidInput("max local CPU size must be ≥ 0 GB")
    cfg: dict[str, Any] = {
        "chunk_size": settings.chunk_size,
        "local_cpu": settings.local_cpu,
        "max_local_cpu_size": float(settings.max_local_cpu_size_gb),
    }
    extra: dict[str, Any] = {}
    if plugin:
        extra[plugin_key("module_path")] = PLUGIN_MODULE
        extra[plugin_key("class_name")] = PLUGIN_CLASS
    if isinstance(urls, str):
        if plugin:
            extra[plugin_key("url")] = urls
        else:
            cfg["remote_url"] = urls
    else:
        urls = [u if isinstance(u, str) else list(u) for u in urls]
        if not plugin:
            cfg["remote_url"] = urls[0]
        extra[URL_LIST_KEY] = urls
    if instances_per_rank > 1:
        extra[plugin_key("instances_per_rank")] = instances_per_rank
    if plugin and settings.connections_per_instance is not None:
        extra[plugin_key("pool_size")] = settings.connections_per_instance + 1  # + the thread of lookups and saves
    cfg["remote_serde"] = settings.remote_serde
    cfg["enable_async_loading"] = settings.enable_async_loading
    if plugin:
        cfg["remote_storage_plugins"] = [PLUGIN_NAME]
    if username:
        extra[USERNAME_KEY] = username
    if password_file:
        extra[PASSWORD_FILE_KEY] = password_file
    if extra:
        cfg["extra_config"] = extra
    return cfg


_CONTROL = re.compile(r"[\x00-\x1f\x7f\x85\u2028\u2029]")


def check_name(value: str | None, what: str) -> None:
    """InvalidInput when ``value`` (a directory, a tier or host name) holds a control character such as a
    newline: written into a config it could start a line of its own."""
    if value is not None and _CONTROL.search(str(value)):
        raise InvalidInput(f"{what} {str(value)!r} holds a control character (a newline?): refused")


def _comment(text: str) -> str:
    """One YAML comment line, whatever ``text`` holds: control characters shown escaped, never a line break."""
    return "# " + _CONTROL.sub(lambda m: repr(m.group(0))[1:-1], text)


def render_lmcache_yaml(cfg: dict[str, Any], title: str, notes: Sequence[str] = ()) -> str:
    """YAML text with comments explaining the per-rank form in use (and ``notes``, one comment line each).

    The mapping goes through ``yaml.safe_dump`` (quoting whatever needs it); every comment line through
    :func:`_comment`, so no value, path or name can add a line of YAML.
    """
    extra = cfg.get("extra_config") or {}
    k = extra.get(plugin_key("instances_per_rank"))
    per_rank = f"{k} Valkey instances per rank (rank r's chunk c on its instance (c // W) mod K)" if k else "one Valkey instance per rank (paper §5.2)"
    head = [_comment(title), f"# Generated by `kvctl deploy-valkey lmcache-config`; {per_rank}."]
    head += [_comment(f"NOTE: {n}") for n in notes]
    if cfg.get("remote_storage_plugins"):
        head += [
            f"# Plugin form: LMCache stores through kvctl's RESP client ({PLUGIN_MODULE}); each worker uses the instance of its rank,",
            f"# from extra_config.{plugin_key('url')} ({RANK_PLACEHOLDER} = the worker's rank) or extra_config.{URL_LIST_KEY}[rank].",
            "# No remote_url: next to the plugin LMCache would build a second remote backend and write every chunk twice.",
        ]
        if k:
            head += [f"# {k} instances per rank: {URL_LIST_KEY}[r][i] is instance i of rank r; the plugin spreads a rank's keys over its {k}",
                     "# instances by a stable hash of the key (every engine of the same W and K agrees)."]
    elif URL_LIST_KEY in extra:
        head += [
            f"# Per-rank list form: extra_config.{URL_LIST_KEY}[r] is rank r's instance.",
            f"# {URL_LIST_KEY} is a kvctl extension key (not LMCache's); kvctl's engine plugin reads it.",
            "# remote_url is rank 0's instance, so a stock LMCache still starts (all ranks on one instance).",
        ]
    else:
        head += [f"# Template form: kvctl's engine plugin replaces {RANK_PLACEHOLDER} in remote_url with the worker's rank."]
    if PASSWORD_FILE_KEY in extra:
        head += [_comment(f"The engine logs in as {extra.get(USERNAME_KEY)}; its password is read from {PASSWORD_FILE_KEY} (mode 0600), never inlined.")]
    return "\n".join(head) + "\n" + yaml.safe_dump(cfg, sort_keys=False, default_flow_style=False)
