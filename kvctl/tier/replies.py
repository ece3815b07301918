"""What a Valkey instance answers to INFO and CONFIG GET, typed before kvctl uses it: the one parser of both.

Pure (bytes and plain data in, plain data out; no socket): :mod:`kvctl.tier.admin` reads the replies (bounded
in time and size) and hands them here. A reply is what :mod:`kvctl.connector.resp_reply` makes of RESP2: a
bulk string ``bytes``, a simple string ``str``, an integer ``int``, a null ``None``, an array ``list``.

* INFO must be a bulk string of at most :data:`~kvctl.core.thresholds.VALKEY_REPLY_MAX_BYTES`. Each
  ``key:value`` line becomes an entry: a value of ``k=v,...`` pairs (``cmdstat_*``, ``db0``) a dict; a whole
  number of up to 20 digits an ``int``, a decimal one a ``float``; anything else stays a ``str`` (redis-py's
  shape, which diagnose's saved captures keep; ``module:`` lines, one per loaded module, a list under ``modules``
  as redis-py gives them). The fields kvctl reads as numbers (:data:`INFO_NUMBERS`, and
  :data:`CMDSTAT_NUMBERS` / :data:`KEYSPACE_NUMBERS` of every ``cmdstat_*`` / ``db<N>`` entry) must be finite
  numbers >= 0 when present: ``used_memory:1e400`` or ``db0:keys=abc`` is refused, not read.
* CONFIG GET must be a flat array of bulk strings, name and value in turn.

Anything else raises :class:`BadReply` ("answered INFO with an array of 2 elements"): a per-instance failure
(exit 5 where an unreachable instance gets it), never a traceback.
"""

from __future__ import annotations

import math
import re
from typing import Any

from kvctl.core.errors import KvctlError, Unreachable
from kvctl.core.thresholds import VALKEY_REPLY_MAX_BYTES

#: top-level INFO fields some kvctl reader takes as a number (status, doctor's checks, diagnose, bench, start_valkey)
INFO_NUMBERS = (
    "used_memory", "used_memory_rss", "maxmemory", "total_system_memory", "connected_clients", "evicted_keys", "keyspace_hits",
    "total_net_input_bytes", "total_net_output_bytes", "process_id",
)
#: the numbers of a ``cmdstat_<command>`` entry and of a ``db<N>`` entry that kvctl reads
CMDSTAT_NUMBERS = ("calls", "usec", "usec_per_call")
KEYSPACE_NUMBERS = ("keys", "expires")
_WHOLE = re.compile(r"-?[0-9]{1,20}")
_DECIMAL = re.compile(r"-?[0-9]{1,20}\.[0-9]{1,20}")
_SHOWN = 60  # characters of a refused value quoted back


class InstanceFailure(KvctlError):
    """One instance could not be read: ``reason`` says why, ``where`` names it (host:port); the message is both."""

    def __init__(self, reason: str, where: str = "") -> None:
        super().__init__(f"{where} {reason}" if where else reason)
        self.reason, self.where = reason, where


class BadReply(InstanceFailure, Unreachable):
    """An instance answered, but not with what Valkey answers: named, never read."""


def is_keyspace(name: str) -> bool:
    """True for an INFO keyspace entry's name (``db0``, ``db15``): the one test of it, its readers' and the check's."""
    return name.startswith("db") and name[2:].isdigit()


def describe(reply: Any) -> str:
    """What a reply is, in words, for a message: "an array of 2 elements", "the integer 7", "a null reply"."""
    if reply is None:
        return "a null reply"
    if isinstance(reply, bool):
        return f"the value {reply!r}"
    if isinstance(reply, int):
        return f"the integer {str(reply)[:_SHOWN]}"
    if isinstance(reply, list):
        return f"an array of {len(reply)} element(s)"
    if isinstance(reply, str):
        return f"the simple string {reply[:_SHOWN]!r}"
    if isinstance(reply, (bytes, bytearray)):
        return f"a bulk string of {len(reply)} bytes"
    return f"a {type(reply).__name__}"


def scalar(text: str) -> int | float | str:
    """An INFO value: a whole number (up to 20 digits) an int, a decimal one a float, anything else the text."""
    if _WHOLE.fullmatch(text):
        return int(text)
    if _DECIMAL.fullmatch(text):
        return float(text)
    return text


def _value(text: str) -> Any:
    if "=" not in text:
        return scalar(text)
    out: dict[str, Any] = {}
    for item in text.split(","):
        if item:
            k, eq, v = item.rpartition("=") if "=" in item else (item, "", "")
            out[k] = scalar(v) if eq else True
    return out


def _number(value: Any, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise BadReply(f"answered INFO with {what} {str(value)[:_SHOWN]!r}, not a finite number >= 0")


def check_info(info: dict[str, Any]) -> dict[str, Any]:
    """``info`` (INFO parsed as :func:`parse_info` does, or as a saved capture holds it) when every field kvctl
    reads as a number is one; :class:`BadReply` naming the first that is not."""
    for name in INFO_NUMBERS:
        if name in info:
            _number(info[name], name)
    for name, value in info.items():
        fields = CMDSTAT_NUMBERS if name.startswith("cmdstat_") else KEYSPACE_NUMBERS if is_keyspace(name) else None
        if fields is None:
            continue
        if not isinstance(value, dict):
            raise BadReply(f"answered INFO with {name} {str(value)[:_SHOWN]!r}, not a list of name=value")
        for f in fields:
            if f in value:
                _number(value[f], f"{name} {f}")
    return info


def parse_info(reply: Any) -> dict[str, Any]:
    """An INFO reply (a bulk string) as a dict, typed (see the module docstring); :class:`BadReply` otherwise."""
    if not isinstance(reply, (bytes, bytearray)):
        raise BadReply(f"answered INFO with {describe(reply)}, not a bulk string")
    if len(reply) > VALKEY_REPLY_MAX_BYTES:
        raise BadReply(f"answered INFO with {len(reply)} bytes, over the {VALKEY_REPLY_MAX_BYTES}-byte cap")
    info: dict[str, Any] = {}
    for line in bytes(reply).decode("utf-8", "replace").splitlines():
        if not line or line.startswith("#") or ":" not in line:
            continue
        key, _, value = line.partition(":")
        if key == "cmdstat_host":  # the command's name holds the colon (redis-py splits it the same way)
            key, _, value = line.rpartition(":")
        if key == "module":  # one line per loaded module (Valkey 9 lists its built-in Lua engine): a list, as redis-py's
            info.setdefault("modules", []).append(_value(value))
            continue
        info[key] = _value(value)
    return check_info(info)


def parse_config(reply: Any) -> dict[str, str]:
    """A CONFIG GET reply (name, value, name, value, ... as bulk strings) as a dict; :class:`BadReply` otherwise."""
    if not isinstance(reply, list):
        raise BadReply(f"answered CONFIG GET with {describe(reply)}, not an array")
    if len(reply) % 2:
        raise BadReply(f"answered CONFIG GET with an odd number of elements ({len(reply)}), not name-value pairs")
    bad = next((x for x in reply if not isinstance(x, (bytes, bytearray))), False)
    if bad is not False:
        raise BadReply(f"answered CONFIG GET with {describe(bad)} among its names and values, not bulk strings only")
    text = [bytes(x).decode("utf-8", "replace") for x in reply]
    return dict(zip(text[::2], text[1::2]))


def whole_number(text: str | None, low: int = 0, high: int = (1 << 63) - 1) -> int | None:
    """A CONFIG value as a whole number in [low, high], or None (absent, not a number, out of range)."""
    if text is None or not _WHOLE.fullmatch(text.strip()):
        return None
    n = int(text.strip())
    return n if low <= n <= high else None
