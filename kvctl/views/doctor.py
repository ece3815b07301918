"""``kvctl doctor``: the checklist, one line per check with its fix and runbook, and the counts."""

from __future__ import annotations

from kvctl.core import render
from kvctl.ops.doctor import NOTHING_CHECKED, DoctorReport

STYLE = {"skipped": "dim", "ok": "green", "warning": "yellow", "fail": "red"}


def show_doctor(report: DoctorReport, as_json: bool) -> None:
    """Every check (or the JSON, with the exit code), the counts by status, and what a run given nothing checked."""
    if as_json:
        render.emit_json({"checks": report.checks, "worst": report.worst, "nothing_checked": report.nothing_checked,
                          "exit_code": int(report.exit_status)})
    else:
        render.text_table("kvctl doctor", ["", "area", "check", "result", "fix"], [(c.status, c.area, c.name, c.message, " ".join(x for x in (c.fix, f"(runbook: {c.runbook})" if c.runbook else "") if x)) for c in report.checks])
        counts = {s: sum(c.status == s for c in report.checks) for s in STYLE}
        render.message(f"{counts['ok']} ok, {counts['warning']} warning(s), {counts['fail']} failure(s), {counts['skipped']} skipped", style=STYLE[report.worst])
        if report.nothing_checked:
            render.warn(NOTHING_CHECKED)
