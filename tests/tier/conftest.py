"""Fixtures of the tier tests."""

from __future__ import annotations

import psutil
import pytest

from tests.tier.tier_procs import servers_under


@pytest.fixture
def no_leftover_servers(tmp_path):
    """After the test, no valkey-server may work under its tmp_path: any left is killed (it was started by
    this test, through `up`) and the test fails."""
    yield tmp_path
    left = servers_under(tmp_path)
    for pid in left:
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass
    assert not left, f"valkey-servers left running under {tmp_path}: {left}"
