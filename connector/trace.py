"""An opt-in timeline of the connector's work, one JSON line per event (benchmarks, incident reviews).

``KVCTL_CONNECTOR_TRACE=/path/trace.jsonl`` in the engine's environment makes
the scheduler side and every worker append one line per lookup, scheduled
load, load (with its phases) and save: ``{"t": <CLOCK_MONOTONIC seconds>,
"ev": ..., "pid": ..., ...}``. CLOCK_MONOTONIC is the same clock in every
process of a host, so the lines of the scheduler, the workers and a client
that timed its requests line up (``benchmarks/engine_gpu.py`` does that).
Unset (the default), nothing is written and nothing is measured for it.

Lines are appended with one ``write`` each to a file opened with
``O_APPEND | O_NOFOLLOW`` (mode 0600): processes never interleave inside a
line, and a planted symlink is refused. A trace that cannot be written is
switched off with one warning: it never fails the engine.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

__all__ = ["TRACE_ENV", "Trace"]

TRACE_ENV = "KVCTL_CONNECTOR_TRACE"
_MAX_LINE = 64 * 1024

log = logging.getLogger(__name__)


class Trace:
    """The trace of one connector half; :attr:`on` is False when the variable is unset."""

    def __init__(self, path: str | None = None) -> None:
        path = path if path is not None else os.environ.get(TRACE_ENV) or None
        self._fd: int | None = None
        self._lock = threading.Lock()
        if path:
            try:
                self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except OSError as exc:
                log.warning("kvctl: connector trace %s cannot be opened (%s): no trace", path, exc.strerror or exc)

    @property
    def on(self) -> bool:
        return self._fd is not None

    def event(self, ev: str, **fields: Any) -> None:
        if self._fd is None:
            return
        line = json.dumps({"t": time.monotonic(), "ev": ev, "pid": os.getpid(), **fields},
                          separators=(",", ":"), default=str)[:_MAX_LINE] + "\n"
        with self._lock:
            fd = self._fd
            if fd is None:
                return
            try:
                os.write(fd, line.encode())
            except OSError as exc:
                log.warning("kvctl: connector trace write failed (%s): trace off", exc.strerror or exc)
                self.close()

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
