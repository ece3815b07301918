"""SIGINT, SIGTERM and SIGHUP as an exception, for workflows that must unwind (stop what they started) first.

No click: the commands turn :class:`Signalled` into the exit code ``exit_code`` (128 + the signal's number).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Signalled(BaseException):
    """A stop signal arrived inside :func:`signals_raise`; ``exit_code`` is the shell's 128 + its number."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signal = signal.Signals(signum)

    @property
    def exit_code(self) -> int:
        return 128 + int(self.signal)


@contextlib.contextmanager
def signals_raise(signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> Iterator[None]:
    """Turn the first of ``signals`` into :class:`Signalled`; later ones are ignored so the unwinding finishes.

    Outside the main thread (where Python cannot install handlers) this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        for s in signals:
            signal.signal(s, signal.SIG_IGN)
        raise Signalled(signum)

    old = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
