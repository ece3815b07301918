"""SIGKILL of a real `kvctl bench` (the console script) against a real valkey-server: nothing it started outlives it.

A client's result holds one float per batch (``batch_s``): tiny values (``--batch 1``) make tens of thousands of
batches in a few seconds, so the results are larger than a pipe buffer. With nobody left to read the result queue,
a client stuck writing its result would keep itself, the forkserver (which waits for every client) and the resource
tracker (whose pipe every client holds) alive for good. Also: ``--embedded`` servers die with the bench; the chain
the forkserver uses (``die_with_starter``) on its own; a client's result send gives up once the bench is gone.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from kvctl.bench.worker import WorkerResult, send_result
from kvctl.core.procs import STARTER_PID_ENV
from tests.bench.bench_procs import get_calls, name_of, start_bench

#: One batch adds ~9 pickled bytes to a client's result: 20,000 GETs over 2 clients are ~90 KB each, past 64 KiB.
GETS_PAST_A_PIPE_BUFFER = 20_000
ARGS = ["--chunk-bytes", "64", "--batch", "1", "--keys", "16", "--clients", "2", "--duration", "60", "--timeout", "1"]


def family(pid: int) -> list[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).children(recursive=True)
    return []


def cmdlines(procs: list[psutil.Process]) -> list[str]:
    """``pid status command`` of each (the command cut short: the forkserver's carries its whole sys.path)."""
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid} {p.status()} {' '.join(p.cmdline())[:100]}")
        except psutil.Error as e:
            out.append(f"{p.pid} {type(e).__name__}")
    return out


def test_sigkilled_bench_leaves_no_client_forkserver_or_resource_tracker(valkey_server, tmp_path):
    bench = start_bench(["--valkey", valkey_server.url, *ARGS], tmp_path)
    seen: dict[int, psutil.Process] = {}
    try:
        deadline = time.monotonic() + 60
        while get_calls(valkey_server.port) < GETS_PAST_A_PIPE_BUFFER:
            assert bench.poll() is None, bench.communicate()
            assert time.monotonic() < deadline, "bench clients did not reach the GET count"
            seen.update((p.pid, p) for p in family(bench.pid))
            time.sleep(0.2)
        seen.update((p.pid, p) for p in family(bench.pid))
        lines = cmdlines(list(seen.values()))
        assert any("forkserver" in c for c in lines), lines
        assert any("resource_tracker" in c for c in lines), lines
        assert len(seen) >= 4, lines  # forkserver, resource tracker, 2 clients
        bench.kill()
        bench.wait(timeout=10)  # not communicate(): a survivor would hold its stdout open
        _, alive = psutil.wait_procs(list(seen.values()), timeout=10)
        assert not alive, cmdlines(alive)
    finally:
        if bench.poll() is None:
            bench.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                bench.wait(timeout=10)
        for p in seen.values():  # survivors of a failed run, by the pid recorded while the bench ran
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(list(seen.values()), timeout=5)
        for pipe in (bench.stdout, bench.stderr):
            pipe.close()


def test_sigkilled_bench_leaves_no_embedded_server(tmp_path):
    """--embedded: the valkey-servers the bench started for itself die with it (its temp dir stays: nobody is left)."""
    bench = start_bench(["--embedded", "1", "--embedded-maxmemory", "64mb", "--chunk-bytes", "2e6", "--batch", "4", "--keys", "16",
                         "--duration", "30", "--timeout", "1"], tmp_path)
    seen: dict[int, psutil.Process] = {}
    try:
        deadline = time.monotonic() + 60
        while not any("forkserver" in c for c in cmdlines(list(seen.values()))):  # clients are starting: the servers run
            assert bench.poll() is None, bench.communicate()
            assert time.monotonic() < deadline, "bench never started its clients"
            seen.update((p.pid, p) for p in family(bench.pid))
            time.sleep(0.1)
        servers = [p for p in seen.values() if "valkey-server" in name_of(p)]
        assert servers, cmdlines(list(seen.values()))
        bench.kill()
        bench.wait(timeout=10)
        _, alive = psutil.wait_procs(list(seen.values()), timeout=10)
        assert not alive, cmdlines(alive)
    finally:
        if bench.poll() is None:
            bench.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                bench.wait(timeout=10)
        for p in seen.values():
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(list(seen.values()), timeout=5)
        for pipe in (bench.stdout, bench.stderr):
            pipe.close()


def test_a_starter_s_child_and_its_forked_children_die_with_it(tmp_path):
    """die_with_starter, the chain the forkserver uses: starter → child (PR_SET_PDEATHSIG) → os.fork'ed grandchild."""
    child = (
        "import os, sys, time\n"
        "from kvctl.core.procs import STARTER_PID_ENV, die_with_starter\n"
        "assert die_with_starter() and STARTER_PID_ENV not in os.environ\n"
        "if os.fork() == 0:\n"
        "    time.sleep(60); os._exit(0)\n"
        "time.sleep(60)\n"
    )
    starter = (
        "import os, subprocess, sys, time\n"
        "from kvctl.core.procs import STARTER_PID_ENV\n"
        f"subprocess.Popen([sys.executable, '-c', {child!r}], env={{**os.environ, STARTER_PID_ENV: str(os.getpid())}})\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", starter], cwd=tmp_path, start_new_session=True)
    seen: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 20
        while len(seen) < 2:  # the child and its forked grandchild
            assert proc.poll() is None and time.monotonic() < deadline, "the starter's children never appeared"
            seen = family(proc.pid)
            time.sleep(0.05)
        time.sleep(0.5)  # past the import and the prctl
        proc.kill()
        proc.wait(timeout=10)
        _, alive = psutil.wait_procs(seen, timeout=10)
        assert not alive, cmdlines(alive)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: only what this test started
        proc.wait(timeout=10)
        for p in seen:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(seen, timeout=5)


def test_die_with_starter_does_nothing_without_the_variable():
    code = "from kvctl.core.procs import die_with_starter; print(die_with_starter())"
    env = {k: v for k, v in os.environ.items() if k != STARTER_PID_ENV}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def read_result(q, n: int) -> None:
    """In a reader process: exit 0 when ``q`` holds a WorkerResult of ``n`` batches."""
    sys.exit(0 if len(q.get(timeout=30).batch_s) == n else 1)


def test_an_orphaned_client_gives_up_a_result_larger_than_the_pipe():
    """send_result with nobody reading: it returns once the bench is gone, instead of waiting on the feeder for good."""
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    res = WorkerResult(0, 0, batch_s=[0.001] * 200_000)  # ~1.8 MB pickled, far past a 64 KiB pipe
    gone_at = time.monotonic() + 0.5
    sender = threading.Thread(target=send_result, args=(q, res, lambda: time.monotonic() >= gone_at), daemon=True)
    sender.start()
    sender.join(timeout=10)
    assert not sender.is_alive(), "send_result still waits for a reader that is gone"
    reader = ctx.Process(target=read_result, args=(q, 200_000))  # lets the blocked feeder thread finish
    reader.start()
    reader.join(timeout=60)
    if reader.exitcode is None:
        reader.kill()
        reader.join(timeout=10)
    assert reader.exitcode == 0


def test_a_client_sends_nothing_once_the_bench_is_gone():
    q = multiprocessing.get_context("spawn").Queue()
    send_result(q, WorkerResult(0, 0), orphaned=lambda: True)
    with pytest.raises(queue.Empty):
        q.get(timeout=0.2)
    q.close()
