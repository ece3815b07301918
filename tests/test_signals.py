"""One handler of stop signals (issue 32 item 3): kvctl.core.signals.on_signals, used by the workflows that unwind
(deploy-valkey up, drill, loading's restart), by bench (a stop event, abort on a second signal) and by the exporter
(stop the server, exit at once on a second signal)."""

from __future__ import annotations

import ast
import os
import signal
from pathlib import Path

import pytest

from kvctl.core.signals import Signalled, exit_code, on_signals, signals_raise

ROOT = Path(__file__).resolve().parents[1]
#: a bench worker process ignores Ctrl-C (its parent stops it): no handler that maps a signal to an exit
CHILD_SETUP = {"kvctl/bench/worker.py"}


def test_the_first_signal_calls_first_and_later_ones_again():
    firsts, agains = [], []
    before = signal.getsignal(signal.SIGTERM)
    with on_signals(firsts.append, again=agains.append, signals=(signal.SIGTERM,)) as caught:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
    assert firsts == [signal.SIGTERM] and agains == [signal.SIGTERM, signal.SIGTERM] and caught == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is before  # restored


def test_without_again_later_signals_are_ignored_while_unwinding():
    with pytest.raises(Signalled) as e, signals_raise((signal.SIGTERM, signal.SIGHUP)):
        os.kill(os.getpid(), signal.SIGHUP)
    assert e.value.signal is signal.SIGHUP and e.value.exit_code == 129 == exit_code(signal.SIGHUP)
    with on_signals(lambda sig: None, signals=(signal.SIGTERM,)) as caught:
        os.kill(os.getpid(), signal.SIGTERM)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # the second one would be lost, not raised
    assert caught == [signal.SIGTERM] and signal.getsignal(signal.SIGTERM) != signal.SIG_IGN
    assert exit_code(signal.SIGINT) == 130 and exit_code(signal.SIGTERM) == 143


def test_no_other_module_installs_a_signal_handler():
    """The bench and the exporter had handlers of their own (issue 32): every handler is kvctl.core.signals'."""
    found = []
    for path in sorted((ROOT / "kvctl").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel == "kvctl/core/signals.py" or rel in CHILD_SETUP:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("signal.signal", "signal"):
                found.append(f"{rel}:{node.lineno}")
    assert not found, f"signal handlers outside kvctl/core/signals.py: {found}"
