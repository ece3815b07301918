"""Python's thread switch interval, lowered while the connector's GET lanes run beside the engine's thread.

A lane reads each reply with the GIL released and must take it back afterwards; beside a thread that keeps the GIL
busy (vLLM's forward launching a large step's kernels, its scheduler), each take-back can wait up to
``sys.getswitchinterval()`` (5 ms by default) per thread ahead of it (``benchmarks/lanes_gil.py``;
``benchmarks/copy_queues.py``, python-step: an 8 MB copy that takes 0.2 ms alone took 52-96 ms on an H100 beside such
a thread, on every one of 12 lanes). A shorter interval hands the GIL back sooner.

The interval is one value for the whole process, and loads of two kinds may overlap (a layered sync load and an async
prefetch): :func:`lower` and :func:`restore` count who holds it lowered. The shortest interval asked for applies while
any is held, and the process's own value comes back when the last is released.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_held: list[float] = []  # the intervals (s) asked for by the loads in flight
_saved: float | None = None  # the process's interval before the first of them


def lower(seconds: float) -> float:
    """Lower the switch interval to ``seconds`` (or keep a shorter one already set); returns the handle for
    :func:`restore`. Never raises the interval above the process's own."""
    global _saved
    if not seconds > 0:
        raise ValueError(f"a switch interval is positive seconds, not {seconds!r}")
    with _lock:
        if not _held:
            _saved = sys.getswitchinterval()
        _held.append(seconds)
        sys.setswitchinterval(min(min(_held), _saved))
    return seconds


def restore(handle: float) -> None:
    """Release one :func:`lower`: the shortest interval still held applies, else the process's own again."""
    global _saved
    with _lock:
        _held.remove(handle)
        if _held:
            sys.setswitchinterval(min(min(_held), _saved))
        else:
            sys.setswitchinterval(_saved)
            _saved = None


@contextmanager
def lowered(ms: float | None) -> Iterator[None]:
    """The switch interval at ``ms`` milliseconds inside the block (None: left as it is)."""
    if not ms:
        yield
        return
    handle = lower(ms / 1000)
    try:
        yield
    finally:
        restore(handle)
