"""Severity of a finding, shared by the live analysis and the stall classifier."""

from __future__ import annotations

from enum import Enum
from typing import Iterable


class Severity(str, Enum):
    """Ordered severities; a ``str`` enum, so ``"warning" == Severity.WARNING``."""

    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"

    @property
    def rank(self) -> int:
        return SEVERITY_ORDER.index(self.value)


SEVERITY_ORDER = ("info", "warning", "critical")


def worst_severity(severities: Iterable[str]) -> Severity | None:
    """The most severe of ``severities`` (strings or ``Severity``), or None when there are none."""
    found = [Severity(s) for s in severities]
    return max(found, key=lambda s: s.rank) if found else None
