"""Shared fixtures: isolated state dirs and real Valkey servers on free loopback ports."""

from __future__ import annotations

import os

import pytest

os.environ["KVCTL_TESTING"] = "1"  # before kvctl.cli is imported: no third-party plugins

from kvctl.tier.server import ValkeyProcess, start_valkey


@pytest.fixture(autouse=True)
def _isolated_state(tmp_path_factory, monkeypatch):
    """Point kvctl's config/state dirs at a temp dir and make errors re-raise."""
    home = tmp_path_factory.mktemp("kvctl-home")
    monkeypatch.setenv("KVCTL_HOME", str(home))
    monkeypatch.setenv("KVCTL_TESTING", "1")
    monkeypatch.delenv("KVCTL_RAISE_ERRORS", raising=False)
    yield


@pytest.fixture
def valkey_server(tmp_path) -> ValkeyProcess:
    """One real valkey-server on a free loopback port, stopped after the test."""
    proc = start_valkey(tmp_path / "valkey", settings={"maxmemory": "256mb"})
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def valkey_factory(tmp_path):
    """Start any number of real valkey-servers; all are stopped after the test."""
    started: list[ValkeyProcess] = []

    def make(**kwargs) -> ValkeyProcess:
        kwargs.setdefault("settings", {"maxmemory": "256mb"})
        proc = start_valkey(tmp_path / f"valkey-{len(started)}", **kwargs)
        started.append(proc)
        return proc

    try:
        yield make
    finally:
        for proc in started:
            proc.stop()


def pytest_collection_modifyitems(config, items):
    """Skip engine tests cleanly when torch is absent (the engine extra is not installed)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        skip = pytest.mark.skip(reason="needs the engine extra: pip install -e .[engine]")
        for item in items:
            if "engine" in item.keywords:
                item.add_marker(skip)
