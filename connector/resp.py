"""A small, fast RESP2 client for the remote KV tier (paper §5.4).

* Batches are pipelined on one pooled socket: all commands are written, then
  all replies are read, in order.
* GET payloads go straight into caller-provided writable buffers with
  ``recv_into`` (zero copy beyond the first few KB that arrive with the
  header). A value whose length differs from its buffer is a miss, and its
  bytes are still consumed so the connection stays in sync.
* Bulk headers are parsed up to CRLF, so the 5-byte null bulk ``$-1\\r\\n`` of
  a missing key is a per-key miss and the connection stays usable (bug 2).
* One deadline per call: ``timeout_s`` bounds the whole call -- the wait for
  a pooled connection, connect (and AUTH/SELECT), every send and every read --
  not each socket operation, so a server that drips its reply cannot stretch
  a call. A bulk longer than Valkey's ``proto-max-bulk-len`` (512 MB, the
  ``max_bulk_bytes`` knob) is a protocol error at its header.
* Timeouts, closed connections and malformed replies raise a
  :class:`RespError` subclass and the connection is dropped from the pool,
  never returned to it. So is a connection with bytes left unread after its
  last expected reply: they would otherwise be taken for the next call's reply.
* A pooled connection is checked before reuse (closed by the server, or
  unsolicited bytes waiting: dropped), and an idempotent call (GET, EXISTS,
  SET, PING) whose reused connection fails before any reply byte is retried
  once on a fresh connection within the same deadline, so the calls after a
  server restart do not fail on the pool's dead sockets.
* A large ``batched_get`` (>= 2 values, >= 4 MiB of buffers) is split into
  up to ``parallel_gets`` sub-batches read on as many pooled connections at
  once (``recv_into`` releases the GIL): one on the caller's thread, the
  others on a small thread pool the client owns. They share the call's one
  deadline; each keeps the retry rule above; the call fails as the serial one
  would once every sub-batch has ended, and a sub-batch still reading after
  the deadline has its socket shut down and is waited for, so no thread
  writes into the caller's buffers after the call returns.
* Every call completes on the caller's thread (and, for a split
  ``batched_get``, the client's GET threads): no future is handed out, so
  none can be lost (bug 1 of paper §5.4 cannot arise).
* :meth:`RespClient.execute` sends any commands and reads their replies whole, typed and bounded
  (:mod:`.resp_reply`): kvctl's admin reads (INFO, CONFIG GET). :meth:`RespClient.abort` cuts calls in flight.

No click, no rich: this module runs inside engine processes.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

from .resp_errors import (
    RespAuthError,
    RespClosedError,
    RespConnectionError,
    RespError,
    RespProtocolError,
    RespServerError,
    RespTimeout,
)
from .resp_codec import CRLF, SMALL_WRITE, encode_command, key_bytes
from .resp_conn import MAX_BULK_BYTES, REARM_FRACTION, Connection, make_ssl_context
from .resp_ops import Fanout, get_op, int_reply, raise_if_error, wait_all
from .resp_reply import ErrorReply, ReplyLimits, pipeline_op
from .urls import parse_resp_url

__all__ = [
    "RespAuthError",
    "RespClient",
    "RespClosedError",
    "RespConnectionError",
    "RespError",
    "RespProtocolError",
    "RespServerError",
    "RespTimeout",
    "ErrorReply",
    "ReplyLimits",
    "make_ssl_context",
]

# batched_get splits a batch over several connections only from these sizes on
_PARALLEL_MIN_BYTES = 4 * 1024 * 1024
_PARALLEL_MIN_PART_BYTES = 2 * 1024 * 1024  # no sub-batch smaller than this (a split costs a thread handoff)
_PARALLEL_MAX = 8


@dataclass(frozen=True)
class _PoolStats:
    created: int
    dropped: int
    idle: int


class RespClient:
    """Pipelined RESP2 client over a small socket pool.

    ``url``: ``resp://``, ``redis://`` or ``rediss://`` (TLS), optionally with
    ``user:password@`` or ``:password@`` and ``/db``. ``timeout_s`` is the
    deadline of each call, all included: the wait for a free pooled
    connection, connect and AUTH, every send and every read. ``pool_size`` caps open
    connections; calls from more threads wait. ``max_bulk_bytes`` caps the
    length a bulk reply may announce (Valkey's ``proto-max-bulk-len``, 512 MB
    by default); a value that differs from its buffer is a miss and its bytes
    are discarded only up to that cap. ``parallel_gets``: how many pooled
    connections one large :meth:`batched_get` (>= 2 values, >= 4 MiB of
    buffers) is spread over at once; ``None`` means ``min(pool_size, 8)``,
    1 reads every batch on one connection; never more than ``pool_size``.
    """

    def __init__(
        self,
        url: str,
        timeout_s: float = 5.0,
        pool_size: int = 4,
        ssl_context: ssl.SSLContext | None = None,
        max_bulk_bytes: int = MAX_BULK_BYTES,
        parallel_gets: int | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if pool_size < 1:
            raise ValueError(f"pool_size must be >= 1, got {pool_size}")
        if max_bulk_bytes < 0:
            raise ValueError(f"max_bulk_bytes must be >= 0, got {max_bulk_bytes}")
        if parallel_gets is not None and (isinstance(parallel_gets, bool) or not isinstance(parallel_gets, int) or parallel_gets < 1):
            raise ValueError(f"parallel_gets must be a whole number >= 1 or None, got {parallel_gets!r}")
        self.url = parse_resp_url(url)
        self.timeout_s = float(timeout_s)
        self.pool_size = pool_size
        self.max_bulk_bytes = int(max_bulk_bytes)
        self.parallel_gets = min(pool_size, _PARALLEL_MAX if parallel_gets is None else parallel_gets)
        self._get_pool: ThreadPoolExecutor | None = None  # the split batched_get's threads, made on first use
        self._ssl_context = ssl_context if ssl_context is not None else (make_ssl_context(self.url) if self.url.tls else None)
        self._slots = threading.BoundedSemaphore(pool_size)
        self._idle: list[Connection] = []
        self._busy: set[Connection] = set()  # in a call now: what abort() cuts
        self._lock = threading.Lock()
        self._closed = False
        self._created = 0
        self._dropped = 0

    # -- pool ----------------------------------------------------------------
    def _deadline(self) -> float:
        return time.monotonic() + self.timeout_s

    def _acquire(self, deadline: float, fresh: bool = False) -> tuple[Connection, bool]:
        """A connection for one call ending by ``deadline``, and whether it was reused from the pool.

        Idle connections that fail :meth:`Connection.reusable` are dropped on
        the way; ``fresh`` skips the pool (the retry after a reused one failed).
        """
        if self._closed:
            raise RespClosedError("RespClient is closed")
        if not self._slots.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise RespTimeout(f"no free connection to {self.url.host}:{self.url.port} within {self.timeout_s:g}s")
        try:
            while not fresh:
                with self._lock:
                    conn = self._idle.pop() if self._idle else None
                if conn is None:
                    break
                if conn.reusable():
                    try:
                        conn.begin(deadline, self.timeout_s)
                    except BaseException:  # the deadline passed (e.g. queued too long): keep the socket
                        with self._lock:
                            self._idle.append(conn)
                        raise
                    with self._lock:
                        self._busy.add(conn)
                    return conn, True
                conn.close()
                with self._lock:
                    self._dropped += 1
            conn = Connection(self.url, self.timeout_s, self._ssl_context, deadline, self.max_bulk_bytes)
        except BaseException:
            self._slots.release()
            raise
        with self._lock:
            self._created += 1
            self._busy.add(conn)
        return conn, False

    def _release(self, conn: Connection, ok: bool) -> None:
        with self._lock:
            self._busy.discard(conn)
        try:
            # a connection with reply bytes left unread after the call would hand
            # them to the next call as its reply (wrong bytes as a hit): dropped.
            # Bytes that reach the socket later are caught by reusable() at reuse.
            if ok and not self._closed and conn.in_sync():
                with self._lock:
                    self._idle.append(conn)
                return
            conn.close()
            with self._lock:
                self._dropped += 1
        finally:
            self._slots.release()

    def _run(self, fn, *args, idempotent: bool = False, deadline: float | None = None):
        """Run ``fn(conn, *args)`` on a pooled connection within one deadline.

        ``idempotent``: when a *reused* connection fails (closed, reset) before
        any reply byte -- a socket the server dropped while it sat in the pool,
        e.g. across a restart -- run ``fn`` once more on a fresh connection,
        within the same deadline. Only for commands whose repetition cannot
        change the outcome (GET, EXISTS, PING, and SET: see batched_set).
        """
        if deadline is None:
            deadline = self._deadline()
        retry = idempotent
        while True:
            conn, reused = self._acquire(deadline, fresh=not retry and idempotent)
            ok = False
            try:
                result = fn(conn, *args)
                ok = True
                return result
            except RespServerError:
                ok = True  # an error reply was read in full: the connection is in sync
                raise
            except RespConnectionError as exc:
                if not (retry and reused and not conn.replied) or isinstance(exc, RespTimeout):
                    raise
                retry = False  # once, on a fresh connection (the finally drops this one)
            finally:
                self._release(conn, ok)

    def pool_stats(self) -> _PoolStats:
        """Connections created and dropped so far, and idle now (for tests and diagnostics)."""
        with self._lock:
            return _PoolStats(self._created, self._dropped, len(self._idle))

    def close(self) -> None:
        """Close every idle connection; later calls raise :class:`RespClosedError`. Idempotent."""
        with self._lock:  # _gets_executor checks _closed under this lock
            self._closed = True
            get_pool, self._get_pool = self._get_pool, None
        try:
            if get_pool is not None:
                # queued sub-batches are cancelled (their calls fail as closed); running ones end by their deadline
                get_pool.shutdown(wait=False, cancel_futures=True)
        finally:
            with self._lock:
                idle, self._idle = self._idle, []
            for conn in idle:
                conn.close()

    def abort(self) -> None:
        """:meth:`close`, and shut the sockets of the calls in flight: each fails at once (a connection error)."""
        self.close()
        with self._lock:
            busy = list(self._busy)
        for conn in busy:
            conn.broken = True  # never pooled again
            try:  # the plain socket's shutdown, also under TLS (as Fanout.abort)
                socket.socket.shutdown(conn.sock, socket.SHUT_RDWR)
            except OSError:
                pass

    def __enter__(self) -> "RespClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- commands ------------------------------------------------------------
    def ping(self) -> bool:
        """True when the server answers PING with PONG."""

        def op(conn: Connection) -> bool:
            conn.send([b"*1\r\n$4\r\nPING\r\n"])
            kind, value = conn.read_simple()
            raise_if_error(conn, [value] if kind == b"-" else [])
            return kind == b"+" and value == b"PONG"

        return self._run(op, idempotent=True)

    def execute(self, commands: Sequence[Sequence[bytes | str | int]], limits: ReplyLimits = ReplyLimits(),
                deadline: float | None = None, idempotent: bool = False) -> list[Any]:
        """Send ``commands`` (each a command and its arguments) in one pipeline and read every reply whole, bounded by
        ``limits`` (:mod:`~kvctl.connector.resp_reply`: an error reply is returned as an :class:`ErrorReply`), all
        by ``deadline`` (``time.monotonic()`` seconds; default ``timeout_s`` from now): for the tools' admin commands
        (INFO, CONFIG GET, ...). ``idempotent``: retried as :meth:`_run` says (read-only commands)."""
        return self._run(pipeline_op(commands, limits), idempotent=idempotent, deadline=deadline)

    def batched_set(self, keys: Sequence[str | bytes], values: Sequence[Any], ttl_s: int | None = None) -> None:
        """SET every key to its value (bytes-like) in one pipeline; with ``ttl_s`` (whole seconds) ``SET ... EX ttl_s``.

        Retried once on a fresh connection when a pooled one fails before any
        reply byte. That is safe because SET is idempotent here: the retry
        writes the same bytes under the same keys, so whether the first
        attempt reached the server or not, the end state is the same (and a
        chunk key names its content: any writer of it writes these bytes).
        """
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        if ttl_s is not None and (isinstance(ttl_s, bool) or not isinstance(ttl_s, int) or ttl_s <= 0):
            raise ValueError(f"ttl_s must be a positive whole number of seconds, got {ttl_s!r}")
        if not keys:
            return
        kbytes = [key_bytes(k) for k in keys]
        views = [memoryview(v).cast("B") if not isinstance(v, (bytes, bytearray)) else v for v in values]
        head = b"*3\r\n$3\r\nSET\r\n"
        tail = CRLF
        if ttl_s is not None:
            ttl = str(ttl_s).encode()
            head = b"*5\r\n$3\r\nSET\r\n"
            tail = b"\r\n$2\r\nEX\r\n$%d\r\n%s\r\n" % (len(ttl), ttl)

        def op(conn: Connection) -> None:
            parts: list[Any] = []
            out = bytearray()
            for k, v in zip(kbytes, views):
                out += head + b"$%d\r\n%s\r\n$%d\r\n" % (len(k), k, len(v))
                if len(v) < SMALL_WRITE:
                    out += v
                else:
                    parts.append(out)
                    parts.append(v)
                    out = bytearray()
                out += tail
            parts.append(out)
            conn.send(parts)
            errors = []
            for _ in kbytes:
                kind, value = conn.read_simple()
                if kind == b"-":
                    errors.append(value)
                elif kind != b"+":
                    raise RespProtocolError(f"unexpected reply to SET: {kind + value!r}")
            raise_if_error(conn, errors)

        self._run(op, idempotent=True)  # safe to repeat: same keys, same bytes (see the docstring)

    def batched_exists(self, keys: Sequence[str | bytes]) -> list[bool]:
        """Whether each key exists, in one pipeline of per-key EXISTS."""
        if not keys:
            return []
        out = bytearray()
        for k in keys:
            kb = key_bytes(k)
            out += b"*2\r\n$6\r\nEXISTS\r\n$%d\r\n%s\r\n" % (len(kb), kb)

        def op(conn: Connection) -> list[bool]:
            conn.send([out])
            found: list[bool] = []
            errors = []
            for _ in keys:
                kind, value = conn.read_simple()
                if kind == b":":
                    found.append(int_reply(value, "EXISTS") > 0)
                elif kind == b"-":
                    errors.append(value)
                    found.append(False)
                else:
                    raise RespProtocolError(f"unexpected reply to EXISTS: {kind + value!r}")
            raise_if_error(conn, errors)
            return found

        return self._run(op, idempotent=True)

    def batched_get(self, keys: Sequence[str | bytes], buffers: Sequence[Any], *, split: bool = True) -> list[bool]:
        """GET every key into its writable buffer; True = filled, False = miss.

        A missing key (``$-1``) and a value whose length differs from its
        buffer are misses; the reply is consumed in full either way and the
        connection stays usable. A missed buffer's contents are unspecified
        only in that no bytes are written to it. ``split=False``: one pipeline
        on one connection whatever its size (a caller that runs a lane per
        connection itself: a split would queue behind the other lanes).
        """
        return self._get(keys, buffers, self._deadline(), split)

    def _get(self, keys: Sequence[str | bytes], buffers: Sequence[Any], deadline: float, split: bool = True) -> list[bool]:
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        if not keys:
            return []
        views = []
        for i, b in enumerate(buffers):
            mv = memoryview(b)
            if mv.readonly:
                raise ValueError(f"buffer {i} is read-only; batched_get needs writable buffers")
            if not mv.contiguous:
                raise ValueError(f"buffer {i} is not contiguous")
            views.append(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv)
        total = sum(len(v) for v in views)
        parts = min(self.parallel_gets, len(views), total // _PARALLEL_MIN_PART_BYTES) if split else 1
        if parts >= 2 and total >= _PARALLEL_MIN_BYTES:
            return self._get_split(keys, views, parts, deadline)
        # a retry happens only before any reply byte, so no buffer was written yet
        return self._run(get_op(keys, views), idempotent=True, deadline=deadline)

    def _get_split(self, keys: Sequence[str | bytes], views: list[memoryview], parts: int, deadline: float) -> list[bool]:
        """:meth:`_get` as ``parts`` sub-batches (keys ``i, i + parts, ...``) on as many connections at once.

        Sub-batch 0 runs on the caller's thread, the others on the client's
        GET threads, each through :meth:`_run` (its own retry) with the
        call's deadline. The caller waits for all of them until the deadline
        (plus the sockets' re-arm slack); one still running then is aborted
        (:meth:`Fanout.abort`: its reads end, and nothing is written into
        the buffers after this returns). Errors are raised as the serial call
        would: a connection/protocol error before an error reply, the first
        sub-batch's first.
        """
        fanout = Fanout()
        groups = [range(i, len(keys), parts) for i in range(parts)]

        def sub(group: range) -> list[bool]:
            op = get_op([keys[i] for i in group], [views[i] for i in group], fanout)
            return self._run(op, idempotent=True, deadline=deadline)

        pool = self._gets_executor()
        futures: list[Future] = []
        outcomes: list[Any] = [None] * parts
        abandoned = False
        try:
            for group in groups[1:]:
                try:
                    futures.append(pool.submit(sub, group))
                except RuntimeError:  # close() shut the pool down
                    raise RespClosedError("RespClient is closed") from None
            try:
                outcomes[0] = sub(groups[0])
            except RespError as exc:
                outcomes[0] = exc
            grace = self.timeout_s * REARM_FRACTION + 0.01  # a socket timeout may fire this late
            wait_all(futures, timeout=max(0.0, deadline - time.monotonic()) + grace)
        finally:
            if not all(f.done() for f in futures):
                abandoned = True
                fanout.abort()  # returns once no sub-batch can write into the buffers
                for f in futures:
                    f.cancel()
        late = RespTimeout(f"call to {self.url.host}:{self.url.port} exceeded its {self.timeout_s:g}s deadline")
        for i, f in enumerate(futures, 1):
            if f.cancelled():  # by the abort above, or queued when close() shut the pool down
                outcomes[i] = late if abandoned else RespClosedError("RespClient is closed")
            elif not f.done():
                outcomes[i] = late  # still connecting: aborted, it can no longer enter
            else:
                outcomes[i] = f.exception() or f.result()
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        if errors:
            raise next((e for e in errors if not isinstance(e, RespServerError)), errors[0])
        filled = [False] * len(keys)
        for group, got in zip(groups, outcomes):
            for i, ok in zip(group, got):
                filled[i] = ok
        return filled

    def _gets_executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise RespClosedError("RespClient is closed")
            if self._get_pool is None:
                self._get_pool = ThreadPoolExecutor(self.parallel_gets - 1, thread_name_prefix="resp-get")
            return self._get_pool

    def delete(self, keys: Sequence[str | bytes]) -> int:
        """DEL the keys; the number removed."""
        if not keys:
            return 0
        out = bytearray()
        encode_command(out, b"DEL", *[key_bytes(k) for k in keys])

        def op(conn: Connection) -> int:
            conn.send([out])
            kind, value = conn.read_simple()
            raise_if_error(conn, [value] if kind == b"-" else [])
            if kind != b":":
                raise RespProtocolError(f"unexpected reply to DEL: {kind + value!r}")
            return int_reply(value, "DEL")

        return self._run(op)
