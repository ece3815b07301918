"""One RESP2 connection: socket, TLS, AUTH/SELECT, framing and the deadline of a call (paper §5.4).

:class:`~kvctl.connector.resp.RespClient` pools these. The rules a
connection keeps (the client's module docstring has the whole list):

* reads go into caller buffers with ``recv_into``; bulk headers are parsed up
  to CRLF, so the 5-byte ``$-1`` of a missing key never blocks a reader
  (bug 2 of §5.4);
* one deadline for a whole call, re-armed on the socket only when it drifts
  by more than :data:`REARM_FRACTION` of the call's budget;
* a bulk longer than ``max_bulk_bytes`` is a protocol error at its header;
* on Linux, over plain TCP, the rest of a large payload is read with
  ``MSG_WAITALL`` on the blocking socket, bounded by ``SO_RCVTIMEO``: one
  syscall, the GIL released for all of it (issue 45: beside a thread that holds
  the GIL, each of the dozens of ``recv_into`` an 8 MB value otherwise takes
  waits to take the GIL back);
* :meth:`Connection.in_sync` / :meth:`Connection.reusable` say whether the
  pool may hand it out again.

No click, no rich: this module runs inside engine processes.
"""

from __future__ import annotations

import select
import socket
import ssl
import struct
import sys
import time
from typing import Any, Iterable

from .resp_codec import CRLF, MAX_LINE, encode_command, parse_bulk_header, parse_simple
from .resp_errors import (
    RespAuthError,
    RespConnectionError,
    RespProtocolError,
    RespServerError,
    RespTimeout,
)
from .urls import InvalidUrl, RespUrl

__all__ = ["MAX_BULK_BYTES", "REARM_FRACTION", "Connection", "make_ssl_context"]

_READ_CHUNK = 256 * 1024  # internal buffer for headers; payloads bypass it
_DISCARD_CHUNK = 1024 * 1024
MAX_BULK_BYTES = 512 * 1024 * 1024  # Valkey's default proto-max-bulk-len: no real server sends more
# The socket timeout is re-armed to the time left before a blocking call once it
# exceeds that by more than this fraction of the call's budget: a call overruns
# its deadline by at most 2 %, without a settimeout() per recv of a large value.
REARM_FRACTION = 0.02
# Payload left to read from which read_exact_into waits for all of it in the kernel (MSG_WAITALL): below it the
# buffered path's few recv_into cost less than the two mode switches.
WAITALL_MIN_BYTES = 256 * 1024
#: MSG_WAITALL with a receive timeout (SO_RCVTIMEO: a struct timeval of two longs) as Linux has them
WAITALL_OK = sys.platform.startswith("linux") and hasattr(socket, "MSG_WAITALL") and hasattr(socket, "SO_RCVTIMEO")


def make_ssl_context(url: RespUrl) -> ssl.SSLContext:
    """The stdlib TLS context for a ``rediss://`` URL (verification on unless ``ssl_cert_reqs=none``)."""
    try:
        ctx = ssl.create_default_context(cafile=url.ssl_ca_certs)
    except (OSError, ssl.SSLError) as e:
        raise InvalidUrl(f"cannot load the TLS CA file {url.ssl_ca_certs!r} of {url.redacted()}: {e}") from e
    if not url.ssl_verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def _open_socket(host: str, port: int, deadline: float) -> socket.socket:
    """TCP connect to the first address of ``host:port`` that answers, all attempts within ``deadline``.

    Name resolution (``getaddrinfo``) is the OS resolver's and is not bounded
    here; URLs for the tier are IP addresses or names resolved from local files.
    """
    err: OSError | None = None
    for family, kind, proto, _, addr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("connect deadline passed")
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(left)
            sock.connect(addr)
            return sock
        except OSError as exc:
            sock.close()
            err = exc
            if isinstance(exc, socket.timeout):
                raise
    raise err if err is not None else OSError(f"no address for {host}")


class Connection:
    """One socket plus a small read buffer. Not thread-safe; the pool hands it to one caller.

    Every blocking operation is bounded by ``deadline`` (``time.monotonic()``
    seconds), which :meth:`begin` sets for each call; ``budget_s`` is the
    call's whole budget, for messages. ``replied`` turns True at the first
    reply byte of the call (a call that failed before it may be retried).
    """

    def __init__(
        self,
        url: RespUrl,
        timeout_s: float,
        ssl_context: ssl.SSLContext | None,
        deadline: float | None = None,
        max_bulk_bytes: int = MAX_BULK_BYTES,
    ) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.max_bulk_bytes = max_bulk_bytes
        self._rbuf = bytearray(_READ_CHUNK)
        self._rview = memoryview(self._rbuf)
        self._rpos = 0
        self._rend = 0
        self.broken = False
        self.replied = False
        self.last_error = b""
        self.deadline = time.monotonic() + timeout_s if deadline is None else deadline
        self._sock_timeout = 0.0
        self.waitall = WAITALL_OK and not url.tls
        where = f"{url.host}:{url.port}"
        try:
            sock = _open_socket(url.host, url.port, self.deadline)
        except socket.timeout:
            raise RespTimeout(f"connect to {where} timed out after {timeout_s:g}s") from None
        except OSError as exc:
            raise RespConnectionError(f"cannot connect to {where}: {exc.strerror or exc}") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if url.tls:
                sock.settimeout(max(1e-3, self.deadline - time.monotonic()))
                ctx = ssl_context or make_ssl_context(url)
                sock = ctx.wrap_socket(sock, server_hostname=url.host)
        except ssl.SSLError as exc:
            sock.close()
            raise RespConnectionError(f"TLS handshake with {where} failed: {exc}") from None
        except socket.timeout:
            sock.close()
            raise RespTimeout(f"TLS handshake with {where} timed out after {timeout_s:g}s") from None
        except OSError as exc:
            sock.close()
            raise RespConnectionError(f"cannot set up connection to {where}: {exc}") from None
        self.sock = sock
        try:
            self.begin(self.deadline, timeout_s)
            self._handshake()
            self.replied = False  # AUTH/SELECT replies are not the call's reply
        except BaseException:
            self.close()
            raise

    # -- setup -----------------------------------------------------------------
    def _handshake(self) -> None:
        out = bytearray()
        n = 0
        if self.url.password is not None:
            if self.url.username:
                encode_command(out, b"AUTH", self.url.username.encode(), self.url.password.encode())
            else:
                encode_command(out, b"AUTH", self.url.password.encode())
            n += 1
        if self.url.db:
            encode_command(out, b"SELECT", str(self.url.db).encode())
            n += 1
        if not n:
            return
        self.send([out])
        errors = []
        for _ in range(n):
            kind, value = self.read_simple()
            if kind == b"-":
                errors.append(value)
        if errors:
            msg = errors[0].decode(errors="replace")
            if any(e.startswith((b"WRONGPASS", b"NOAUTH", b"ERR AUTH", b"NOPERM")) or b"password" in e for e in errors):
                raise RespAuthError(f"authentication to {self.url.host}:{self.url.port} refused: {msg}")
            raise RespServerError(f"connection setup on {self.url.host}:{self.url.port} failed: {msg}")

    def close(self) -> None:
        self.broken = True
        try:
            self.sock.close()
        except (OSError, AttributeError):
            pass

    # -- one call ----------------------------------------------------------------
    def begin(self, deadline: float, budget_s: float) -> None:
        """Start a call that must end by ``deadline`` (its whole budget is ``budget_s``)."""
        self.deadline = deadline
        self.timeout_s = budget_s
        self.replied = False
        self._slack = budget_s * REARM_FRACTION
        self._arm(fresh=True)

    def _arm(self, fresh: bool = False) -> None:
        """Before a blocking operation: fail if the deadline passed, else bound the socket by the time left.

        Within a call the time left only shrinks, so the socket timeout is
        lowered once it exceeds it by the slack. At a call's start (``fresh``)
        it is also raised when it is shorter by more than the slack; a reused
        connection whose last call was short keeps its timeout (no syscall).
        """
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise RespTimeout(f"call to {self.where()} exceeded its {self.timeout_s:g}s deadline")
        if self._sock_timeout - left > self._slack or (fresh and left - self._sock_timeout > self._slack):
            self.sock.settimeout(left)
            self._sock_timeout = left

    def in_sync(self) -> bool:
        """No reply bytes left in the read buffer after the call (else they would be the next call's reply)."""
        return not self.broken and self._rpos == self._rend

    def reusable(self) -> bool:
        """Whether this idle connection may serve another call.

        Not when bytes of a reply are still buffered (they would become the
        next call's reply) or waiting in the socket, nor when the server closed
        it. One ``poll(0)``; a TLS record without application data (a
        session ticket) leaves the connection usable.
        """
        if not self.in_sync():
            return False
        try:
            poller = select.poll()
            poller.register(self.sock.fileno(), select.POLLIN)
            if not poller.poll(0):
                return not (self.url.tls and self.sock.pending())
            if not self.url.tls:
                return False  # readable while idle: unsolicited bytes, or the server closed it
            self.sock.settimeout(0.0)
            self._sock_timeout = 0.0
            self.sock.recv_into(self._rview[self._rend :], 1)
            return False  # application data (or EOF) while idle
        except ssl.SSLWantReadError:
            return True  # only a TLS record without data (a session ticket): idle and open
        except (OSError, ValueError):
            return False

    # -- low-level I/O -----------------------------------------------------------
    def where(self) -> str:
        return f"{self.url.host}:{self.url.port}"

    def send(self, parts: Iterable[Any]) -> None:
        """Write every buffer in ``parts``, in order, within the call's deadline."""
        try:
            for part in parts:
                self._arm()
                self.sock.sendall(part)  # sendall's timeout bounds the whole buffer (Python >= 3.5)
        except socket.timeout:
            raise RespTimeout(f"send to {self.where()} timed out after {self.timeout_s:g}s") from None
        except OSError as exc:
            raise RespConnectionError(f"send to {self.where()} failed: {exc}") from None

    def _no_reply(self) -> RespTimeout:
        return RespTimeout(f"no reply from {self.where()} within {self.timeout_s:g}s")

    def _recv_into(self, view: memoryview) -> int:
        self._arm()
        try:
            n = self.sock.recv_into(view)
        except socket.timeout:
            raise self._no_reply() from None
        except OSError as exc:
            raise RespConnectionError(f"receive from {self.where()} failed: {exc}") from None
        if n == 0:
            raise RespConnectionError(f"{self.where()} closed the connection mid-reply")
        self.replied = True
        return n

    def _fill(self) -> None:
        """Read more bytes into the internal buffer (compacting it first)."""
        if self._rpos == self._rend:
            self._rpos = self._rend = 0
        elif self._rend == len(self._rbuf):
            if self._rpos == 0:
                raise RespProtocolError(f"reply line from {self.where()} longer than {MAX_LINE} bytes")
            live = self._rend - self._rpos
            self._rbuf[:live] = self._rbuf[self._rpos : self._rend]
            self._rpos, self._rend = 0, live
        self._rend += self._recv_into(self._rview[self._rend :])

    def read_line(self) -> bytes:
        """One reply line without its CRLF (the header is parsed up to CRLF: bug 2)."""
        while True:
            idx = self._rbuf.find(CRLF, self._rpos, self._rend)
            if idx >= 0:
                line = bytes(self._rview[self._rpos : idx])
                self._rpos = idx + 2
                return line
            if self._rend - self._rpos > MAX_LINE:
                raise RespProtocolError(f"reply line from {self.where()} longer than {MAX_LINE} bytes")
            self._fill()

    def read_exact_into(self, dest: memoryview, crlf: bool = False) -> None:
        """Fill ``dest`` completely: buffered bytes first, then ``recv_into`` straight into it.

        With ``crlf`` the bulk's terminating CRLF is read and checked too (in the
        same ``MSG_WAITALL`` receive as the payload's rest, where that is taken).
        """
        need = len(dest)
        have = min(need, self._rend - self._rpos)
        if have:
            dest[:have] = self._rview[self._rpos : self._rpos + have]
            self._rpos += have
        pos = have
        if self.waitall and need - pos >= WAITALL_MIN_BYTES:
            self._recv_all_into(dest[pos:], crlf)
            return
        while pos < need:
            pos += self._recv_into(dest[pos:])
        if crlf:
            self.expect_crlf()

    def _recv_all_into(self, dest: memoryview, crlf: bool) -> None:
        """Fill ``dest`` (and read a CRLF after it) with ``MSG_WAITALL`` on the blocking socket, bounded by ``SO_RCVTIMEO``.

        CPython releases the GIL around each ``recv``; a nonblocking socket (how
        Python implements timeouts) returns whatever has arrived, so a multi-MB
        value comes in dozens of calls, each taking the GIL back. Blocking with
        ``MSG_WAITALL`` the kernel returns once, when all of it is there, or
        early at the receive timeout, a signal, or the peer's close; the
        deadline is re-checked after each early return. The socket's Python
        timeout is restored after. Only called with nothing buffered.
        """
        need = len(dest)
        tail = bytearray(2 if crlf else 0)
        tview = memoryview(tail)
        pos = got = 0
        sock = self.sock
        try:
            sock.settimeout(None)
            while pos < need or got < len(tail):
                left = self.deadline - time.monotonic()
                if left <= 0:
                    raise self._no_reply()
                sec = int(left)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                                struct.pack("ll", sec, max(1, int((left - sec) * 1e6))))
                bufs = [dest[pos:]] if pos < need else []
                if got < len(tail):
                    bufs.append(tview[got:])
                try:
                    n = sock.recvmsg_into(bufs, 0, socket.MSG_WAITALL)[0]
                except BlockingIOError:  # EAGAIN: the receive timeout passed with nothing read
                    raise self._no_reply() from None
                if n == 0:
                    raise RespConnectionError(f"{self.where()} closed the connection mid-reply")
                self.replied = True
                into_dest = min(n, need - pos)
                pos += into_dest
                got += n - into_dest
        except OSError as exc:
            raise RespConnectionError(f"receive from {self.where()} failed: {exc}") from None
        finally:
            try:
                sock.settimeout(self._sock_timeout)
            except OSError:
                self.broken = True
        if crlf and tail != CRLF:
            raise RespProtocolError(f"bulk reply from {self.where()} not terminated by CRLF")

    def discard(self, n: int) -> None:
        """Consume and drop ``n`` bytes of reply."""
        have = min(n, self._rend - self._rpos)
        self._rpos += have
        n -= have
        if n:
            scratch = memoryview(bytearray(min(n, _DISCARD_CHUNK)))
            while n:
                n -= self._recv_into(scratch[: min(n, len(scratch))])

    def expect_crlf(self) -> None:
        while self._rend - self._rpos < 2:
            self._fill()
        if self._rbuf[self._rpos : self._rpos + 2] != CRLF:
            raise RespProtocolError(f"bulk reply from {self.where()} not terminated by CRLF")
        self._rpos += 2

    def read_simple(self) -> tuple[bytes, bytes]:
        """A one-line reply: (type byte, rest of the line). Bulk/array replies are protocol errors here."""
        return parse_simple(self.read_line(), self.where())

    def read_bulk_header(self) -> tuple[bytes, int]:
        """Header of a bulk reply: ('$', length) with -1 for null, or ('-', 0) after an error line."""
        line = self.read_line()
        kind, length = parse_bulk_header(line, self.max_bulk_bytes, self.where())
        if kind == b"-":
            self.last_error = line[1:]
        return kind, length
