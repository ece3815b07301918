"""Read request traces: Mooncake/FAST'25 JSONL, ``{offset_s, prompt}`` JSONL, and kvctl run files.

One reader for all three; the format is recognised line by line from its keys:

* Mooncake (FAST'25): ``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [..]}``.
  Each hash id names one block of ``block_tokens`` (512) tokens; two requests that share a hash id
  share that block, so prefix hits happen as in the original trace.
* offsets: ``{"offset_s": t, "prompt": "text"}`` or ``{"offset_s": t, "prompt_tokens": n | [ids]}``
  (a count gives a prompt of n tokens unique to that request); optional ``max_tokens``.
* a kvctl run file (``kvctl replay --out``): a ``{"metadata": ...}`` first line, then one row per
  request whose ``request`` field holds the original trace line (replays a past run). A file that opens
  with a metadata line is read by the run-file reader (:func:`kvctl.records.runfile.parse_run`) and takes
  its rules: one row a request, bounded times, a torn last line skipped with a warning (``Trace.warnings``).

Offsets are taken relative to the trace's first request. Malformed lines are rejected together,
each named by its line number. Every number has a stated cap (:data:`MAX_TOKENS`, :data:`MAX_SPAN_S`,
64-bit ids); a 400-digit number, a 5,000-digit one or nesting past JSON_MAX_DEPTH is a malformed line, never a crash.
The file itself is read by :func:`kvctl.core.files.read_regular`: a regular file (never a FIFO or a device) of at
most TRACE_MAX_BYTES.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from kvctl.core import files
from kvctl.core.errors import InvalidInput
from kvctl.core.thresholds import TRACE_MAX_BYTES, TRACE_MAX_TOKENS
from kvctl.records import runfile
from kvctl.records.jsonl import json_lines, malformed

DEFAULT_BLOCK_TOKENS = 512
#: The stated caps on a trace line. Prompt and output tokens: 10 million, past the longest context any
#: model declares (``kvctl replay`` also holds prompts to the engine's own ``max_model_len``). The one bound
#: on a prompt's tokens: a run file's ``prompt_tokens``/``cached_tokens`` (report, ``--fit-from``) obey it too.
MAX_TOKENS = TRACE_MAX_TOKENS
#: An offset (``timestamp`` ms / 1000, or ``offset_s``) as written: up to 10^12 s, room for Unix-epoch
#: times, refused past it (a number past a float's range never reaches arithmetic).
MAX_RAW_OFFSET_S = 1e12
#: From the trace's first request to its last: 30 days. A replay sleeps until each offset.
MAX_SPAN_S = 30 * 86400.0
#: Hash ids and token ids: 64-bit integers (two ids past that would draw the same block).
MIN_ID, MAX_ID = -(1 << 63), (1 << 64) - 1


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace; exactly one of hash_ids / prompt / prompt_token_ids / input_length describes the prompt."""

    index: int
    offset_s: float  # from the trace's first request, before --speed
    line: int
    max_tokens: int | None = None  # the trace's output length, when it has one
    input_length: int | None = None  # prompt tokens, when known
    hash_ids: tuple[int, ...] | None = None
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    source: dict[str, Any] | None = None  # the original trace line, stored in run files
    cached_tokens: int | None = None  # a run file's row: what the engine reported cached

    @property
    def token_count(self) -> int | None:
        """Prompt tokens when the trace says (None for a text prompt)."""
        if self.prompt_token_ids is not None:
            return len(self.prompt_token_ids)
        return self.input_length


@dataclass(frozen=True)
class Trace:
    path: str
    sha256: str
    format: str  # "mooncake", "offsets", "run" or "mixed"
    requests: tuple[TraceRequest, ...]
    metadata: dict[str, Any] | None = None  # a run file's metadata
    warnings: tuple[str, ...] = ()  # a run file's: its torn last line, skipped


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: Any) -> bool:
    """A JSON number that is finite (an int of any size is: math.isfinite would overflow on it)."""
    return _is_int(v) or (isinstance(v, float) and math.isfinite(v))


def _shown(v: Any) -> str:
    """A value for an error message, cut short (a 400-digit number is not worth quoting whole)."""
    text = repr(v) if not _is_int(v) or abs(v) < 10**30 else f"a {len(str(abs(v)))}-digit integer"
    return text if len(text) <= 60 else text[:57] + "..."


def _max_tokens(obj: dict, key: str) -> int | None:
    if key not in obj or obj[key] is None:
        return None
    v = obj[key]
    if not _is_int(v) or not 0 <= v <= MAX_TOKENS:
        raise ValueError(f"{key} must be an integer in [0, {MAX_TOKENS:,}], got {_shown(v)}")
    return v


def _offset(v: Any, key: str, scale: float) -> float:
    """``v`` (in units of 1/scale s) as seconds: a non-negative number up to MAX_RAW_OFFSET_S."""
    if not _number(v) or v < 0 or v > MAX_RAW_OFFSET_S * scale:
        unit = "ms" if scale != 1 else "s"
        raise ValueError(f"{key} must be a non-negative number of {unit} up to {MAX_RAW_OFFSET_S * scale:g}, got {_shown(v)}")
    return v / scale


def _prompt_tokens(v: Any, key: str) -> int:
    if not _is_int(v) or not 1 <= v <= MAX_TOKENS:
        raise ValueError(f"{key} must be an integer in [1, {MAX_TOKENS:,}] (the stated cap), got {_shown(v)}")
    return v


def _ids(v: Any) -> bool:
    return isinstance(v, list) and all(_is_int(h) and MIN_ID <= h <= MAX_ID for h in v)


def parse_line(obj: Any, line: int) -> tuple[str, dict[str, Any]]:
    """(format, fields of TraceRequest) for one decoded trace line; ValueError says what is wrong."""
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    if "timestamp" in obj or "hash_ids" in obj:
        ts, n, ids = obj.get("timestamp"), obj.get("input_length"), obj.get("hash_ids")
        offset = _offset(ts, "timestamp", 1000.0)
        n = _prompt_tokens(n, "input_length")
        if not _ids(ids):
            raise ValueError(f"hash_ids must be a list of 64-bit integers, got {_shown(ids)}")
        return "mooncake", {
            "offset_s": offset,
            "input_length": n,
            "hash_ids": tuple(ids),
            "max_tokens": _max_tokens(obj, "output_length"),
        }
    if "offset_s" in obj:
        fields: dict[str, Any] = {"offset_s": float(_offset(obj["offset_s"], "offset_s", 1.0)), "max_tokens": _max_tokens(obj, "max_tokens")}
        if "prompt" in obj:
            if not isinstance(obj["prompt"], str) or not obj["prompt"]:
                raise ValueError("prompt must be a non-empty string")
            fields["prompt"] = obj["prompt"]
        elif "prompt_tokens" in obj:
            pt = obj["prompt_tokens"]
            if _is_int(pt):
                fields["input_length"] = _prompt_tokens(pt, "prompt_tokens")
            elif isinstance(pt, list) and 0 < len(pt) <= MAX_TOKENS and all(_is_int(t) and 0 <= t <= MAX_ID for t in pt):
                fields["prompt_token_ids"] = tuple(pt)
            else:
                raise ValueError(f"prompt_tokens must be a positive integer or a list of token ids, got {_shown(pt)}")
        else:
            raise ValueError("an offset_s line needs prompt or prompt_tokens")
        return "offsets", fields
    raise ValueError("unknown line: expected timestamp/input_length/hash_ids (Mooncake) or offset_s with prompt/prompt_tokens")


def read_trace(path: str | Path) -> Trace:
    """Read a trace or run file (a regular file of at most TRACE_MAX_BYTES); InvalidInput lists malformed lines by number."""
    p = Path(path)
    text = files.read_regular(p, "trace", TRACE_MAX_BYTES, kind="a trace")
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    requests: list[TraceRequest] = []
    errors: list[str] = []
    formats: set[str] = set()
    metadata: dict[str, Any] | None = None
    warnings: tuple[str, ...] = ()
    lines: Iterable[tuple[int, Any]]
    if runfile.opens_as_run(text):  # a run file: the run-file reader's rules, then its rows' trace lines
        run = runfile.parse_run(p, text)
        lines, metadata, warnings = zip(run.row_lines, run.rows), run.metadata, tuple(run.warnings)
    else:
        lines = json_lines(text, errors)
    for lineno, obj in lines:
        if isinstance(obj, dict) and "metadata" in obj and len(obj) == 1:
            if not isinstance(obj["metadata"], dict):
                errors.append(f"line {lineno}: metadata must be an object")
            metadata = obj["metadata"] if isinstance(obj["metadata"], dict) else {}
            continue
        if isinstance(obj, dict) and "summary" in obj and len(obj) == 1:
            continue  # a run file's closing line
        source = obj
        if isinstance(obj, dict) and "request" in obj and "scheduled_s" in obj:
            source = obj["request"]  # a run-file row: replay the original trace line
            formats.add("run")
        try:
            fmt, fields = parse_line(source, lineno)
        except ValueError as e:
            errors.append(f"line {lineno}: {e}")
            continue
        formats.add(fmt)
        if source is not obj:
            if "prompt" in fields and _is_int(obj.get("prompt_tokens")):
                fields["input_length"] = obj["prompt_tokens"]  # the engine's count from the past run
            if _is_int(obj.get("cached_tokens")):
                fields["cached_tokens"] = obj["cached_tokens"]
        requests.append(TraceRequest(index=0, line=lineno, source=source, **fields))
    if errors:
        raise malformed(p, errors)
    if not requests:
        raise InvalidInput(f"{p}: no requests in the trace")
    start = min(r.offset_s for r in requests)
    far = [r for r in requests if r.offset_s - start > MAX_SPAN_S]
    if far:
        raise malformed(p, [f"line {r.line}: {r.offset_s - start:.6g} s after the trace's first request, past the cap of {MAX_SPAN_S:g} s (30 days)" for r in far])
    ordered = sorted(requests, key=lambda r: (r.offset_s, r.line))
    out = tuple(
        TraceRequest(
            index=i,
            offset_s=r.offset_s - start,
            line=r.line,
            max_tokens=r.max_tokens,
            input_length=r.input_length,
            hash_ids=r.hash_ids,
            prompt=r.prompt,
            prompt_token_ids=r.prompt_token_ids,
            source=r.source,
            cached_tokens=r.cached_tokens,
        )
        for i, r in enumerate(ordered)
    )
    fmt = "run" if "run" in formats else (formats.pop() if len(formats) == 1 else "mixed")
    return Trace(str(p), digest, fmt, out, metadata, warnings)
