"""``kvctl deploy-valkey status``: INFO of every instance of a tier, in parallel, and what to do about one that does not answer.

A tier directory's instances (:func:`status`) are told apart by their process: down, or alive but
silent (stopped, hung); instances named by URL (:func:`targets_status`) only by their answer.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from kvctl.connector.urls import redacted_repr
from kvctl.core.files import read_password_file
from kvctl.core.thresholds import CHECK_TIMEOUT_S
from kvctl.tier.local import is_our_server
from kvctl.tier.admin import PASSWORD_HINT, Admin, InstanceFailure, LoginRefused, TimedOut
from kvctl.tier.replies import BadReply
from kvctl.tier.server import local_url
from kvctl.tier.targets import InstanceState, Target, instance_name, load_tier

#: ``deploy-valkey status`` has no --timeout: one INFO per instance, in parallel; a healthy instance answers in
#: milliseconds, and a stopped (SIGSTOP), hung or dripping one costs these seconds in all (one deadline for the
#: connect and the whole reply), not hang the status.
STATUS_TIMEOUT_S = CHECK_TIMEOUT_S


@dataclass(frozen=True)
class InstanceStatus:
    __repr__ = redacted_repr  # URLs shown with their passwords masked (issue 44)
    rank: int
    host: str
    port: int
    pid: int
    url: str
    up: bool
    state: str = "up"  # up | alive, not answering (state T) | auth refused | down
    hint: str | None = None
    used_memory: int | None = None
    maxmemory: int | None = None
    keys: int | None = None
    evicted_keys: int | None = None
    connected_clients: int | None = None  # other clients: this status read's own connection not counted
    get_calls: int | None = None
    get_usec_per_call: float | None = None  # None before the first GET (not 0 µs)
    error: str | None = None
    instance: int = 0  # which of its rank's instances
    name: str = ""  # "rank 2", or "rank 2 instance 1" when ranks have several instances


@dataclass(frozen=True)
class TierStatus:
    dir: str
    instances: list[InstanceStatus] = field(default_factory=list)
    instances_per_rank: int = 1


def instance_status(inst: InstanceState, password: str | None, instances_per_rank: int = 1) -> InstanceStatus:
    """INFO of one instance: memory, keys, evictions, clients, GET commandstats.

    ``inst.pid`` 0: an instance named by URL (``status --valkey``), with no
    process of a tier to look at; it is reached through its URL (TLS, user).
    One deadline (:data:`STATUS_TIMEOUT_S`) for the connect and the whole reply; a
    reply that is not Valkey's INFO (:mod:`kvctl.tier.replies`) is an error of this instance.
    """
    base = dict(rank=inst.rank, host=inst.host, port=inst.port, pid=inst.pid, url=inst.url, instance=inst.instance,
                name=instance_name(inst.rank, inst.instance, instances_per_rank))
    by_url = inst.pid <= 0
    try:
        with Admin(inst.url if by_url else local_url(inst.host, inst.port), STATUS_TIMEOUT_S, password) as a:
            info = a.info("all")
    except InstanceFailure as e:
        error = e.reason.splitlines()[0] if e.reason else type(e).__name__
        if isinstance(e, LoginRefused):
            why = "no password given" if password is None else "the password was refused"
            return InstanceStatus(**base, up=False, state="auth refused", hint=f"{why}: {PASSWORD_HINT}", error=error)
        if isinstance(e, BadReply):  # something answers there, not as Valkey does
            return InstanceStatus(**base, up=False, state="bad reply", error=error,
                                  hint=f"{error}: is this port a Valkey of the tier (not another server, or a proxy that mangles replies)?")
        silent = isinstance(e, TimedOut)
        proc = None if by_url else is_our_server(inst)
        if proc is None and (by_url or silent):
            return InstanceStatus(
                **base, up=False, state="not answering" if silent else "down", error=error,
                hint=(f"{error}: it accepts connections but does not answer in full (stopped, hung, or dripping its reply)? "
                      "`kvctl diagnose stalls --pid PID` on its host"
                      if silent else "nothing answers there: is the server running, and reachable from this host?"),
            )
        if proc is None:
            return InstanceStatus(**base, up=False, state="down", hint="no process: restart the tier (`kvctl deploy-valkey down`, then `up`)", error=error)
        letter = _state_letter(proc)
        return InstanceStatus(
            **base,
            up=False,
            state=f"alive, not answering (state {letter})",
            hint=f"pid {inst.pid} is {'stopped (SIGSTOP/ptrace)' if letter == 'T' else 'alive but silent'}: "
            f"look at it with `kvctl diagnose stalls --pid {inst.pid}`, or restart it (down, then up)",
            error=error,
        )
    keyspace = info.get("db0") or {}
    get_stats = info.get("cmdstat_get") or {}
    return InstanceStatus(
        **base,
        up=True,
        used_memory=int(info.get("used_memory", 0)),
        maxmemory=int(info.get("maxmemory", 0)),
        keys=int(keyspace.get("keys", 0)) if isinstance(keyspace, dict) else 0,
        evicted_keys=int(info.get("evicted_keys", 0)),
        connected_clients=max(0, int(info.get("connected_clients", 0)) - 1),  # less the connection reading this INFO
        get_calls=int(get_stats.get("calls", 0)),
        get_usec_per_call=float(get_stats.get("usec_per_call", 0)) if get_stats.get("calls") else None,
    )


def _state_letter(proc: psutil.Process) -> str:
    """The kernel's one-letter process state (R, S, D, T, t, Z, ...) from /proc, '?' when unreadable."""
    try:
        return Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return {psutil.STATUS_STOPPED: "T", psutil.STATUS_TRACING_STOP: "t", psutil.STATUS_RUNNING: "R"}.get(proc.status(), "?")


def status(tier_dir: Path | str, password_file: str | None = None) -> TierStatus:
    """INFO of every instance, in parallel: stalled instances cost one timeout together, not one each."""
    state = load_tier(tier_dir)
    pw_file = password_file or state.password_file
    password = read_password_file(pw_file) if pw_file else None
    insts = state.in_tier_order()
    k = state.instances_per_rank
    with ThreadPoolExecutor(max_workers=max(1, len(insts))) as pool:
        return TierStatus(state.dir, list(pool.map(lambda i: instance_status(i, password, k), insts)), k)


def targets_status(targets: list[Target]) -> TierStatus:
    """:func:`status` of instances named by URL rather than a tier directory (``dir`` is empty)."""
    k = targets[0].instances_per_rank if targets else 1
    insts = [(InstanceState(t.rank, t.host, t.port, 0, t.url, "", "", "", instance=t.instance), t.password) for t in targets]
    with ThreadPoolExecutor(max_workers=max(1, len(insts))) as pool:
        return TierStatus("", list(pool.map(lambda ip: instance_status(*ip, k), insts)), k)
