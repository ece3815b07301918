"""Talking HTTP to an engine (vLLM's API server): credentials, masking, and a bounded GET.

One place for the three things every reader of an engine URL needs (``diagnose``, ``exporter``,
``doctor``, ``replay``):

* **credentials** — ``http://USER:PASS@host:8000`` becomes HTTP basic auth (an ``Authorization``
  header; the user info is never sent as part of the host), and an API key (vLLM's ``--api-key``)
  from ``--engine-api-key-file`` or ``$KVCTL_ENGINE_API_KEY`` becomes ``Authorization: Bearer``.
  Credentials in the URL win for that URL.
* **masking** — :func:`masked` hides the password and the values of secret-looking query
  parameters (:data:`SECRET_NAME_PARTS`: ``access_token``, ``jwt``, ``bearer``, ``api_key``, ...) in every
  URL kvctl prints, labels or saves.
* **a bounded read** — :func:`get` reads at most ``max_bytes`` (``--max-metrics-bytes``,
  16 MiB by default) within one deadline for the whole answer; an :class:`Inflight` registry
  lets a stopping exporter cut every open read at once.
"""

from __future__ import annotations

import base64
import http.client
import io
import os
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, quote, unquote, urlencode, urljoin, urlsplit, urlunsplit

from kvctl.core import files
from kvctl.core.errors import InvalidInput, Unreachable
from kvctl.core.thresholds import METRICS_MAX_BYTES

API_KEY_ENV = "KVCTL_ENGINE_API_KEY"
MASK = "***"
#: A query parameter whose name holds one of these (any case, anywhere in the name: ``access_token``,
#: ``X-Amz-Signature``, ``id_jwt``, ``client_secret``, ``passwd``) has its value masked in every URL
#: kvctl prints, labels or saves (docs/reliability.md lists them).
SECRET_NAME_PARTS = ("token", "jwt", "bearer", "key", "secret", "pass", "pwd", "auth", "sig", "cred", "session", "cookie",
                     "otp", "code", "ticket", "nonce", "hmac", "private")
_SECRET_PARAM = re.compile("|".join(SECRET_NAME_PARTS), re.I)
#: what :class:`TooLarge` errors say, so an analysis can tell "over the cap" from "down"
TOO_LARGE = "over the /metrics size cap"
MAX_REDIRECTS = 3
_API_KEY_MAX_BYTES = 4096


class TooLarge(Unreachable):
    """The engine's answer is larger than the cap: refused, the read stopped at the cap."""


def secret_name(name: str) -> bool:
    """Whether a parameter or variable named ``name`` holds a secret by its name (:data:`SECRET_NAME_PARTS`)."""
    return _SECRET_PARAM.search(name) is not None


def masked(url: str) -> str:
    """``url`` with its password and secret-looking query values replaced by ``***`` (for messages, labels, files)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(unparseable URL: not shown)"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user, has_pw, _ = userinfo.partition(":")
        netloc = f"{user}:{MASK}@{host}" if has_pw else f"{MASK}@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, MASK if secret_name(k) else v) for k, v in pairs], safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def split_credentials(url: str) -> tuple[str, str | None]:
    """(``url`` without user info, the ``Authorization: Basic`` value it carried or None)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url, None
    userinfo, host = parts.netloc.rsplit("@", 1)
    user, _, password = userinfo.partition(":")
    token = base64.b64encode(f"{unquote(user)}:{unquote(password)}".encode()).decode()
    return urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment)), f"Basic {token}"


def read_api_key(path: str | None) -> str | None:
    """The engine API key: the first line of ``path`` (a regular file, never quoted in errors), else
    ``$KVCTL_ENGINE_API_KEY``, else None."""
    if path:
        key = files.read_regular(path, "--engine-api-key-file", _API_KEY_MAX_BYTES, newline=None).strip()
        if not key or "\n" in key:
            raise InvalidInput(f"--engine-api-key-file {path} must hold one line, the key")
        return key
    return os.environ.get(API_KEY_ENV) or None


class _DeadlineReader(io.RawIOBase):
    """A socket read for http.client under one deadline: every read gets only what is left of it, so an
    answer that drips (a byte of its status line every few hundred ms) cannot outlast it."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self._sock, self._deadline = sock, deadline
        self._raw = sock.makefile("rb", buffering=0)  # holds the socket open after http.client lets go of it

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int | None:  # noqa: ANN001 - a writable buffer
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the deadline for the whole answer passed")
        self._sock.settimeout(left)
        return self._raw.readinto(b)

    def close(self) -> None:
        if not self.closed:
            self._raw.close()
        super().close()


class _DeadlineSocket:
    """The connection's socket as :class:`http.client.HTTPResponse` sees it: reads through a
    :class:`_DeadlineReader` (status line, headers and body alike); everything else is the socket's."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock, self._deadline = sock, deadline

    def makefile(self, mode: str = "rb", *args: object, **kwargs: object) -> io.BufferedReader:
        return io.BufferedReader(_DeadlineReader(self._sock, self._deadline))

    def __getattr__(self, name: str) -> object:
        return getattr(self._sock, name)


class Inflight:
    """The sockets being read now; :meth:`cancel` shuts them so every blocked read returns at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self.cancelled = threading.Event()

    def add(self, sock: socket.socket) -> None:
        with self._lock:
            if self.cancelled.is_set():
                raise Unreachable("kvctl is stopping: no new reads")
            self._socks.add(sock)

    def discard(self, sock: socket.socket) -> None:
        with self._lock:
            self._socks.discard(sock)

    def cancel(self) -> None:
        with self._lock:
            self.cancelled.set()
            socks = list(self._socks)
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@dataclass(frozen=True)
class EngineHttp:
    """How kvctl reads an engine: an API key (bearer) for URLs without their own credentials, the size cap,
    and the registry of reads in flight (a stopping exporter cancels them)."""

    api_key: str | None = field(default=None, repr=False)
    max_bytes: int = METRICS_MAX_BYTES
    inflight: Inflight | None = None

    def auth_header(self, url: str) -> tuple[str, dict[str, str]]:
        """(the URL to connect to, without user info; the headers carrying its credentials)."""
        bare, basic = split_credentials(url)
        if basic:
            return bare, {"Authorization": basic}
        if self.api_key:
            return bare, {"Authorization": f"Bearer {self.api_key}"}
        return bare, {}

    def get(self, url: str, timeout_s: float, accept: str = "text/plain") -> bytes:
        """GET ``url``: at most ``max_bytes`` of body, the whole answer within ``timeout_s``.

        Unreachable (with the masked URL) when it fails, answers HTTP ≥ 400 or is too slow; TooLarge past
        the cap. Redirects within the same scheme are followed (at most 3); credentials go only to the
        URL's own host.
        """
        shown = masked(url)
        bare, headers = self.auth_header(url)
        deadline = time.monotonic() + timeout_s
        origin = urlsplit(bare).netloc
        for _ in range(MAX_REDIRECTS + 1):
            status, location, body = self._get_once(bare, headers, accept, deadline, timeout_s, shown)
            if location is None:
                return body
            nxt = urljoin(bare, location)
            if urlsplit(nxt).scheme != urlsplit(bare).scheme:
                raise Unreachable(f"engine {shown} redirected to another scheme ({status}): refused")
            if urlsplit(nxt).netloc != origin:
                headers = {}
            bare = nxt
        raise Unreachable(f"engine {shown}: more than {MAX_REDIRECTS} redirects")

    def _get_once(self, url: str, headers: dict[str, str], accept: str, deadline: float, timeout_s: float, shown: str) -> tuple[int, str | None, bytes]:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidInput(f"engine URL must be http(s)://HOST[:PORT][/PATH], got {shown!r}")
        left = deadline - time.monotonic()
        if left <= 0:
            raise Unreachable(f"engine {shown} timed out: the answer was not read within {timeout_s:g} s")
        cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        try:
            conn = cls(parts.hostname, parts.port, timeout=left)
        except ValueError as e:  # a bad port
            raise InvalidInput(f"engine URL {shown!r}: {e}") from e
        target = (quote(parts.path, safe="/%:@!$&'()*+,;=~-._") or "/") + (f"?{parts.query}" if parts.query else "")
        reg = self.inflight
        sock = None
        try:
            if reg is not None and reg.cancelled.is_set():
                raise Unreachable(f"engine {shown}: not read, kvctl is stopping")
            conn.connect()
            sock = conn.sock  # kept: the connection lets go of it once the answer says "close"
            if reg is not None:
                reg.add(sock)
            conn.request("GET", target, headers={"Accept": accept, "User-Agent": "kvctl", **headers})
            conn.sock = _DeadlineSocket(sock, deadline)  # the status line and headers are read under the deadline too
            resp = conn.getresponse()
            if resp.status in (301, 302, 303, 307, 308) and resp.getheader("Location"):
                return resp.status, resp.getheader("Location"), b""
            if resp.status >= 400:
                raise Unreachable(f"engine {shown} answered HTTP {resp.status} {resp.reason}")
            chunks: list[bytes] = []
            total = 0
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Unreachable(f"engine {shown} timed out: the answer was not read within {timeout_s:g} s ({total:,} bytes so far)")
                block = resp.read1(1 << 16)
                if not block:
                    return resp.status, None, b"".join(chunks)
                total += len(block)
                if total > self.max_bytes:
                    raise TooLarge(f"engine {shown}: the answer is {TOO_LARGE} of {self.max_bytes:,} bytes (--max-metrics-bytes): refused")
                chunks.append(block)
        except Unreachable:
            raise
        except (OSError, http.client.HTTPException, TimeoutError) as e:
            if reg is not None and reg.cancelled.is_set():
                raise Unreachable(f"engine {shown}: read cut short, kvctl is stopping") from e
            if isinstance(e, (socket.timeout, TimeoutError)):
                raise Unreachable(f"engine {shown} timed out: the answer was not read within {timeout_s:g} s") from e
            reason = getattr(e, "strerror", None) or e
            raise Unreachable(f"engine {shown} unreachable: {type(e).__name__}: {reason}") from e
        finally:
            if reg is not None and sock is not None:
                reg.discard(sock)
            conn.close()
