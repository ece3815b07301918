"""The names of every setting the engine side reads, in one place (pure): the writers in kvctl.tier
(``kvctl deploy-valkey vllm-config`` / ``lmcache-config``), the readers here (:mod:`kvctl.connector.settings`,
:mod:`kvctl.connector.lmcache_settings`) and doctor's checks all use these constants.
"""

from __future__ import annotations

# -- vLLM's --kv-transfer-config for kvctl's own connector (kvctl.plugins.vllm) -------------------------------
CONNECTOR = "KvctlConnector"
MODULE_PATH = "kvctl.plugins.vllm"
EXTRA = "kv_connector_extra_config"
URLS = "urls"  # per rank: one URL, or a list of K URLs
URL = "url"  # a {rank} (and {instance}) template, or one URL for every rank
CHUNK_TOKENS = "chunk_tokens"
PASSWORD_FILE = "password_file"
TIMEOUT_S = "timeout_s"
HOST_BUDGET_BYTES = "host_budget_bytes"
ASYNC_LOADING = "async_loading"
LOAD_POLICY = "load_policy"
PINNED_POOL_BYTES = "pinned_pool_bytes"
INSTANCES_PER_RANK = "instances_per_rank"
CONNECTIONS_PER_INSTANCE = "connections_per_instance"
SAVE_DRAIN_S = "save_drain_s"
SAVE_QUEUE_BYTES = "save_queue_bytes"
SYNC_LOAD_PATH = "sync_load_path"
LAYER_GROUPS = "layer_groups"
LAYERED_SWITCH_MS = "layered_switch_ms"
ASYNC_SWITCH_MS = "async_switch_ms"
#: every key of ``kv_connector_extra_config`` the connector knows (anything else is refused at start)
VLLM_KEYS = frozenset({URLS, URL, CHUNK_TOKENS, PASSWORD_FILE, TIMEOUT_S, HOST_BUDGET_BYTES, ASYNC_LOADING, LOAD_POLICY,
                       PINNED_POOL_BYTES, INSTANCES_PER_RANK, CONNECTIONS_PER_INSTANCE, SAVE_DRAIN_S, SAVE_QUEUE_BYTES,
                       SYNC_LOAD_PATH, LAYER_GROUPS, LAYERED_SWITCH_MS, ASYNC_SWITCH_MS})
#: the keys of ``load_policy``
POLICY_KEYS = frozenset({"enabled", "prefill_tokens_per_s", "t0_s", "bandwidth_gbps", "reprobe_after_s", "line_credit_cap"})

# -- LMCache's extra_config for kvctl's remote-storage plugin (kvctl.plugins.lmcache) ---------------------------
URL_LIST_KEY = "kvctl_remote_urls"
USERNAME_KEY = "kvctl_username"
PASSWORD_FILE_KEY = "kvctl_password_file"
#: the keys of kvctl's plugin under ``remote_storage_plugin.<name>.`` (LMCache's loader reads module_path and
#: class_name; :mod:`kvctl.connector.lmcache_settings` the rest); any other is named, with the nearest, when read
PLUGIN_KEYS = frozenset({"module_path", "class_name", "url", "instances_per_rank", "pool_size", "timeout_s", "prefill_tokens_per_s", "t0_s"})
#: ``extra_config`` keys of kvctl's plugin outside that prefix
LMCACHE_EXTRA_KEYS = frozenset({URL_LIST_KEY, USERNAME_KEY, PASSWORD_FILE_KEY})
#: LMCache loads kvctl's RESP client as the remote-storage plugin of this name
PLUGIN_NAME = "kvctl"
PLUGIN_MODULE = "kvctl.plugins.lmcache"
PLUGIN_CLASS = "KvctlConnectorAdapter"


def plugin_key(name: str, plugin_name: str = PLUGIN_NAME) -> str:
    """An ``extra_config`` key of one remote-storage plugin, e.g. ``remote_storage_plugin.kvctl.url``."""
    return f"remote_storage_plugin.{plugin_name}.{name}"
