"""Stalled lookups: the three stall signatures of paper §5.4, from live stacks.

``diagnose_stalls`` takes several ``py-spy dump`` samples a short interval
apart, keeps the threads that stayed in the same place and did not wake up
in between (per-thread context switches from ``/proc``), and classifies them:

* ``lost-completion``: a thread blocked in a concurrent.futures ``result()``
  (a threading Condition wait) while nothing in the process could complete
  it: no executor work item running, no thread in socket I/O, the event-loop
  thread idle in ``select`` (bug 1);
* ``missing-key-get``: a thread blocked in a socket receive inside a remote
  GET (bug 2: a fixed-size header read of the 5-byte ``$-1\\r\\n``);
* ``lockstep-stall``: a thread waiting in a torch.distributed collective
  while an inspected peer is elsewhere or in a different collective;
* ``server-not-answering``: a client that reads replies correctly (redis-py
  with either parser, redis-py asyncio, LMCache's ``redis://`` connector,
  kvctl's own) waiting the whole window for a reply: the server is hung. For
  asyncio clients the evidence is the kernel's: the event loop's epoll waits
  on an established TCP connection (:mod:`kvctl.diagnose.procnet`).

Clients are recognised by their frames (:mod:`kvctl.diagnose.clients`).

GPU utilisation from NVML is added to the evidence ("no GPU visible" where
there is none). Everything returns dataclasses; no click, no rich.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from kvctl.diagnose import clients as C
from kvctl.diagnose.findings import Severity, worst_severity
from kvctl.diagnose.procnet import ProcSockets
from kvctl.diagnose.pyspy import Frame, ThreadStack, dump_threads
from kvctl.core.thresholds import GPU_IDLE_PCT
from kvctl.diagnose.sampling import (  # noqa: F401 - re-exported: the stall API in one place
    ProcessInfo,
    StableThread,
    StackSamples,
    find_processes,
    gpu_state,
    process_info,
    sample_stacks,
    stable_threads,
    thread_switches,
)

# ---------------------------------------------------------------------------
# results


LMCACHE_NOTE = "not fixed in LMCache <= 0.5.6 (current on PyPI); use kvctl.connector"

RECOMMENDATIONS = {
    "lost-completion": (
        f"Lost completion (paper §5.4, bug 1): {LMCACHE_NOTE}, whose RESP client holds one lock across "
        "submit-and-register and across the drain. Restart the engine to recover now: after one lost "
        "completion every later lookup on this client waits its full timeout."
    ),
    "missing-key-get": (
        f"Missing-key GET hang (paper §5.4, bug 2): {LMCACHE_NOTE}, whose RESP client parses the reply header "
        "up to CRLF and treats `$-1` as a per-key miss, keeping the connection usable. Until then keep evictions "
        "rare (maxmemory headroom) and switch to async loading (`kvctl loading async`) so a missing chunk "
        "stalls one request instead of every rank."
    ),
    "lockstep-stall": (
        "Every rank must enter the same collectives whatever it found locally; use kvctl.connector's "
        "agreed-prefix load protocol, where local failures only shorten the agreed prefix. Dump the peer "
        "named in the evidence to see why it skipped the collective."
    ),
    "server-not-answering": (
        "The client reads replies correctly (it parses up to CRLF and registers before it submits); the server it "
        "talks to has stopped answering. Check that Valkey instance (`kvctl deploy-valkey status`, `kvctl diagnose "
        "--valkey ...`): stopped (SIGSTOP), swapping, or its main thread blocked by a slow command. Give the client a "
        "socket timeout (redis-py `socket_timeout=`) so a hung server costs one timeout instead of a stalled engine, "
        "and load asynchronously (`kvctl loading async`)."
    ),
    "collective-wait": (
        "Pass every rank's pid (--pid per rank, or --match) to see which peer is elsewhere; a rank that "
        "skips a collective stalls all others (use kvctl.connector's agreed-prefix load protocol)."
    ),
}


@dataclass(frozen=True)
class StallFinding:
    """One stalled thread and what it means."""

    id: str
    severity: Severity
    pid: int
    process_name: str
    thread_id: int
    os_thread_id: int | None
    thread_name: str
    frames: tuple[str, ...]
    message: str
    evidence: str
    recommendation: str


@dataclass(frozen=True)
class ProcessSummary:
    """One inspected process: how many threads, how many stayed put, or why it could not be read."""

    pid: int
    name: str
    cmdline: str
    threads: int = 0
    stable_threads: int = 0
    error: str | None = None


@dataclass(frozen=True)
class StallReport:
    samples: int
    interval_s: float
    window_s: float
    processes: tuple[ProcessSummary, ...]
    gpu_utilization_pct: tuple[float, ...]
    gpu_names: tuple[str, ...]
    gpu_note: str
    findings: tuple[StallFinding, ...]

    @property
    def worst_severity(self) -> Severity | None:
        return worst_severity(f.severity for f in self.findings)


# ---------------------------------------------------------------------------
# signatures

RECV_FUNCS = {
    "recv", "recv_into", "recvfrom", "recvfrom_into", "recvmsg", "readinto", "read_exactly", "_read_exactly",
    "readexactly", "recv_exactly", "_recv_exactly", "_read_from_socket", "read_response", "readline", "_readline",
    "read", "_read", "read_bytes", "_recv", "read_from_socket",
}
SEND_FUNCS = {"send", "sendall", "sendmsg", "_send", "send_packed_command", "send_command"}
GET_FUNCS = {"get", "mget", "_get", "batched_get", "get_blocking", "batched_get_blocking", "get_non_blocking",
             "async_get", "retrieve", "batched_retrieve", "get_many", "load", "batched_load"}
#: receives under these are queues, pipes, RPC or HTTP, never a KV GET (short py-spy file names)
NOT_KV_READS = (
    "multiprocessing/", "queue.py", "zmq/", "subprocess.py", "requests/", "urllib3/", "http/", "urllib/",
    "httpx/", "httpcore/", "aiohttp/", "huggingface_hub/", "grpc/", "ray/",
)
REMOTE_FILE = re.compile(r"redis|resp|valkey|remote|lmcache", re.I)
COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast", "broadcast_object_list",
    "barrier", "monitored_barrier", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
    "all_to_all_single", "gather", "gather_object", "scatter", "scatter_object_list", "send", "recv", "wait",
}
# a thread waiting for work, not doing any: it cannot complete a future
IDLE_FILES = ("selectors.py", "asyncio/")
#: fraction of a second: a blocked thread wakes at most about once per second (a timeout retry)
MAX_WAKEUPS_PER_S = 1.0


def _is_thread_wait(f: Frame) -> bool:
    return f.filename.endswith("threading.py") and f.function in ("wait", "acquire")


def _future_wait_index(frames: tuple[Frame, ...]) -> int | None:
    """Index of the concurrent.futures ``result``/``wait`` frame a thread is blocked under, if any."""
    for i, f in enumerate(frames[:4]):
        if "concurrent/futures" in f.filename and f.function in ("result", "wait", "exception"):
            if all(_is_thread_wait(g) for g in frames[:i]):
                return i
            return None
    return None


def _in_collective(frames: tuple[Frame, ...]) -> Frame | None:
    """The torch.distributed collective a thread is blocked in (innermost frames only)."""
    for f in frames[:3]:
        if "torch/distributed" in f.filename and f.function in COLLECTIVES:
            return f
        if "torch/distributed" not in f.filename:
            return None
    return None


def _in_remote_get(frames: tuple[Frame, ...]) -> bool:
    """A socket receive innermost, under a GET-like call of a KV client (not a queue, pipe or HTTP read)."""
    if not frames or frames[0].function not in RECV_FUNCS:
        return False
    if any(f.filename.startswith(NOT_KV_READS) or f.filename in NOT_KV_READS for f in frames):
        return False
    for f in frames:
        fn = f.function.lower()
        if fn in GET_FUNCS or fn.startswith("get_") or fn.endswith("_get") or REMOTE_FILE.search(f.filename):
            return True
    return False


def _can_complete(t: ThreadStack) -> bool:
    """Could this thread be producing a result someone waits for (busy, not idle)?"""
    fr = t.frames
    if not fr:
        return False
    if _future_wait_index(fr) is not None:
        return False  # another waiter
    if fr[0].function in RECV_FUNCS or fr[0].function in SEND_FUNCS:
        return True  # socket I/O in flight
    if any("concurrent/futures/thread.py" in f.filename and f.function == "run" for f in fr):
        return True  # an executor work item is running
    if any("asyncio/events.py" in f.filename and f.function == "_run" for f in fr):
        return True  # the event loop is running a callback
    if any(x in fr[0].filename for x in IDLE_FILES) or _is_thread_wait(fr[0]):
        return False  # idle loop in select, or waiting on a lock/event/queue
    return t.active


def _idle_loop_running_until_complete(frames: tuple[Frame, ...]) -> bool:
    """An event loop idle in select, under run_until_complete (asyncio.run): someone awaits a result."""
    return bool(frames) and "selectors.py" in frames[0].filename and any(
        f.function == "run_until_complete" and "asyncio/" in f.filename for f in frames
    )


def _conns_text(socks: ProcSockets | None) -> str:
    if socks is None:
        return "TCP connections unknown (/proc not readable)"
    est = socks.established
    if not est:
        return "no established TCP connection"
    shown = ", ".join(map(str, est[:6])) + (f", … {len(est) - 6} more" if len(est) > 6 else "")
    return f"open TCP connections: {shown}"


def _frames_text(frames: Iterable[Frame], limit: int = 12) -> tuple[str, ...]:
    fr = list(frames)
    out = [str(f) for f in fr[:limit]]
    if len(fr) > limit:
        out.append(f"... {len(fr) - limit} more")
    return tuple(out)


def _where(threads: list[ThreadStack]) -> str:
    """Where a peer process is: its main thread's innermost frames."""
    main = next((t for t in threads if t.thread_name == "MainThread" and t.frames), None)
    main = main or next((t for t in threads if t.frames), None)
    if main is None:
        return "no Python frames"
    return f"{main.label} in " + " ← ".join(f.name for f in main.frames[:3])


def _gpu_text(utils: tuple[float, ...], note: str) -> str:
    if not utils:
        return note or "no GPU visible"
    shown = ", ".join(f"{u:g}%" for u in utils)
    if max(utils) < GPU_IDLE_PCT:  # the busiest GPU runs no kernel: idle, not just "not compute-bound" (diagnose's 30 %)
        return f"GPUs idle, all below {GPU_IDLE_PCT:g}% ({shown})"
    return f"GPUs busy ({shown})"


def classify(
    s: StackSamples,
    gpu_utils: tuple[float, ...] = (),
    gpu_note: str = "no GPU visible",
) -> list[StallFinding]:
    """Findings from sampled stacks: the three §5.4 stall signatures."""
    findings: list[StallFinding] = []
    gpu = _gpu_text(gpu_utils, gpu_note)
    window = max(s.window_s, 1e-9)
    max_wake = 1 + int(MAX_WAKEUPS_PER_S * window)
    last = {pid: rounds[-1] for pid, rounds in s.rounds.items() if rounds}
    collective_of: dict[int, set[str]] = {
        pid: {c.function for t in ts if (c := _in_collective(t.frames))} for pid, ts in last.items()
    }
    for pid in s.rounds:
        if pid in s.errors:
            continue  # exited or unreadable mid-way: not a stall
        info = s.processes[pid]
        for st in stable_threads(s, pid):
            if st.wakeups is not None and st.wakeups > max_wake:
                continue  # it keeps waking up: slow, not stuck
            t = st.stack
            woke = "no wakeups" if st.wakeups == 0 else "unknown wakeups" if st.wakeups is None else f"{st.wakeups} wakeup(s)"
            held = f"same frames in {len(s.rounds[pid])} samples over {s.window_s:.1f}s, {woke}"

            def add(fid: str, sev: Severity, message: str, evidence: str) -> None:
                findings.append(
                    StallFinding(
                        id=fid, severity=sev, pid=pid, process_name=info.name, thread_id=t.thread_id,
                        os_thread_id=t.os_thread_id, thread_name=t.label, frames=_frames_text(t.frames),
                        message=message, evidence=f"{evidence}; {held}; {gpu}", recommendation=RECOMMENDATIONS[fid],
                    )
                )

            client = C.identify(t.frames)
            socks = s.sockets.get(pid)
            conns = _conns_text(socks)
            if _in_remote_get(t.frames):
                if client is not None and client.reads_to_crlf:
                    add(
                        "server-not-answering", Severity.CRITICAL,
                        f"{t.label} has waited the whole window for a reply in {client.name}: the server is not answering",
                        f"innermost {t.frames[0]}; {client.name} parses replies up to CRLF, so not a missing-key hang; {conns}",
                    )
                else:
                    who = f" ({client.name})" if client else ""
                    add(
                        "missing-key-get", Severity.CRITICAL,
                        f"{t.label} is blocked in a socket receive inside a remote GET{who}",
                        f"innermost {t.frames[0]}; {conns}",
                    )
                continue
            coll = _in_collective(t.frames)
            if coll is not None:
                peers = [p for p in last if p != pid]
                elsewhere = [p for p in peers if not collective_of.get(p)]
                other = [p for p in peers if collective_of.get(p) and coll.function not in collective_of[p]]
                if elsewhere or other:
                    desc = "; ".join(
                        [f"peer pid {p} ({s.processes[p].name}) is elsewhere: {_where(last[p])}" for p in elsewhere]
                        + [f"peer pid {p} ({s.processes[p].name}) waits in {', '.join(sorted(collective_of[p]))}" for p in other]
                    )
                    add("lockstep-stall", Severity.CRITICAL, f"{t.label} waits in {coll.function} that a peer never entered", desc)
                else:
                    why = (
                        "no peer process inspected"
                        if not peers
                        else f"all {len(peers) + 1} inspected processes wait in {coll.function}; a rank not inspected may be elsewhere"
                    )
                    add("collective-wait", Severity.WARNING, f"{t.label} has waited in {coll.function} for the whole window", why)
                continue
            if _future_wait_index(t.frames) is not None:
                busy = [o for o in last.get(pid, []) if o.thread_id != t.thread_id and _can_complete(o)]
                if busy:
                    continue  # something is still working: a slow request, not a lost completion
                loops = [o.label for o in last.get(pid, []) if o.frames and any(x in o.frames[0].filename for x in IDLE_FILES)]
                idle = f"event-loop thread(s) {', '.join(loops)} idle in select" if loops else "no event-loop thread running"
                waiting_on = socks.loop_waits_on if socks else []
                if loops and waiting_on and (client is None or client.completion_safe):
                    who = client.name if client else "an asyncio client"
                    add(
                        "server-not-answering", Severity.CRITICAL,
                        f"{t.label} waits on a future its event loop completes when the server replies; the reply never came",
                        f"{idle}, its epoll waiting to read TCP {', '.join(map(str, waiting_on))} ({who}); {conns}",
                    )
                    continue
                lm = ""
                if client is C.LMCACHE_NATIVE:
                    lm = (f"; in {client.name}: a completion lost between submit and register (bug 1)"
                          + (", or its C++ worker stuck reading a missing key's `$-1` (bug 2)" if any("get" in f.function for f in t.frames) else ""))
                add(
                    "lost-completion", Severity.CRITICAL,
                    f"{t.label} is blocked in a future's result() with nothing outstanding",
                    f"{idle}; no executor work item, socket I/O or loop callback in flight in {len(last.get(pid, []))} threads{lm}",
                )
                continue
            if _idle_loop_running_until_complete(t.frames) and socks and socks.loop_waits_on and not socks.loop_listens:
                add(
                    "server-not-answering", Severity.WARNING,
                    f"{t.label} runs a coroutine to completion and its event loop has waited the whole window on TCP only",
                    f"epoll waiting to read TCP {', '.join(map(str, socks.loop_waits_on))} and no listening socket: a request "
                    f"(e.g. redis.asyncio) whose server does not answer; py-spy cannot show suspended coroutines",
                )
    return findings


def diagnose_stalls(
    pids: Sequence[int],
    samples: int = 3,
    interval_s: float = 1.0,
    dump: Callable[[int], list[ThreadStack]] = dump_threads,
    gpu: Callable[[], tuple[tuple[float, ...], tuple[str, ...], str]] = gpu_state,
) -> StallReport:
    """Sample ``pids`` and classify their stalled threads."""
    s = sample_stacks(pids, samples=samples, interval_s=interval_s, dump=dump)
    utils, names, note = gpu()
    findings = classify(s, utils, note)
    procs = []
    for pid, info in s.processes.items():
        rounds = s.rounds.get(pid) or []
        err = s.errors.get(pid)
        procs.append(
            ProcessSummary(
                pid=pid, name=info.name, cmdline=info.cmdline[:200],
                threads=len(rounds[-1]) if rounds else 0,
                stable_threads=len(stable_threads(s, pid)) if err is None else 0,
                error=str(err) if err else None,
            )
        )
    return StallReport(
        samples=samples, interval_s=interval_s, window_s=round(s.window_s, 3), processes=tuple(procs),
        gpu_utilization_pct=utils, gpu_names=names, gpu_note=note, findings=tuple(findings),
    )
