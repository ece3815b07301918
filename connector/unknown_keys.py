"""The keys of an engine config no reader knows, each with the known key it was probably meant to be (pure).

LMCache's YAML (its own keys: LMCache 0.5.6's config class, :mod:`kvctl.core.engine_keys`; kvctl's plugin keys in
``extra_config``, other plugins' keys left to them) and env files (``LMCACHE_<KEY>``: only near misses of a key, as
LMCache reads many other ``LMCACHE_`` variables), vLLM's ``--kv-transfer-config`` (``KVTransferConfig``'s fields) and
kvctl's connector settings in it (``kv_connector_extra_config``, ``load_policy``). The readers that say so:
``kvctl loading`` (show, and its refusal to add a key beside a near miss), ``kvctl doctor``, and the engine side at
start (:mod:`kvctl.connector.settings` refuses, :mod:`kvctl.connector.lmcache_settings` logs).
"""

from __future__ import annotations

from typing import Any, Mapping

from kvctl.core.engine_keys import LMCACHE_ENV_PREFIX, LMCACHE_KEYS, LMCACHE_OLD_KEYS, LMCACHE_OTHER_ENV, VLLM_KV_TRANSFER_KEYS
from kvctl.core.known_keys import UnknownKey, unknown

from . import config_keys as K

#: every top-level key LMCache 0.5.6 takes (old names included)
LMCACHE_ALL = LMCACHE_KEYS | LMCACHE_OLD_KEYS
#: the env variables of those keys
LMCACHE_ENV = frozenset(LMCACHE_ENV_PREFIX + k.upper() for k in LMCACHE_ALL)
#: what each reader does with a key it does not know
LMCACHE_IGNORES = "LMCache ignores it (it logs \"Unknown configuration key\") and uses its default"
PLUGIN_IGNORES = "kvctl's plugin ignores it and uses its default"
CONNECTOR_REFUSES = "kvctl's connector refuses it: the engine does not start"
VLLM_REFUSES = "vLLM 0.32's KVTransferConfig has no such field: vLLM refuses it and the engine does not start"


def plugin_keys(plugin_name: str = K.PLUGIN_NAME) -> frozenset[str]:
    """Every ``extra_config`` key of kvctl's plugin of this name."""
    return frozenset(K.plugin_key(k, plugin_name) for k in K.PLUGIN_KEYS) | K.LMCACHE_EXTRA_KEYS


def _another_instance(key: str, mine: str) -> bool:
    """``remote_storage_plugin.kvctl.b.url`` seen by plugin ``kvctl``: a key of the plugin instance ``kvctl.b``."""
    rest = key[len(mine):]
    return "." in rest and rest.rsplit(".", 1)[1] in K.PLUGIN_KEYS


def in_plugin_extra(extra: Mapping[str, Any], where: str, plugin_name: str = K.PLUGIN_NAME, prefix: str = "extra_config.") -> list[UnknownKey]:
    """Keys of ``extra_config`` that look like this kvctl plugin's (its prefix, or ``kvctl_``) but are none of them."""
    mine = K.plugin_key("", plugin_name)
    ours = [k for k in extra if str(k).startswith("kvctl_") or (str(k).startswith(mine) and not _another_instance(str(k), mine))]
    return unknown(ours, plugin_keys(plugin_name), where, prefix, effect=PLUGIN_IGNORES)


def in_lmcache(cfg: Mapping[str, Any], where: str, lines: Mapping[str, int] | None = None) -> list[UnknownKey]:
    """Unknown top-level keys of an LMCache YAML (LMCache ignores them, with a log line) and of kvctl's plugin in it."""
    found = unknown(cfg, LMCACHE_ALL, where, lines=lines, effect=LMCACHE_IGNORES)
    extra = cfg.get("extra_config")
    if isinstance(extra, Mapping):
        listed = cfg.get("remote_storage_plugins") if isinstance(cfg.get("remote_storage_plugins"), list) else []
        names = [n for n in listed if isinstance(n, str) and n.split(".", 1)[0] == K.PLUGIN_NAME] or [K.PLUGIN_NAME]
        seen = {u.key: u for n in names for u in in_plugin_extra(extra, where, n)}  # each kvctl plugin instance its own keys
        found += [u for key, u in seen.items() if not any(key.removeprefix("extra_config.") in plugin_keys(n) for n in names)]
    return found


def in_lmcache_env(names: Mapping[str, int], where: str) -> list[UnknownKey]:
    """``LMCACHE_`` variables of an env file (name -> line) that LMCache 0.5.6 reads neither as a key nor otherwise, and that
    are near misses of one of its keys' variables."""
    found = [u for u in unknown([n for n in names if n.startswith(LMCACHE_ENV_PREFIX)], LMCACHE_ENV, where, lines=names, effect=LMCACHE_IGNORES)
             if u.key not in LMCACHE_OTHER_ENV]
    return [u for u in found if u.nearest]


def in_connector_extra(extra: Mapping[str, Any], where: str, prefix: str = f"{K.EXTRA}.") -> list[UnknownKey]:
    """Unknown keys of kvctl's connector settings (``kv_connector_extra_config``, its ``load_policy``): the connector
    refuses them at start."""
    found = unknown(extra, K.VLLM_KEYS, where, prefix, effect=CONNECTOR_REFUSES)
    policy = extra.get(K.LOAD_POLICY)
    if isinstance(policy, Mapping):
        found += unknown(policy, K.POLICY_KEYS, where, f"{prefix}{K.LOAD_POLICY}.", effect=CONNECTOR_REFUSES)
    return found


def in_kv_transfer(cfg: Mapping[str, Any], where: str, kvctl_connector: bool = True) -> list[UnknownKey]:
    """Unknown keys of vLLM's ``--kv-transfer-config`` (vLLM refuses them) and, for kvctl's connector, of its settings."""
    found = unknown(cfg, VLLM_KV_TRANSFER_KEYS, where, effect=VLLM_REFUSES)
    extra = cfg.get(K.EXTRA)
    if kvctl_connector and isinstance(extra, Mapping):
        found += in_connector_extra(extra, where)
    return found
