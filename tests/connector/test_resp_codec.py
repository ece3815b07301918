"""The RESP2 wire format alone (connector/resp_codec.py): byte strings in, values out, no socket and no server."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from kvctl.connector.resp_codec import encode_command, key_bytes, parse_bulk_header, parse_simple
from kvctl.connector.resp_errors import RespProtocolError


def test_a_command_is_an_array_of_bulk_strings():
    out = bytearray()
    encode_command(out, b"GET", key_bytes("m@f@w0@ab"))
    assert bytes(out) == b"*2\r\n$3\r\nGET\r\n$9\r\nm@f@w0@ab\r\n"


@given(st.lists(st.binary(max_size=40), min_size=1, max_size=6))
def test_any_argument_round_trips_through_the_framing(args):
    out = bytearray()
    encode_command(out, *args)
    head, rest = bytes(out).split(b"\r\n", 1)
    assert head == b"*%d" % len(args)
    for a in args:
        kind, length = parse_bulk_header(rest.split(b"\r\n", 1)[0], 1 << 20, "t")
        rest = rest.split(b"\r\n", 1)[1]
        assert (kind, rest[:length], rest[length : length + 2]) == (b"$", a, b"\r\n")
        rest = rest[length + 2 :]
    assert rest == b""


def test_a_missing_key_is_a_whole_null_bulk():
    """Bug 2 of the paper's §5.4: ``$-1`` is the whole reply, never a header to read more bytes for."""
    assert parse_bulk_header(b"$-1", 100, "t") == (b"$", -1)
    assert parse_bulk_header(b"$0", 100, "t") == (b"$", 0)
    assert parse_bulk_header(b"-ERR wrong", 100, "t") == (b"-", 0)


@pytest.mark.parametrize("line, why", [(b"$-2", "bad bulk length"), (b"$x", "bad bulk length"), (b"$101", "exceeds"),
                                       (b"*1", "unexpected reply type"), (b":5", "unexpected reply type")])
def test_a_bad_bulk_header_is_a_protocol_error_naming_the_server(line, why):
    with pytest.raises(RespProtocolError, match=why) as e:
        parse_bulk_header(line, 100, "127.0.0.1:7")
    assert "127.0.0.1:7" in str(e.value)


def test_simple_replies_and_what_they_are_not():
    assert parse_simple(b"+OK", "t") == (b"+", b"OK")
    assert parse_simple(b":42", "t") == (b":", b"42")
    assert parse_simple(b"-NOAUTH x", "t") == (b"-", b"NOAUTH x")
    for bad in (b"", b"$3", b"*2"):
        with pytest.raises(RespProtocolError):
            parse_simple(bad, "t")
