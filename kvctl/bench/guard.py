"""Imported first by the bench's client processes: the forkserver (its preload) and, without one, each spawned client.

The bench starts them with :data:`kvctl.core.procs.STARTER_PID_ENV` set to its pid, so that on import the process
dies with the bench (``prctl(PR_SET_PDEATHSIG)``, SIGKILL included) and every client the forkserver forks dies with
the forkserver (:func:`kvctl.core.procs.die_with_starter`): a SIGKILLed bench leaves no client, forkserver or
(its pipe closed by all of them) resource tracker behind. Imported anywhere else, without the variable, it does nothing.
"""

from __future__ import annotations

from kvctl.core.procs import die_with_starter

DIES_WITH_STARTER = die_with_starter()
