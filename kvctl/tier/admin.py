"""Every read kvctl's tools make of a Valkey instance: one deadline for the whole read, every reply typed.

doctor, ``deploy-valkey status``, diagnose's sources, the exporter, bench's server counters, the drills and
:func:`kvctl.tier.server.start_valkey`'s readiness probe all talk to an instance through :class:`Admin`, and
nothing else in ``kvctl/`` speaks RESP to one (``tests/tier/test_server.py`` checks it).

* **The connector's own client.** An :class:`Admin` sends its commands through
  :meth:`kvctl.connector.resp.RespClient.execute`, the client the engines use (one code path for the engine,
  ``kvctl bench`` and the tools), whose deadline covers a whole call: connect, AUTH/SELECT, every send and
  every read.
* **One deadline per read of an instance.** Every command an :class:`Admin` sends shares one deadline,
  ``timeout_s`` after it was made (or after :meth:`Admin.restart`, for a client kept open between rounds): a
  server that drips its reply a byte at a time costs the caller its ``--timeout`` once, whatever it asks
  (INFO, then CONFIG GET, then key lengths), and is then :class:`TimedOut` ("timed out: no whole reply to
  INFO within 1 s"). redis-py, whose socket timeout bounds each read, not the call, is no longer used here.
* **Bounded and typed.** Replies are read within :data:`~kvctl.core.thresholds.VALKEY_REPLY_MAX_BYTES` (and
  elements, depth) and typed by :mod:`kvctl.tier.replies`; an error reply is a :class:`LoginRefused`,
  :class:`NoPermission` or :class:`~kvctl.tier.replies.BadReply`. Every failure is an
  :class:`~kvctl.tier.replies.InstanceFailure` naming the instance: each caller turns it into its per-instance
  line, never a traceback.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from kvctl.core.errors import KvctlError, Unreachable
from kvctl.core.thresholds import VALKEY_REPLY_MAX_BYTES, VALKEY_REPLY_MAX_DEPTH, VALKEY_REPLY_MAX_ELEMENTS
from kvctl.tier.replies import BadReply, InstanceFailure, describe, parse_config, parse_info

#: What to tell the user when an instance refuses the password (or wants one).
PASSWORD_HINT = "give the tier's password with --password-file FILE (mode 0600)"
_LOGIN_ERRORS = ("NOAUTH", "WRONGPASS", "Authentication required", "invalid username-password")


class AuthFailed(KvctlError):
    """A Valkey instance refused our credentials (none given, or wrong): not the same as unreachable."""


class LoginRefused(InstanceFailure, AuthFailed):
    """The instance refused the login (AUTH refused, or it wants a password that was not given)."""


class NoPermission(InstanceFailure):
    """Logged in, as a user that may not run the command (``NOPERM``): the engines' ACL user, say."""


class TimedOut(InstanceFailure, Unreachable):
    """The read did not end within its deadline: the instance is stopped, hung, or drips its reply."""


class Unanswered(InstanceFailure, Unreachable):
    """Nothing answers there (refused, reset, closed mid-reply), or the connection could not be set up."""


def is_auth_error(exc: BaseException) -> bool:
    """True for a refused login: :class:`AuthFailed`, the RESP client's RespAuthError, redis-py's
    AuthenticationError, or an error text that says NOAUTH/WRONGPASS."""
    names = {c.__name__ for c in type(exc).__mro__}
    return bool(names & {"AuthFailed", "AuthenticationError", "AuthenticationWrongNumberOfArgsError", "RespAuthError"}) or \
        str(exc).startswith(_LOGIN_ERRORS)


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class Admin:
    """Admin commands to one instance at ``url`` (``resp://``, ``redis://``, ``rediss://``: TLS, ACL user, db),
    all of them within one deadline of ``timeout_s`` from now (see :meth:`restart`). ``password`` (a
    ``--password-file``'s) wins over the URL's. Use as a context manager, or :meth:`close` it."""

    def __init__(self, url: str, timeout_s: float, password: str | None = None) -> None:
        from kvctl.connector.resp import ReplyLimits, RespClient  # noqa: PLC0415 - keep `kvctl --help` light
        from kvctl.connector.urls import parse_resp_url, with_credentials  # noqa: PLC0415

        u = parse_resp_url(url)
        self.where = f"{_bracketed(u.host)}:{u.port}"
        self.timeout_s = float(timeout_s)
        self._limits = ReplyLimits(VALKEY_REPLY_MAX_BYTES, VALKEY_REPLY_MAX_ELEMENTS, VALKEY_REPLY_MAX_DEPTH)
        full = with_credentials(url, password=password) if password is not None else url
        self._client = RespClient(full, timeout_s=self.timeout_s, pool_size=1, max_bulk_bytes=VALKEY_REPLY_MAX_BYTES, parallel_gets=1)
        self.restart()

    def restart(self) -> None:
        """Start a new read: the deadline of every command from now on is ``timeout_s`` from now."""
        self.deadline = time.monotonic() + self.timeout_s

    # --- the one way a command is sent ----------------------------------------------------------------------

    def call(self, what: str, commands: Sequence[Sequence[bytes | str | int]], errors_ok: bool = False) -> list[Any]:
        """Send ``commands`` in one pipeline and read their replies within the deadline; ``what`` names them in
        messages (``INFO``). An error reply raises (:meth:`judge_error`) unless ``errors_ok``."""
        from kvctl.connector.resp import ErrorReply, RespAuthError, RespConnectionError, RespError, RespProtocolError, RespTimeout  # noqa: PLC0415

        try:
            replies = self._client.execute(commands, self._limits, deadline=self.deadline, idempotent=True)
        except RespTimeout:
            raise TimedOut(f"timed out: no whole reply to {what} within {self.timeout_s:g} s", self.where) from None
        except RespAuthError as e:
            raise LoginRefused(f"refused the login: {e}", self.where) from None
        except RespConnectionError as e:
            raise Unanswered(f"unreachable: {e}", self.where) from None
        except RespProtocolError as e:
            raise BadReply(f"answered {what} with an unreadable reply: {e}", self.where) from None
        except RespError as e:  # connection setup refused (SELECT), client closed
            raise Unanswered(str(e), self.where) from None
        if not errors_ok:
            for r in replies:
                if isinstance(r, ErrorReply):
                    raise self.judge_error(what, r.message)
        return replies

    def judge_error(self, what: str, message: str) -> InstanceFailure:
        """The failure an error reply to ``what`` is: a refused login, a missing permission, or a bad reply."""
        shown = message[:200]
        if message.startswith(_LOGIN_ERRORS):
            return LoginRefused(f"refused the login: {shown}", self.where)
        if message.startswith("NOPERM"):
            return NoPermission(f"may not run {what}: {shown}", self.where)
        return BadReply(f"answered {what} with the error {shown!r}", self.where)

    # --- the commands -------------------------------------------------------------------------------------

    def info(self, section: str = "all") -> dict[str, Any]:
        """INFO ``section`` as a typed dict (:func:`kvctl.tier.replies.parse_info`)."""
        (reply,) = self.call("INFO", [("INFO", section)])
        return self._typed(parse_info, reply)

    def config_get(self, pattern: str = "*") -> dict[str, str]:
        """CONFIG GET ``pattern`` as a dict of strings (:func:`kvctl.tier.replies.parse_config`)."""
        (reply,) = self.call("CONFIG GET", [("CONFIG", "GET", pattern)])
        return self._typed(parse_config, reply)

    def ping(self) -> bool:
        (reply,) = self.call("PING", [("PING",)])
        return reply == "PONG"

    def dbsize(self) -> int:
        (reply,) = self.call("DBSIZE", [("DBSIZE",)])
        if isinstance(reply, bool) or not isinstance(reply, int) or reply < 0:
            raise BadReply(f"answered DBSIZE with {describe(reply)}, not a count", self.where)
        return reply

    def flushall(self) -> None:
        self.call("FLUSHALL", [("FLUSHALL",)])

    def random_keys(self, n: int) -> list[bytes]:
        """Up to ``n`` random key names (RANDOMKEY ``n`` times in one pipeline; an empty instance gives none)."""
        return [k for k in self.call("RANDOMKEY", [("RANDOMKEY",)] * n, errors_ok=True) if isinstance(k, bytes)]

    def strlens(self, keys: Sequence[bytes]) -> list[int | None]:
        """The length of each key's string value; None for what is not one (another type, a missing key)."""
        if not keys:
            return []
        got = self.call("STRLEN", [("STRLEN", k) for k in keys], errors_ok=True)
        return [n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None for n in got]

    def _typed(self, parse, reply: Any) -> Any:
        try:
            return parse(reply)
        except BadReply as e:
            raise BadReply(e.reason, self.where) from None

    # --- lifetime -----------------------------------------------------------------------------------------

    def close(self) -> None:
        self._client.close()

    def abort(self) -> None:
        """Close, and cut a read in flight (its socket shut): it fails at once."""
        self._client.abort()

    def __enter__(self) -> "Admin":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
