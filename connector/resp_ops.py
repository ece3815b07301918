"""The pipelined replies of :class:`kvctl.connector.resp.RespClient`'s commands: GET into caller buffers, the
sub-batches of a split GET, and error replies (no click, no rich: this runs inside engine processes)."""

from __future__ import annotations

import socket
import threading
from concurrent.futures import Future
from typing import Sequence

from .resp_codec import key_bytes
from .resp_conn import Connection
from .resp_errors import RespAuthError, RespProtocolError, RespServerError, RespTimeout


class Fanout:
    """The sub-batches of one split ``batched_get``: their connections, so the caller can cut their reads off.

    A sub-batch writes into caller buffers only between :meth:`enter` and
    :meth:`leave`. :meth:`abort` refuses later entries, shuts down the sockets
    of the entered ones (a blocked ``recv_into`` returns at once) and returns
    only when every one has left: after it, no thread writes into the buffers.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._conns: set[Connection] = set()
        self._aborted = False

    def enter(self, conn: Connection) -> None:
        with self._cond:
            if self._aborted:
                raise RespTimeout(f"call to {conn.where()} exceeded its {conn.timeout_s:g}s deadline")
            self._conns.add(conn)

    def leave(self, conn: Connection) -> None:
        with self._cond:
            self._conns.discard(conn)
            self._cond.notify_all()

    def abort(self) -> None:
        with self._cond:
            self._aborted = True
            while self._conns:
                for conn in self._conns:
                    conn.broken = True  # never pooled again
                    try:
                        # the plain socket's shutdown, also under TLS (SSLSocket.shutdown would drop its SSL object)
                        socket.socket.shutdown(conn.sock, socket.SHUT_RDWR)
                    except OSError:
                        pass
                # after shutdown(2) each reader's recv returns within one syscall; re-shut while waiting
                self._cond.wait(0.1)


def wait_all(futures: Sequence[Future], timeout: float) -> None:
    """Wait until every future is done or ``timeout`` passes.

    Unlike ``concurrent.futures.wait``, a future cancelled by ``Future.cancel()``
    (close() shutting the GET threads down with ``cancel_futures``) wakes the
    wait: its done-callbacks run, ``wait`` is only told of ``set_running_or_notify_cancel``.
    """
    if not futures:
        return
    all_done = threading.Event()

    def check(_f: Future) -> None:
        if all(f.done() for f in futures):
            all_done.set()

    for f in futures:
        f.add_done_callback(check)
    all_done.wait(timeout)


def get_op(keys: Sequence[str | bytes], views: Sequence[memoryview], fanout: Fanout | None = None):
    """The pipelined GETs of ``keys`` into ``views``, as an op for :meth:`RespClient._run`.

    With ``fanout`` (a sub-batch of a split call) the connection is entered
    in it for as long as the op may write into the buffers.
    """
    out = bytearray()
    for k in keys:
        kb = key_bytes(k)
        out += b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(kb), kb)

    def op(conn: Connection) -> list[bool]:
        if fanout is not None:
            fanout.enter(conn)
        try:
            conn.send([out])
            filled: list[bool] = []
            errors = []
            for view in views:
                kind, length = conn.read_bulk_header()
                if kind == b"-":
                    errors.append(conn.last_error)
                    filled.append(False)
                elif length == -1:
                    filled.append(False)  # bug 2: null bulk = per-key miss, nothing more to read
                elif length == len(view):
                    conn.read_exact_into(view, crlf=True)
                    filled.append(True)
                else:
                    conn.discard(length)  # size mismatch: a miss, but consume the value
                    conn.expect_crlf()
                    filled.append(False)
            raise_if_error(conn, errors)
            return filled
        finally:
            if fanout is not None:
                fanout.leave(conn)

    return op


def int_reply(value: bytes, command: str) -> int:
    """The integer of a ``:`` reply line; anything else is a protocol error, not a ValueError."""
    try:
        return int(value)
    except ValueError:
        raise RespProtocolError(f"bad integer reply to {command}: {value[:40]!r}") from None


def raise_if_error(conn: Connection, errors: list[bytes]) -> None:
    """After a pipeline's replies are all read, turn the first error reply into an exception."""
    if not errors:
        return
    msg = errors[0].decode(errors="replace")
    where = f"{conn.url.host}:{conn.url.port}"
    if errors[0].startswith((b"NOAUTH", b"WRONGPASS", b"NOPERM")):
        raise RespAuthError(f"{where}: {msg}")
    raise RespServerError(f"{where}: {msg}")
