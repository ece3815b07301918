"""Flip LMCache between synchronous and asynchronous loading, safely.

The edit is line-based so every other line and comment of the config stays
byte-for-byte; PyYAML only validates (the original must parse, and the result
must parse to the same mapping with just ``enable_async_loading`` changed).
Writes are atomic (temp file in the same directory + ``os.replace``) after a
timestamped backup. Deployments that set ``LMCACHE_ENABLE_ASYNC_LOADING`` in
an env file (``KEY=value`` lines, optionally ``export``) are edited the same way.
kvctl's vLLM connector keeps the switch in vLLM's ``--kv-transfer-config``: those files
(a ``--config`` YAML, an env/unit file with the argument) are detected, read and edited in
``kvctl.loading_vllm``, then backed up and written here like the others.

Switching to synchronous loading turns every L2 hit into a single-server
queue with ρ = λ·n·s/B (paper §4); it is refused unless forced when the
latest diagnosis shows ρ ≥ 0.7, and also when it cannot decide: no diagnosis,
ρ unknown, ρ only a lower bound (server-side B), or a diagnosis older than
``--max-age`` (1 h by default).
"""

from __future__ import annotations

import datetime as _dt
import difflib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from kvctl.errors import InvalidInput, KvctlError

KEY = "enable_async_loading"
ENV_VAR = "LMCACHE_ENABLE_ASYNC_LOADING"
SYNC_REFUSE_RHO = 0.7
TRUTHY = ("true", "1", "yes", "on")

_YAML_LINE = re.compile(rf"^(?P<head>{KEY}[ \t]*:[ \t]*)(?P<val>[^#\r\n]*?)(?P<rest>[ \t]*(?:#.*)?)$")
_ENV_LINE = re.compile(rf"^(?P<head>[ \t]*(?:export[ \t]+)?{ENV_VAR}[ \t]*=[ \t]*)(?P<q>[\"']?)(?P<val>[^\"'#\s]*)(?P=q)(?P<rest>.*)$")


class Refused(KvctlError):
    """A flip that the safety check does not allow (use --force to override)."""


@dataclass(frozen=True)
class SourceState:
    """What one file says about async loading."""

    path: str
    kind: str  # "yaml" or "env" (LMCache), "vllm-yaml" or "vllm-args" (kvctl's vLLM connector, kvctl.loading_vllm)
    async_loading: bool | None  # None: not set (LMCache's and the connector's default is synchronous)
    line: int | None  # 1-based line of the setting, when set
    found: str | None = None  # what kind of file was detected, for vLLM files


@dataclass(frozen=True)
class Change:
    """A planned (or applied) edit of one file."""

    path: str
    kind: str
    before: bool | None
    after: bool
    changed: bool
    diff: str
    new_text: str
    backup: str | None = None


@dataclass(frozen=True)
class SafetyCheck:
    allowed: bool
    rho: float | None
    source: str | None
    saved_at: str | None
    note: str


@dataclass(frozen=True)
class RestartResult:
    command: str
    returncode: int | None
    duration_s: float
    output_tail: str
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def _read(path: Path | str) -> str:
    """The file's text with its line endings as they are (``newline=""``: CRLF stays CRLF)."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise InvalidInput(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); the file was not changed") from e
    except OSError as e:
        raise InvalidInput(f"cannot read {path}: {e.strerror or e}") from e


def parse_yaml(text: str, path: str = "<config>") -> dict[str, Any]:
    """The config as a mapping; InvalidInput with the line number when it is malformed."""
    import yaml  # noqa: PLC0415

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"line {mark.line + 1}" if mark is not None else "unknown line"
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise InvalidInput(f"{path}: malformed YAML at {where}: {problem}; the file was not changed") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise InvalidInput(f"{path}: an LMCache config must be a YAML mapping, got {type(data).__name__}; the file was not changed")
    return data


def _as_bool(value: Any) -> bool | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return value
    return str(value).strip().strip("\"'").lower() in TRUTHY


def yaml_state(path: Path | str) -> SourceState:
    text = _read(path)
    data = parse_yaml(text, str(path))
    line = next((i + 1 for i, ln in enumerate(text.splitlines()) if _YAML_LINE.match(ln)), None)
    return SourceState(str(path), "yaml", _as_bool(data.get(KEY)), line)


def env_state(path: Path | str) -> SourceState:
    text = _read(path)
    value, line = None, None
    for i, ln in enumerate(text.splitlines()):
        m = _ENV_LINE.match(ln)
        if m:
            value, line = _as_bool(m.group("val")), i + 1
    return SourceState(str(path), "env", value, line)


def detect_kind(path: Path | str, given: str) -> str:
    """The kind of one file named by option ``given`` ("yaml", "env" or "vllm"); vLLM files are recognised by content."""
    from kvctl import loading_vllm  # noqa: PLC0415

    return loading_vllm.detect(path, _read(path), given)


def state(path: Path | str, kind: str) -> SourceState:
    """What one file of a detected kind says about async loading."""
    if kind == "yaml":
        return yaml_state(path)
    if kind == "env":
        return env_state(path)
    from kvctl import loading_vllm  # noqa: PLC0415

    return loading_vllm.state(path, _read(path), kind)


def set_yaml(text: str, value: bool, path: str = "<config>") -> str:
    """``text`` with ``enable_async_loading`` set to ``value``; every other line unchanged."""
    before = parse_yaml(text, path)
    word = "true" if value else "false"
    new = _rewrite(text, _YAML_LINE, lambda m: f"{m.group('head')}{word}{m.group('rest')}")
    if new is None:
        if KEY in before:
            raise KvctlError(f"{path}: {KEY} is set in a form kvctl does not edit (quoted or nested key); change it by hand")
        new = _append(text, f"{KEY}: {word}")
    after = parse_yaml(new, path)
    if after.get(KEY) is not value or {k: v for k, v in after.items() if k != KEY} != {k: v for k, v in before.items() if k != KEY}:
        raise KvctlError(f"{path}: the line edit did not give the expected config; change {KEY} by hand")
    return new


def set_env(text: str, value: bool) -> str:
    """Env-file ``text`` with ``LMCACHE_ENABLE_ASYNC_LOADING`` set; other lines unchanged."""
    word = "True" if value else "False"
    new = _rewrite(text, _ENV_LINE, lambda m: f"{m.group('head')}{m.group('q')}{word}{m.group('q')}{m.group('rest')}")
    return _append(text, f"{ENV_VAR}={word}") if new is None else new


def _rewrite(text: str, pattern: re.Pattern[str], replace: Callable[[re.Match[str]], str]) -> str | None:
    """``text`` with every line matching ``pattern`` replaced (its line ending kept); None when none matches."""
    lines = text.splitlines(keepends=True)
    found = False
    for i, raw in enumerate(lines):
        body = raw.rstrip("\r\n")
        m = pattern.match(body)
        if m:
            lines[i] = replace(m) + raw[len(body):]
            found = True
    return "".join(lines) if found else None


def _append(text: str, line: str) -> str:
    """``text`` with ``line`` added as a last line, ended like the file's lines (CRLF or LF)."""
    eol = "\r\n" if "\r\n" in text else "\n"
    return text + (eol if text and not text.endswith("\n") else "") + line + eol


def env_form(value: bool) -> str:
    return f"{ENV_VAR}={'True' if value else 'False'}"


def plan(path: Path | str, kind: str, value: bool) -> Change:
    """The edit that sets async loading to ``value`` in one file (nothing is written)."""
    text = _read(path)
    if kind == "yaml":
        before = yaml_state(path).async_loading
        new = set_yaml(text, value, str(path))
    elif kind == "env":
        before = env_state(path).async_loading
        new = set_env(text, value)
    else:
        from kvctl import loading_vllm  # noqa: PLC0415

        before, new = loading_vllm.flip(text, kind, value, str(path))
    diff = "".join(difflib.unified_diff(text.splitlines(keepends=True), new.splitlines(keepends=True), f"{path} (before)", f"{path} (after)"))
    return Change(str(path), kind, before, value, new != text, diff, new)


def backup_path(path: Path) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%dT%H%M%S")
    cand = path.with_name(f"{path.name}.{stamp}.bak")
    n = 1
    while cand.exists():
        cand = path.with_name(f"{path.name}.{stamp}-{n}.bak")
        n += 1
    return cand


def atomic_write(path: Path | str, text: str) -> None:
    """Write via a temp file in the same directory and ``os.replace``; keeps the file mode."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.kvctl-tmp-{os.getpid()}")
    created = False
    try:
        with open(tmp, "x", encoding="utf-8", newline="") as f:
            created = True
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        shutil.copymode(path, tmp)
        os.replace(tmp, path)
    except OSError as e:
        if created:
            tmp.unlink(missing_ok=True)
        raise KvctlError(f"cannot write {path}: {e.strerror or e}; the original is unchanged") from e


def apply(change: Change, backup: bool = True) -> Change:
    """Write a planned change (backup first); a no-op for an unchanged file."""
    if not change.changed:
        return change
    path = Path(change.path)
    bak = None
    if backup:
        bak = backup_path(path)
        try:
            shutil.copy2(path, bak)
        except OSError as e:
            raise KvctlError(f"cannot back up {path} to {bak}: {e.strerror or e}; nothing was changed") from e
    atomic_write(path, change.new_text)
    return Change(change.path, change.kind, change.before, change.after, True, change.diff, change.new_text, str(bak) if bak else None)


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


def check_sync(
    diagnosis: dict[str, Any] | None,
    source: str | None,
    force: bool,
    threshold: float = SYNC_REFUSE_RHO,
    max_age_s: float = DEFAULT_MAX_AGE_S,
    now: _dt.datetime | None = None,
) -> SafetyCheck:
    """May we switch to synchronous loading? Raises Refused unless ``force`` when it is unsafe OR undecidable.

    Refused: no diagnosis; ρ missing, null or not a finite number; ρ only a lower
    bound (B from Valkey's server-side time, which overstates B); a diagnosis
    undated or older than ``max_age_s``; ρ ≥ ``threshold``.
    """
    now = now or _dt.datetime.now(_dt.timezone.utc)
    if diagnosis is None:
        problems, rho, when_raw = ["no diagnosis found: run `kvctl diagnose` (or give --diagnosis FILE) to measure ρ first"], None, None
    else:
        problems = []
        rho = diagnosis.get("rho")
        when, when_raw = _diagnosis_time(diagnosis)
        reasons = diagnosis.get("null_reasons") if isinstance(diagnosis.get("null_reasons"), dict) else {}
        if isinstance(rho, bool) or not isinstance(rho, (int, float)) or not math.isfinite(rho):
            why = reasons.get("rho") or "no L2 traffic or bandwidth measured"
            problems.append(f"the diagnosis in {source} has no usable ρ ({rho!r}: {why})")
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
        if when is None:
            problems.append(f"the diagnosis in {source} is undated" if when_raw is None else f"the diagnosis date {when_raw!r} is not an ISO time")
        else:
            age = (now - when).total_seconds()
            if age > max_age_s:
                problems.append(f"the diagnosis is {age / 3600:.1f} h old (taken {when_raw}; --max-age {max_age_s / 3600:g} h): diagnose again")
            elif age < -300:
                problems.append(f"the diagnosis is dated in the future ({when_raw}): check the clocks, diagnose again")
    if problems:
        msg = f"{source or 'no diagnosis'}: " + "; ".join(problems)
        if not force:
            raise Refused(f"refusing to switch to synchronous loading: {msg}; pass --force to switch anyway")
        return SafetyCheck(True, rho, source, when_raw, f"forced: {msg}")
    return SafetyCheck(True, rho, source, when_raw, f"ρ = {rho:.2f} < {threshold:g} in {source} ({when_raw})")


def run_restart(command: str, timeout_s: float = 300.0) -> RestartResult:
    """Run the user's restart command through ``/bin/sh -c`` and report how it went.

    The shell runs in a process group of its own, so a timeout (or Ctrl-C)
    stops everything the command started, not only the shell: a restart
    reported as timed out does not go on in the background.
    """
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(
            ["/bin/sh", "-c", command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
    except OSError as e:
        return RestartResult(command, None, time.monotonic() - t0, str(e))
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        _kill_group(proc)
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return RestartResult(command, None, time.monotonic() - t0, out[-2000:], timed_out=True)
    except BaseException:
        _kill_group(proc)
        raise
    return RestartResult(command, proc.returncode, time.monotonic() - t0, (stdout + stderr)[-2000:])


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group that ``run_restart`` created for ``proc`` (its pid is the group id), then reap."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()
