"""`kvctl diagnose stalls` recognises real KV clients stuck on a Valkey that stopped answering.

redis-py 8.1 with its pure-Python and hiredis parsers and its asyncio client run
for real (``stall_programs/redis_client_get.py``) against a real valkey-server
that the test SIGSTOPs (and always SIGCONTs). LMCache 0.5.6 cannot be installed
here (it downgrades numpy and prometheus_client under vLLM), so its clients are
recognised from stacks carrying the frame names of its sources.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from kvctl.diagnose import clients, stalls
from kvctl.diagnose.procnet import ProcSockets, TcpConn
from kvctl.diagnose.pyspy import Frame, ThreadStack
from tests.diagnose.stall_helpers import INTERVAL_S, LIFETIME_S, PROGRAMS, by_id, wait_ready


@contextlib.contextmanager
def stuck_client(valkey, mode: str):
    """The client connected, then the server SIGSTOPped, then the GET sent."""
    cmd = [sys.executable, str(PROGRAMS / "redis_client_get.py"), "--lifetime", str(LIFETIME_S), "--port", str(valkey.port), "--mode", mode]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stopped = False
    try:
        line = proc.stdout.readline()
        assert line.startswith("CONNECTED"), (line, proc.stderr.read() if proc.poll() is not None else "")
        os.kill(valkey.pid, signal.SIGSTOP)
        stopped = True
        proc.stdin.write("go\n")
        proc.stdin.flush()
        wait_ready(proc)
        time.sleep(0.3)  # the GET is on the wire
        yield proc
    finally:
        if stopped:
            os.kill(valkey.pid, signal.SIGCONT)
        if proc.poll() is None:
            os.kill(proc.pid, 9)
        proc.wait(timeout=10)
        for f in (proc.stdin, proc.stdout, proc.stderr):
            f.close()


@pytest.mark.parametrize(
    "mode, innermost, client_name",
    [
        ("sync-python", "SocketBuffer._read_from_socket (redis/_parsers/socket.py", "pure-Python parser"),
        ("sync-hiredis", "_HiredisParser.read_from_socket (redis/_parsers/hiredis.py", "hiredis parser"),
    ],
)
def test_redis_py_sync_client_waiting_on_a_stopped_server(pyspy_attach, valkey_server, mode, innermost, client_name):
    with stuck_client(valkey_server, mode) as proc:
        report = stalls.diagnose_stalls([proc.pid], samples=3, interval_s=INTERVAL_S)
    found = by_id(report)
    assert list(found) == ["server-not-answering"], report.findings
    (f,) = found["server-not-answering"]
    assert f.severity is stalls.Severity.CRITICAL and f.thread_name == "MainThread"
    assert f.frames[0].startswith(innermost)
    assert client_name in f.message and "not a missing-key hang" in f.evidence
    assert f"127.0.0.1:{valkey_server.port}" in f.evidence  # the peer that does not answer
    assert "socket timeout" in f.recommendation


def test_redis_asyncio_from_a_sync_caller_is_not_a_lost_completion(pyspy_attach, valkey_server):
    """The LMCache redis:// pattern: a sync caller in Future.result, the loop idle in select. Its epoll
    waits on the TCP connection to the stopped server: a reply outstanding, not a lost completion."""
    with stuck_client(valkey_server, "asyncio-thread") as proc:
        report = stalls.diagnose_stalls([proc.pid], samples=3, interval_s=INTERVAL_S)
    found = by_id(report)
    assert list(found) == ["server-not-answering"], report.findings
    (f,) = found["server-not-answering"]
    assert f.severity is stalls.Severity.CRITICAL and f.thread_name == "MainThread"
    assert any(fr.startswith("Future.result (concurrent/futures/_base.py") for fr in f.frames)
    assert "remote-loop idle in select" in f.evidence and f"→ 127.0.0.1:{valkey_server.port}" in f.evidence


def test_redis_asyncio_under_asyncio_run(pyspy_attach, valkey_server):
    """asyncio.run(main()) awaiting a GET: only the idle loop is visible; the kernel says what it waits on."""
    with stuck_client(valkey_server, "asyncio-run") as proc:
        report = stalls.diagnose_stalls([proc.pid], samples=3, interval_s=INTERVAL_S)
    found = by_id(report)
    assert list(found) == ["server-not-answering"], report.findings
    (f,) = found["server-not-answering"]
    assert f.severity is stalls.Severity.WARNING
    assert f.frames[0].startswith("EpollSelector.select (selectors.py") and any("run_until_complete" in fr for fr in f.frames)
    assert f"→ 127.0.0.1:{valkey_server.port}" in f.evidence and "no listening socket" in f.evidence


# --- LMCache 0.5.6's clients, by the frame names of its sources ------------------------------

LM_CONN = "lmcache/v1/storage_backend/connector/redis_connector.py"
LM_NATIVE = "lmcache/v1/storage_backend/native_clients/connector_client_base.py"
WAIT = (Frame("Condition.wait", "threading.py", 327), Frame("Future.result", "concurrent/futures/_base.py", 451))
LOOP = (Frame("EpollSelector.select", "selectors.py", 468), Frame("BaseEventLoop._run_once", "asyncio/base_events.py", 1884),
        Frame("BaseEventLoop.run_forever", "asyncio/base_events.py", 607), Frame("Thread.run", "threading.py", 982))


def _samples(waiter: tuple[Frame, ...], sockets: ProcSockets) -> stalls.StackSamples:
    threads = [
        ThreadStack(7, 1, 101, "lmcache-lookup", False, False, waiter),
        ThreadStack(7, 2, 102, "lmcache-loop", False, False, LOOP),
    ]
    s = stalls.StackSamples(processes={7: stalls.ProcessInfo(7, "python", "vllm serve")})
    s.rounds = {7: [threads, threads, threads]}
    s.switches_before, s.switches_after = {7: {101: 5, 102: 9}}, {7: {101: 5, 102: 9}}
    s.window_s, s.sockets = 0.8, {7: sockets}
    return s


EVENTFD_ONLY = ProcSockets((TcpConn(9, "10.0.0.5:40000", "10.0.0.9:6379", "ESTABLISHED"),), frozenset({4}))  # C++ workers' sockets
LOOP_ON_TCP = ProcSockets((TcpConn(9, "10.0.0.5:40000", "10.0.0.9:6379", "ESTABLISHED"),), frozenset({4, 9}))


@pytest.mark.parametrize("op, bug2", [("batch_get_sync", True), ("batch_exists_sync", False)])
def test_lmcache_native_client_wait_is_a_lost_completion_naming_the_client(op, bug2):
    waiter = WAIT + (Frame(f"ConnectorClientBase.{op}", LM_NATIVE, 150), Frame("RESPConnector.batched_contains", LM_CONN, 170))
    assert clients.identify(waiter) is clients.LMCACHE_NATIVE
    (f,) = stalls.classify(_samples(waiter, EVENTFD_ONLY))
    assert f.id == "lost-completion" and "LMCache native RESP client" in f.evidence and "bug 1" in f.evidence
    assert ("bug 2" in f.evidence) is bug2
    # the native client's loop waits on its eventfd only, so even a TCP socket in the process is not "outstanding"
    (f,) = stalls.classify(_samples(waiter, LOOP_ON_TCP))
    assert f.id == "lost-completion"  # it is not completion-safe: a loop on TCP does not clear it


def test_lmcache_redis_connector_waiting_on_a_silent_server():
    waiter = WAIT + (Frame("RedisConnector.exists_sync", LM_CONN, 75), Frame("RemoteBackend.contains", "lmcache/v1/storage_backend/remote_backend.py", 120))
    assert clients.identify(waiter) is clients.LMCACHE_REDIS
    (f,) = stalls.classify(_samples(waiter, LOOP_ON_TCP))
    assert f.id == "server-not-answering" and "LMCache redis:// connector" in f.evidence and "10.0.0.9:6379" in f.evidence
    (f,) = stalls.classify(_samples(waiter, EVENTFD_ONLY))  # nothing outstanding on the loop: the completion was lost
    assert f.id == "lost-completion"
