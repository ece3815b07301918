"""Exceptions and exit codes shared by the library and the CLI.

Library code raises ``KvctlError`` subclasses; only ``kvctl.cli`` turns them
into messages and exit codes.
"""

from __future__ import annotations

from enum import IntEnum


class ExitStatus(IntEnum):
    """Process exit codes, stable for runbooks and cron."""

    OK = 0
    ERROR = 1
    USAGE = 2
    FINDING_WARNING = 3
    FINDING_CRITICAL = 4
    UNREACHABLE = 5
    INSUFFICIENT_DATA = 6  # kvctl diagnose: the samples cannot answer the question (with the next step)
    DRILL_MISSED = 7  # kvctl drill: diagnose did not report what the drill planted
    DRILL_NOT_RUN = 8  # kvctl drill: the drill could not run (a child died, the tier or engine did not start): nothing was judged
    SLO_UNMET = 9  # kvctl plan: nothing tried (no instance count, no loading mode, not recompute) meets the SLO


class KvctlError(Exception):
    """An expected failure with a one-line message for the user."""

    exit_status: ExitStatus = ExitStatus.ERROR


class InvalidInput(KvctlError):
    """Bad input from the user (a flag, a file, a config): exit 2."""

    exit_status = ExitStatus.USAGE


class Unreachable(KvctlError):
    """A server or endpoint that should answer did not."""

    exit_status = ExitStatus.UNREACHABLE


class BinaryNotFound(KvctlError):
    """A required executable (valkey-server, py-spy, ...) is missing."""
