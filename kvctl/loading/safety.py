"""Is switching LMCache to synchronous loading safe? The saved diagnosis decides.

Synchronous loading turns every L2 hit into a single-server queue with
ρ = λ·n·s/B (paper §4): ``kvctl loading sync`` refuses it unless forced when the
latest diagnosis shows ρ ≥ 0.7 (``kvctl.core.thresholds.RHO_HIGH``), and also when it
cannot decide (no diagnosis, ρ unknown or only a lower bound, a diagnosis older than
``--max-age``). ``kvctl doctor`` asks the same :func:`judge_sync`.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvctl.core.errors import InvalidInput
from kvctl.core.thresholds import RHO_HIGH
from kvctl.loading.edit import Refused

SYNC_REFUSE_RHO = RHO_HIGH  # kvctl.core.thresholds: the ρ at which diagnose warns


@dataclass(frozen=True)
class SafetyCheck:
    allowed: bool
    rho: float | None
    source: str | None
    saved_at: str | None
    note: str


def load_diagnosis(path: Path | str | None, default_path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """The diagnosis JSON at ``path`` (must exist), else the last saved one (may be absent)."""
    p = Path(path) if path else default_path
    if not p.exists():
        if path:
            raise InvalidInput(f"--diagnosis {path} does not exist")
        return None, None
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise InvalidInput(f"cannot read diagnosis {p}: {e}") from e
    if not isinstance(data, dict):
        raise InvalidInput(f"diagnosis {p} is not a JSON object (expected `kvctl diagnose --json` output)")
    return data, str(p)


DEFAULT_MAX_AGE_S = 3600.0


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``30m``, ``1h``, ``2d`` → seconds; InvalidInput unless finite and > 0."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([smhd]?)\s*", str(text))
    if not m:
        raise InvalidInput(f"{text!r} is not a duration (e.g. 3600, 30m, 1h, 2d)")
    value = float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
    if not (0 < value <= 366 * 86400):
        raise InvalidInput(f"{text!r} is not a duration between 0 and a year")
    return value


def _diagnosis_time(diagnosis: dict[str, Any]) -> tuple[_dt.datetime | None, str | None]:
    """When the diagnosed samples were taken (``created_at``, else ``saved_at``), parsed; None if absent/bad."""
    raw = diagnosis.get("created_at") or diagnosis.get("saved_at")
    if not isinstance(raw, str) or not raw:
        return None, None
    try:
        t = _dt.datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        return None, raw
    return (t if t.tzinfo else t.replace(tzinfo=_dt.timezone.utc)), raw


@dataclass(frozen=True)
class SyncVerdict:
    """What a saved diagnosis says about synchronous loading (:func:`judge_sync`); no problems: it is safe."""

    rho: float | None  # a usable (finite) ρ, else None
    lower_bound: bool  # ρ from Valkey's server-side time: the true ρ is at least this
    stale: bool  # undated, older than max_age_s, or dated in the future: ρ may no longer hold
    saved_at: str | None
    problems: tuple[str, ...]


def _rho_as_found(diagnosis: dict[str, Any]) -> str:
    """What the diagnosis holds for ρ, in words or as its JSON: never Python's ``None``/``True``."""
    if "rho" not in diagnosis:
        return "no ρ in it"
    rho = diagnosis["rho"]
    if rho is None:
        return "ρ is null"
    if isinstance(rho, float) and math.isnan(rho):
        return "ρ is NaN"
    if isinstance(rho, float):
        return "ρ is infinite"
    return f"ρ is {json.dumps(rho)}" + (", a string" if isinstance(rho, str) else "")


def judge_sync(
    diagnosis: dict[str, Any] | None,
    source: str | None,
    threshold: float = SYNC_REFUSE_RHO,
    max_age_s: float = DEFAULT_MAX_AGE_S,
    now: _dt.datetime | None = None,
) -> SyncVerdict:
    """Is synchronous loading safe by this diagnosis? Pure: ``kvctl loading sync`` and ``kvctl doctor`` both ask it.

    A problem each: no diagnosis; ρ missing, null or not a finite number; ρ only a
    lower bound (B from Valkey's server-side time, which overstates B); a diagnosis
    undated or older than ``max_age_s``; ρ ≥ ``threshold``.
    """
    now = now or _dt.datetime.now(_dt.timezone.utc)
    if diagnosis is None:
        return SyncVerdict(None, False, True, None, ("no diagnosis found: run `kvctl diagnose` (or give --diagnosis FILE) to measure ρ first",))
    problems = []
    rho = diagnosis.get("rho")
    when, when_raw = _diagnosis_time(diagnosis)
    reasons = diagnosis.get("null_reasons") if isinstance(diagnosis.get("null_reasons"), dict) else {}
    lower = False
    if isinstance(rho, bool) or not isinstance(rho, (int, float)) or not math.isfinite(rho):
        why = reasons.get("rho") or "no L2 traffic or bandwidth measured"
        problems.append(f"the diagnosis in {source} has no usable ρ ({_rho_as_found(diagnosis)}: {why})")
        rho = None
    else:
        lower = diagnosis.get("rho_bound") == "lower_bound" or str(diagnosis.get("bandwidth_source") or "").startswith("valkey")
        if rho >= threshold:
            problems.append(f"it shows ρ {'≥' if lower else '='} {rho:.2f} ≥ {threshold:g}: synchronous loading would queue every hit behind the tier")
        elif lower:
            problems.append(
                f"its ρ ≥ {rho:.2f} is only a lower bound (B from Valkey's server-side GET time, which leaves out socket "
                "writes): diagnose with engine-side metrics (kvctl connector or LMCache) to know ρ"
            )
    stale = True
    if when is None:
        problems.append(f"the diagnosis in {source} is undated" if when_raw is None else f"the diagnosis date {when_raw!r} is not an ISO time")
    else:
        age = (now - when).total_seconds()
        if age > max_age_s:
            problems.append(f"the diagnosis is {age / 3600:.1f} h old (taken {when_raw}; --max-age {max_age_s / 3600:g} h): diagnose again")
        elif age < -300:
            problems.append(f"the diagnosis is dated in the future ({when_raw}): check the clocks, diagnose again")
        else:
            stale = False
    return SyncVerdict(rho, lower, stale, when_raw, tuple(problems))


def check_sync(
    diagnosis: dict[str, Any] | None,
    source: str | None,
    force: bool,
    threshold: float = SYNC_REFUSE_RHO,
    max_age_s: float = DEFAULT_MAX_AGE_S,
    now: _dt.datetime | None = None,
) -> SafetyCheck:
    """May we switch to synchronous loading? Raises Refused unless ``force`` when it is unsafe OR undecidable (:func:`judge_sync`)."""
    v = judge_sync(diagnosis, source, threshold, max_age_s, now)
    if v.problems:
        msg = f"{source or 'no diagnosis'}: " + "; ".join(v.problems)
        if not force:
            raise Refused(f"refusing to switch to synchronous loading: {msg}; pass --force to switch anyway")
        return SafetyCheck(True, v.rho, source, v.saved_at, f"forced: {msg}")
    return SafetyCheck(True, v.rho, source, v.saved_at, f"ρ = {v.rho:.2f} < {threshold:g} in {source} ({v.saved_at})")
