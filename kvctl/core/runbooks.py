"""The on-call runbooks: one page per finding and alert, shipped inside the package (``kvctl/runbooks/*.md``).

One page per finding id of ``kvctl diagnose`` and ``kvctl diagnose stalls``, plus pages for alerts that are not
findings (instance or engine down, data insufficient, stalled lookup) and for ``kvctl doctor``'s tier settings (one
section per check). The pages are package data, read through :mod:`importlib.resources`, so an installed kvctl
prints them anywhere: ``kvctl runbook`` lists them, ``kvctl runbook ID`` prints one, ``kvctl runbook ID SECTION`` one
section. Every finding names that command (:func:`runbook_for`), in the findings table and as ``runbook`` in
``--json``; doctor's lines name a section (:func:`section_command`). The alert rules in
``configs/prometheus/kvctl-alerts.yaml`` link the pages by their path in the repository (:data:`RUNBOOK_DIR`). The
docs tests fail when a finding id has no page, or a page no id.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from importlib import resources

from kvctl.core.errors import InvalidInput

#: where the pages live in the repository (and, below the package, in an installed kvctl)
RUNBOOK_DIR = "kvctl/runbooks"
#: the command that prints a page
COMMAND = "kvctl runbook"

#: finding ids of kvctl diagnose (kvctl/diagnose/rules.py)
DIAGNOSE_FINDINGS = (
    "rho_high", "rho_unstable", "bandwidth_below_breakeven", "bandwidth_implausible", "prompt_below_min_hit",
    "queue_growing_gpu_idle", "queue_growing", "hot_instance", "evictions_under_load", "timeouts_rising",
    "l2_no_hits", "prefill_rate_implausible", "engine_restarted", "load_failures", "instance_saturated",
    "metrics_too_large", "hits_recomputed", "saves_dropped",
)
#: finding ids of kvctl diagnose stalls (kvctl/diagnose/stalls.py)
STALL_FINDINGS = ("lost-completion", "missing-key-get", "lockstep-stall", "server-not-answering", "collective-wait")
#: pages of alerts that are not a single finding
ALERT_PAGES = ("stalled_lookup", "instance_down", "engine_down", "data_insufficient")
#: pages of kvctl doctor's lines (one section per check: kvctl/tier/checks.py)
DOCTOR_PAGES = ("tier_settings",)
#: every page, in the order ``kvctl runbook`` lists them
PAGE_IDS = (*DIAGNOSE_FINDINGS, *STALL_FINDINGS, *ALERT_PAGES, *DOCTOR_PAGES)


@dataclass(frozen=True)
class Runbook:
    id: str
    title: str  # the page's heading, without its id
    markdown: str  # the whole page, or the section asked for
    section: str | None = None  # the section's anchor, when one was asked for

    @property
    def command(self) -> str:
        return f"{COMMAND} {self.id}" + (f" {self.section}" if self.section else "")


def runbook_for(finding_id: str) -> str | None:
    """The command that prints a finding's (or an alert's) page: ``kvctl runbook rho_unstable``; None for an id without one."""
    return f"{COMMAND} {finding_id}" if finding_id in PAGE_IDS else None


def section_command(page: str, anchor: str) -> str:
    """The command that prints one section of a page: ``kvctl runbook tier_settings io-threads``."""
    return f"{COMMAND} {page} {anchor}"


def all_pages() -> list[str]:
    """Each page's path in the repository (the docs tests read them there)."""
    return [f"{RUNBOOK_DIR}/{p}.md" for p in PAGE_IDS]


def anchor(heading: str) -> str:
    """The anchor of a markdown heading as GitHub makes it: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")


def _text(page_id: str) -> str:
    return (resources.files("kvctl") / "runbooks" / f"{page_id}.md").read_text(encoding="utf-8")  # one name a step: Python 3.10


def _title(page_id: str, text: str) -> str:
    first = text.splitlines()[0].lstrip("#").strip() if text.strip() else page_id
    return re.sub(rf"\s*\(`{re.escape(page_id)}`\)$", "", first)


def sections(text: str) -> dict[str, str]:
    """Each ``##``/``###`` section of a page by its anchor: from its heading up to the next heading of its level or above."""
    heads = [(m.start(), len(m.group(1)), anchor(m.group(2))) for m in re.finditer(r"(?m)^(#{2,3}) (.+)$", text)]
    out = {}
    for i, (start, level, name) in enumerate(heads):
        end = next((s for s, lv, _ in heads[i + 1:] if lv <= level), len(text))
        out.setdefault(name, text[start:end].rstrip() + "\n")
    return out


def list_runbooks() -> list[Runbook]:
    """Every page, with its title."""
    out = []
    for p in PAGE_IDS:
        text = _text(p)
        out.append(Runbook(p, _title(p, text), text))
    return out


def read_runbook(page_id: str, section: str | None = None) -> Runbook:
    """One page (one section of it with ``section``, an anchor); InvalidInput naming the nearest id or section."""
    if page_id not in PAGE_IDS:
        near = difflib.get_close_matches(page_id, PAGE_IDS, n=1)
        raise InvalidInput(f"no runbook {page_id!r}" + (f" (did you mean {near[0]}?)" if near else "") + f": `{COMMAND}` lists them")
    try:
        text = _text(page_id)
    except OSError as e:
        raise InvalidInput(f"runbook {page_id} is not installed with this kvctl ({e.strerror or e}): reinstall kvctl") from None
    title = _title(page_id, text)
    if section is None:
        return Runbook(page_id, title, text)
    parts = sections(text)
    wanted = anchor(section)
    if wanted not in parts:
        near = difflib.get_close_matches(wanted, list(parts), n=1)
        raise InvalidInput(f"runbook {page_id} has no section {section!r}" + (f" (did you mean {near[0]}?)" if near else "")
                           + f"; its sections: {', '.join(parts)}")
    return Runbook(page_id, title, parts[wanted], wanted)
