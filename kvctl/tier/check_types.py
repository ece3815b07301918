"""What every ``kvctl doctor`` line of the tier is made of: a :class:`Check`, what one instance said
(:class:`InstanceRead`), and the runbook section each line points to (``kvctl runbook tier_settings SECTION``).

Below :mod:`kvctl.tier.checks` and :mod:`kvctl.tier.server_checks`, which both build lines of these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvctl.connector.urls import flat_instance
from kvctl.core.runbooks import DOCTOR_PAGES, RUNBOOK_DIR, section_command
from kvctl.tier.targets import instance_name

OK, WARNING, FAIL, SKIPPED = "ok", "warning", "fail", "skipped"
RUNBOOK = f"{RUNBOOK_DIR}/{DOCTOR_PAGES[0]}.md"  # the page in the repository


@dataclass(frozen=True)
class Check:
    area: str  # engine, valkey, lmcache, config, host
    name: str
    status: str  # ok, warning, fail; skipped (nothing given to check) counts as ok
    message: str
    fix: str = ""
    evidence: dict[str, Any] = field(default_factory=dict)
    runbook: str | None = None  # the command that prints the section explaining the check and its fix


def runbook(anchor: str) -> str:
    """``kvctl runbook tier_settings ANCHOR``: the section of the page that explains a check."""
    return section_command(DOCTOR_PAGES[0], anchor)


@dataclass(frozen=True)
class InstanceRead:
    """What one instance said: INFO, its whole configuration, key counts and sampled value lengths."""

    rank: int
    host: str
    port: int
    info: dict[str, Any]
    config: dict[str, str]
    keys: int
    keys_with_ttl: int
    largest_value: int | None  # bytes of the largest sampled string value, None when no key was sampled
    instance: int = 0  # which of its rank's instances
    instances_per_rank: int = 1
    sampled_keys: tuple[str, ...] = ()  # the random keys' names read (the stored layer groups: doctor)

    @property
    def where(self) -> str:
        return f"{instance_name(self.rank, self.instance, self.instances_per_rank)} ({self.host}:{self.port})"

    @property
    def key(self) -> int:
        """What the per-instance results are keyed by: the tier number r*K + i (the rank with one instance per rank)."""
        return flat_instance(self.rank, self.instance, self.instances_per_rank)

    @property
    def ident(self) -> dict[str, int]:
        """The evidence naming this instance: its rank, and its instance index when ranks have several."""
        return {"rank": self.rank} if self.instances_per_rank == 1 else {"rank": self.rank, "instance": self.instance}
