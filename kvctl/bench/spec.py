"""One bench's workload (:class:`BenchSpec`), the runs it makes (:func:`grid`), and what it needs.

Keys and memory: how many keys each instance can hold (:func:`auto_keys`, from its INFO), whether
this host can run the clients honestly (:func:`check_host`), and the maxmemory an ``--embedded``
tier gets (:func:`size_embedded`). Pure: no sockets, no processes (those are :mod:`kvctl.bench.runner`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvctl.bench.info import ServerInfo
from kvctl.core.errors import InvalidInput
from kvctl.core.thresholds import BENCH_TIMEOUT_S

#: Keys per instance aim at this many bytes (beyond any CPU cache), within maxmemory.
AUTO_WORKING_SET_BYTES = 1_000_000_000
#: Fraction of (maxmemory − used) the keys may fill; the rest is room for in-flight buffers.
MAXMEMORY_FILL = 0.8
#: Client processes beyond this many per core measure the host's scheduler, not the tier.
MAX_CLIENTS_PER_CORE = 16
#: ... but a small host may still run this many.
MIN_CLIENT_CAP = 64
#: Share of the host's available memory an --embedded tier plus the clients' buffers may take.
EMBEDDED_HOST_FRACTION = 0.5
#: An empty valkey-server with its client, INFO and replication buffers, per instance.
EMBEDDED_BASE_BYTES = 16 * 2**20
#: Per-key overhead Valkey adds to a value (dict entry, key, robj): a generous bound.
KEY_OVERHEAD_BYTES = 64


@dataclass(frozen=True)
class BenchSpec:
    """Workload parameters shared by every run of one bench."""

    chunk_bytes: int
    batch: int = 8
    clients: int = 1  # per instance (the largest client count in a sweep)
    duration_s: float = 10.0
    keys: int | None = None  # per instance; None = automatic within maxmemory
    write: bool = False
    sweep: bool = False
    timeout_s: float = BENCH_TIMEOUT_S
    seed: int = 0
    engines: int = 0  # bench --engines E: runs of 1, 2, 4 … E engines, each one client per instance in lockstep
    fit_batch: bool = False  # --batch not given: a tier too small for batches of ``batch`` gets the largest that fits

    def check(self) -> None:
        if not all(math.isfinite(x) for x in (self.chunk_bytes, self.duration_s, self.timeout_s)):
            raise InvalidInput("--chunk-bytes, --duration and --timeout must be finite numbers")
        if self.chunk_bytes < 1:
            raise InvalidInput(f"--chunk-bytes must be ≥ 1, got {self.chunk_bytes}")
        if self.batch < 1 or self.clients < 1:
            raise InvalidInput("--batch and --clients must be ≥ 1")
        if not self.duration_s > 0 or not self.timeout_s > 0:
            raise InvalidInput("--duration and --timeout must be > 0")
        if self.keys is not None and self.keys < self.batch:
            raise InvalidInput(f"--keys {self.keys} is fewer than one batch (--batch {self.batch})")


def grid(instances: int, spec: BenchSpec) -> list[tuple[int, int]]:
    """(instances, clients per instance) of every run.

    Plain: all instances with ``spec.clients`` each. Sweep (paper Fig. 3): one
    instance with 1, 2, 4, … up to ``spec.clients`` clients, then 2, 4, … up to
    all instances with one client each. Engines: all instances with 1, 2, 4, … up
    to ``spec.engines`` clients each, client j of every instance being engine j's rank.
    """
    def steps(top: int) -> list[int]:
        out, k = [], 1
        while k < top:
            out.append(k)
            k *= 2
        return out + [top]

    if spec.engines:  # contention curve: every instance, one client per engine
        return [(instances, e) for e in steps(spec.engines)]
    if not spec.sweep:
        return [(instances, spec.clients)]

    return [(1, c) for c in steps(spec.clients)] + [(w, 1) for w in steps(instances) if w > 1]


def clients_option(spec: BenchSpec) -> str:
    """The option that sets the clients per instance, for advice: ``--engines`` for an --engines bench (it
    refuses ``--clients``), else ``--clients``."""
    return "--engines" if spec.engines else "--clients"


def auto_keys(info: ServerInfo, spec: BenchSpec) -> int:
    """Distinct keys per instance: about 1 GB of values, at least 4 batches per client, within maxmemory."""
    want = max(4 * spec.batch * spec.clients, math.ceil(AUTO_WORKING_SET_BYTES / spec.chunk_bytes))
    limit = info.maxmemory_bytes or (info.total_system_memory_bytes // 4)
    if not limit:
        return want
    inflight = 2 * spec.clients * spec.batch * spec.chunk_bytes
    room = MAXMEMORY_FILL * (limit - info.used_memory_bytes) - inflight
    fit = int(room // (spec.chunk_bytes + KEY_OVERHEAD_BYTES))
    if fit < spec.batch:
        raise InvalidInput(
            f"maxmemory {limit / 1e6:.0f} MB leaves room for {max(fit, 0)} values of {spec.chunk_bytes / 1e6:g} MB, "
            f"fewer than one batch of {spec.batch}: of the {(limit - info.used_memory_bytes) / 1e6:.0f} MB free "
            f"({info.used_memory_bytes / 1e6:.0f} MB already used), the keys may fill {MAXMEMORY_FILL:.0%} and "
            f"{inflight / 1e6:.0f} MB is reserved for the replies in flight (2 × {spec.clients} client(s) × {spec.batch} "
            f"× {spec.chunk_bytes / 1e6:g} MB): raise maxmemory or lower --batch/--chunk-bytes/{clients_option(spec)}"
        )
    return min(want, fit)


def batch_that_fits(info: ServerInfo, spec: BenchSpec) -> int:
    """The largest batch (at most ``spec.batch``) whose keys and replies in flight fit the instance as
    :func:`auto_keys` counts them: at least one batch of keys, and 2 × clients × batch values being sent."""
    limit = info.maxmemory_bytes or (info.total_system_memory_bytes // 4)
    if not limit:
        return spec.batch
    free = MAXMEMORY_FILL * (limit - info.used_memory_bytes)
    return max(1, min(spec.batch, int(free // (spec.chunk_bytes + KEY_OVERHEAD_BYTES + 2 * spec.clients * spec.chunk_bytes))))


def _peak_clients(instances: int, spec: BenchSpec) -> tuple[int, int]:
    """(most clients on one instance, most client processes at once) over the grid."""
    pts = grid(instances, spec)
    return max(c for _, c in pts), max(i * c for i, c in pts)


def check_host(instances: int, spec: BenchSpec, cores: int, available_bytes: int) -> list[str]:
    """Refuse a bench this host cannot run honestly; warnings for one it runs with caveats.

    Every client process holds ``batch`` buffers of ``chunk_bytes``. More
    processes than cores still run (each waits on its socket most of the
    time) but are reported; past :data:`MAX_CLIENTS_PER_CORE` per core the
    bench would measure the host's scheduler, so it is refused.
    """
    _, procs = _peak_clients(instances, spec)
    cap = max(MIN_CLIENT_CAP, MAX_CLIENTS_PER_CORE * cores)
    if procs > cap:
        raise InvalidInput(
            f"{procs} client processes on {cores} core(s): the bench would measure this host's scheduler, not the tier; "
            f"at most {cap} here ({MAX_CLIENTS_PER_CORE} per core): lower {clients_option(spec)} or run from a larger host"
        )
    buffers = procs * spec.batch * spec.chunk_bytes
    if available_bytes and buffers > EMBEDDED_HOST_FRACTION * available_bytes:
        raise InvalidInput(
            f"{procs} clients × --batch {spec.batch} × {spec.chunk_bytes / 1e6:g} MB buffers need {buffers / 1e9:.1f} GB, "
            f"more than half of the {available_bytes / 1e9:.1f} GB this host has available: lower {clients_option(spec)}, --batch or --chunk-bytes"
        )
    if procs > cores:
        return [f"{procs} client processes on {cores} core(s): clients share cores, so the bench may report this host's limit rather than the tier's"]
    return []


@dataclass(frozen=True)
class EmbeddedSizing:
    """What ``--embedded`` instances get when no --embedded-maxmemory is given."""

    maxmemory_bytes: int  # per instance
    keys: int  # per instance
    footprint_bytes: int  # peak host memory: every instance's values + the busiest run's buffers


def size_embedded(instances: int, spec: BenchSpec, available_bytes: int) -> EmbeddedSizing:
    """maxmemory for ``instances`` × clients × batch × chunk, within :data:`EMBEDDED_HOST_FRACTION` of the host.

    Keys: the usual ~1 GB working set (and ≥ 4 batches per client), fewer when
    every instance's copy would not fit, never fewer than one batch. maxmemory:
    room for the keys plus the output buffers of the instance with the most
    clients (2 × clients × batch × chunk), over :data:`MAXMEMORY_FILL`.
    """
    chunk = spec.chunk_bytes + KEY_OVERHEAD_BYTES
    clients_one, procs = _peak_clients(instances, spec)
    inflight_one = 2 * clients_one * spec.batch * spec.chunk_bytes
    peak_buffers = max(
        i * 2 * c * spec.batch * spec.chunk_bytes + i * c * spec.batch * spec.chunk_bytes for i, c in grid(instances, spec)
    )  # server output buffers + the clients' own buffers, for the busiest run
    budget = EMBEDDED_HOST_FRACTION * available_bytes
    fit = int((budget - peak_buffers - instances * EMBEDDED_BASE_BYTES) // (instances * chunk))
    want = spec.keys or max(4 * spec.batch * clients_one, math.ceil(AUTO_WORKING_SET_BYTES / spec.chunk_bytes))
    keys = want if spec.keys else min(want, fit)
    if fit < max(keys, spec.batch):
        need = instances * (max(keys, spec.batch) * chunk + EMBEDDED_BASE_BYTES) + peak_buffers
        raise InvalidInput(
            f"--embedded {instances} with {clients_one} client(s) × --batch {spec.batch} × {spec.chunk_bytes / 1e6:g} MB values "
            f"needs {need / 1e9:.1f} GB, more than half of the {available_bytes / 1e9:.1f} GB this host has available: "
            f"lower --embedded, {clients_option(spec)}, --batch, --chunk-bytes or --keys"
        )
    maxmemory = math.ceil((keys * chunk + inflight_one) / MAXMEMORY_FILL) + EMBEDDED_BASE_BYTES
    footprint = instances * (keys * chunk + EMBEDDED_BASE_BYTES) + peak_buffers
    return EmbeddedSizing(maxmemory_bytes=maxmemory, keys=keys, footprint_bytes=footprint)
