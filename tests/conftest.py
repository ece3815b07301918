"""Shared fixtures: isolated state dirs, real Valkey servers on free loopback ports, py-spy that can attach."""

from __future__ import annotations

import os
import subprocess
import sys

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


@pytest.fixture
def gloo_world1(tmp_path):
    """A one-rank gloo process group (the default group) for the data path's collectives, destroyed after the test."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def pyspy_attach():
    """Skip (with the exact reason) when py-spy cannot attach in this sandbox (the stall tests, tests/diagnose and runbooks)."""
    from kvctl.diagnose import pyspy  # noqa: PLC0415
    from kvctl.core.errors import BinaryNotFound  # noqa: PLC0415

    try:
        pyspy.find_py_spy()
    except BinaryNotFound as e:
        pytest.skip(str(e))
    proc = subprocess.Popen([sys.executable, "-c", "import time; print('READY', flush=True); time.sleep(30)"], stdout=subprocess.PIPE, text=True)
    try:
        proc.stdout.readline()
        pyspy.dump_threads(proc.pid)
    except pyspy.PtraceNotPermitted as e:
        pytest.skip(str(e))
    finally:
        os.kill(proc.pid, 9)
        proc.wait()
        proc.stdout.close()


def pytest_collection_modifyitems(config, items):
    """Skip engine tests cleanly when torch is absent (the engine extra is not installed)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        skip = pytest.mark.skip(reason="needs the engine extra: pip install -e .[engine]")
        for item in items:
            if "engine" in item.keywords:
                item.add_marker(skip)
