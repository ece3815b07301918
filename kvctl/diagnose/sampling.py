"""Stack samples of live processes for ``kvctl diagnose stalls``: the outside world and the sampling.

Processes (psutil), per-thread context switches (``/proc``), sockets and epoll
registrations (:mod:`kvctl.diagnose.procnet`), GPU utilisation (NVML), and
``py-spy dump`` samples a short interval apart. :mod:`kvctl.diagnose.stalls`
classifies what this module collects.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from kvctl.diagnose.procnet import ProcSockets, read_sockets
from kvctl.diagnose.pyspy import ProcessGone, PtraceNotPermitted, ThreadStack, dump_threads
from kvctl.core.errors import BinaryNotFound, InvalidInput, KvctlError

@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    name: str
    cmdline: str


@dataclass
class StackSamples:
    """Raw material of a diagnosis: per pid, one list of thread stacks per sample."""

    processes: dict[int, ProcessInfo]
    rounds: dict[int, list[list[ThreadStack]]] = field(default_factory=dict)
    switches_before: dict[int, dict[int, int]] = field(default_factory=dict)
    switches_after: dict[int, dict[int, int]] = field(default_factory=dict)
    errors: dict[int, KvctlError] = field(default_factory=dict)
    window_s: float = 0.0
    sockets: dict[int, ProcSockets | None] = field(default_factory=dict)  # /proc view at the end of the window


@dataclass(frozen=True)
class StableThread:
    """A thread whose frames were identical in every sample."""

    stack: ThreadStack
    wakeups: int | None  # context switches during the window; None when /proc is unreadable


# ---------------------------------------------------------------------------
# the outside world: processes, /proc, NVML


def process_info(pid: int) -> ProcessInfo:
    import psutil  # noqa: PLC0415

    try:
        p = psutil.Process(pid)
        name = p.name()
        try:
            cmd = " ".join(p.cmdline())
        except (psutil.AccessDenied, psutil.ZombieProcess):
            cmd = name
    except psutil.NoSuchProcess as e:
        raise ProcessGone(f"no process with pid {pid}") from e
    except psutil.AccessDenied:
        return ProcessInfo(pid, "?", "?")
    return ProcessInfo(pid, name, cmd)


def find_processes(pattern: str) -> list[ProcessInfo]:
    """Processes whose name or command line contains ``pattern`` (case-insensitive), not kvctl itself."""
    import psutil  # noqa: PLC0415

    if not pattern.strip():
        raise InvalidInput("--match needs a non-empty pattern")
    skip = {os.getpid()}
    try:
        skip.update(p.pid for p in psutil.Process().parents())
    except psutil.Error:
        pass
    needle = pattern.lower()
    found = []
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        if p.info["pid"] in skip:
            continue
        name = p.info.get("name") or ""
        cmd = " ".join(p.info.get("cmdline") or ())
        if "py-spy" in name or "py-spy" in cmd.split(" ", 1)[0]:
            continue
        if needle in name.lower() or needle in cmd.lower():
            found.append(ProcessInfo(p.info["pid"], name, cmd))
    return sorted(found, key=lambda i: i.pid)


def thread_switches(pid: int) -> dict[int, int]:
    """Context switches so far per OS thread id, from ``/proc/PID/task/*/status``; {} when unreadable."""
    out: dict[int, int] = {}
    base = f"/proc/{pid}/task"
    try:
        tids = os.listdir(base)
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"{base}/{tid}/status") as fh:
                total = 0
                for line in fh:
                    if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                        total += int(line.split()[1])
            out[int(tid)] = total
        except (OSError, ValueError):
            continue
    return out


def gpu_state() -> tuple[tuple[float, ...], tuple[str, ...], str]:
    """NVML utilisation per visible GPU, names, and a note ("no GPU visible (...)" when none)."""
    from kvctl.diagnose.sources import gpu_sample  # noqa: PLC0415 - shared with `kvctl diagnose`; urllib stays unloaded here

    g = gpu_sample()
    return tuple(g.utilization_pct), tuple(g.names), g.note


# ---------------------------------------------------------------------------
# sampling


def sample_stacks(
    pids: Sequence[int],
    samples: int = 3,
    interval_s: float = 1.0,
    dump: Callable[[int], list[ThreadStack]] = dump_threads,
) -> StackSamples:
    """``samples`` dumps of every pid, ``interval_s`` apart, with context switches before and after."""
    if samples < 2:
        raise InvalidInput("--samples must be at least 2 to tell a stall from a moment")
    if not pids:
        raise InvalidInput("no process to inspect: give --pid or --match")
    infos = {}
    errors: dict[int, KvctlError] = {}
    for pid in dict.fromkeys(pids):
        try:
            infos[pid] = process_info(pid)
        except ProcessGone as e:
            infos[pid] = ProcessInfo(pid, "?", "?")
            errors[pid] = e
    res = StackSamples(processes=infos, errors=errors)
    live = [p for p in infos if p not in errors]
    res.switches_before = {pid: thread_switches(pid) for pid in live}
    start = time.monotonic()
    for i in range(samples):
        if i:
            time.sleep(interval_s)
        for pid in live:
            if pid in res.errors:
                continue
            try:
                res.rounds.setdefault(pid, []).append(_dump_retrying(dump, pid))
            except KvctlError as e:
                res.errors[pid] = e
    res.window_s = time.monotonic() - start
    res.switches_after = {pid: thread_switches(pid) for pid in live if pid not in res.errors}
    res.sockets = {pid: read_sockets(pid) for pid in live if pid not in res.errors}
    if infos and len(res.errors) == len(infos):
        raise next(iter(res.errors.values()))
    return res


def _dump_retrying(dump: Callable[[int], list[ThreadStack]], pid: int, attempts: int = 3) -> list[ThreadStack]:
    """A non-blocking dump can catch a frame mid-update and fail; retry those, not permanent errors."""
    for i in range(attempts):
        try:
            return dump(pid)
        except (PtraceNotPermitted, ProcessGone, BinaryNotFound):
            raise
        except KvctlError:
            if i == attempts - 1:
                raise
            time.sleep(0.05)
    raise AssertionError("unreachable")


def stable_threads(s: StackSamples, pid: int) -> list[StableThread]:
    """Threads of ``pid`` seen in every sample with exactly the same frames."""
    rounds = s.rounds.get(pid) or []
    if len(rounds) < 2:
        return []
    by_id: dict[int, list[ThreadStack]] = {}
    for r in rounds:
        for t in r:
            by_id.setdefault(t.thread_id, []).append(t)
    before, after = s.switches_before.get(pid, {}), s.switches_after.get(pid, {})
    out = []
    for seen in by_id.values():
        if len(seen) != len(rounds) or not seen[0].frames:
            continue
        if any(t.frames != seen[0].frames for t in seen[1:]):
            continue
        tid = seen[-1].os_thread_id
        wake = after[tid] - before[tid] if tid in before and tid in after else None
        out.append(StableThread(seen[-1], wake))
    return out
