"""Fixtures of the LMCache tests."""

from __future__ import annotations

import pytest

from tests.lmcache.lmcache_env import lmcache_available, lmcache_python


@pytest.fixture(scope="module")
def lmc_python() -> str:
    """The LMCache venv's Python ($KVCTL_LMCACHE_PYTHON); the test skips where LMCache 0.5.6 is not installed."""
    ok, reason = lmcache_available()
    if not ok:
        pytest.skip(reason)
    return lmcache_python()
