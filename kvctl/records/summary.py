"""Summaries of replay runs: the columns of the paper's Table 2, per run file.

* outcomes: every row is one of :data:`OUTCOMES` (a hit, a miss, ok without usage, an HTTP error, a timeout,
  another error, or interrupted: open when a stop signal ended the run), so they add up to the rows
  (``requests``); the requests of the trace that have no row (due after the stop) are ``not_sent``, and
  ``requests + not_sent`` is the trace's ``trace_requests`` when the metadata says it;
* latency percentiles p50/p90/p99 (linear interpolation, :func:`kvctl.records.stats.percentile`),
  max and mean, over the requests that finished ``ok``;
* drift: p50 of each third of the run: the ok requests in order of scheduled time, cut into three
  consecutive groups as equal as possible (the first groups take the remainder, as
  ``numpy.array_split``);
* hit rate: share of ok requests with ``cached_tokens`` ≥ ``hit_tokens``;
* share of prompt tokens from L2 (:func:`l2_share`): the engine's counters before and after the run, kvctl's
  connector counter ``kvctl:remote_hit_tokens`` when present, else LMCache's ``lmcache:num_remote_read_bytes``
  divided by ``bytes_per_token`` (when given), over Δ``vllm:prompt_tokens`` (else the ok requests' prompt
  tokens); without those counters, the rows' ``cached_tokens`` over their prompt tokens: the share itself on an
  engine with no prefix cache of its own (its metrics have no ``vllm:prefix_cache_hits``), else an upper bound
  (``l2_token_share_max``); ``l2_token_share_source`` says which, or why there is none;
* max in flight: the most requests open at once, as the sender counted them;
* by class: the same percentiles over the hits and over the misses apart (rows that report ``cached_tokens``),
  what ``kvctl simulate`` predicts per class too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from kvctl.records.stats import latency_by_class, mean, percentile
from kvctl.records.prometheus import delta
from kvctl.core.errors import InvalidInput
from kvctl.records.runfile import INTERRUPTED, Run, counter, read_run
from kvctl.connector import metric_names as N
from kvctl.connector.metric_names import REMOTE_HIT_TOKENS

#: kvctl connector counter of prompt tokens loaded from the remote tier (tokens).
CONNECTOR_L2_TOKENS = REMOTE_HIT_TOKENS
#: LMCache counter of bytes read from the remote backend.
LMCACHE_L2_BYTES = N.LMCACHE_NUM_REMOTE_READ_BYTES

#: What became of each row, in the order the report shows them; they add up to the rows of a run file.
OUTCOMES = ("hit", "miss", "ok_no_usage", "http_error", "timeout", "error", "interrupted")
#: How replay (:mod:`kvctl.replay.sender`) begins the status of a request the engine answered with an HTTP error,
#: and of one that took longer than ``--timeout``; any other status but "ok" and :data:`INTERRUPTED` is an error.
HTTP_ERROR_STATUS = "http "
TIMEOUT_STATUS = "timeout"
#: The longest part of a run file's own words (a scrape's error) that a report quotes.
QUOTE_MAX = 120


@dataclass(frozen=True)
class RunSummary:
    name: str
    path: str
    requests: int  # rows in the run file: every request sent (finished, ok or not, and those still open at a stop)
    errors: int  # finished, not ok: HTTP errors, timeouts and other errors
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
    unfinished: int = 0  # requests still open when a stop signal ended the run (outcome "interrupted")
    warnings: tuple[str, ...] = ()  # what the reader skipped (a torn last line)
    #: p50/p90/p99 of the hits and of the misses apart (:func:`kvctl.records.stats.latency_by_class`)
    by_class: dict | None = None
    #: rows per outcome (:data:`OUTCOMES`, in that order): they add up to ``requests``
    outcomes: dict[str, int] = field(default_factory=dict)
    trace_requests: int | None = None  # requests in the trace replayed (the metadata's), when the file says it
    not_sent: int = 0  # requests of the trace with no row: due after the stop (or open at it, when not ``open_rows``)
    #: whether requests open at a stop have rows (interrupted): not after a hard stop (no summary line), nor in run files
    #: of a replay that did not write them yet (a summary without ``unfinished``)
    open_rows: bool = True
    signal: str | None = None  # the stop signal, when one ended the run
    duration_s: float | None = None
    ok: int = 0
    l2_token_share_max: float | None = None  # an upper bound when only cached_tokens (any cache) are known
    l2_token_share_source: str = ""  # how the L2 share was found, or why it is not known


@dataclass(frozen=True)
class L2Share:
    """Share of prompt tokens from L2: ``value`` when known, else at most ``at_most``; ``source`` says how, or why not."""

    value: float | None
    at_most: float | None
    source: str


def thirds(values_in_order: Sequence[float]) -> list[list[float]]:
    """Three consecutive groups, sizes as equal as possible, the first ones taking the remainder."""
    n = len(values_in_order)
    sizes = [n // 3 + (1 if i < n % 3 else 0) for i in range(3)]
    out, start = [], 0
    for size in sizes:
        out.append(list(values_in_order[start : start + size]))
        start += size
    return out


def outcome(row: dict[str, Any], hit_tokens: int) -> str:
    """Which of :data:`OUTCOMES` a run file's row is (``hit_tokens``: the fewest cached tokens of a hit)."""
    status = row["status"]
    if status == "ok":
        cached = row.get("cached_tokens")
        return "ok_no_usage" if cached is None else "hit" if cached >= hit_tokens else "miss"
    if status.startswith(INTERRUPTED):
        return "interrupted"
    if status.startswith(HTTP_ERROR_STATUS):
        return "http_error"
    if status.startswith(TIMEOUT_STATUS):
        return "timeout"
    return "error"


def _quoted(text: Any) -> str:
    text = str(text)
    return text if len(text) <= QUOTE_MAX else text[: QUOTE_MAX - 3] + "..."


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


def _no_counters(run: Run, bytes_per_token: float | None) -> str:
    """Why the counters scraped before and after the run give no L2 tokens."""
    before = run.metadata.get("metrics_before")
    summary = run.summary
    after = (summary or {}).get("metrics_after")
    if not before:
        err = run.metadata.get("metrics_before_error")
        return "no counters before the run" + (f" (the scrape failed: {_quoted(err)})" if err else "")
    if summary is None:
        return "no counters after the run (it has no summary line: stopped hard)"
    if not after:
        err = summary.get("metrics_after_error")
        if err:
            return f"no counters after the run (the scrape failed: {_quoted(err)})"
        if summary.get("interrupted"):
            return f"no counters after the run (replay skips that scrape when {summary.get('signal') or 'a stop signal'} ends the run)"
        return "no counters after the run"
    if delta(counter(before, LMCACHE_L2_BYTES), counter(after, LMCACHE_L2_BYTES)) is not None and not bytes_per_token:
        return f"{LMCACHE_L2_BYTES} counts bytes: pass --bytes-per-token to turn them into tokens"
    return f"the engine's metrics have no L2 counter ({CONNECTOR_L2_TOKENS}, {LMCACHE_L2_BYTES})"


def l2_share(run: Run, ok_prompt_tokens: int, cached_share: float | None, reported: int,
             bytes_per_token: float | None = None) -> L2Share:
    """Share of prompt tokens from L2 (the module docstring's rules): ``ok_prompt_tokens`` are the ok rows' prompt
    tokens, ``cached_share`` the rows' cached tokens over their prompt tokens, over ``reported`` rows."""
    l2 = l2_tokens(run, bytes_per_token)
    if l2 is not None:
        name = CONNECTOR_L2_TOKENS if counter(run.metadata.get("metrics_before"), CONNECTOR_L2_TOKENS) is not None \
            else f"{LMCACHE_L2_BYTES} ÷ --bytes-per-token"
        prompt = delta(counter(run.metadata.get("metrics_before"), N.VLLM_PROMPT_TOKENS),
                       counter((run.summary or {}).get("metrics_after"), N.VLLM_PROMPT_TOKENS))
        if prompt:
            return L2Share(l2 / prompt, None, f"Δ{name} / Δ{N.VLLM_PROMPT_TOKENS}, counters before and after the run")
        if ok_prompt_tokens:
            return L2Share(l2 / ok_prompt_tokens, None, f"Δ{name} over the ok requests' prompt tokens")
    why = _no_counters(run, bytes_per_token)
    if cached_share is None:
        return L2Share(None, None, f"{why}, and no ok request reports cached_tokens")
    before = run.metadata.get("metrics_before") or {}
    own_cache = counter(before, N.VLLM_PREFIX_CACHE_HITS) is not None
    l2_counter = any(counter(before, c) is not None for c in (CONNECTOR_L2_TOKENS, LMCACHE_L2_BYTES))
    over = f"cached_tokens / prompt_tokens of the {reported:,} ok requests that report them"
    if l2_counter and not own_cache:
        return L2Share(cached_share, None, f"{over}: the engine keeps no prefix cache of its own (no {N.VLLM_PREFIX_CACHE_HITS}), "
                                           f"so its cached tokens came from L2; {why}")
    cache = f"count the engine's own prefix cache too ({N.VLLM_PREFIX_CACHE_HITS})" if own_cache else "may count a prefix cache of the engine's own"
    return L2Share(None, cached_share, f"at most {over}: cached_tokens {cache}; {why}")


def _trace_requests(run: Run) -> int | None:
    """The trace's request count, from the metadata (or the summary), when it is a count no smaller than the rows."""
    for where in (run.metadata, run.summary or {}):
        n = where.get("requests")
        if isinstance(n, int) and not isinstance(n, bool) and n >= len(run.rows):
            return n
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
    l2 = l2_share(run, prompt_total, cached_share, len(reported), bytes_per_token)
    in_flight = (run.summary or {}).get("max_in_flight")
    if in_flight is None:
        in_flight = max((int(r["in_flight"]) for r in run.rows if r.get("in_flight") is not None), default=None)
    outcomes = dict.fromkeys(OUTCOMES, 0)
    for r in run.rows:
        outcomes[outcome(r, hit_tokens)] += 1
    planned = _trace_requests(run)
    summary = run.summary or {}
    sig, duration = summary.get("signal"), summary.get("duration_s")
    return RunSummary(
        name=name or run.name,
        path=run.path,
        requests=len(run.rows),
        errors=outcomes["http_error"] + outcomes["timeout"] + outcomes["error"],
        p50_s=percentile(lat, 50),
        p90_s=percentile(lat, 90),
        p99_s=percentile(lat, 99),
        max_s=max(lat) if lat else None,
        mean_s=mean(lat),
        thirds_p50_s=[percentile(t, 50) for t in thirds(lat)],
        hit_rate=hit_rate,
        cached_token_share=cached_share,
        l2_token_share=l2.value,
        max_in_flight=in_flight,
        capped=sum(1 for r in run.rows if r.get("capped")),
        interrupted=bool(summary.get("interrupted")) or run.summary is None,
        unfinished=outcomes["interrupted"],
        warnings=tuple(run.warnings),
        by_class=latency_by_class([float(r["latency_s"]) for r, c in zip(reported, known) if c >= hit_tokens],
                                  [float(r["latency_s"]) for r, c in zip(reported, known) if c < hit_tokens]) if reported else None,
        outcomes=outcomes,
        trace_requests=planned,
        not_sent=planned - len(run.rows) if planned is not None else 0,
        signal=sig if isinstance(sig, str) else None,
        duration_s=float(duration) if isinstance(duration, (int, float)) and not isinstance(duration, bool) and math.isfinite(duration) else None,
        ok=len(ok),
        open_rows=run.summary is not None and (not summary.get("interrupted") or "unfinished" in summary),
        l2_token_share_max=l2.at_most,
        l2_token_share_source=l2.source,
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
