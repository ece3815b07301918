"""Shared fixtures: isolated state dirs, real Valkey servers on free loopback ports, py-spy that can attach."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import traceback

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


#: Seconds a thread a test started gets to end after the test (a pool told to shut down, a server being closed).
THREAD_GRACE_S = 2.0
#: Non-daemon threads a test may leave alive, by name prefix: each one process-wide by design (created once per
#: process by a library, reused by every later caller), with the reason. Empty: every leak found was a leak.
PROCESS_WIDE_THREADS: dict[str, str] = {}


def _describe_thread(t: threading.Thread) -> str:
    target = getattr(t, "_target", None)  # Thread.run drops it when the thread ends; this one is alive
    what = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}" if target else type(t).__qualname__
    frame = sys._current_frames().get(t.ident or -1)
    at = "".join(traceback.format_stack(frame, limit=3)).strip().replace("\n", " | ") if frame else "?"
    return f"{t.name!r} (target {what}; now at: {at})"


@pytest.fixture(autouse=True)
def _no_thread_left_behind():
    """Fail a test that leaves a new non-daemon thread alive (issue 44 defect 20).

    A non-daemon thread holds the interpreter's exit, and one left by a test made `kvctl exporter`, run in-process
    later, end pytest with exit 0 and no summary. Threads started before the test (by wider-scoped fixtures
    too: they are set up first) are not counted; each new one gets THREAD_GRACE_S to end."""
    before = set(threading.enumerate())
    yield

    def stray() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t not in before and not t.daemon and t.is_alive()
                and not t.name.startswith(tuple(PROCESS_WIDE_THREADS))]

    left, deadline = stray(), time.monotonic() + THREAD_GRACE_S
    while left and time.monotonic() < deadline:
        left[0].join(timeout=max(0.0, min(0.1, deadline - time.monotonic())))
        left = stray()
    if left:
        pytest.fail(f"the test left {len(left)} non-daemon thread(s) alive {THREAD_GRACE_S:g} s after it ended (they hold the "
                    "interpreter's exit; stop or join them, or make them daemons): " + "; ".join(map(_describe_thread, left)),
                    pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def _no_server_left_behind(tmp_path_factory):
    """Fail the run when a valkey-server that a test started (its working directory is under this run's temp dir)
    outlives the run. A tier started with `deploy-valkey up` is a daemon of its own: a test that loses track of it
    leaves it running after pytest ends, unseen (one did, every fast-lane run, until 2026-12-05). The server is
    stopped (by pid, ours) and the run ends with an error that names its directory, which names the test."""
    import psutil  # noqa: PLC0415

    base = str(tmp_path_factory.getbasetemp().resolve())
    yield
    left = []
    for p in psutil.process_iter(["name", "cwd"]):
        if "valkey-server" in (p.info["name"] or "") and (p.info["cwd"] or "").startswith(base):
            left.append(f"pid {p.pid} in {p.info['cwd']}")
            p.kill()
    if left:
        pytest.fail(f"{len(left)} valkey-server(s) started by tests outlived them (stopped now): " + "; ".join(left),
                    pytrace=False)


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


MAX_RANK_POOLS = 2


@pytest.fixture(scope="session")
def rank_pool():
    """``rank_pool(W).run(target, args, timeout_s)``: W warm spawned gloo ranks shared by the tests of a run
    (tests/connector/ranks.py RankPool), one pool per W, stopped at the end; a pool killed by a hang is replaced."""
    from tests.connector.ranks import RankPool  # noqa: PLC0415 - torch only where a test asks for ranks

    pools: dict[int, RankPool] = {}  # most recently used last; at most MAX_RANK_POOLS kept (each rank holds torch, vLLM)

    def get(world: int) -> RankPool:
        pool = pools.pop(world, None)
        if pool is None or pool.broken:
            while len(pools) >= MAX_RANK_POOLS:
                pools.pop(next(iter(pools))).close()
            pool = RankPool(world)
        pools[world] = pool
        return pool

    try:
        yield get
    finally:
        for pool in pools.values():
            pool.close()


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
