"""The kvctl connector's trace read back: its events, in time order (``KVCTL_CONNECTOR_TRACE``, kvctl.connector.trace).

Each line of the file is one event, ``{"t": seconds, "ev": name, ...}`` (``lookup``, ``decision``, ``load``, ``step``,
``save``...; docs/connector.md lists them). A line that is no JSON object with a string ``ev`` and a numeric ``t`` is
left out and counted: a trace the engine was still writing ends in a torn line. The file is read by
:func:`kvctl.core.files.read_regular`: a regular file of at most TRACE_MAX_BYTES. ``kvctl explain`` tells a request's
story from these events, and ``kvctl simulate --fit-loads`` fits the async loader's service from its ``load`` events.
"""

from __future__ import annotations

from kvctl.core import files
from kvctl.core.errors import InvalidInput
from kvctl.core.thresholds import TRACE_MAX_BYTES
from kvctl.records.jsonl import json_lines


def read_events(path: str, what: str = "connector trace") -> tuple[list[dict], int]:
    """(the events of the trace at ``path`` sorted by ``t``, how many lines were left out). InvalidInput, one line,
    when the file holds no event at all."""
    text = files.read_regular(path, what, TRACE_MAX_BYTES, kind="a trace", errors="replace")
    errors: list[str] = []
    events = [v for _, v in json_lines(text, errors) if isinstance(v, dict) and isinstance(v.get("ev"), str)
              and isinstance(v.get("t"), (int, float)) and not isinstance(v.get("t"), bool)]
    if not events:
        raise InvalidInput(f"{path}: no connector trace events (write one with KVCTL_CONNECTOR_TRACE={path} in the "
                           "engine's environment)")
    events.sort(key=lambda e: e["t"])
    return events, len(errors)
