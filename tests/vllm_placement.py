"""vLLM's KV cache placement (``get_kv_cache_groups``, ``get_kv_cache_config_from_groups``) wherever the running
release keeps it: ``vllm/v1/core/kv_cache_utils.py`` in 0.32, ``kv_cache_planning.py`` since 0.33, with the same
names and signatures. Tests that group or place caches as vLLM does import it from here, so they run under both
releases (make test-vllm-033). Import it after checking that vLLM imports."""

from __future__ import annotations

try:
    from vllm.v1.core import kv_cache_planning as placement
except ImportError:  # vLLM 0.32
    from vllm.v1.core import kv_cache_utils as placement

__all__ = ["placement"]
