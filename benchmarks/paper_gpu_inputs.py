"""The files of ``paper_gpu.py``'s work directory read back, bounded and typed (issue 44, defect 6).

A work directory outlives the process that wrote it: ``--only`` calls add to it, ``--analyse`` reads it on
another machine, a person may edit it. So what it holds is input. Each file goes through kvctl's bounded
readers (:func:`kvctl.core.files.read_regular`: a regular file under a cap, so a FIFO or a link to
``/dev/zero`` is refused, never waited on or read without end; run files through
:func:`kvctl.records.runfile.read_run`), and each field is checked for its type and range before it is used.
Anything else is :class:`~kvctl.core.errors.InvalidInput`: one line naming the file and the key.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

from kvctl.core import files
from kvctl.core.errors import InvalidInput
from kvctl.core.thresholds import CONFIG_MAX_BYTES, JSON_MAX_DEPTH, METRICS_MAX_BYTES

#: meta.json, <run>.info.json, <run>.diagnose.json, bytes_per_token.txt: a few KB each.
DOC_MAX_BYTES = CONFIG_MAX_BYTES
#: <run>.exporter.jsonl: ~60 bytes a scrape every 2 s (16 MiB: three days of scrapes).
SAMPLES_MAX_BYTES = METRICS_MAX_BYTES
#: Ranges of meta.json's figures: generous, but a figure past one is no run this script made.
MAX_TOKENS = 10_000_000  # prompt, block, chunk and batch tokens (kvctl replay's cap on a prompt)
MAX_INSTANCES = 64  # instances per rank (kvctl's MAX_INSTANCES_PER_RANK)
MAX_BYTES_PER_TOKEN = 1e9  # kvctl's cap on --bytes-per-token
MAX_REQUESTS = 10**8
MAX_RATE = 1e6  # requests/s
MAX_SPAN_S = 31 * 86400.0
MAX_RHO = 1e9

Check = tuple[Callable[[Any], bool], str]


def integer(lo: int, hi: int) -> Check:
    return (lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi), f"an integer in [{lo:,}, {hi:,}]"


def number(lo: float, hi: float, *, above: bool = False) -> Check:
    """A finite number in [lo, hi] (``above``: in (lo, hi])."""
    def ok(v: Any) -> bool:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, int) and abs(v) > 1e300):
            return False
        return math.isfinite(v) and (v > lo if above else v >= lo) and v <= hi
    return ok, f"a number in {'(' if above else '['}{lo:g}, {hi:g}]"


def text() -> Check:
    return (lambda v: isinstance(v, str)), "a string"


def _shown(v: Any) -> str:
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10**30:
        return f"a {len(str(abs(v)))}-digit integer"
    s = json.dumps(v) if not isinstance(v, float) or math.isfinite(v) else repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


def field(doc: dict, path: Path, key: str, check: Check, *, optional: bool = False, default: Any = None) -> Any:
    """``doc[key]`` (``key`` dotted through nested objects) when it passes ``check``; ``default`` when ``optional``
    and missing or null; InvalidInput naming ``path`` and ``key`` otherwise."""
    value: Any = doc
    for i, part in enumerate(key.split(".")):
        if not isinstance(value, dict):
            raise InvalidInput(f"{path}: {'.'.join(key.split('.')[:i])} must be an object, got {_shown(value)}")
        if part not in value:
            if optional:
                return default
            raise InvalidInput(f"{path}: {key} is missing")
        value = value[part]
    if value is None and optional:
        return default
    ok, what = check
    if not ok(value):
        raise InvalidInput(f"{path}: {key} must be {what}{' or null' if optional else ''}, got {_shown(value)}")
    return value


def read_doc(path: Path, what: str, *, empty_ok: bool = False) -> dict | None:
    """The JSON object in ``path`` (a regular file of at most DOC_MAX_BYTES); None when ``empty_ok`` and the file
    holds nothing (a command killed before it printed)."""
    raw = files.read_regular(path, what, DOC_MAX_BYTES, kind=f"a {what}")
    if empty_ok and not raw.strip():
        return None
    if files.json_too_deep(raw):
        raise InvalidInput(f"{path}: nested more than {JSON_MAX_DEPTH} levels deep: not a {what}")
    try:
        doc = json.loads(raw)
    except ValueError as e:  # a JSONDecodeError, or an integer past Python's digit limit
        raise InvalidInput(f"{path}: not JSON ({str(e).split(';')[0]}): not a {what}") from e
    if not isinstance(doc, dict):
        raise InvalidInput(f"{path}: must hold a JSON object, got {_shown(doc)}")
    return doc


def read_meta(work: Path) -> dict:
    """``W/meta.json`` with every figure the script uses checked (the rest as it is)."""
    path = work / "meta.json"
    meta = read_doc(path, "paper_gpu meta file")
    tokens, k = integer(1, MAX_TOKENS), integer(1, MAX_INSTANCES)
    field(meta, path, "bytes_per_token", number(0, MAX_BYTES_PER_TOKEN, above=True))
    for key in ("prompt_tokens", "block_tokens", "chunk_tokens", "max_batched_tokens"):
        field(meta, path, key, tokens)
    field(meta, path, "instances", k)
    field(meta, path, "calib_instances", k, optional=True)  # runs before --calib-instances calibrated on one
    field(meta, path, "calib_loading", (lambda v: v in ("sync", "async"), '"sync" or "async"'), optional=True)
    field(meta, path, "traces", (lambda v: isinstance(v, dict) and "main" in v, 'an object with a "main" trace'))
    for name in ("main", "calib"):
        if name == "main" or name in meta["traces"]:
            requests = field(meta, path, f"traces.{name}.requests", integer(1, MAX_REQUESTS))
            field(meta, path, f"traces.{name}.primed", integer(0, requests))
            field(meta, path, f"traces.{name}.rate", number(0, MAX_RATE, above=True))
            field(meta, path, f"traces.{name}.span_s", number(0, MAX_SPAN_S))
    return meta


def read_info(work: Path, run: str) -> dict:
    """``W/<run>.info.json`` (empty when absent), its ``diagnose_exit`` checked."""
    path = work / f"{run}.info.json"
    if not path.exists() and not path.is_symlink():
        return {}
    info = read_doc(path, "paper_gpu run info file")
    field(info, path, "diagnose_exit", integer(-255, 255), optional=True)
    return info


def read_diagnose(work: Path, run: str) -> dict | None:
    """What ``kvctl diagnose --json`` printed during ``run`` (None when absent or empty: it printed nothing), with
    the figures the analysis shows checked."""
    path = work / f"{run}.diagnose.json"
    if not path.exists() and not path.is_symlink():
        return None
    doc = read_doc(path, "kvctl diagnose JSON file", empty_ok=True)
    if doc is None:
        return None
    field(doc, path, "rho", number(0, MAX_RHO), optional=True)
    field(doc, path, "rho_bound", text(), optional=True)
    field(doc, path, "bandwidth_gbps", number(0, 1e9), optional=True)
    field(doc, path, "bandwidth_source", text(), optional=True)
    findings = field(doc, path, "findings", (lambda v: isinstance(v, list), "a list"), optional=True, default=[])
    for i, f in enumerate(findings):
        if not isinstance(f, dict) or not isinstance(f.get("id"), str):
            raise InvalidInput(f"{path}: findings[{i}] must be an object with a string id, got {_shown(f)}")
    return doc


def read_rho_samples(path: Path) -> list[float]:
    """The highest ``kvctl_rho`` of each scrape in an exporter recording (scrapes without one left out); a torn last
    line (the scraper stopped while writing it) is dropped."""
    raw = files.read_regular(path, "exporter recording", SAMPLES_MAX_BYTES, kind="an exporter recording")
    lines = raw.splitlines()
    if lines and not raw.endswith("\n"):
        lines.pop()
    rho_ok, what = number(0, MAX_RHO)
    values = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line) if not files.json_too_deep(line) else None
        except ValueError:
            row = None
        if not isinstance(row, dict):
            raise InvalidInput(f"{path}: line {lineno} is not a JSON object")
        rho = row.get("kvctl_rho")
        if rho is None or rho == []:
            continue
        if not isinstance(rho, list) or not all(rho_ok(v) for v in rho):
            raise InvalidInput(f"{path}: line {lineno}: kvctl_rho must be a list of {what}, got {_shown(rho)}")
        values.append(float(max(rho)))
    return values


def read_bytes_per_token(path: Path) -> float:
    """The cached KV bytes per token (``W/bytes_per_token.txt``)."""
    raw = files.read_regular(path, "bytes-per-token cache", DOC_MAX_BYTES, kind="a bytes-per-token cache").strip()
    ok, what = number(0, MAX_BYTES_PER_TOKEN, above=True)
    try:
        value = float(raw)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise InvalidInput(f"{path}: must hold {what}, got {_shown(raw)}")
    return value
