"""JSONL as traces and run files hold it: decoded line by line, malformed lines gathered and reported together.

The floor below both readers (:mod:`kvctl.records.trace` and :mod:`kvctl.records.runfile`): the trace reader
hands a run file to the run-file reader, so what they share lives here, below both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from kvctl.core import files
from kvctl.core.errors import InvalidInput
from kvctl.core.thresholds import JSON_MAX_DEPTH

#: How many malformed lines one error message lists.
MAX_LISTED_ERRORS = 5


def json_lines(text: str, errors: list[str]) -> Iterator[tuple[int, Any]]:
    """(line number, decoded value) of each non-blank JSONL line; undecodable lines (and lines nested deeper
    than JSON_MAX_DEPTH) are added to ``errors``."""
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if files.json_too_deep(line):
            errors.append(f"line {lineno}: not usable JSON (nested too deeply: more than {JSON_MAX_DEPTH} levels)")
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            errors.append(f"line {lineno}: not JSON ({e.msg})")
            continue
        except ValueError as e:  # an integer past Python's digit limit (4300 digits)
            errors.append(f"line {lineno}: not usable JSON ({str(e).split(';')[0]})")
            continue
        except RecursionError:
            errors.append(f"line {lineno}: not usable JSON (nested too deeply)")
            continue
        yield lineno, value


def first_value(text: str) -> Any:
    """The decoded first non-blank line of ``text`` (None when it is not usable JSON): what a file opens with."""
    start = 0
    while start <= len(text):
        end = text.find("\n", start)
        line = text[start:] if end < 0 else text[start:end]
        if line.strip():
            return next((value for _, value in json_lines(line, [])), None)
        if end < 0:
            break
        start = end + 1
    return None


def malformed(path: Path | str, errors: list[str]) -> InvalidInput:
    """One error naming the file and its first malformed lines."""
    more = f" (and {len(errors) - MAX_LISTED_ERRORS} more)" if len(errors) > MAX_LISTED_ERRORS else ""
    return InvalidInput(f"{path}: {len(errors)} malformed line(s): " + "; ".join(errors[:MAX_LISTED_ERRORS]) + more)
