"""kvctl.core.threads.DaemonPool (issue 44 defect 20): an executor whose workers are daemon threads registered
nowhere, so a read that ignores being cut is left behind instead of holding the interpreter's exit."""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import threading
import time

import pytest

from kvctl.core.threads import DaemonPool, join_all


def test_it_runs_work_like_an_executor():
    with DaemonPool(3, "t-pool") as pool:
        assert list(pool.map(lambda x: x * x, range(10))) == [x * x for x in range(10)]
        f = pool.submit(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            f.result(timeout=5)
        names = {t.name for t in pool.threads}
    assert 1 <= len(names) <= 3 and all(n.startswith("t-pool_") for n in names)
    assert not [t for t in pool.threads if t.is_alive()]  # the with form waited for them
    with pytest.raises(RuntimeError):
        pool.submit(print)


def test_a_stuck_worker_is_a_daemon_left_behind_and_queued_work_is_cancelled():
    release, started = threading.Event(), threading.Event()
    pool = DaemonPool(1, "t-stuck")

    def stuck():
        started.set()
        release.wait(30)

    try:
        first = pool.submit(stuck)
        assert started.wait(5)
        queued = pool.submit(lambda: "never")
        pool.shutdown(wait=False, cancel_futures=True)
        t0 = time.monotonic()
        left = pool.join(0.3)
        assert time.monotonic() - t0 < 5
        assert [t.name for t in left] == ["t-stuck_0"] and left[0].daemon
        assert queued.cancelled() and not first.done()
    finally:
        release.set()
    assert pool.join(5) == [] and first.result(timeout=5) is None
    assert join_all([threading.Thread(target=print)], 0) == []  # a thread never started is not waited for


def test_a_stuck_worker_does_not_hold_the_interpreter_exit():
    """What ThreadPoolExecutor does (its atexit hook joins every worker): the process below would live 30 s."""
    code = ("import threading, time\nfrom kvctl.core.threads import DaemonPool\n"
            "p = DaemonPool(2, 'x'); e = threading.Event(); p.submit(e.wait, 30); p.shutdown(wait=False)\nprint('BYE', flush=True)\n")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0 and "BYE" in proc.stdout, proc.stderr[-1000:]
    assert time.monotonic() - t0 < 20


def test_it_is_a_concurrent_futures_executor():
    assert isinstance(DaemonPool(1, "t"), concurrent.futures.Executor)
    with pytest.raises(ValueError):
        DaemonPool(0, "t")
