"""The one handler of stop signals (SIGINT, SIGTERM, SIGHUP) kvctl installs, and their exit codes.

:func:`on_signals` runs a callback on the first signal and another (or nothing: the signals are then
ignored) on each later one: ``kvctl bench`` sets its stop event and aborts on a second signal, the
exporter stops its server and, on a second one, raises :class:`ExitNow`, which :func:`kvctl.cli.main` (the one
place that ends the process) turns into an exit at once. :func:`signals_raise` is its form for
workflows that must unwind (stop what they started) first: the first signal raises :class:`Signalled`, which says
what the unwinding stopped (``said``).

No click: :class:`kvctl.cli.KvctlGroup`, the one error point, turns a :class:`Signalled` that reaches it into its
message and the exit code :func:`exit_code` (128 + the signal's number); a command catches none itself.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def exit_code(sig: signal.Signals | int) -> int:
    """The shell's exit code of a process a signal stopped: 128 + its number (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + int(sig)


class Signalled(BaseException):
    """A stop signal arrived inside :func:`signals_raise`; ``exit_code`` is the shell's 128 + its number, ``said`` what
    the unwinding stopped (the message: "interrupted by SIGTERM: <said>")."""

    def __init__(self, signum: int, said: str = "") -> None:
        super().__init__(signum)
        self.signal = signal.Signals(signum)
        self.said = said

    def __str__(self) -> str:
        return f"interrupted by {self.signal.name}" + (f": {self.said}" if self.said else "")

    @property
    def exit_code(self) -> int:
        return exit_code(self.signal)


class ExitNow(Signalled):
    """A second stop signal where the first began an orderly stop (``kvctl exporter``): the process is to end at
    once, with ``exit_code``. Raised (from the signal handler) rather than acted on: nothing in a command ends the
    process, :func:`kvctl.cli.main` does, so a command run in-process (a test's CliRunner) only sees it raised."""


def exit_now(sig: signal.Signals) -> None:
    """An ``again`` for :func:`on_signals`: raise :class:`ExitNow`."""
    raise ExitNow(sig)


@contextlib.contextmanager
def on_signals(first: Callable[[signal.Signals], None], again: Callable[[signal.Signals], None] | None = None,
               signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> Iterator[list[signal.Signals]]:
    """While inside: the first of ``signals`` calls ``first(sig)``; each later one calls ``again(sig)``, or, without
    ``again``, is ignored (all of ``signals`` are SIG_IGN from the first on, so the unwinding finishes).

    Yields the list the first signal caught is appended to. The handlers in place before are restored on the way
    out. Outside the main thread (where Python cannot install handlers) it installs nothing and only yields.
    """
    caught: list[signal.Signals] = []
    if threading.current_thread() is not threading.main_thread():
        yield caught
        return

    def handler(signum: int, frame: object) -> None:
        sig = signal.Signals(signum)
        if caught:
            if again is not None:
                again(sig)
            return
        caught.append(sig)
        if again is None:
            for s in signals:
                signal.signal(s, signal.SIG_IGN)
        first(sig)

    old = {s: signal.signal(s, handler) for s in signals}
    try:
        yield caught
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def signals_raise(signals: tuple[signal.Signals, ...] = STOP_SIGNALS, said: str = "") -> contextlib.AbstractContextManager[list[signal.Signals]]:
    """Turn the first of ``signals`` into :class:`Signalled` (``said``: what the unwinding stops, for its message); later
    ones are ignored so the unwinding finishes.

    Outside the main thread (where Python cannot install handlers) this does nothing.
    """
    def _raise(sig: signal.Signals) -> None:
        raise Signalled(sig, said)

    return on_signals(_raise, signals=signals)
