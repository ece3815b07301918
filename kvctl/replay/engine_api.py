"""What a replay asks the engine besides the requests: its models and ``max_model_len``, a token pool, ``/metrics``.

All of it over the replay's aiohttp session; an engine that does not answer ``/v1/models`` is
:class:`~kvctl.core.errors.Unreachable`, and a ``/metrics`` that fails is a reason, never an abort.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

from kvctl.connector import metric_names as N
from kvctl.core.engine_http import masked
from kvctl.core.errors import InvalidInput, Unreachable
from kvctl.core.thresholds import LMCACHE_PUBLISH_S, METRICS_MAX_BYTES, REPLAY_LMCACHE_SETTLE_S
from kvctl.replay.prompts import SEED_TEXT, TokenPool, pool_from_ids
from kvctl.records.trace import Trace

#: Metric families kept from /metrics in the run file (counters and gauges, summed over labels).
METRIC_PREFIXES = (N.VLLM_PREFIX, N.LMCACHE_PREFIX, N.PREFIX)


def engine_base(url: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise InvalidInput(f"--engine-url must start with http:// or https://, got {url!r}")
    return url.rstrip("/").removesuffix("/v1")


async def _get_json(session: Any, url: str, timeout_s: float = 10.0) -> Any:
    import aiohttp  # noqa: PLC0415

    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
        r.raise_for_status()
        return await r.json(content_type=None)


async def list_models(session: Any, base: str) -> list[dict[str, Any]]:
    """The entries of ``/v1/models`` (objects only); Unreachable when it does not answer."""
    import aiohttp  # noqa: PLC0415

    try:
        data = await _get_json(session, base + "/v1/models")
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        raise Unreachable(f"{base} did not answer /v1/models: {type(e).__name__}: {e}") from e
    except ValueError:
        return []
    entries = data.get("data") if isinstance(data, dict) else None
    return [m for m in entries if isinstance(m, dict)] if isinstance(entries, list) else []


async def discover_model(session: Any, base: str, models: list[dict[str, Any]] | None = None) -> str:
    """The first model the engine serves (``/v1/models``, or ``models`` read from it); Unreachable when it does not answer."""
    models = await list_models(session, base) if models is None else models
    if not models or not isinstance(models[0].get("id"), str):
        raise Unreachable(f"{base}/v1/models lists no model; pass --model")
    return models[0]["id"]


def max_model_len(models: list[dict[str, Any]], model: str) -> int | None:
    """vLLM's ``max_model_len`` of ``model`` in ``/v1/models``, when the engine says."""
    for m in models:
        n = m.get("max_model_len")
        if m.get("id") == model and isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return n
    return None


def check_lengths(trace: Trace, limit: int, model: str) -> None:
    """InvalidInput naming every trace line whose prompt is longer than the engine's ``max_model_len``."""
    from kvctl.records.trace import malformed  # noqa: PLC0415

    long = [r for r in trace.requests if r.token_count is not None and r.token_count > limit]
    if long:
        raise malformed(trace.path, [f"line {r.line}: {r.token_count:,} prompt tokens, past {model}'s max_model_len {limit:,}"
                                     for r in sorted(long, key=lambda r: r.line)])


async def pool_from_engine(session: Any, base: str, model: str) -> TokenPool | None:
    """Token pool from the engine's ``/tokenize`` (vLLM), or None when it has none."""
    import aiohttp  # noqa: PLC0415

    body = {"model": model, "prompt": SEED_TEXT, "add_special_tokens": False}
    try:
        async with session.post(base + "/tokenize", json=body, timeout=aiohttp.ClientTimeout(total=30)) as r:
            if r.status != 200:
                return None
            data = await r.json(content_type=None)
        return pool_from_ids(data["tokens"], "engine /tokenize")
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, KeyError, TypeError, ValueError):
        return None


#: a /metrics scrape before or after a run is tried this many times, SCRAPE_PAUSE_S apart: an engine
#: that just started, or is busy finishing the run, can miss one
SCRAPE_TRIES = 3
SCRAPE_PAUSE_S = 1.0


async def _scrape_once(session: Any, base: str, max_bytes: int) -> tuple[dict[str, float] | None, str | None, bool]:
    """(values, why not, worth retrying)."""
    import aiohttp  # noqa: PLC0415

    from kvctl.records.prometheus import parse  # noqa: PLC0415

    try:
        async with session.get(base + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
            if r.status != 200:
                return None, f"/metrics answered HTTP {r.status}", True
            body = await r.content.read(max_bytes + 1)
            if len(body) > max_bytes:
                return None, f"/metrics is larger than --max-metrics-bytes {max_bytes}", False
        scrape = parse(body.decode("utf-8", errors="replace"), f"{masked(base)}/metrics")
    except asyncio.TimeoutError:  # not retried: a hung engine would hold the run's end for 10 s a try
        return None, "/metrics did not answer within 10 s", False
    except (aiohttp.ClientError, OSError) as e:
        return None, f"/metrics: {type(e).__name__}", True
    except InvalidInput as e:
        return None, str(e), True
    return {k: v for k, v in sorted(scrape.values.items()) if k.startswith(METRIC_PREFIXES)}, None, False


async def scrape_metrics(session: Any, base: str, max_bytes: int = METRICS_MAX_BYTES) -> tuple[dict[str, float] | None, str | None]:
    """(counters and gauges of vLLM, LMCache and kvctl from ``/metrics``, None) or (None, why not), after
    up to :data:`SCRAPE_TRIES` tries (an answer over ``max_bytes`` or none within 10 s is not retried)."""
    why = None
    for attempt in range(SCRAPE_TRIES):
        if attempt:
            await asyncio.sleep(SCRAPE_PAUSE_S)
        values, why, retry = await _scrape_once(session, base, max_bytes)
        if values is not None:
            return values, None
        if not retry:
            return None, why
    return None, f"{why} ({SCRAPE_TRIES} tries)"


async def scrape_after_run(session: Any, base: str, last_answer: float, max_bytes: int = METRICS_MAX_BYTES,
                           on_wait: Callable[[str], None] = lambda note: None) -> tuple[dict[str, float] | None, str | None]:
    """The scrape after a run whose last answer came at ``last_answer`` (``time.monotonic()``): at once, and on an engine
    whose /metrics holds lmcache: series again :data:`~kvctl.core.thresholds.REPLAY_LMCACHE_SETTLE_S` after that answer
    (``on_wait`` is told first), so LMCache's counters hold the whole run.

    LMCache publishes its counters every 10 s (its stats logger, LMCACHE_PUBLISH_S), vLLM its own every step: read at
    once, the L2 share of a short run came out 0.0625 where it was 0.5. Waiting for one publish interval after the last
    answer, rather than for the counters to change, is what holds whatever the engine does: every LMCache worker (one
    per TP rank, each on its own 10 s clock, summed on /metrics) has published at least once by then, and a publish with
    nothing new in it changes no counter at all. A stop signal during the wait (the task cancelled) keeps the first read.
    """
    values, why = await scrape_metrics(session, base, max_bytes)
    if values is None or not any(k.startswith(N.LMCACHE_PREFIX) for k in values):
        return values, why
    wait = REPLAY_LMCACHE_SETTLE_S - (time.monotonic() - last_answer)
    if wait > 0:
        on_wait(f"waiting {wait:.0f} s for LMCache to publish its counters (every {LMCACHE_PUBLISH_S:g} s) before the scrape after the run")
        try:
            await asyncio.sleep(wait)
        except asyncio.CancelledError:  # stopped: what was read at the last answer, said so
            return values, f"stopped {wait:.0f} s before LMCache's next publish: its counters may miss the run's last {LMCACHE_PUBLISH_S:g} s"
    later, later_why = await scrape_metrics(session, base, max_bytes)
    if later is None:
        return values, f"read at the last answer: the scrape {REPLAY_LMCACHE_SETTLE_S:g} s after it failed ({later_why}), so LMCache's counters may miss the run's last {LMCACHE_PUBLISH_S:g} s"
    return later, None
