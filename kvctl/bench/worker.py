"""One bench client, run in its own process (multiprocessing forkserver/spawn).

Imports only the connector's RESP client, so a forkserver can preload it and
a worker starts in milliseconds. Each worker owns ``batch`` preallocated
buffers of ``chunk_bytes`` and fetches pipelined batches into them with
:meth:`RespClient.batched_get` — the same code path as the engine.

Bounded: the run ends at ``duration_s`` after the start signal (or when the
parent sets ``stop``); each RespClient call ends by one ``timeout_s`` deadline;
after an error the worker backs off (at most 0.5 s) and retries until the end,
counting errors. The result always goes back on the queue while the bench lives.

Ctrl-C reaches every process of the terminal's process group: a worker ignores
SIGINT and lets the parent stop it (the parent then still collects its
numbers). A worker whose parent died (SIGKILL) stops at its next batch and drops its result
(:func:`send_result`); on Linux it is killed before that (:mod:`kvctl.bench.guard`).
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from kvctl.connector.resp import RespClient
from kvctl.connector.urls import redacted_repr

#: Distinct keys of one bench run: ``<prefix><index>``; the same names on every instance.
KEY_FORMAT = "{prefix}{index}"


def key_names(prefix: str, n_keys: int) -> list[bytes]:
    return [KEY_FORMAT.format(prefix=prefix, index=i).encode() for i in range(n_keys)]


@dataclass(frozen=True)
class WorkerConfig:
    """Everything one client process needs (picklable)."""

    __repr__ = redacted_repr  # URLs shown with their passwords masked (issue 44)

    worker_id: int
    instance: int  # index into the run's targets (= rank)
    url: str  # may carry a password; never printed
    op: str  # "get" or "set"
    key_prefix: str
    n_keys: int
    chunk_bytes: int
    batch: int
    duration_s: float
    timeout_s: float
    seed: int
    start_wait_s: float  # how long to wait for the start signal before giving up
    key_ttl_s: int | None = None  # SET runs write with this TTL, so a killed bench's keys still expire
    engine: int | None = None  # bench --engines: the engine this client is one rank of (its ranks load in lockstep)


@dataclass
class WorkerResult:
    """Raw numbers of one client; summarised by :func:`kvctl.bench.results.summarize_run`."""

    worker_id: int
    instance: int
    ready: bool = False
    started: bool = False
    batches: int = 0
    ops: int = 0  # keys requested in completed batches (hits + misses)
    misses: int = 0
    bytes: int = 0  # payload bytes moved in completed batches
    errors: int = 0
    first_error: str | None = None
    elapsed_s: float = 0.0  # start signal → end of the last batch (or of the run)
    batch_s: list[float] = field(default_factory=list)
    engine: int | None = None
    spans: list[tuple[float, float]] = field(default_factory=list)  # with an engine: (start, end) of each prompt's batch, CLOCK_MONOTONIC


def _batches(order: list[int], batch: int):
    """Endless windows of ``batch`` distinct keys, walking a shuffled order cyclically."""
    n = len(order)
    pos = 0
    while True:
        if pos + batch <= n:
            yield order[pos : pos + batch]
        else:
            yield order[pos:] + order[: pos + batch - n]
        pos = (pos + batch) % n


def _record_error(res: WorkerResult, exc: BaseException) -> None:
    res.errors += 1
    if res.first_error is None:
        res.first_error = f"{type(exc).__name__}: {exc}"


#: How often a worker waiting for the start signal checks that its parent still lives.
PARENT_CHECK_S = 0.25


def send_result(result_q: Any, res: WorkerResult, orphaned: Callable[[], bool]) -> None:
    """Put ``res`` on the queue and wait until it is in the pipe, or until the bench is gone.

    A result holds one float per batch, often more than a pipe buffer: the queue's feeder thread writes it
    while the bench reads, and the process waits for that thread when it exits. With the bench gone nobody
    reads (every client holds the pipe's read end, so the write never fails): the wait is given up, the
    result dropped, and the client exits.
    """
    if orphaned():
        result_q.cancel_join_thread()
        return
    result_q.put(res)
    result_q.close()  # no more puts: the feeder writes what it holds and ends
    flushed = threading.Thread(target=result_q.join_thread, name="kvctl-bench-result", daemon=True)
    flushed.start()
    while flushed.is_alive():
        flushed.join(PARENT_CHECK_S)
        if flushed.is_alive() and orphaned():
            result_q.cancel_join_thread()
            return


def worker_main(cfg: WorkerConfig, ready_q: Any, start: Any, stop: Any, result_q: Any, live_bytes: Any, barrier: Any = None) -> None:
    """Process entry point: warm up, report ready, run until the deadline, report the result.

    With ``barrier`` (one per engine, one party per rank) every batch starts when all of the engine's ranks
    are ready for it, as the ranks of one engine load their shares of a prompt at the same moment; a broken
    barrier (the parent aborts it at the end, or a rank failed) ends the run.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = multiprocessing.parent_process()  # the bench process (not the forkserver): its sentinel closes when it dies

    def orphaned() -> bool:
        return parent is not None and not parent.is_alive()

    res = WorkerResult(cfg.worker_id, cfg.instance, engine=cfg.engine)
    client = None
    announced = False
    try:
        keys = key_names(cfg.key_prefix, cfg.n_keys)
        rng = random.Random(cfg.seed)
        order = list(range(cfg.n_keys))
        rng.shuffle(order)
        windows = _batches(order, min(cfg.batch, cfg.n_keys))
        buffers = [bytearray(cfg.chunk_bytes) for _ in range(cfg.batch)]
        if cfg.op == "set":
            pattern = os.urandom(4096)
            for b in buffers:
                b[:] = (pattern * (cfg.chunk_bytes // len(pattern) + 1))[: cfg.chunk_bytes]
        client = RespClient(cfg.url, timeout_s=cfg.timeout_s, pool_size=1)

        def one_batch() -> tuple[int, int]:
            idx = next(windows)
            ks = [keys[i] for i in idx]
            bufs = buffers[: len(ks)]
            if cfg.op == "set":
                client.batched_set(ks, bufs, ttl_s=cfg.key_ttl_s)
                return len(ks), 0
            filled = client.batched_get(ks, bufs)
            hits = sum(filled)
            return hits, len(ks) - hits

        try:  # warm-up: connect and touch the server once, outside the measured window
            one_batch()
            res.ready = True
        except Exception as exc:  # noqa: BLE001 - any failure is a recorded error, never a crash
            _record_error(res, exc)
        ready_q.put((cfg.worker_id, res.ready))
        announced = True
        wait_until = time.monotonic() + cfg.start_wait_s
        while not start.wait(PARENT_CHECK_S):
            if orphaned() or time.monotonic() >= wait_until:
                return
        res.started = True
        t_start = time.monotonic()
        deadline = t_start + cfg.duration_s
        backoff = 0.05
        perf = time.perf_counter
        while time.monotonic() < deadline and not stop.is_set() and not orphaned():
            if barrier is not None:
                try:
                    barrier.wait(max(0.0, min(cfg.timeout_s, deadline - time.monotonic())))
                except threading.BrokenBarrierError:
                    break  # the run is over (or a rank of this engine failed): the prompt is not loaded
            t0 = perf()
            m0 = time.monotonic()
            try:
                hits, misses = one_batch()
            except Exception as exc:  # noqa: BLE001
                _record_error(res, exc)
                if barrier is not None:
                    res.spans.append((m0, float("nan")))  # keeps prompt k the k-th span on every rank
                stop.wait(max(0.0, min(backoff, deadline - time.monotonic())))
                backoff = min(backoff * 2, 0.5)
                continue
            res.batch_s.append(perf() - t0)
            if barrier is not None:
                res.spans.append((m0, time.monotonic()))
            res.batches += 1
            res.ops += hits + misses
            res.misses += misses
            res.bytes += hits * cfg.chunk_bytes
            res.elapsed_s = time.monotonic() - t_start
            live_bytes[cfg.worker_id] = res.bytes
            backoff = 0.05
        if res.batches == 0:
            res.elapsed_s = time.monotonic() - t_start
    except Exception as exc:  # noqa: BLE001 - setup failure (bad URL, out of memory): report, don't hang the parent
        _record_error(res, exc)
        if not announced:
            try:
                ready_q.put((cfg.worker_id, False))
            except Exception:  # noqa: BLE001
                pass
    finally:
        if client is not None:
            client.close()
        send_result(result_q, res, orphaned)
