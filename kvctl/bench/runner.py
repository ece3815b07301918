"""Run a bench: targets → prepopulated keys → client processes → raw results → RunResult.

Clients are separate processes (forkserver, else spawn) so one Python
interpreter is never the limit. Every wait is bounded: a run ends within
``duration_s + timeout_s`` plus a small grace, whatever the servers do; a
client that does not report by then is killed and counted as an error of its
instance.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import math
import multiprocessing as mp
import os
import platform
import queue
import socket
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence
from urllib.parse import quote, urlsplit, urlunsplit

from kvctl import __version__
from kvctl.bench.info import ServerInfo, delta, server_info, snapshot_all
from kvctl.bench.results import BenchMetadata, BenchReport, RunResult, summarize_run, summarize_verdict, with_scaling
from kvctl.bench.worker import WorkerConfig, WorkerResult, key_names, worker_main
from kvctl.connector.resp import RespClient
from kvctl.connector.urls import parse_resp_url
from kvctl.errors import InvalidInput, KvctlError, Unreachable
from kvctl.tier.targets import Target

#: Seconds the parent waits past ``duration + timeout`` before killing a silent client.
GRACE_S = 1.0
#: INFO snapshots are taken while the servers are idle; a healthy one answers in milliseconds.
SNAPSHOT_TIMEOUT_S = 2.0
#: Keys per instance aim at this many bytes (beyond any CPU cache), within maxmemory.
AUTO_WORKING_SET_BYTES = 1_000_000_000
#: Fraction of (maxmemory − used) the keys may fill; the rest is room for in-flight buffers.
MAXMEMORY_FILL = 0.8

ProgressFn = Callable[[str, float, float, float], None]  # (label, elapsed_s, duration_s, live_gbps)


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
    timeout_s: float = 5.0
    seed: int = 0

    def check(self) -> None:
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
    all instances with one client each.
    """
    if not spec.sweep:
        return [(instances, spec.clients)]

    def steps(top: int) -> list[int]:
        out, k = [], 1
        while k < top:
            out.append(k)
            k *= 2
        return out + [top]

    return [(1, c) for c in steps(spec.clients)] + [(w, 1) for w in steps(instances) if w > 1]


def url_with_password(target: Target) -> str:
    """The target's URL carrying its password (for the client processes; never printed)."""
    if target.password is None or parse_resp_url(target.url).password is not None:
        return target.url
    parts = urlsplit(target.url)
    netloc = f":{quote(target.password, safe='')}@{parts.netloc.rsplit('@', 1)[-1]}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def redacted(target: Target) -> str:
    return parse_resp_url(url_with_password(target)).redacted()


def auto_keys(info: ServerInfo, spec: BenchSpec) -> int:
    """Distinct keys per instance: about 1 GB of values, at least 4 batches per client, within maxmemory."""
    want = max(4 * spec.batch * spec.clients, math.ceil(AUTO_WORKING_SET_BYTES / spec.chunk_bytes))
    limit = info.maxmemory_bytes or (info.total_system_memory_bytes // 4)
    if not limit:
        return want
    inflight = 2 * spec.clients * spec.batch * spec.chunk_bytes
    room = MAXMEMORY_FILL * (limit - info.used_memory_bytes) - inflight
    fit = int(room // (spec.chunk_bytes + 64))
    if fit < spec.batch:
        raise InvalidInput(
            f"maxmemory {limit / 1e6:.0f} MB leaves room for {max(fit, 0)} values of {spec.chunk_bytes / 1e6:g} MB, "
            f"fewer than one batch of {spec.batch}: raise maxmemory or lower --batch/--chunk-bytes/--clients"
        )
    return min(want, fit)


def _mp_context():
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["kvctl.bench.worker"])
        return ctx
    return mp.get_context("spawn")


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Start client processes without re-importing the parent's ``__main__`` in them.

    spawn/forkserver children normally run the parent's main script or module
    again (as ``__mp_main__``); the clients need only :mod:`kvctl.bench.worker`,
    and a main without a file (stdin, an embedding host) would crash them.
    """
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main is not None and k in main.__dict__}
    try:
        if main is not None:
            main.__dict__.pop("__file__", None)
            if "__spec__" in saved:
                main.__spec__ = None
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)


def _parallel(fn, items: Sequence) -> list:
    with ThreadPoolExecutor(max_workers=max(1, len(items))) as pool:
        return list(pool.map(fn, items))


def populate(targets: Sequence[Target], key_prefix: str, n_keys: int, spec: BenchSpec) -> None:
    """SET ``n_keys`` values of ``chunk_bytes`` on every instance (in parallel); Unreachable on failure."""
    value = os.urandom(spec.chunk_bytes)
    keys = key_names(key_prefix, n_keys)

    def one(t: Target) -> str | None:
        try:
            with RespClient(url_with_password(t), timeout_s=max(spec.timeout_s, 10.0), pool_size=1) as c:
                for i in range(0, n_keys, spec.batch):
                    ks = keys[i : i + spec.batch]
                    c.batched_set(ks, [value] * len(ks))
                if not all(c.batched_exists(keys[-spec.batch :])):
                    return f"{redacted(t)}: values were evicted while populating; lower --keys or raise maxmemory"
        except KvctlError as e:
            return f"{redacted(t)}: {e}"
        return None

    problems = [p for p in _parallel(one, list(targets)) if p]
    if problems:
        raise Unreachable("cannot populate bench keys: " + "; ".join(problems))


def cleanup(targets: Sequence[Target], key_prefix: str, n_keys: int, timeout_s: float) -> None:
    """Best-effort DEL of the bench keys (bounded; errors ignored: the run already reported them)."""
    keys = key_names(key_prefix, n_keys)

    def one(t: Target) -> None:
        with contextlib.suppress(Exception):
            with RespClient(url_with_password(t), timeout_s=timeout_s, pool_size=1) as c:
                for i in range(0, n_keys, 512):
                    c.delete(keys[i : i + 512])

    _parallel(one, list(targets))


def run_once(
    targets: Sequence[Target],
    clients: int,
    op: str,
    key_prefix: str,
    n_keys: int,
    spec: BenchSpec,
    on_progress: ProgressFn | None = None,
) -> RunResult:
    """One grid point: ``clients`` processes per target doing ``op`` for ``spec.duration_s``."""
    ctx = _mp_context()
    n_workers = len(targets) * clients
    ready_q, result_q = ctx.Queue(), ctx.Queue()
    start, stop = ctx.Event(), ctx.Event()
    live = ctx.RawArray("d", n_workers)
    urls = [url_with_password(t) for t in targets]
    start_wait_s = 30.0 + spec.timeout_s
    cfgs = [
        WorkerConfig(
            worker_id=i * clients + j,
            instance=i,
            url=urls[i],
            op=op,
            key_prefix=key_prefix,
            n_keys=n_keys,
            chunk_bytes=spec.chunk_bytes,
            batch=spec.batch,
            duration_s=spec.duration_s,
            timeout_s=spec.timeout_s,
            seed=spec.seed * 1_000_003 + i * clients + j,
            start_wait_s=start_wait_s,
        )
        for i in range(len(targets))
        for j in range(clients)
    ]
    procs = [ctx.Process(target=worker_main, args=(c, ready_q, start, stop, result_q, live), daemon=True) for c in cfgs]
    label = f"{op.upper()} {len(targets)} instance(s) × {clients} client(s)"
    results: dict[int, WorkerResult] = {}
    extra: list[list[str]] = [[] for _ in targets]
    try:
        with _main_module_hidden():
            for p in procs:
                p.start()
        # 1. every client connected and warmed up (or failed trying), bounded
        ready_deadline = time.monotonic() + start_wait_s
        announced = 0
        while announced < n_workers and time.monotonic() < ready_deadline:
            with contextlib.suppress(queue.Empty):
                ready_q.get(timeout=0.1)
                announced += 1
            if not any(p.is_alive() for p in procs):
                break
        # 2. server counters, go, wait for the deadline, counters again
        snap_timeout = min(spec.timeout_s, SNAPSHOT_TIMEOUT_S)
        before = snapshot_all(urls, snap_timeout)
        t0 = time.monotonic()
        start.set()
        hard_deadline = t0 + spec.duration_s + spec.timeout_s + GRACE_S
        while len(results) < n_workers:
            now = time.monotonic()
            if now >= t0 + spec.duration_s:
                stop.set()
            if now >= hard_deadline:
                break
            with contextlib.suppress(queue.Empty):
                r = result_q.get(timeout=0.1)
                results[r.worker_id] = r
            if on_progress:
                elapsed = min(time.monotonic() - t0, spec.duration_s)
                on_progress(label, elapsed, spec.duration_s, sum(live) / max(elapsed, 1e-9) / 1e9)
        stop.set()
        after = snapshot_all(urls, snap_timeout)
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=2.0)
    for c in cfgs:
        if c.worker_id not in results:
            extra[c.instance].append(
                f"client {c.worker_id} did not report within duration + timeout ({spec.duration_s:g}+{spec.timeout_s:g}s); killed"
            )
    deltas = [
        b if isinstance(b, str) else a if isinstance(a, str) else delta(b, a, op)
        for b, a in zip(before, after)
    ]
    return summarize_run(
        op,
        [t.rank for t in targets],
        [redacted(t) for t in targets],
        clients,
        spec.chunk_bytes,
        spec.batch,
        list(results.values()),
        deltas,
        extra,
    )


def run_bench(
    targets: Sequence[Target],
    spec: BenchSpec,
    on_progress: ProgressFn | None = None,
    bytes_per_token: float | None = None,
    prefill_rate: float | None = None,
    parameters: dict | None = None,
    keep_keys: bool = False,
) -> BenchReport:
    """Populate keys, run every grid point (SET then GET with ``spec.write``), clean up, summarise."""
    spec.check()
    if not targets:
        raise InvalidInput("no Valkey instances to bench")

    def info(t: Target) -> ServerInfo | str:
        try:
            return server_info(url_with_password(t), spec.timeout_s)
        except Exception as e:  # noqa: BLE001 - redis errors, OSError
            return f"{redacted(t)}: {type(e).__name__}: {e}"

    infos = _parallel(info, list(targets))
    bad = [i for i in infos if isinstance(i, str)]
    if bad:
        raise Unreachable("cannot reach " + "; ".join(bad))
    n_keys = spec.keys or min(auto_keys(i, spec) for i in infos)
    prefix = f"kvctl-bench:{uuid.uuid4().hex[:8]}:"
    populate(targets, prefix, n_keys, spec)
    runs: list[RunResult] = []
    try:
        for instances, clients in grid(len(targets), spec):
            for op in (("set", "get") if spec.write else ("get",)):
                runs.append(run_once(targets[:instances], clients, op, prefix, n_keys, spec, on_progress))
    finally:
        if not keep_keys:  # skip instances that failed: a dead or stalled server would only add timeouts
            failed = {p.rank for r in runs for p in r.per_instance if p.errors}
            cleanup([t for t in targets if t.rank not in failed], prefix, n_keys, spec.timeout_s)
    runs_t = with_scaling(runs)
    params = dict(parameters or {})
    params.update(
        chunk_bytes=spec.chunk_bytes, batch=spec.batch, clients=spec.clients, duration_s=spec.duration_s,
        keys_per_instance=n_keys, write=spec.write, sweep=spec.sweep, timeout_s=spec.timeout_s, seed=spec.seed,
        instances=len(targets), urls=[redacted(t) for t in targets],
    )
    meta = BenchMetadata(
        date_utc=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        kvctl_version=__version__,
        server_versions=tuple(i.version for i in infos),
        host=socket.gethostname(),
        host_cores=os.cpu_count() or 0,
        python=platform.python_version(),
        parameters=params,
    )
    verdict = None
    if bytes_per_token and prefill_rate:
        verdict = summarize_verdict(runs_t, bytes_per_token, prefill_rate)
    return BenchReport(metadata=meta, runs=runs_t, verdict=verdict)


@contextlib.contextmanager
def embedded_tier(n: int, maxmemory: str = "1gb", workdir: str | None = None) -> Iterator[list[Target]]:
    """Start ``n`` local valkey-servers (one per rank) for the bench; always stop them."""
    from kvctl.tier.server import start_valkey  # noqa: PLC0415

    if n < 1:
        raise InvalidInput(f"--embedded needs N ≥ 1, got {n}")
    procs = []
    with tempfile.TemporaryDirectory(prefix="kvctl-bench-", dir=workdir) as tmp:
        try:
            for r in range(n):
                procs.append(start_valkey(os.path.join(tmp, f"rank{r}"), settings={"maxmemory": maxmemory}))
            yield [Target(r, p.host, p.port, p.url) for r, p in enumerate(procs)]
        finally:
            for p in procs:
                p.stop()
