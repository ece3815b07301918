"""Options shared by several commands. Importing this registers nothing (unlike ``kvctl.cli``)."""

from __future__ import annotations

import functools
from typing import Any, Callable

import click

from kvctl.errors import ExitStatus


def output_options(func: Callable) -> Callable:
    """``--json``: plain JSON on stdout instead of tables."""

    @click.option("--json", "as_json", is_flag=True, help="Print plain JSON on stdout (no styling).")
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return func(*args, **kwargs)

    return wrapper


def severity_exit(severity: str | None) -> ExitStatus:
    """Exit status for the worst finding: 3 for a warning, 4 for critical, 0 otherwise."""
    value = getattr(severity, "value", severity)
    return {"warning": ExitStatus.FINDING_WARNING, "critical": ExitStatus.FINDING_CRITICAL}.get(value, ExitStatus.OK)
