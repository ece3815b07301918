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

Each line is flushed when written: a Ctrl-C or a crash loses nothing that finished.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from kvctl.errors import InvalidInput
from kvctl.replay.trace import json_lines, malformed

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
        try:
            self._f: IO[str] = open(self.path, "w", encoding="utf-8")
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


def _check_row(row: dict[str, Any], lineno: int) -> str | None:
    for k in ROW_FIELDS:
        if k not in row:
            return f"line {lineno}: missing {k}"
    if not isinstance(row["status"], str):
        return f"line {lineno}: status must be a string"
    if row["status"] == "ok":
        lat = row["latency_s"]
        if not isinstance(lat, (int, float)) or isinstance(lat, bool) or not math.isfinite(lat) or lat < 0:
            return f"line {lineno}: latency_s must be a non-negative number, got {lat!r}"
    return None


def read_run(path: str | Path) -> Run:
    """Read a run file; InvalidInput names the file and line of anything malformed."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidInput(f"cannot read run file {p}: {getattr(e, 'strerror', None) or e}") from e
    metadata: dict[str, Any] | None = None
    summary = None
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    for lineno, obj in json_lines(text, errors):
        if metadata is None and not (isinstance(obj, dict) and "metadata" in obj):
            break  # a run file opens with its metadata
        if not isinstance(obj, dict):
            errors.append(f"line {lineno}: not a JSON object")
        elif "metadata" in obj and len(obj) == 1:
            metadata = obj["metadata"] if isinstance(obj["metadata"], dict) else {}
        elif "summary" in obj and len(obj) == 1:
            summary = obj["summary"] if isinstance(obj["summary"], dict) else None
        else:
            err = _check_row(obj, lineno)
            if err:
                errors.append(err)
            else:
                rows.append(obj)
    if errors:
        raise malformed(p, errors)
    if metadata is None:
        raise InvalidInput(f"{p} is not a kvctl run file (no {{\"metadata\": ...}} line)")
    return Run(str(p), metadata, rows, summary, name=p.stem)
