"""Exceptions of the RESP client; all are ``KvctlError`` so the CLI prints one line."""

from __future__ import annotations

from kvctl.core.errors import KvctlError, Unreachable


class RespError(KvctlError):
    """Any failure of the RESP client."""


class RespConnectionError(RespError, Unreachable):
    """Could not connect, or the server closed the connection mid-reply."""


class RespTimeout(RespConnectionError):
    """A socket operation (connect, send, receive) exceeded ``timeout_s``."""


class RespProtocolError(RespError):
    """The server sent bytes that are not the RESP2 reply expected (truncated, garbage type byte...)."""


class RespServerError(RespError):
    """The server answered with an error reply (``-ERR ...``); the connection stays usable."""


class RespAuthError(RespServerError):
    """AUTH (password or ACL user) was refused, or the server requires it."""


class RespClosedError(RespError):
    """The client was used after :meth:`RespClient.close`."""
