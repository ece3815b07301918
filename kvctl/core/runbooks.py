"""Where each finding's on-call runbook lives (``docs/runbooks/`` in the kvctl repository).

One page per finding id of ``kvctl diagnose`` and ``kvctl diagnose stalls``,
plus pages for alerts that are not findings (instance or engine down, data
insufficient, stalled lookup) and for ``kvctl doctor``'s tier settings (one
section per check, linked with an anchor). ``kvctl diagnose --json`` carries the page as
each finding's ``runbook``; the alert rules in
``configs/prometheus/kvctl-alerts.yaml`` link the same pages. The docs tests
fail when a finding id has no page here or on disk.
"""

from __future__ import annotations

RUNBOOK_DIR = "docs/runbooks"

#: finding ids of kvctl diagnose (kvctl/diagnose/rules.py)
DIAGNOSE_FINDINGS = (
    "rho_high", "rho_unstable", "bandwidth_below_breakeven", "bandwidth_implausible", "prompt_below_min_hit",
    "queue_growing_gpu_idle", "queue_growing", "hot_instance", "evictions_under_load", "timeouts_rising",
    "l2_no_hits", "prefill_rate_implausible", "engine_restarted", "load_failures", "instance_saturated",
    "metrics_too_large",
)
#: finding ids of kvctl diagnose stalls (kvctl/diagnose/stalls.py)
STALL_FINDINGS = ("lost-completion", "missing-key-get", "lockstep-stall", "server-not-answering", "collective-wait")
#: pages of alerts that are not a single finding
ALERT_PAGES = ("stalled_lookup", "instance_down", "engine_down", "data_insufficient")
#: pages of kvctl doctor's lines (one section, an anchor, per check: kvctl/tier/checks.py)
DOCTOR_PAGES = ("tier_settings",)


def runbook_for(finding_id: str) -> str | None:
    """The runbook page of a finding id, relative to the repository root; None for an id without one."""
    if finding_id in DIAGNOSE_FINDINGS or finding_id in STALL_FINDINGS or finding_id in ALERT_PAGES or finding_id in DOCTOR_PAGES:
        return f"{RUNBOOK_DIR}/{finding_id}.md"
    return None


def all_pages() -> list[str]:
    return [f"{RUNBOOK_DIR}/{p}.md" for p in (*DIAGNOSE_FINDINGS, *STALL_FINDINGS, *ALERT_PAGES, *DOCTOR_PAGES)]
