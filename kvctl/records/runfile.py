"""Run files (``kvctl replay --out RUN.jsonl``): write as requests finish, read back for reports.

Layout, one JSON object per line:

* first line ``{"metadata": {...}}``: trace path and sha256, engine URL, model, kvctl version,
  start time, options, and the engine metrics scraped before the run (``metrics_before``);
* one row per finished request, in finishing order: ``index``, ``scheduled_s``, ``sent_s``,
  ``first_token_s``, ``finished_s`` (seconds from the run's start), ``latency_s`` (finished −
  scheduled), ``prompt_tokens``, ``cached_tokens``, ``status`` ("ok" or the error), ``in_flight``
  (requests in flight once it was sent, itself included), ``capped`` (it waited for
  ``--max-in-flight``), ``request`` (the original trace line, so a run file replays as a trace);
* last line ``{"summary": {...}}``: counts, max in flight, cap hits, ``metrics_after``,
  ``interrupted``. A run stopped hard may lack it; readers cope.

Each line is flushed when written: a Ctrl-C or a crash loses nothing that finished. A run stopped
hard in the middle of a write leaves a torn last line (no newline, not JSON): the reader skips it
with a warning (:attr:`Run.warnings`). Every other line is checked, types included: a wrong type is
an error naming its line, never a crash in the report.

:func:`read_run` (and :func:`parse_run`, for a text already read) is the one reader of run files: ``report``,
``simulate``/``plan --fit-from`` and its fits (``kvctl.sim.variability``, ``kvctl.sim.calibrate``) and the trace
reader (a run file given as ``--trace`` or replayed) all take its rules:

* every row names its request (``index``, an integer) and no two rows name the same one: replay writes each
  request once, so a repeat is an edited or concatenated file, refused naming both lines (which copy is
  right cannot be told, and counting it twice moves every percentile); a second metadata or summary line
  (two runs in one file) likewise;
* every time (``scheduled_s``, ``sent_s``, ``first_token_s``, ``finished_s``, ``latency_s``) is null or a
  finite number of seconds in [0, RUN_FILE_MAX_TIME_S]; token counts are within the trace's MAX_TOKENS,
  other counts within RUN_FILE_MAX_COUNT, scraped counters finite as floats;
* a torn last line is skipped with the same warning, whoever reads.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from kvctl.core import files
from kvctl.core.errors import InvalidInput
from kvctl.core.thresholds import RUN_FILE_MAX_COUNT, RUN_FILE_MAX_TIME_S, TRACE_MAX_BYTES
from kvctl.core.thresholds import TRACE_MAX_TOKENS as MAX_TOKENS
from kvctl.records.jsonl import first_value, json_lines, malformed

#: How replay's rows for requests still open at a stop signal begin their status (not errors of the engine).
INTERRUPTED = "interrupted"

ROW_FIELDS = (
    "scheduled_s",
    "sent_s",
    "first_token_s",
    "finished_s",
    "latency_s",
    "prompt_tokens",
    "cached_tokens",
    "status",
)


class RunWriter:
    """Append-only JSONL writer that flushes every line."""

    def __init__(self, path: str | Path, metadata: dict[str, Any], overwrite: bool = False) -> None:
        self.path = Path(path)
        if self.path.exists() and not overwrite:
            raise InvalidInput(f"{self.path} exists; choose another --out or pass --force")
        try:  # 0600: the metadata names the engine (masked) and the run may be shared on purpose, not by default
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
            os.fchmod(fd, 0o600)
            self._f: IO[str] = os.fdopen(fd, "w", encoding="utf-8")
        except OSError as e:
            raise InvalidInput(f"cannot write --out {self.path}: {e.strerror or e}") from e
        self.rows = 0
        self._line({"metadata": metadata})

    def _line(self, obj: dict[str, Any]) -> None:
        self._f.write(json.dumps(obj, separators=(",", ":"), allow_nan=False) + "\n")
        self._f.flush()

    def row(self, row: dict[str, Any]) -> None:
        self._line(row)
        self.rows += 1

    def close(self, summary: dict[str, Any]) -> None:
        if not self._f.closed:
            self._line({"summary": summary})
            self._f.close()


@dataclass
class Run:
    path: str
    metadata: dict[str, Any]
    rows: list[dict[str, Any]]
    summary: dict[str, Any] | None = None
    name: str = field(default="")
    warnings: list[str] = field(default_factory=list)
    row_lines: list[int] = field(default_factory=list)  # the line of each row in the file


def counter(values: dict[str, Any] | None, name: str) -> float | None:
    """Counter ``name`` of scraped values (``metrics_before``/``metrics_after``), as Prometheus exposes it
    (``name_total``) or bare; None when not scraped."""
    if not values:
        return None
    for n in (f"{name}_total", name):
        if n in values:
            return float(values[n])
    return None


def _is_number(v: Any) -> bool:
    """A JSON number that is finite as a float (a 400-digit integer is not: float() of it overflows)."""
    if isinstance(v, int) and not isinstance(v, bool):
        try:
            return math.isfinite(float(v))
        except OverflowError:
            return False
    return isinstance(v, float) and math.isfinite(v)


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= RUN_FILE_MAX_COUNT


def _is_tokens(v: Any) -> bool:
    """A token count within the one stated cap on prompts (replay's MAX_TOKENS)."""
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_TOKENS


def _is_time(v: Any) -> bool:
    """Seconds of a run: finite, non-negative, at most RUN_FILE_MAX_TIME_S."""
    return _is_number(v) and 0 <= v <= RUN_FILE_MAX_TIME_S


def _shown(v: Any) -> str:
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10**30:
        return f"a {len(str(abs(v)))}-digit integer"
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


_TIME = f"a non-negative number of seconds up to {RUN_FILE_MAX_TIME_S:,.0f} (31 days)"
_COUNT = f"a non-negative integer up to {RUN_FILE_MAX_COUNT:,}"
#: Optional row fields and what each must be when present and not null.
_ROW_TYPES = (
    ("sent_s", _is_time, _TIME), ("first_token_s", _is_time, _TIME), ("finished_s", _is_time, _TIME),
    ("latency_s", _is_time, _TIME),
    ("prompt_tokens", _is_tokens, f"a non-negative integer up to {MAX_TOKENS:,}"),
    ("cached_tokens", _is_tokens, f"a non-negative integer up to {MAX_TOKENS:,}"),
    ("in_flight", _is_count, _COUNT),
    ("capped", lambda v: isinstance(v, bool), "true or false"),
)


def _check_row(row: dict[str, Any], lineno: int) -> str | None:
    for k in ("index", *ROW_FIELDS):
        if k not in row:
            return f"line {lineno}: missing {k}"
    if not _is_count(row["index"]):
        return f"line {lineno}: index must be {_COUNT} (the request's number), got {_shown(row['index'])}"
    if not isinstance(row["status"], str):
        return f"line {lineno}: status must be a string"
    if not _is_time(row["scheduled_s"]):
        return f"line {lineno}: scheduled_s must be {_TIME}, got {_shown(row['scheduled_s'])}"
    if row["status"] == "ok" and not _is_time(row["latency_s"]):
        return f"line {lineno}: latency_s must be {_TIME}, got {_shown(row['latency_s'])}"
    for k, ok, what in _ROW_TYPES:
        if row.get(k) is not None and not ok(row[k]):
            return f"line {lineno}: {k} must be {what} or null, got {_shown(row[k])}"
    return None


def _check_metrics(values: Any, where: str, lineno: int) -> str | None:
    """Scraped counters (``metrics_before``/``metrics_after``): null, or an object of names to numbers."""
    if values is None:
        return None
    if not isinstance(values, dict):
        return f"line {lineno}: {where} must be an object of metric names to numbers or null, got {_shown(values)}"
    bad = next((k for k, v in values.items() if not _is_number(v)), None)
    if bad is not None:
        return f"line {lineno}: {where}.{bad} must be a number, got {_shown(values[bad])}"
    return None


def _check_summary(summary: dict[str, Any], lineno: int) -> str | None:
    if summary.get("max_in_flight") is not None and not _is_count(summary["max_in_flight"]):
        return f"line {lineno}: summary.max_in_flight must be {_COUNT} or null, got {_shown(summary['max_in_flight'])}"
    if summary.get("interrupted") is not None and not isinstance(summary["interrupted"], bool):
        return f"line {lineno}: summary.interrupted must be true or false, got {_shown(summary['interrupted'])}"
    return _check_metrics(summary.get("metrics_after"), "summary.metrics_after", lineno)


def _torn_last_line(text: str, errors: list[str]) -> str | None:
    """The warning for a torn last line (a hard stop mid-write: no newline, not JSON), removed from ``errors``."""
    if not errors or text.endswith("\n"):
        return None
    lines = text.splitlines()
    last = len(lines)
    if errors[-1].startswith((f"line {last}: not JSON", f"line {last}: not usable JSON")):
        errors.pop()
        return f"line {last} is torn (the run stopped while writing it): skipped"
    return None


def opens_as_run(text: str) -> bool:
    """Whether ``text`` opens as a run file does: a ``{"metadata": ...}`` line first."""
    first = first_value(text)
    return isinstance(first, dict) and "metadata" in first


def parse_run(path: str | Path, text: str) -> Run:
    """The run file ``text`` (read from ``path``) by the rules of the module docstring; InvalidInput names the file
    and the lines of anything malformed."""
    p = Path(path)
    metadata: dict[str, Any] | None = None
    summary = None
    rows: list[dict[str, Any]] = []
    row_lines: list[int] = []
    seen: dict[int, int] = {}  # request index -> the line that first named it
    errors: list[str] = []
    summary_line = None
    for lineno, obj in json_lines(text, errors):
        if metadata is None and not (isinstance(obj, dict) and "metadata" in obj):
            break  # a run file opens with its metadata
        if not isinstance(obj, dict):
            errors.append(f"line {lineno}: not a JSON object")
        elif "metadata" in obj and len(obj) == 1:
            if metadata is not None:
                errors.append(f"line {lineno}: a second metadata line (two runs in one file?): one run a file")
                continue
            metadata = obj["metadata"] if isinstance(obj["metadata"], dict) else {}
            err = _check_metrics(metadata.get("metrics_before"), "metadata.metrics_before", lineno)
            if err:
                errors.append(err)
        elif "summary" in obj and len(obj) == 1:
            if summary_line is not None:
                errors.append(f"line {lineno}: a second summary line (the first is line {summary_line}): one run a file")
                continue
            summary_line = lineno
            summary = obj["summary"] if isinstance(obj["summary"], dict) else None
            err = _check_summary(summary, lineno) if summary is not None else None
            if err:
                errors.append(err)
        else:
            err = _check_row(obj, lineno)
            if err is None and obj["index"] in seen:
                err = (f"line {lineno}: index {obj['index']} is on line {seen[obj['index']]} too (replay writes each "
                       f"request once: an edited or concatenated run file)")
            if err:
                errors.append(err)
            else:
                seen[obj["index"]] = lineno
                rows.append(obj)
                row_lines.append(lineno)
    warnings = [w] if metadata is not None and (w := _torn_last_line(text, errors)) else []
    if errors:
        raise malformed(p, errors)
    if metadata is None:
        raise InvalidInput(f"{p} is not a kvctl run file (no {{\"metadata\": ...}} line)")
    return Run(str(p), metadata, rows, summary, name=p.stem, warnings=warnings, row_lines=row_lines)


def read_run(path: str | Path) -> Run:
    """Read a run file (a regular file of at most TRACE_MAX_BYTES: :func:`kvctl.core.files.read_regular`) by
    :func:`parse_run`; InvalidInput names the file and line of anything malformed."""
    text = files.read_regular(Path(path), "run file", TRACE_MAX_BYTES, kind="a run file")
    return parse_run(path, text)
