"""Child processes kvctl starts for itself: Python children that import only the installed kvctl, and
children that die with the process that started them.

* :func:`python_argv` / :func:`child_env`: ``python -P`` with ``PYTHONSAFEPATH=1`` (Python ≥ 3.11), so
  the working directory is never on the child's ``sys.path``: a ``./kvctl/`` folder there (a planted
  ``kvctl/__init__.py``, or the parent of a checkout) is never imported instead of the installed package.
  The variable is inherited, so a child's own ``python -m`` children (an engine re-exec'd on SIGHUP)
  are started the same way.
* :func:`kill_group`: SIGKILL the session a child was started in (``start_new_session=True``: its pid is the
  group id), so nothing it started goes on, then reap it and close its pipes.
* :func:`die_with_parent`: a ``preexec_fn`` that asks the kernel (``prctl(PR_SET_PDEATHSIG)``) to
  signal the child when the thread that started it dies, whatever kills it (SIGKILL included); it
  survives the child's ``exec``. Start such children from the main thread: the signal follows the
  starting *thread*.
* :func:`die_with` / :func:`die_with_starter`: the same, called by a Python child started without a
  ``preexec_fn`` (a multiprocessing child; the forkserver, whose parent puts its pid in
  :data:`STARTER_PID_ENV`); the forkserver's own children (``os.fork``) then die with it in turn.

Library code: no click.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from typing import Callable, Mapping

#: Python ≥ 3.11: the working directory (or the script's directory) is not put on sys.path
SAFE_PATH_ENV = "PYTHONSAFEPATH"
#: The pid of the process that started this one, for :func:`die_with_starter`
STARTER_PID_ENV = "KVCTL_DIE_WITH_PID"
_PR_SET_PDEATHSIG = 1


def python_argv(*args: str) -> list[str]:
    """``[this python, -P, *args]``: a Python child that never imports from the working directory."""
    return [sys.executable, "-P", *args]


def child_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this environment) with ``PYTHONSAFEPATH=1``, passed on to the child's children."""
    return {**(os.environ if base is None else base), SAFE_PATH_ENV: "1"}


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``sig`` when this process dies (Linux).

    libc is looked up here, before the fork; the child only calls it. A parent that died between the
    fork and the ``prctl`` is caught too (the child's parent is then no longer this process: it signals
    itself). None where there is no ``prctl`` (not Linux): the caller stops its children itself.
    """
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return preexec


def _prctl() -> Callable[..., int] | None:
    """libc's ``prctl`` (Linux), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def die_with(parent: int, sig: int = signal.SIGKILL, forks_too: bool = False) -> bool:
    """This process gets ``sig`` when ``parent``, the process that started it, dies (at once if it has died
    already): :func:`die_with_parent` for a child started without a ``preexec_fn`` (a multiprocessing
    child: ``die_with(multiprocessing.parent_process().pid)``). With ``forks_too`` every child this process
    forks from now on (``os.fork``: a forkserver's clients) gets ``sig`` when this one dies. Call it from
    the main thread.

    False, and nothing done, without ``prctl`` (not Linux) or when ``parent`` is alive but is not this
    process's parent.
    """
    prctl = _prctl()
    if prctl is None:
        return False
    if os.getppid() != parent:
        try:
            os.kill(parent, 0)
        except ProcessLookupError:  # it died before we got here: we were reparented
            os.kill(os.getpid(), sig)
        except PermissionError:  # alive, someone else's
            pass
        return False
    prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent:  # it died between the check and the prctl
        os.kill(os.getpid(), sig)
    if forks_too:
        me = os.getpid()

        def after_fork_in_child() -> None:
            prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
            if os.getppid() != me:
                os.kill(os.getpid(), sig)

        os.register_at_fork(after_in_child=after_fork_in_child)
    return True


def die_with_starter(sig: int = signal.SIGKILL) -> bool:
    """In a child whose starter set :data:`STARTER_PID_ENV` to its pid: :func:`die_with` that starter, its
    forks too. The variable is removed, so this process's own children never act on it. False, and
    nothing done, without the variable (and as :func:`die_with`: a leaked variable names no parent)."""
    value = os.environ.pop(STARTER_PID_ENV, "")
    return value.isdigit() and die_with(int(value), sig, forks_too=True)


def kill_group(proc: subprocess.Popen, wait_s: float | None = None) -> None:
    """SIGKILL the process group of ``proc`` (started with ``start_new_session=True``, so its pid is the group id:
    only what it started), then reap it, waiting at most ``wait_s`` (None: until it is gone), and close its pipes."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # gone already
        pass
    try:
        proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        pass
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()
