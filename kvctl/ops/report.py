"""Summaries of replay runs: the columns of the paper's Table 2, per run file.

* latency percentiles p50/p90/p99 (linear interpolation, :func:`kvctl.bench.stats.percentile`),
  max and mean, over the requests that finished ``ok``;
* drift: p50 of each third of the run: the ok requests in order of scheduled time, cut into three
  consecutive groups as equal as possible (the first groups take the remainder, as
  ``numpy.array_split``);
* hit rate: share of ok requests with ``cached_tokens`` ≥ ``hit_tokens``;
* share of prompt tokens from L2: the engine's counters before and after the run, kvctl's connector
  counter ``kvctl:remote_hit_tokens`` when present, else LMCache's ``lmcache:num_remote_read_bytes``
  divided by ``bytes_per_token`` (when given), over the ok requests' prompt tokens;
* max in flight: the most requests open at once, as the sender counted them;
* by class: the same percentiles over the hits and over the misses apart (rows that report ``cached_tokens``),
  what ``kvctl simulate`` predicts per class too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from kvctl.bench.stats import latency_by_class, mean, percentile
from kvctl.diagnose.metrics import delta
from kvctl.core.errors import InvalidInput
from kvctl.replay.runfile import INTERRUPTED, Run, counter, read_run
from kvctl.connector import metric_names as N
from kvctl.connector.metric_names import REMOTE_HIT_TOKENS

#: kvctl connector counter of prompt tokens loaded from the remote tier (tokens).
CONNECTOR_L2_TOKENS = REMOTE_HIT_TOKENS
#: LMCache counter of bytes read from the remote backend.
LMCACHE_L2_BYTES = N.LMCACHE_NUM_REMOTE_READ_BYTES


@dataclass(frozen=True)
class RunSummary:
    name: str
    path: str
    requests: int  # rows in the run file (finished, ok or not, and those still open at a stop)
    errors: int  # finished, not ok
    p50_s: float | None
    p90_s: float | None
    p99_s: float | None
    max_s: float | None
    mean_s: float | None
    thirds_p50_s: list[float | None]
    hit_rate: float | None
    cached_token_share: float | None  # cached prompt tokens (any tier) / prompt tokens
    l2_token_share: float | None
    max_in_flight: int | None
    capped: int  # sends delayed by replay's --max-in-flight (the run was not fully open loop)
    interrupted: bool
    unfinished: int = 0  # requests still open when a stop signal ended the run
    warnings: tuple[str, ...] = ()  # what the reader skipped (a torn last line)
    #: p50/p90/p99 of the hits and of the misses apart (:func:`kvctl.bench.stats.latency_by_class`)
    by_class: dict | None = None


def thirds(values_in_order: Sequence[float]) -> list[list[float]]:
    """Three consecutive groups, sizes as equal as possible, the first ones taking the remainder."""
    n = len(values_in_order)
    sizes = [n // 3 + (1 if i < n % 3 else 0) for i in range(3)]
    out, start = [], 0
    for size in sizes:
        out.append(list(values_in_order[start : start + size]))
        start += size
    return out


def l2_tokens(run: Run, bytes_per_token: float | None = None) -> float | None:
    """Prompt tokens served from L2 during the run, from the counters scraped before and after."""
    before = run.metadata.get("metrics_before")
    after = (run.summary or {}).get("metrics_after")
    tokens = delta(counter(before, CONNECTOR_L2_TOKENS), counter(after, CONNECTOR_L2_TOKENS))
    if tokens is not None:
        return tokens
    nbytes = delta(counter(before, LMCACHE_L2_BYTES), counter(after, LMCACHE_L2_BYTES))
    if nbytes is not None and bytes_per_token:
        return nbytes / bytes_per_token
    return None


def summarize_run(run: Run, hit_tokens: int = 1, bytes_per_token: float | None = None, name: str | None = None) -> RunSummary:
    if hit_tokens < 1:
        raise InvalidInput(f"--hit-tokens must be at least 1, got {hit_tokens}")
    ok = sorted((r for r in run.rows if r["status"] == "ok"), key=lambda r: (r["scheduled_s"], r.get("index", 0)))
    lat = [float(r["latency_s"]) for r in ok]
    # rows without usage (cached_tokens null) say nothing about hits: both ratios count only rows that report it
    reported = [r for r in ok if r.get("cached_tokens") is not None]
    known = [int(r["cached_tokens"]) for r in reported]
    hit_rate = sum(1 for c in known if c >= hit_tokens) / len(known) if known else None
    reported_prompt = sum(int(r.get("prompt_tokens") or 0) for r in reported)
    cached_share = sum(known) / reported_prompt if known and reported_prompt else None
    prompt_total = sum(int(r.get("prompt_tokens") or 0) for r in ok)  # the L2 counters cover every request
    l2 = l2_tokens(run, bytes_per_token)
    in_flight = (run.summary or {}).get("max_in_flight")
    if in_flight is None:
        in_flight = max((int(r["in_flight"]) for r in run.rows if r.get("in_flight") is not None), default=None)
    unfinished = sum(1 for r in run.rows if r["status"].startswith(INTERRUPTED))
    return RunSummary(
        name=name or run.name,
        path=run.path,
        requests=len(run.rows),
        errors=len(run.rows) - len(ok) - unfinished,
        p50_s=percentile(lat, 50),
        p90_s=percentile(lat, 90),
        p99_s=percentile(lat, 99),
        max_s=max(lat) if lat else None,
        mean_s=mean(lat),
        thirds_p50_s=[percentile(t, 50) for t in thirds(lat)],
        hit_rate=hit_rate,
        cached_token_share=cached_share,
        l2_token_share=(l2 / prompt_total) if l2 is not None and prompt_total else None,
        max_in_flight=in_flight,
        capped=sum(1 for r in run.rows if r.get("capped")),
        interrupted=bool((run.summary or {}).get("interrupted")) or run.summary is None,
        unfinished=unfinished,
        warnings=tuple(run.warnings),
        by_class=latency_by_class([float(r["latency_s"]) for r, c in zip(reported, known) if c >= hit_tokens],
                                  [float(r["latency_s"]) for r, c in zip(reported, known) if c < hit_tokens]) if reported else None,
    )


def load_runs(paths: Sequence[str]) -> list[Run]:
    """Read run files; names are file stems, made unique with their parent directory when needed."""
    runs = [read_run(p) for p in paths]
    stems = [r.name for r in runs]
    for r in runs:
        if stems.count(r.name) > 1:
            r.name = f"{Path(r.path).parent.name}/{r.name}"
    return runs


def series(run: Run) -> tuple[list[float], list[float]]:
    """(scheduled seconds, latency seconds) of the ok requests, in scheduled order, for plots."""
    ok = sorted((r for r in run.rows if r["status"] == "ok"), key=lambda r: r["scheduled_s"])
    return [float(r["scheduled_s"]) for r in ok], [float(r["latency_s"]) for r in ok]
