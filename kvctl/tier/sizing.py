"""What one Valkey instance needs for multi-MB values: its io-threads, the zero-copy reply, the connections to it,
and what it should deliver (issue 45). Pure: the host's cores are the only thing read.

* :func:`io_threads_for`: the io-threads ``deploy-valkey up`` chooses from a host's cores and the instances it
  puts there (:data:`~kvctl.core.thresholds.IO_THREADS_CORE_SHARE`, :data:`~kvctl.core.thresholds.IO_THREADS_MAX`);
* :func:`zero_copy_settings`: Valkey 9.x's ``min-io-threads-avoid-copy-reply`` at the instance's io-threads.
  Valkey 9.0 added reply copy avoidance (valkey-io/valkey PR 2078; ``isCopyAvoidPreferred()`` in
  ``src/networking.c``): a reply of a stored string is written from the value itself instead of being copied into
  the client's reply buffer by the main thread. Its hidden configs (``CONFIG GET`` shows them on 9.1.2):
  ``min-io-threads-avoid-copy-reply`` (default 7: with at least that many io-threads every string reply avoids the
  copy), else a size gate: ``min-string-size-avoid-copy-reply`` (16384, single-threaded) and
  ``min-string-size-avoid-copy-reply-threaded`` (65536, with io-threads). kvctl writes the first at the
  io-threads it chose, so the copy-free path is on at those threads whatever the value size. Valkey 8.x refuses
  the directive as unknown (the server does not start), so it is never written for 8.x;
* :func:`connections_for`: the engine's connections per instance, one per I/O thread;
* :func:`expected_gbps` and :func:`first_step`: what an instance of a version and io-threads gives
  (:data:`~kvctl.core.thresholds.INSTANCE_GBPS_BY_SERVER`), and the change to make before adding instances.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

from kvctl.core.thresholds import (
    CONNECTIONS_PER_INSTANCE_MAX,
    CONNECTIONS_PER_INSTANCE_MIN,
    FLEET_HOST_CORES,
    INSTANCE_GBPS_BY_SERVER,
    IO_THREADS_CORE_SHARE,
    IO_THREADS_MAX,
    RECOMMENDED_VALKEY,
    UPGRADE_GAIN_MIN,
)

#: Valkey 9.x's directive (hidden config) that turns the copy-free reply on at this many io-threads and above
AVOID_COPY_DIRECTIVE = "min-io-threads-avoid-copy-reply"
#: the first major version that knows it
ZERO_COPY_MAJOR = 9
Version = tuple[int, int, int]


def host_cores() -> int:
    """Cores this process may run on (the affinity mask, as containers and taskset limit it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def io_threads_for(cores: int | None = None, instances: int = 1) -> int:
    """io-threads per instance (main thread included) when ``instances`` instances share a host of ``cores`` cores
    (None: this host's): clamp(floor(IO_THREADS_CORE_SHARE × cores / instances), 1, IO_THREADS_MAX)."""
    cores = host_cores() if cores is None else cores
    return max(1, min(IO_THREADS_MAX, math.floor(IO_THREADS_CORE_SHARE * cores / max(1, instances))))


_VERSION = re.compile(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?")


def parse_version(value: object) -> Version | None:
    """(major, minor, patch) of ``9.1.2``, ``8.1``, a tuple, or an image tag such as ``valkey/valkey:9.1-alpine``;
    None when it names no version (``latest``, ``?``, empty)."""
    if isinstance(value, tuple):
        return (tuple(int(x) for x in value) + (0, 0, 0))[:3] if value else None  # type: ignore[return-value]
    text = str(value or "")
    if "@" in text:  # pinned by digest: no version to read
        return None
    if "/" in text or ":" in text:  # an image reference: its tag
        text = text.rsplit(":", 1)[-1] if ":" in text.rsplit("/", 1)[-1] else ""
    m = _VERSION.match(text.strip())
    return (int(m.group(1)), int(m.group(2) or 0), int(m.group(3) or 0)) if m else None


def io_threads_from_info(info: dict) -> int | None:
    """An instance's io-threads from its ``INFO`` (no CONFIG needed): Valkey 9.x lists one ``used_active_time_io_thread_N``
    per I/O thread besides the main thread's ``used_active_time_main_thread``; None when INFO does not say (8.x)."""
    if "used_active_time_main_thread" not in info:
        return None
    return 1 + sum(1 for k in info if k.startswith("used_active_time_io_thread_"))


def zero_copy_settings(version: object, io_threads: int) -> dict[str, object]:
    """The directive that puts Valkey 9.x's copy-free reply on at ``io_threads`` (from 2 up), or nothing: one
    thread has the size gate only, and 8.x refuses the directive. An unknown ``version`` counts as 8.x."""
    v = parse_version(version)
    if v is None or v[0] < ZERO_COPY_MAJOR or io_threads < 2:
        return {}
    return {AVOID_COPY_DIRECTIVE: io_threads}


#: Valkey 9's copy-avoidance configs and their defaults: hidden (``CONFIG GET *`` and globs do not list them; ``CONFIG GET
#: <name>`` does); 0 turns each test off.
AVOID_COPY_DEFAULTS = {AVOID_COPY_DIRECTIVE: 7, "min-string-size-avoid-copy-reply": 16384, "min-string-size-avoid-copy-reply-threaded": 65536}


def copy_avoided(version: object, io_threads: int | None, value_bytes: int, config: dict[str, str] | None = None) -> bool:
    """Whether a GET reply of a ``value_bytes`` string is written from the value itself (Valkey 9.x's copy avoidance,
    ``isCopyAvoidPreferred()``) rather than copied into the client's reply buffer: at io-threads ≥
    min-io-threads-avoid-copy-reply always, else from min-string-size-avoid-copy-reply bytes (one thread) or
    min-string-size-avoid-copy-reply-threaded (more). ``config``: the instance's values of those configs (their
    defaults where absent). Such a reply holds a reference in the output buffer, not the value's bytes, so
    ``client-output-buffer-limit`` does not count them (measured on 9.1.2: 8 pipelined GETs of 1 MB and 4 MB values
    whole under ``normal 4mb 2mb 10``, where 8.1.8 cuts every batch)."""
    v = parse_version(version)
    if v is None or v[0] < ZERO_COPY_MAJOR:
        return False
    conf = {k: d if (config or {}).get(k) is None else _whole((config or {})[k], d) for k, d in AVOID_COPY_DEFAULTS.items()}
    threads = max(1, io_threads or 1)
    min_threads = conf[AVOID_COPY_DIRECTIVE]
    if min_threads and threads >= min_threads:
        return True
    gate = conf["min-string-size-avoid-copy-reply" if threads == 1 else "min-string-size-avoid-copy-reply-threaded"]
    return bool(gate) and value_bytes >= gate


def _whole(text: str, default: int) -> int:
    text = str(text).strip()
    return int(text) if text.isdigit() else default


def connections_for(io_threads: int | None) -> int:
    """Connections an engine keeps busy per instance: one per I/O thread, within [CONNECTIONS_PER_INSTANCE_MIN,
    CONNECTIONS_PER_INSTANCE_MAX] (None, an unknown io-threads: the minimum)."""
    return max(CONNECTIONS_PER_INSTANCE_MIN, min(CONNECTIONS_PER_INSTANCE_MAX, io_threads or 1))


def expected_gbps(version: object, io_threads: int | None) -> float | None:
    """GB/s one instance of ``version`` with ``io_threads`` gives for multi-MB values, from the measured table (the row of
    its major version, at the largest io-threads measured that is at most its own); None for an unknown version."""
    v = parse_version(version)
    if v is None:
        return None
    major = ZERO_COPY_MAJOR if v[0] >= ZERO_COPY_MAJOR else 8
    row = {t: g for (m, t), g in INSTANCE_GBPS_BY_SERVER.items() if m == major}
    n = max(1, io_threads or 1)
    return row[max(t for t in row if t <= n)]


def recommended_label() -> str:
    return ".".join(map(str, RECOMMENDED_VALKEY))


@dataclass(frozen=True)
class FirstStep:
    """What to change on an instance before adding instances: a server version, io-threads, or both."""

    text: str  # "Valkey 8.1.8: move to 9.1 ..." / "io-threads 1 on a 16-core host: set io-threads 8 ..."
    now_gbps: float  # measured, else what the table gives for the instance as it is
    then_gbps: float  # what the table gives after the change
    version: str  # the instance's
    io_threads: int | None
    target_io_threads: int
    upgrade: bool  # the version is below 9

    def evidence(self) -> dict[str, object]:
        return {"server_version": self.version, "io_threads": self.io_threads, "target_io_threads": self.target_io_threads,
                "now_gbps": round(self.now_gbps, 3), "expected_gbps_after": self.then_gbps, "move_to_9": self.upgrade}


def first_step(version: object, io_threads: int | None, cores: int | None = None, instances_on_host: int = 1,
               measured_gbps: float | None = None) -> FirstStep | None:
    """The change that gives one instance at least UPGRADE_GAIN_MIN × its bandwidth, before any instance is added:
    Valkey 8.x → 9.1 and/or io-threads → what :func:`io_threads_for` chooses on a host of ``cores`` (None: a host of
    FLEET_HOST_CORES, said so) shared by ``instances_on_host``. ``measured_gbps``: the instance's measured GET GB/s
    (else the table's figure for it as it is). None when no change would give that much, or the version is unknown."""
    v = parse_version(version)
    if v is None:
        return None
    threads = io_threads or 1
    host = cores if cores else FLEET_HOST_CORES
    target = max(threads, io_threads_for(host, instances_on_host))
    upgrade = v[0] < ZERO_COPY_MAJOR
    if not upgrade and target <= threads:  # 9.x with the threads its host allows already: nothing to change here
        return None
    now = measured_gbps if measured_gbps and measured_gbps > 0 else expected_gbps(v, threads)
    then = expected_gbps((max(v[0], ZERO_COPY_MAJOR), 0, 0), target)
    if now is None or then is None or then < UPGRADE_GAIN_MIN * now:
        return None
    shown = ".".join(map(str, v))
    on = f"a {host}-core host" + ("" if cores else " (assumed: its cores are not known here)")
    gain = f"~{then / now:.1f}× one instance's GET bandwidth for multi-MB values (~{then:g} GB/s measured on a 16-core host)"
    if upgrade:
        also = f", with io-threads {target}" if target > threads else ""
        text = f"Valkey {shown}: move to {recommended_label()}{also} (zero-copy replies with io-threads: {gain})"
    else:
        text = f"io-threads {threads} on {on}: set io-threads {target} ({gain})"
    return FirstStep(text, now, then, shown, io_threads, target, upgrade)


def up_command(ranks: int | str = "W", instances_per_rank: int | str = "K") -> str:
    """The one form of the command that deploys W ranks × K instances per rank, in every fix kvctl prints (diagnose's
    findings, the runbooks, the drill, doctor): both numbers always given, placeholders ``W`` and ``K`` where unknown."""
    return f"kvctl deploy-valkey up --ranks {ranks} --instances-per-rank {instances_per_rank}"
