"""The RESP2 wire format, apart from any socket: commands to bytes, reply lines to values (pure; paper §5.4).

As redis-py keeps its parsers apart from its connections, the byte rules live here and
:class:`~kvctl.connector.resp_conn.Connection` only moves bytes: it reads a line up to CRLF and hands it to
:func:`parse_bulk_header` or :func:`parse_simple`, so the 5-byte ``$-1`` of a missing key is a whole reply
(bug 2 of §5.4) whatever the socket does. Tested with byte strings alone (tests/connector/test_resp_codec.py).

No click, no rich: this module runs inside engine processes.
"""

from __future__ import annotations

from .resp_errors import RespProtocolError

__all__ = ["CRLF", "MAX_LINE", "SMALL_WRITE", "encode_command", "key_bytes", "parse_bulk_header", "parse_simple"]

CRLF = b"\r\n"
MAX_LINE = 64 * 1024  # a header/status line longer than this is malformed
SMALL_WRITE = 64 * 1024  # values smaller than this are copied into the command buffer


def encode_command(out: bytearray, *args: bytes) -> None:
    """Append one RESP2 array-of-bulk-strings command to ``out``."""
    out += b"*%d\r\n" % len(args)
    for a in args:
        out += b"$%d\r\n" % len(a)
        out += a
        out += CRLF


def key_bytes(key: str | bytes) -> bytes:
    """A key as the bytes a command carries (text as UTF-8)."""
    return key.encode() if isinstance(key, str) else bytes(key)


def parse_bulk_header(line: bytes, max_bulk: int, where: str) -> tuple[bytes, int]:
    """The header line of a bulk reply (CRLF stripped): ``(b"$", length)`` with -1 for a null bulk (a miss), or
    ``(b"-", 0)`` for an error line (its text is ``line[1:]``). A length past ``max_bulk`` (Valkey's
    ``proto-max-bulk-len``), a bad number or another reply type is a :class:`RespProtocolError` naming ``where``."""
    kind = line[:1]
    if kind == b"$":
        try:
            length = int(line[1:])
        except ValueError:
            raise RespProtocolError(f"bad bulk length from {where}: {line[:40]!r}") from None
        if length < -1:
            raise RespProtocolError(f"bad bulk length from {where}: {line[:40]!r}")
        if length > max_bulk:
            raise RespProtocolError(
                f"bulk of {length} bytes from {where} exceeds the {max_bulk}-byte cap (proto-max-bulk-len)")
        return b"$", length
    if kind == b"-":
        return b"-", 0
    raise RespProtocolError(f"unexpected reply type {kind!r} to GET from {where}: {line[:40]!r}")


def parse_simple(line: bytes, where: str) -> tuple[bytes, bytes]:
    """A one-line reply (CRLF stripped): ``(type byte, rest of the line)`` for ``+``, ``-`` and ``:``; anything
    else (a bulk, an array, an empty line) is a :class:`RespProtocolError` here."""
    if not line:
        raise RespProtocolError(f"empty reply line from {where}")
    kind = line[:1]
    if kind not in (b"+", b"-", b":"):
        raise RespProtocolError(f"unexpected reply type {kind!r} from {where}: {line[:40]!r}")
    return kind, line[1:]
