"""Every finding id kvctl diagnose can report, read from where the findings are built.

The live analysis builds its findings in ``kvctl/diagnose/rules.py``
(``Finding("id", ...)``, and ``("severity", "id")`` pairs where a rule picks
one of two); the stall classifier keys its recommendations by id
(``kvctl.diagnose.stalls.RECOMMENDATIONS``). Reading the source means a new
finding added the usual way is covered without anyone updating a list.
"""

from __future__ import annotations

import re
from pathlib import Path

from kvctl.diagnose import rules, stalls

SEVERITIES = "info|warning|critical"


def diagnose_finding_ids() -> set[str]:
    src = Path(rules.__file__).read_text()
    ids = set(re.findall(r'Finding\(\s*"([a-z0-9_-]+)"', src))
    ids |= set(re.findall(rf'\(\s*"(?:{SEVERITIES})",\s*"([a-z0-9_-]+)"\s*\)', src))
    return ids


def stall_finding_ids() -> set[str]:
    return set(stalls.RECOMMENDATIONS)


def all_finding_ids() -> set[str]:
    return diagnose_finding_ids() | stall_finding_ids()
