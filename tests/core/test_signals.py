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

ROOT = Path(__file__).resolve().parents[2]
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


# --- issue 49 item 4: interrupts at the one error point --------------------------------------------------------------

#: handlers a command may keep: Ctrl-C is how a `diagnose --watch` ends (exit: the last diagnosis'), not an error
WATCH_END = {"kvctl/commands/diagnose.py:_watch"}
STOP_EXCEPTIONS = {"Signalled", "RestartInterrupted", "KeyboardInterrupt"}


def _stop_handlers(path: Path) -> list[str]:
    """``except`` clauses of ``path`` that catch a stop signal and do more than re-raise it, as path:function."""
    rel, found = str(path.relative_to(ROOT)), []
    for fn in ast.walk(ast.parse(path.read_text())):
        if not isinstance(fn, ast.FunctionDef):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.ExceptHandler) and node.type is not None:
                names = {n.attr if isinstance(n, ast.Attribute) else getattr(n, "id", "") for n in ast.walk(node.type)}
                if names & STOP_EXCEPTIONS and not (len(node.body) == 1 and isinstance(node.body[0], ast.Raise) and node.body[0].exc is None):
                    found.append(f"{rel}:{fn.name}")
    return found


def test_no_command_handles_a_stop_signal_beside_the_error_point():
    """deploy-valkey up, drill and loading each caught Signalled (or RestartInterrupted) themselves, printed their line
    and exited 128 + N beside KvctlGroup; now the workflow only says what its unwinding stops (signals_raise's ``said``)
    and KvctlGroup prints it and exits."""
    found = [h for p in sorted((ROOT / "kvctl" / "commands").rglob("*.py")) for h in _stop_handlers(p)]
    assert sorted(set(found) - WATCH_END) == [], found


def test_the_error_point_says_the_interrupt_and_exits_128_plus_n():
    """A stop signal inside signals_raise reaches KvctlGroup once the workflow has unwound: its one line, 128 + N, and
    under --json the one error object; ExitNow (a second signal of an orderly stop) goes on to kvctl.cli.main."""
    import json  # noqa: PLC0415

    import click  # noqa: PLC0415
    from click.testing import CliRunner  # noqa: PLC0415

    from kvctl.cli import KvctlGroup  # noqa: PLC0415
    from kvctl.core.signals import ExitNow  # noqa: PLC0415

    cleaned = []

    @click.command("work")
    @click.option("--json", "as_json", is_flag=True)
    def work(as_json: bool) -> None:
        with signals_raise((signal.SIGTERM,), said="stopped the 2 servers it started"):
            try:
                os.kill(os.getpid(), signal.SIGTERM)
            finally:
                cleaned.append(True)

    @click.command("now")
    def now() -> None:
        raise ExitNow(signal.SIGINT)

    g = KvctlGroup("kvctl")
    g.add_command(work)
    g.add_command(now)
    res = CliRunner().invoke(g, ["work"])
    assert res.exit_code == 143 and cleaned == [True], res.output
    assert res.stderr == "Error: interrupted by SIGTERM: stopped the 2 servers it started\n" and res.stdout == ""
    res = CliRunner().invoke(g, ["work", "--json"])
    assert res.exit_code == 143
    assert json.loads(res.stdout) | {"kvctl_version": None} == {"kvctl_version": None, "outcome": "error", "exit_code": 143,
                                                              "error": "interrupted by SIGTERM: stopped the 2 servers it started"}
    with pytest.raises(ExitNow):
        CliRunner().invoke(g, ["now"], catch_exceptions=False)
    assert str(Signalled(signal.SIGHUP)) == "interrupted by SIGHUP"
