"""Server-side counters of a bench run: INFO commandstats + stats deltas (:class:`kvctl.tier.admin.Admin`: one
deadline for each read of an instance, every reply typed).

A snapshot before the start signal and one after the last client reports give,
per instance: GET (or SET) calls, the usec Valkey's main thread spent in them,
usec per call, output/input bytes — hence server-side bandwidth and the main
thread's busy fraction for GETs (paper §5.2: 73–74 % at one instance).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

from kvctl.tier.admin import Admin, BadReply, NoPermission
from kvctl.tier.replies import whole_number


@dataclass(frozen=True)
class ServerSnapshot:
    t_s: float  # time.monotonic() when the reply arrived
    get_calls: int
    get_usec: int
    set_calls: int
    set_usec: int
    net_output_bytes: int
    net_input_bytes: int


@dataclass(frozen=True)
class ServerDelta:
    """Counters between two snapshots of one instance, for one command."""

    window_s: float
    calls: int
    usec: int
    net_bytes: int  # output bytes for GET runs, input bytes for SET runs

    @property
    def usec_per_call(self) -> float | None:
        return self.usec / self.calls if self.calls else None

    @property
    def busy_frac(self) -> float:
        return self.usec / (self.window_s * 1e6) if self.window_s > 0 else 0.0

    @property
    def gbps(self) -> float:
        return self.net_bytes / self.window_s / 1e9 if self.window_s > 0 else 0.0


@dataclass(frozen=True)
class ServerInfo:
    """Static facts about one instance, read once before a bench."""

    version: str
    maxmemory_bytes: int
    used_memory_bytes: int
    total_system_memory_bytes: int
    io_threads: int | None = None  # main thread included; None when CONFIG is not allowed (an ACL user)


#: io-threads a Valkey accepts (it counts the main thread)
MAX_IO_THREADS = 256


def server_info(url: str, timeout_s: float) -> ServerInfo:
    """Version, io-threads and memory limits (INFO server + memory, CONFIG GET io-threads), all within one deadline of
    ``timeout_s``; raises :class:`~kvctl.tier.replies.InstanceFailure` (unreachable, timed out, an odd INFO)."""
    with Admin(url, timeout_s) as r:
        info = r.info("server")
        mem = r.info("memory")
        try:
            io_threads = whole_number(r.config_get("io-threads").get("io-threads"), 1, MAX_IO_THREADS)
        except (NoPermission, BadReply):  # CONFIG refused to an ACL user, or an odd reply: the number is unknown
            io_threads = None
    version = str(info.get("valkey_version") or info.get("redis_version") or "?")
    return ServerInfo(
        version=version,
        maxmemory_bytes=int(mem.get("maxmemory", 0)),
        used_memory_bytes=int(mem.get("used_memory", 0)),
        total_system_memory_bytes=int(mem.get("total_system_memory", 0)),
        io_threads=io_threads,
    )


def tier_chunk_bytes(urls: Sequence[str], timeout_s: float) -> int | None:
    """The chunk size the tier's engines stored: the largest of a few random keys per instance (kvctl's own
    ``kvctl-bench:`` keys left out, as ``kvctl doctor`` samples them), every instance within one deadline of
    ``timeout_s``; None on an empty tier (or one whose first instances took the whole deadline)."""
    from kvctl.tier.checks import largest_sampled_value  # noqa: PLC0415

    found = []
    end = time.monotonic() + timeout_s  # one deadline for the whole tier
    for url in urls:
        left = end - time.monotonic()
        if left <= 0:
            break
        with Admin(url, left) as r:
            n = largest_sampled_value(r, skip_prefix=BENCH_KEY_PREFIX)
        if n:
            found.append(n)
    return max(found) if found else None


#: every bench key starts so (kvctl.bench.runner names them ``kvctl-bench:RUN:N``)
BENCH_KEY_PREFIX = b"kvctl-bench:"


def snapshot(url: str, timeout_s: float) -> ServerSnapshot:
    """One INFO stats + commandstats read, within one deadline of ``timeout_s``; raises
    :class:`~kvctl.tier.replies.InstanceFailure`."""
    with Admin(url, timeout_s) as r:
        info = r.info("stats")
        cmd = r.info("commandstats")
    t = time.monotonic()
    get = cmd.get("cmdstat_get", {})
    set_ = cmd.get("cmdstat_set", {})
    return ServerSnapshot(
        t_s=t,
        get_calls=int(get.get("calls", 0)),
        get_usec=int(get.get("usec", 0)),
        set_calls=int(set_.get("calls", 0)),
        set_usec=int(set_.get("usec", 0)),
        net_output_bytes=int(info.get("total_net_output_bytes", 0)),
        net_input_bytes=int(info.get("total_net_input_bytes", 0)),
    )


def snapshot_all(urls: Sequence[str], timeout_s: float) -> list[ServerSnapshot | str]:
    """Snapshots of every instance in parallel: a stalled one costs ``timeout_s`` once, not per instance.

    Each entry is a snapshot or the error message for that instance.
    """

    def one(url: str) -> ServerSnapshot | str:
        try:
            return snapshot(url, timeout_s)
        except Exception as exc:  # noqa: BLE001 - InstanceFailure, and whatever else: the run's report says it
            return f"INFO failed: {type(exc).__name__}: {exc}"

    if not urls:
        return []
    with ThreadPoolExecutor(max_workers=len(urls)) as pool:
        return list(pool.map(one, urls))


def delta(before: ServerSnapshot, after: ServerSnapshot, op: str = "get") -> ServerDelta:
    """Counters of ``op`` between two snapshots of the same instance."""
    if op == "get":
        calls, usec = after.get_calls - before.get_calls, after.get_usec - before.get_usec
        net = after.net_output_bytes - before.net_output_bytes
    else:
        calls, usec = after.set_calls - before.set_calls, after.set_usec - before.set_usec
        net = after.net_input_bytes - before.net_input_bytes
    return ServerDelta(window_s=after.t_s - before.t_s, calls=calls, usec=usec, net_bytes=net)
