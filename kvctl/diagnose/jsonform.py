"""The JSON form of a diagnosis: what ``kvctl diagnose --json`` prints and ``last-diagnosis.json`` keeps.

Library code (no click): the commands print it, ``kvctl loading sync`` and ``kvctl doctor`` read it back.
"""

from __future__ import annotations

import math
from typing import Any

from kvctl import __version__

from kvctl.core import render
from kvctl.diagnose.analysis import Diagnosis
from kvctl.core.runbooks import runbook_for
from kvctl.diagnose.fixes import verdict


def _finite(obj: Any, path: str, reasons: dict[str, str]) -> Any:
    """JSON-safe: NaN/±inf become null, with the reason recorded under its path."""
    if isinstance(obj, float) and not math.isfinite(obj):
        reasons[path] = f"not a finite number ({obj!r})"
        return None
    if isinstance(obj, dict):
        return {k: _finite(v, f"{path}.{k}" if path else str(k), reasons) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v, f"{path}[{i}]", reasons) for i, v in enumerate(obj)]
    return obj


def diagnosis_json(diag: Diagnosis, explain: bool = False) -> dict[str, Any]:
    """The ``--json`` object: never NaN or Infinity (null, with the reason in ``null_reasons``)."""
    data = {"kvctl_version": __version__, **render.to_jsonable(diag), "exit_code": int(diag.exit_status),
            "verdict": render.to_jsonable(verdict(diag.findings, diag.rho, bool(diag.unreachable) and not diag.findings,
                                                diag.rho_bound == "lower_bound"))}
    for f in data.get("findings") or []:
        f["runbook"] = runbook_for(f["id"])
    if not explain:
        data.pop("explain")
    reasons: dict[str, str] = {}
    data = _finite(data, "", reasons)
    data["null_reasons"] = {**(data.get("null_reasons") or {}), **reasons}
    return data
