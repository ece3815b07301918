"""Test hooks named by an environment variable (``module:function``), for the engine tests' faults.

An engine test cannot reach into a vLLM or LMCache worker process to delete a chunk between the scheduler's
lookup and the load, so the connectors call a function named in their environment at that point (the tests'
hooks: tests/engine/connector_hooks.py, tests/lmcache/shard_hooks.py, tests/lmcache/plugin_hooks.py). Unset (every
deployment), nothing is imported and nothing is called.
"""

from __future__ import annotations

import importlib
import os
from typing import Callable, Optional

__all__ = ["hook_from_env"]


def hook_from_env(name: str) -> Optional[Callable]:
    """The function ``module:function`` that the variable ``name`` names, or None where it is unset or empty."""
    spec = os.environ.get(name)
    if not spec:
        return None
    module, _, func = spec.partition(":")
    return getattr(importlib.import_module(module), func)
