"""Run a bench: targets → prepopulated keys → client processes → raw results → RunResult.

Clients are separate processes (forkserver, else spawn) so one Python
interpreter is never the limit. Every wait is bounded: a run ends within
``duration_s + timeout_s`` plus a small grace, whatever the servers do; a
client that does not report by then is killed and counted as an error of its
instance, and one that dies is reported with its exit code (or signal) and,
when it raised, its exception.

Interrupts are cooperative: the caller sets ``stop_requested`` (the CLI does
on SIGINT/SIGTERM); the current run stops, its clients report what they
measured, the bench keys are deleted and the report says it was interrupted.
Bench keys carry a TTL, so even the keys of a SIGKILLed bench expire.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import math
import multiprocessing as mp
import os
import platform
import queue
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from typing import Callable, Iterator, Sequence

from kvctl import __version__
from kvctl.bench.engines import summarize_engines
from kvctl.bench.info import ServerInfo, delta, server_info, snapshot_all
from kvctl.bench.results import BenchMetadata, BenchReport, RunResult, summarize_run, summarize_verdict, with_scaling
from kvctl.bench.spec import BenchSpec, auto_keys, batch_that_fits, grid
from kvctl.bench.worker import WorkerConfig, WorkerResult, key_names
from kvctl.connector.resp import RespClient
from kvctl.connector.urls import parse_resp_url, with_credentials
from kvctl.core.errors import InvalidInput, KvctlError, Unreachable
from kvctl.core.procs import SAFE_PATH_ENV, STARTER_PID_ENV
from kvctl.tier.targets import Target

#: Seconds the parent waits past ``duration + timeout`` before killing a silent client.
GRACE_S = 1.0
#: Seconds client processes get to start and report ready (forkserver, imports, connect) past --timeout.
WORKER_START_S = 30.0
#: The fill (SET of every key before the measured GETs) is setup, not measurement: a SET into a server still
#: growing its memory may outlast a short --timeout meant for the GETs, so the fill waits at least this long.
FILL_TIMEOUT_FLOOR_S = 10.0
#: Polling period of the parent's queue reads; seconds it waits for a stopped client to exit, then for a killed one.
POLL_S, EXIT_WAIT_S, KILL_WAIT_S = 0.1, 0.5, 2.0
#: INFO snapshots are taken while the servers are idle; a healthy one answers in milliseconds.
SNAPSHOT_TIMEOUT_S = 2.0
#: Bench keys outlive the bench's own worst-case length by this much, then expire.
KEY_TTL_MARGIN_S = 60

ProgressFn = Callable[[str, float, float, float], None]  # (label, elapsed_s, duration_s, live_gbps)


def url_with_password(target: Target) -> str:
    """The target's URL carrying its password (for the client processes; never printed): the URL's ACL
    user is kept, and the target's password (``--password-file`` before the URL's) is the one used."""
    return with_credentials(target.url, password=target.password)


def redacted(target: Target) -> str:
    return parse_resp_url(url_with_password(target)).redacted()


def key_ttl_s(spec: BenchSpec, n_runs: int) -> int:
    """Seconds the bench keys live: the bench's worst-case length plus a margin, so a killed bench's keys expire."""
    per_run = WORKER_START_S + spec.timeout_s + spec.duration_s + spec.timeout_s + GRACE_S + 2 * SNAPSHOT_TIMEOUT_S
    return math.ceil(KEY_TTL_MARGIN_S + n_runs * per_run)


def _mp_context():
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["kvctl.bench.guard", "kvctl.bench.worker"])
        return ctx
    return mp.get_context("spawn")


@contextlib.contextmanager
def _clean_child_start() -> Iterator[None]:
    """Start client processes without re-importing the parent's ``__main__`` and without the cwd on sys.path.

    spawn/forkserver children normally run the parent's main script or module
    again (as ``__mp_main__``); the clients need only :mod:`kvctl.bench.worker`,
    and a main without a file (stdin, an embedding host) would crash them.
    The forkserver is a ``python -c`` process, whose ``sys.path[0]`` is the
    working directory: a ``kvctl/`` folder there would be preloaded instead of
    the installed package and every client would die. ``PYTHONSAFEPATH``
    (Python ≥ 3.11) keeps the working directory off its path.

    :data:`STARTER_PID_ENV` names this process to the forkserver (or a spawned client), which
    :mod:`kvctl.bench.guard` makes die with it; the forkserver's clients die with the forkserver.
    """
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main is not None and k in main.__dict__}
    saved_env = {k: os.environ.get(k) for k in (SAFE_PATH_ENV, STARTER_PID_ENV)}
    try:
        os.environ[SAFE_PATH_ENV] = "1"
        os.environ[STARTER_PID_ENV] = str(os.getpid())
        if main is not None:
            main.__dict__.pop("__file__", None)
            if "__spec__" in saved:
                main.__spec__ = None
        yield
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if main is not None:
            main.__dict__.update(saved)


#: What a client process runs. The Process target is the builtin ``exec``, so that even
#: a failing import of kvctl in the child (a broken install, a shadowing package) comes
#: back to the parent as an exception on the result queue, not as a bare exit code 1.
WORKER_BOOT = """
try:
    from kvctl.bench.worker import WorkerConfig, worker_main
    import kvctl.bench.guard  # a spawned client dies with the bench (under a forkserver: imported there already)
except BaseException as exc:
    result_q.put(("boot-failed", cfg["worker_id"], f"{type(exc).__name__}: {exc}"))
    raise
worker_main(WorkerConfig(**cfg), ready_q, start, stop, result_q, live, barrier)
"""


def describe_exit(exitcode: int | None) -> str:
    """``exited with code 1`` / ``killed by SIGKILL``, for a client that died without reporting."""
    if exitcode is None:
        return "did not exit"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"killed by {name}" + (" (out of memory?)" if exitcode == -signal.SIGKILL else "")
    return f"exited with code {exitcode}"


class _Interrupted(Exception):
    """Raised inside the runner when ``stop_requested`` is set between steps."""


def _parallel(fn, items: Sequence) -> list:
    with ThreadPoolExecutor(max_workers=max(1, len(items))) as pool:
        return list(pool.map(fn, items))


def populate(
    targets: Sequence[Target],
    key_prefix: str,
    n_keys: int,
    spec: BenchSpec,
    ttl_s: int | None = None,
    stop_requested: threading.Event | None = None,
) -> None:
    """SET ``n_keys`` values of ``chunk_bytes`` on every instance (in parallel); Unreachable on failure.

    With ``ttl_s`` every key is written with that TTL (SET ... EX). Stops
    between batches once ``stop_requested`` is set (raises ``_Interrupted``).
    """
    value = os.urandom(spec.chunk_bytes)
    keys = key_names(key_prefix, n_keys)

    def one(t: Target) -> str | None:
        try:
            with RespClient(url_with_password(t), timeout_s=max(spec.timeout_s, FILL_TIMEOUT_FLOOR_S), pool_size=1) as c:
                for i in range(0, n_keys, spec.batch):
                    if stop_requested is not None and stop_requested.is_set():
                        return None
                    ks = keys[i : i + spec.batch]
                    c.batched_set(ks, [value] * len(ks), ttl_s=ttl_s)
                if not all(c.batched_exists(keys[-spec.batch :])):
                    return f"{redacted(t)}: values were evicted while populating; lower --keys or raise maxmemory"
        except KvctlError as e:
            return f"{redacted(t)}: {e}"
        return None

    problems = [p for p in _parallel(one, list(targets)) if p]
    if stop_requested is not None and stop_requested.is_set():
        raise _Interrupted
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
    stop_requested: threading.Event | None = None,
    key_ttl_s: int | None = None,
    engines: bool = False,
) -> RunResult:
    """One grid point: ``clients`` processes per target doing ``op`` for ``spec.duration_s``.

    ``engines``: client j of every target is rank i of engine j; an engine's ranks start each batch
    together (a barrier per engine), as one engine loads the shares of one prompt.

    A SET run writes its keys with ``key_ttl_s`` (a plain SET would drop the TTL).

    ``stop_requested`` ends the run early: the clients stop at their next
    batch and report, so the result covers the time actually run.
    """
    ctx = _mp_context()
    n_workers = len(targets) * clients
    ready_q, result_q = ctx.Queue(), ctx.Queue()
    start, stop = ctx.Event(), ctx.Event()
    live = ctx.RawArray("d", n_workers)
    barriers = [ctx.Barrier(len(targets)) for _ in range(clients)] if engines else []
    urls = [url_with_password(t) for t in targets]
    start_wait_s = WORKER_START_S + spec.timeout_s
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
            key_ttl_s=key_ttl_s,
            engine=j if engines else None,
        )
        for i in range(len(targets))
        for j in range(clients)
    ]
    shared = {"ready_q": ready_q, "start": start, "stop": stop, "result_q": result_q, "live": live}
    procs = [ctx.Process(target=exec, args=(WORKER_BOOT, {"cfg": asdict(c), **shared, "barrier": barriers[c.engine] if engines else None}),
                         daemon=True) for c in cfgs]
    label = f"{op.upper()} {len(targets)} instance(s) × {clients} client(s)"
    results: dict[int, WorkerResult] = {}
    failed: dict[int, str] = {}  # worker id -> why it never reported
    boot_errors: dict[int, str] = {}

    def interrupted() -> bool:
        return stop_requested is not None and stop_requested.is_set()

    def collect(timeout: float) -> None:
        """One queue read; then every client that exited before it without a result is dead."""
        exited = [(c, p) for c, p in zip(cfgs, procs) if p.exitcode is not None]
        try:
            r = result_q.get(timeout=timeout)
        except queue.Empty:
            for c, p in exited:  # their results would have been in the pipe before they exited
                if c.worker_id not in results and c.worker_id not in failed:
                    why = f"client {c.worker_id} (pid {p.pid}) {describe_exit(p.exitcode)} before reporting"
                    exc = boot_errors.get(c.worker_id)
                    failed[c.worker_id] = f"{why}: {exc}" if exc else why
            return
        if isinstance(r, tuple):  # ("boot-failed", worker id, exception text)
            boot_errors[r[1]] = r[2]
        else:
            results[r.worker_id] = r

    try:
        with _clean_child_start():
            for p in procs:
                p.start()
        # 1. every client connected and warmed up (or failed trying), bounded
        ready_deadline = time.monotonic() + start_wait_s
        announced = 0
        while announced < n_workers and time.monotonic() < ready_deadline and not interrupted():
            with contextlib.suppress(queue.Empty):
                ready_q.get(timeout=POLL_S)
                announced += 1
            if announced + sum(p.exitcode is not None for p in procs) >= n_workers:
                break
        # 2. server counters, go, wait for the deadline, counters again
        snap_timeout = min(spec.timeout_s, SNAPSHOT_TIMEOUT_S)
        before = snapshot_all(urls, snap_timeout)
        t0 = time.monotonic()
        start.set()
        hard_deadline = t0 + spec.duration_s + spec.timeout_s + GRACE_S
        while len(results) + len(failed) < n_workers:
            now = time.monotonic()
            if now >= t0 + spec.duration_s:
                stop.set()
                for b in barriers:  # ranks waiting for a prompt that will not start
                    b.abort()
            if interrupted() and not stop.is_set():
                stop.set()
                for b in barriers:
                    b.abort()
                hard_deadline = min(hard_deadline, now + spec.timeout_s + GRACE_S)
            if now >= hard_deadline:
                break
            collect(POLL_S)
            if on_progress:
                elapsed = min(time.monotonic() - t0, spec.duration_s)
                on_progress(label, elapsed, spec.duration_s, sum(live) / max(elapsed, 1e-9) / 1e9)
        stop.set()
        after = snapshot_all(urls, snap_timeout)
    finally:
        stop.set()
        for b in barriers:
            b.abort()
        for p in procs:
            p.join(timeout=EXIT_WAIT_S)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=KILL_WAIT_S)
    extra: list[list[str]] = [[] for _ in targets]
    for c in cfgs:
        if c.worker_id in results:
            continue
        extra[c.instance].append(
            failed.get(c.worker_id)
            or f"client {c.worker_id} did not report within duration + timeout ({spec.duration_s:g}+{spec.timeout_s:g}s); killed"
        )
    deltas = [
        b if isinstance(b, str) else a if isinstance(a, str) else delta(b, a, op)
        for b, a in zip(before, after)
    ]
    run = summarize_run(
        op,
        [t.rank for t in targets],
        [redacted(t) for t in targets],
        clients,
        spec.chunk_bytes,
        spec.batch,
        list(results.values()),
        deltas,
        extra,
        instances=[t.instance for t in targets],
        instances_per_rank=max((t.instances_per_rank for t in targets), default=1),
    )
    if engines:
        run = replace(run, engines=clients, per_engine=summarize_engines(list(results.values()), clients, len(targets)))
    return run


def run_bench(
    targets: Sequence[Target],
    spec: BenchSpec,
    on_progress: ProgressFn | None = None,
    bytes_per_token: float | None = None,
    prefill_rate: float | None = None,
    parameters: dict | None = None,
    keep_keys: bool = False,
    stop_requested: threading.Event | None = None,
) -> BenchReport:
    """Populate keys, run every grid point (SET then GET with ``spec.write``), clean up, summarise.

    Once ``stop_requested`` is set, the current run ends early, no further
    run starts, the keys are deleted and the report has ``interrupted`` set
    and holds the runs measured so far (the last one possibly shortened).
    """
    spec.check()
    if not targets:
        raise InvalidInput("no Valkey instances to bench")

    from kvctl.tier.admin import PASSWORD_HINT, AuthFailed, is_auth_error  # noqa: PLC0415

    def info(t: Target) -> ServerInfo | tuple[str, bool]:
        try:
            return server_info(url_with_password(t), spec.timeout_s)
        except Exception as e:  # noqa: BLE001 - redis errors, OSError
            return f"{redacted(t)}: {type(e).__name__}: {e}", is_auth_error(e)

    infos = _parallel(info, list(targets))
    refused = [i[0] for i in infos if isinstance(i, tuple) and i[1]]
    if refused:
        given = any(t.password is not None or parse_resp_url(t.url).password is not None for t in targets)
        why = "the password was refused" if given else "no password given"
        raise AuthFailed(f"{why} ({'; '.join(refused)}): {PASSWORD_HINT}")
    bad = [i[0] for i in infos if isinstance(i, tuple)]
    if bad:
        raise Unreachable("cannot reach " + "; ".join(bad))
    sizing_note = None
    if spec.fit_batch and not spec.keys:
        fits = min(batch_that_fits(i, spec) for i in infos)  # type: ignore[arg-type]
        if fits < spec.batch:
            sizing_note = (f"--batch {fits} instead of {spec.batch}: the tier's maxmemory holds no more batches of "
                           f"{spec.chunk_bytes / 1e6:g} MB values with {spec.clients} client(s) reading them (give --batch to insist)")
            spec = replace(spec, batch=fits)
    n_keys = spec.keys or min(auto_keys(i, spec) for i in infos)
    prefix = f"kvctl-bench:{uuid.uuid4().hex[:8]}:"
    plan = [(w, c, op) for w, c in grid(len(targets), spec) for op in (("set", "get") if spec.write else ("get",))]
    ttl = key_ttl_s(spec, len(plan))
    runs: list[RunResult] = []
    was_interrupted = False
    try:
        populate(targets, prefix, n_keys, spec, ttl, stop_requested)
        for instances, clients, op in plan:
            if stop_requested is not None and stop_requested.is_set():
                raise _Interrupted
            runs.append(run_once(targets[:instances], clients, op, prefix, n_keys, spec, on_progress, stop_requested, ttl,
                                 engines=bool(spec.engines) and op == "get"))
        was_interrupted = stop_requested is not None and stop_requested.is_set()
    except _Interrupted:
        was_interrupted = True
    finally:
        if not keep_keys:  # skip instances that failed: a dead or stalled server would only add timeouts
            failed = {(p.rank, p.instance) for r in runs for p in r.per_instance if p.errors}
            cleanup([t for t in targets if (t.rank, t.instance) not in failed], prefix, n_keys, spec.timeout_s)
    runs_t = with_scaling(runs)
    params = dict(parameters or {})
    params.update(
        chunk_bytes=spec.chunk_bytes, batch=spec.batch, clients=spec.clients, duration_s=spec.duration_s,
        keys_per_instance=n_keys, write=spec.write, sweep=spec.sweep, timeout_s=spec.timeout_s, seed=spec.seed, engines=spec.engines,
        instances=len(targets), urls=[redacted(t) for t in targets], key_ttl_s=ttl, sizing_note=sizing_note,
        instances_per_rank=max(t.instances_per_rank for t in targets),
    )
    meta = BenchMetadata(
        date_utc=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        kvctl_version=__version__,
        server_versions=tuple(i.version for i in infos),
        host=socket.gethostname(),
        host_cores=os.cpu_count() or 0,
        python=platform.python_version(),
        parameters=params,
        server_io_threads=tuple(i.io_threads for i in infos),
    )
    advice = _advice(runs_t, meta, targets)
    verdict = None
    if bytes_per_token and prefill_rate:
        verdict = summarize_verdict(runs_t, bytes_per_token, prefill_rate, advice)
    return BenchReport(metadata=meta, runs=runs_t, verdict=verdict, interrupted=was_interrupted, runs_planned=len(plan), advice=advice)


def _advice(runs: Sequence[RunResult], meta: BenchMetadata, targets: Sequence[Target]) -> str | None:
    """The server change to make before adding instances, judged on the best GB/s one instance gave in any GET run."""
    from kvctl.bench.sizing import instance_advice  # noqa: PLC0415
    from kvctl.tier.checks import is_local  # noqa: PLC0415

    best = max((g for r in runs if r.op == "get" for g in r.per_instance_gbps), default=None)
    if not best:
        return None
    local = bool(targets) and all(is_local(t.host) for t in targets)
    return instance_advice(meta.server_versions, meta.server_io_threads, best, local, len(targets))


@contextlib.contextmanager
def embedded_tier(n: int, maxmemory: str | int = "1gb", workdir: str | None = None) -> Iterator[list[Target]]:
    """Start ``n`` local valkey-servers (one per rank) for the bench, with the io-threads `deploy-valkey up` gives ``n``
    instances on this host (:func:`kvctl.tier.sizing.io_threads_for`); always stop them, and they die with this process
    (SIGKILL included: :func:`kvctl.core.procs.die_with_parent`)."""
    from kvctl.tier.server import find_valkey_server, server_version, start_valkey  # noqa: PLC0415
    from kvctl.tier.sizing import io_threads_for, zero_copy_settings  # noqa: PLC0415

    if n < 1:
        raise InvalidInput(f"--embedded needs N ≥ 1, got {n}")
    binary, threads = find_valkey_server(), io_threads_for(instances=n)
    settings = {"maxmemory": maxmemory, "io-threads": threads, **zero_copy_settings(server_version(binary), threads)}
    procs = []
    with tempfile.TemporaryDirectory(prefix="kvctl-bench-", dir=workdir) as tmp:
        try:
            for r in range(n):
                procs.append(start_valkey(os.path.join(tmp, f"rank{r}"), settings=settings, binary=binary, die_with_parent=True))
            yield [Target(r, p.host, p.port, p.url) for r, p in enumerate(procs)]
        finally:
            for p in procs:
                p.stop()
