"""kvctl.diagnose.sampling: finding processes, /proc context switches, the sampling loop and stable threads.

Processes are real children of the test. ``sample_stacks`` takes its dump
function as a parameter; the tests here pass one that returns chosen stacks
or raises chosen errors, because py-spy's transient failures (a frame caught
mid-update) cannot be provoked on demand: the real py-spy path is exercised by
test_stalls.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid

import pytest

from kvctl.diagnose.pyspy import Frame, ProcessGone, PtraceNotPermitted, ThreadStack
from kvctl.diagnose.sampling import (
    StackSamples,
    find_processes,
    process_info,
    sample_stacks,
    stable_threads,
    thread_switches,
)
from kvctl.core.errors import InvalidInput, KvctlError


@pytest.fixture
def sleeper():
    """A real Python child sleeping with a unique marker on its command line; killed after the test."""
    marker = f"kvctl-sampling-{uuid.uuid4().hex[:12]}"
    p = subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(60)", marker])
    try:
        yield p, marker
    finally:
        p.kill()
        p.wait(timeout=10)


def _gone_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(timeout=30)
    return p.pid


def test_find_processes_by_command_line_and_info(sleeper):
    p, marker = sleeper
    found = find_processes(marker.upper())  # case-insensitive
    assert [i.pid for i in found] == [p.pid]
    assert marker in found[0].cmdline and found[0].name.startswith("python")
    info = process_info(p.pid)
    assert info.pid == p.pid and marker in info.cmdline
    # kvctl never lists itself (nor its parents), though this pytest process is a python too
    assert os.getpid() not in [i.pid for i in find_processes("python")]


def test_find_processes_refuses_an_empty_pattern():
    with pytest.raises(InvalidInput, match="non-empty"):
        find_processes("  ")


def test_process_info_of_a_gone_pid():
    with pytest.raises(ProcessGone, match="no process"):
        process_info(_gone_pid())


def test_thread_switches_count_up_while_a_thread_sleeps():
    mine = thread_switches(os.getpid())
    tid = threading.get_native_id()
    assert tid in mine
    for _ in range(5):
        time.sleep(0.001)  # each sleep is at least one voluntary context switch
    assert thread_switches(os.getpid())[tid] >= mine[tid] + 5
    assert thread_switches(_gone_pid()) == {}


F1 = (Frame("recv_into", "socket.py", 10), Frame("get", "resp.py", 20))
F2 = (Frame("select", "selectors.py", 5),)


def _t(thread_id: int, frames: tuple, tid: int | None = None) -> ThreadStack:
    return ThreadStack(1, thread_id, tid, f"t{thread_id}", True, False, frames)


def test_stable_threads_need_identical_frames_in_every_round():
    rounds = [
        [_t(1, F1, 101), _t(2, F1, 102), _t(3, F2, 103), _t(4, (), 104)],
        [_t(1, F1, 101), _t(2, F2, 102), _t(4, (), 104)],  # thread 2 moved; thread 3 missing
        [_t(1, F1, 101), _t(2, F1, 102), _t(3, F2, 103), _t(4, (), 104)],
    ]
    s = StackSamples(processes={}, rounds={1: rounds}, switches_before={1: {101: 40}}, switches_after={1: {101: 43}})
    (only,) = stable_threads(s, 1)
    assert only.stack.thread_id == 1 and only.wakeups == 3  # 43 - 40 switches in the window
    s.switches_after = {1: {}}  # /proc unreadable at the end: unknown, not 0
    assert stable_threads(s, 1)[0].wakeups is None
    assert stable_threads(StackSamples(processes={}, rounds={1: rounds[:1]}), 1) == []  # one round proves nothing


def test_sample_stacks_rounds_window_and_per_pid_errors(sleeper):
    p, _ = sleeper
    gone = _gone_pid()
    calls: list[int] = []

    def dump(pid: int) -> list[ThreadStack]:
        calls.append(pid)
        return [_t(1, F2, pid)]

    t = time.monotonic()
    s = sample_stacks([p.pid, gone, p.pid], samples=3, interval_s=0.1, dump=dump)
    assert time.monotonic() - t >= 0.2 and s.window_s >= 0.2  # 2 intervals of 0.1 s between 3 samples
    assert calls == [p.pid] * 3  # the repeat read once, the gone pid never dumped
    assert len(s.rounds[p.pid]) == 3 and isinstance(s.errors[gone], ProcessGone)
    assert p.pid in s.switches_before and p.pid in s.switches_after and p.pid in s.sockets


def test_sample_stacks_retries_transient_dump_errors_not_permanent_ones(sleeper):
    p, _ = sleeper
    failures = iter([KvctlError("frame changed while reading"), KvctlError("again")])

    def flaky(pid: int) -> list[ThreadStack]:
        err = next(failures, None)
        if err:
            raise err
        return [_t(1, F1, pid)]

    s = sample_stacks([p.pid], samples=2, interval_s=0.01, dump=flaky)  # 2 failures, then 2 good dumps
    assert len(s.rounds[p.pid]) == 2 and not s.errors

    tries: list[int] = []

    def denied(pid: int) -> list[ThreadStack]:
        tries.append(pid)
        raise PtraceNotPermitted("ptrace denied")

    with pytest.raises(PtraceNotPermitted):  # every pid failed: the first error is raised
        sample_stacks([p.pid], samples=2, interval_s=0.01, dump=denied)
    assert tries == [p.pid]  # not retried


@pytest.mark.parametrize("pids, samples, message", [([1], 1, "at least 2"), ([], 2, "no process")])
def test_sample_stacks_refuses_bad_requests(pids, samples, message):
    with pytest.raises(InvalidInput, match=message):
        sample_stacks(pids, samples=samples, interval_s=0.01, dump=lambda pid: [])
