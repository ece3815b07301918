"""The engines' own config keys, as their releases define them (pure data; ``python -m kvctl.core.engine_keys`` regenerates).

* LMCache 0.5.6 (the release kvctl's plugins are written against, setup.cfg's ``lmcache`` extra): the keys of its
  config class, ``lmcache/v1/config.py``'s ``_CONFIG_DEFINITIONS``, and the old names it still maps or warns about
  (``_CONFIG_ALIASES``, ``_DEPRECATED_CONFIGS``). LMCache logs "Unknown configuration key" for any other key of its
  YAML and goes on with the default: kvctl says so before the engine starts (``kvctl doctor``, ``kvctl loading``).
* vLLM 0.32 (the engine extra): the fields of ``vllm/config/kv_transfer.py``'s ``KVTransferConfig`` (vLLM refuses
  any other key of ``--kv-transfer-config``: its config dataclasses forbid extra fields).

Read from the sources, never imported (neither runs in kvctl's interpreter): tests/core/test_config_keys.py checks these
lists against ``.venv-lmcache`` and ``.venv`` with the same functions.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

#: LMCache 0.5.6's config keys (``_CONFIG_DEFINITIONS``)
LMCACHE_KEYS = frozenset({
    "app_id", "audit_actual_remote_url", "blend_check_layers", "blend_min_tokens", "blend_recompute_ratios",
    "blend_special_str", "blend_thresholds", "blocking_timeout_secs", "cache_policy", "chunk_size",
    "chunk_statistics_auto_exit_target_unique_chunks", "chunk_statistics_auto_exit_timeout_hours",
    "chunk_statistics_auto_start_statistics", "chunk_statistics_strategy", "controller_pull_url",
    "controller_reply_url", "enable_async_loading", "enable_blending", "enable_chunk_statistics",
    "enable_controller", "enable_hidden_state_cache", "enable_kv_events", "enable_lazy_memory_allocator",
    "enable_p2p", "enable_pd", "enable_scheduler_bypass_lookup", "external_lookup_client", "extra_config",
    "gds_backend", "gds_buffer_size", "gds_path", "gds_path_sharding", "hidden_state_layers",
    "hidden_states_retrieve_mode", "hit_miss_ratio", "internal_api_server_enabled", "internal_api_server_host",
    "internal_api_server_include_index_list", "internal_api_server_port_start",
    "internal_api_server_socket_path_prefix", "lazy_memory_expand_trigger_ratio", "lazy_memory_initial_ratio",
    "lazy_memory_safe_size", "lazy_memory_step_ratio", "lmcache_instance_id", "lmcache_worker_heartbeat_delay_time",
    "lmcache_worker_heartbeat_time", "lmcache_worker_ids", "lmcache_worker_ports", "local_cpu",
    "local_cpu_use_hugepages", "local_disk", "local_disk_path_sharding", "lookup_server_worker_ids",
    "lookup_timeout_ms", "maru_path", "maru_pool_size", "max_hidden_state_cpu_size", "max_local_cpu_size",
    "max_local_disk_size", "min_retrieve_tokens", "mp_host", "mp_port", "nixl_backends", "nixl_buffer_device",
    "nixl_buffer_size", "numa_mode", "p2p_host", "p2p_init_ports", "p2p_lookup_ports", "pd_allocation_timeout_sec",
    "pd_backend_mode", "pd_bidirectional", "pd_buffer_device", "pd_buffer_size", "pd_condition_poll_interval_sec",
    "pd_max_prefill_len", "pd_peer_alloc_port", "pd_peer_host", "pd_peer_init_port", "pd_peer_query_port",
    "pd_proxy_host", "pd_proxy_port", "pd_role", "pd_shutdown_timeout_sec", "pd_skip_proxy_notification",
    "pin_check_interval_sec", "pin_timeout_sec", "pre_caching_hash_algorithm", "priority_limit", "py_enable_gc",
    "remote_config_url", "remote_serde", "remote_storage_plugins", "remote_url", "reserve_local_cpu_size",
    "retrieve_locations", "run_script_api_enabled", "runtime_plugin_locations", "save_decode_cache",
    "save_unfull_chunk", "script_allowed_imports", "storage_plugins", "store_location", "transfer_channel",
    "use_gds", "use_gpu_connector_v3", "use_layerwise"
})  # fmt: skip
#: old names LMCache 0.5.6 still takes (``_CONFIG_ALIASES`` and ``_DEPRECATED_CONFIGS``): known, not typos
LMCACHE_OLD_KEYS = frozenset({
    "controller_url", "enable_xpyd", "external_backends", "lmcache_worker_port", "nixl_buffer_size",
    "nixl_peer_alloc_port", "nixl_peer_host", "nixl_peer_init_port", "nixl_peer_port", "nixl_proxy_host",
    "nixl_proxy_port", "nixl_role", "plugin_locations"
})  # fmt: skip
#: LMCache reads ``LMCACHE_<KEY>`` from the environment for each of its keys (its config class's env prefix)
LMCACHE_ENV_PREFIX = "LMCACHE_"
#: the other ``LMCACHE_`` variables LMCache 0.5.6 reads (every such name its package's sources quote)
LMCACHE_OTHER_ENV = frozenset({
    "LMCACHE_AEROSPIKE_HOSTS", "LMCACHE_AEROSPIKE_NAMESPACE", "LMCACHE_AEROSPIKE_PASSWORD", "LMCACHE_AEROSPIKE_SET",
    "LMCACHE_AEROSPIKE_USERNAME", "LMCACHE_CONFIG_FILE", "LMCACHE_CONTROLLER_CONFIG_FILE",
    "LMCACHE_COORDINATOR_ADVERTISE_IP", "LMCACHE_COORDINATOR_EVENT_FLUSH_INTERVAL",
    "LMCACHE_COORDINATOR_EVENT_REPORTING", "LMCACHE_COORDINATOR_HEARTBEAT_INTERVAL", "LMCACHE_COORDINATOR_URL",
    "LMCACHE_DEVICE_BACKEND", "LMCACHE_DISABLE_BANNER", "LMCACHE_FORCE_SKIP_SAVE",
    "LMCACHE_GPU_STAGING_BUFFER_BYTES", "LMCACHE_LOG_LEVEL", "LMCACHE_MP_TRANSFER_MODE", "LMCACHE_MQ_TIMEOUT",
    "LMCACHE_MUSA_HANDLE_TRANSFER", "LMCACHE_MUSA_NATIVE_KV_TRANSFER", "LMCACHE_OFFLOAD_RPC_PORT",
    "LMCACHE_PLUGIN_CONFIG", "LMCACHE_PLUGIN_ROLE", "LMCACHE_PLUGIN_WORKER_COUNT", "LMCACHE_PLUGIN_WORKER_ID",
    "LMCACHE_REQUEST_TELEMETRY_ENDPOINT", "LMCACHE_REQUEST_TELEMETRY_TYPE", "LMCACHE_RESP_HOST",
    "LMCACHE_RESP_PASSWORD", "LMCACHE_RESP_PORT", "LMCACHE_RESP_USERNAME", "LMCACHE_RUNTIME_PLUGIN_CONFIG",
    "LMCACHE_RUNTIME_PLUGIN_ROLE", "LMCACHE_RUNTIME_PLUGIN_WORKER_COUNT", "LMCACHE_RUNTIME_PLUGIN_WORKER_ID",
    "LMCACHE_SERVER_URL", "LMCACHE_TRACK_USAGE", "LMCACHE_USAGE_TRACK_INTERVAL", "LMCACHE_USAGE_TRACK_URL"
})  # fmt: skip
#: vLLM 0.32's ``KVTransferConfig`` fields: every key ``--kv-transfer-config`` may hold
VLLM_KV_TRANSFER_KEYS = frozenset({
    "enable_permute_local_kv", "engine_id", "kv_buffer_device", "kv_connector", "kv_connector_extra_config",
    "kv_connector_module_path", "kv_load_failure_policy", "kv_port", "kv_role"
})  # fmt: skip


def _dict_keys(tree: ast.Module, name: str) -> frozenset[str]:
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else node.targets[0] if isinstance(node, ast.Assign) else None
        if isinstance(target, ast.Name) and target.id == name and isinstance(node.value, ast.Dict):
            return frozenset(k.value for k in node.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
    raise ValueError(f"no {name} dict in the source")


def lmcache_keys_from_source(text: str) -> tuple[frozenset[str], frozenset[str]]:
    """(keys, old names) of an LMCache ``lmcache/v1/config.py``."""
    tree = ast.parse(text)
    return _dict_keys(tree, "_CONFIG_DEFINITIONS"), _dict_keys(tree, "_CONFIG_ALIASES") | _dict_keys(tree, "_DEPRECATED_CONFIGS")


def lmcache_env_from_package(root: Path) -> frozenset[str]:
    """Every ``LMCACHE_...`` name quoted in the sources of an LMCache package (``site-packages/lmcache``)."""
    found: set[str] = set()
    for p in sorted(root.rglob("*.py")):
        found |= set(re.findall(r"[\"'](LMCACHE_[A-Z0-9_]*[A-Z0-9])[\"']", p.read_text(errors="replace")))
    return frozenset(found)


def vllm_keys_from_source(text: str) -> frozenset[str]:
    """The fields of ``KVTransferConfig`` in a vLLM ``vllm/config/kv_transfer.py``."""
    for node in ast.parse(text).body:
        if isinstance(node, ast.ClassDef) and node.name == "KVTransferConfig":
            return frozenset(s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name))
    raise ValueError("no KVTransferConfig class in the source")


def _main(argv: list[str]) -> None:  # pragma: no cover - a maintainer's tool
    """``python -m kvctl.core.engine_keys LMCACHE_PACKAGE_DIR VLLM_KV_TRANSFER_PY``: the lists above, read from those."""
    keys, old = lmcache_keys_from_source((Path(argv[0]) / "v1" / "config.py").read_text())
    env = lmcache_env_from_package(Path(argv[0]))
    vllm = vllm_keys_from_source(Path(argv[1]).read_text())
    for name, values in (("LMCACHE_KEYS", keys), ("LMCACHE_OLD_KEYS", old), ("LMCACHE_OTHER_ENV", env), ("VLLM_KV_TRANSFER_KEYS", vllm)):
        sys.stdout.write(f"{name} = {sorted(values)!r}\n")


if __name__ == "__main__":
    _main(sys.argv[1:])
