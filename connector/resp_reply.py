"""Any RESP2 reply, read whole and bounded: the replies to the admin commands kvctl's tools send through
:meth:`kvctl.connector.resp.RespClient.execute` (INFO, CONFIG GET, RANDOMKEY, STRLEN, DBSIZE, PING).

A reply becomes plain data, each RESP2 type its own Python type, so a caller can tell what it was answered:
a simple string is ``str``, a bulk string ``bytes``, a null bulk or null array ``None``, an integer ``int``,
an array ``list``, an error reply an :class:`ErrorReply` (returned, not raised: the caller judges it, and the
connection stays in sync). :class:`ReplyLimits` bounds what one call may read: its bytes (lines and bulk
payloads together, each bulk refused at its header), its array elements, and how deep arrays nest. Past any
of them the call fails with :class:`~kvctl.connector.resp_errors.RespProtocolError` before the bytes are read
(the connection is dropped).

No click, no rich: this module runs inside engine processes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

from .resp_codec import encode_command
from .resp_conn import Connection
from .resp_errors import RespProtocolError

__all__ = ["ErrorReply", "ReplyLimits", "pipeline_op"]

_INTEGER = re.compile(rb"-?[0-9]{1,20}")


@dataclass(frozen=True)
class ErrorReply:
    """An error reply (``-ERR ...``, ``-NOAUTH ...``): its text without the ``-``."""

    message: str


@dataclass(frozen=True)
class ReplyLimits:
    """What the replies of one call may hold, all of them together."""

    max_bytes: int = 1 << 20
    max_elements: int = 1 << 16
    max_depth: int = 4


class _Budget:
    def __init__(self, limits: ReplyLimits, where: str) -> None:
        self.limits, self.where = limits, where
        self.bytes_left, self.elements_left = limits.max_bytes, limits.max_elements

    def take(self, n_bytes: int, n_elements: int = 0) -> None:
        self.bytes_left -= n_bytes
        self.elements_left -= n_elements
        if self.bytes_left < 0:
            raise RespProtocolError(f"a reply of more than {self.limits.max_bytes} bytes from {self.where}")
        if self.elements_left < 0:
            raise RespProtocolError(f"a reply of more than {self.limits.max_elements} array elements from {self.where}")


def _read(conn: Connection, budget: _Budget, depth: int) -> Any:
    line = conn.read_line()
    budget.take(len(line) + 2)
    kind, rest = line[:1], line[1:]
    if kind == b"+":
        return rest.decode("utf-8", "replace")
    if kind == b"-":
        return ErrorReply(rest.decode("utf-8", "replace"))
    if kind in (b":", b"$", b"*"):
        if not _INTEGER.fullmatch(rest):
            raise RespProtocolError(f"a malformed {kind.decode()} line from {budget.where}: {line[:40]!r}")
        n = int(rest)
    else:
        raise RespProtocolError(f"a reply of type {kind!r} (not RESP2) from {budget.where}: {line[:40]!r}")
    if kind == b":":
        return n
    if n < -1:
        raise RespProtocolError(f"a negative length from {budget.where}: {line[:40]!r}")
    if n == -1:
        return None
    if kind == b"$":
        budget.take(n + 2)
        buf = bytearray(n)
        conn.read_exact_into(memoryview(buf), crlf=True)
        return bytes(buf)
    if depth >= budget.limits.max_depth:
        raise RespProtocolError(f"arrays nested deeper than {budget.limits.max_depth} from {budget.where}")
    budget.take(0, n)
    return [_read(conn, budget, depth + 1) for _ in range(n)]


def _arg(a: bytes | str | int) -> bytes:
    return a if isinstance(a, bytes) else str(a).encode()


def pipeline_op(commands: Sequence[Sequence[bytes | str | int]], limits: ReplyLimits):
    """The operation of one :meth:`RespClient.execute` call: send ``commands`` at once, read one reply each."""
    out = bytearray()
    for cmd in commands:
        encode_command(out, *[_arg(a) for a in cmd])

    def op(conn: Connection) -> list[Any]:
        conn.send([out])
        budget = _Budget(limits, f"{conn.url.host}:{conn.url.port}")
        return [_read(conn, budget, 0) for _ in commands]

    return op
