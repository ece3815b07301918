"""Per-component observations of two samples: each engine's counter deltas over its own window, each Valkey instance's.

Pure (no I/O); used by :func:`kvctl.diagnose.analysis.analyse`. A counter that
went backwards is an engine restart: recorded per engine (``counter_resets``),
its delta counted from zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvctl.core import cost
from kvctl.connector import metric_names as N
from kvctl.records import prometheus as M
from kvctl.diagnose.capture import Sample
from kvctl.diagnose.sources import metrics_url
from kvctl.core.errors import InvalidInput
from kvctl.tier.sizing import io_threads_from_info
from kvctl.tier.targets import instance_name

GET_COMMANDS = ("cmdstat_get", "cmdstat_mget", "cmdstat_getex")
#: INFO section headers ("# Commandstats\r\n" and the blank line before it), generously: ~15 sections.
_INFO_HEADER_BYTES = 16 * 20


def info_reply_bytes(info: dict[str, Any]) -> int:
    """About how many bytes one INFO reply like ``info`` carried, from its parsed form: one
    ``key:value\r\n`` line per field (``cmdstat_*``, ``db*`` as ``k=v,...``) and the section headers."""
    n = _INFO_HEADER_BYTES
    for k, v in info.items():
        val = ",".join(f"{a}={b}" for a, b in v.items()) if isinstance(v, dict) else str(v)
        n += len(str(k)) + len(val) + 3
    return n


def get_served_bytes(ia: dict[str, Any], ib: dict[str, Any], get_calls: float) -> float:
    """Bytes the GETs served between two INFO samples: never the instance's other replies.

    Valkey counts only all output together (``total_net_output_bytes``); commandstats count GETs. With no
    GET in the window, no byte was served to a GET; otherwise the replies to INFO (the samplers' own,
    and any other monitor's: Δ``cmdstat_info`` calls × the size of the INFO reply read here) are taken
    out. The other commands an engine sends (EXISTS, SET) reply in a few bytes each.
    """
    if not get_calls:
        return 0.0
    out = M.delta(float(ia.get("total_net_output_bytes", 0)), float(ib.get("total_net_output_bytes", 0))) or 0.0
    info_calls = M.delta(float((ia.get("cmdstat_info") or {}).get("calls", 0)), float((ib.get("cmdstat_info") or {}).get("calls", 0))) or 0.0
    return max(0.0, out - info_calls * info_reply_bytes(ib))


@dataclass(frozen=True)
class EngineObs:
    """One engine URL: what it said over its own window, or why it could not be read."""

    index: int
    url: str
    status: str  # "ok", "unreachable", "no_vllm_metrics", "duplicate"
    error: str | None = None
    window_s: float | None = None
    finished: float | None = None
    queue_start: float | None = None  # waiting + running
    queue_end: float | None = None
    arrival_rate_per_s: float | None = None
    completion_rate_per_s: float | None = None
    counter_resets: tuple[str, ...] = ()
    # λ's estimators (kvctl.diagnose.arrivals): arrival_rate_per_s is the states' when the window has them, else this one
    arrival_rate_queue_per_s: float | None = None  # (finished + waiting and running growth) / window, at the sample times
    arrivals_basis: str = "finished + waiting and running growth at the sample times"
    arrivals_counted: float | None = None  # the requests λ counted
    states: int = 0  # states the engine published in the window, as seen by the reads


@dataclass(frozen=True)
class InstanceObs:
    rank: int
    url: str
    status: str = "ok"  # "ok" or "unreachable"
    error: str | None = None
    window_s: float | None = None
    get_calls: float | None = None
    get_rate_per_s: float | None = None
    bytes_out: float | None = None
    bytes_out_per_s: float | None = None
    usec_per_get: float | None = None
    get_busy_fraction: float | None = None
    bandwidth_gbps: float | None = None
    evicted_keys: float | None = None
    restarted: bool = False  # its counters went backwards: the server restarted inside the window
    instance: int = 0  # which of its rank's instances (K per rank: sample index n = rank*K + instance)
    name: str = ""  # "rank 2", or "rank 2 instance 1" (kvctl.tier.targets.instance_name)
    server_version: str | None = None  # INFO server's valkey_version (redis_version)
    io_threads: int | None = None  # from INFO (Valkey 9.x: kvctl.tier.sizing.io_threads_from_info); None: not said (8.x)


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    q = a / b
    return q if math.isfinite(q) else None


# --- per-engine deltas -----------------------------------------------------------


@dataclass
class EnginePair:
    index: int
    url: str
    a: M.Scrape
    b: M.Scrape
    window_s: float
    resets: list[str] = field(default_factory=list)

    def delta(self, before: float | None, after: float | None, name: str) -> float | None:
        if before is None or after is None:
            return None
        if after < before:
            if name not in self.resets:
                self.resets.append(name)
            return after  # restarted inside the window: counts from zero (a lower bound)
        return after - before


class Deltas:
    """Counter deltas of every readable engine, each differenced on its own."""

    def __init__(self, engines: list[EnginePair]):
        self.engines = engines

    def _each(self, name: str, kind: str) -> list[tuple[EnginePair, float]]:
        out = []
        for e in self.engines:
            if kind == "counter":
                d = e.delta(e.a.counter(name), e.b.counter(name), name)
            elif kind == "sum":
                d = e.delta(e.a.hist_sum(name), e.b.hist_sum(name), f"{name}_sum")
            else:
                d = e.delta(e.a.hist_count(name), e.b.hist_count(name), f"{name}_count")
            if d is not None:
                out.append((e, d))
        return out

    def total(self, name: str, kind: str = "counter") -> float | None:
        each = self._each(name, kind)
        return sum(d for _, d in each) if each else None

    def rate(self, name: str, kind: str = "counter") -> float | None:
        each = self._each(name, kind)
        return sum(d / e.window_s for e, d in each) if each else None

    def by_labels(self, name: str) -> dict[tuple[str, ...], float]:
        """A labelled counter's window deltas per value of its own labels (:data:`kvctl.records.prometheus.SPLIT`),
        summed over engines; a series first seen inside the window counts from zero."""
        out: dict[tuple[str, ...], float] = {}
        for e in self.engines:
            before = e.a.by_labels(name)
            for key, after in e.b.by_labels(name).items():
                d = e.delta(before.get(key, 0.0), after, name)
                if d:
                    out[key] = out.get(key, 0.0) + d
        return out

    def buckets(self, family: str) -> dict[float, float]:
        out: dict[float, float] = {}
        for e in self.engines:
            for le, c in M.bucket_delta(e.a, e.b, family).items():
                out[le] = out.get(le, 0.0) + c
        return out


def _queue(s: M.Scrape) -> float | None:
    w, r = s.gauge(N.VLLM_NUM_REQUESTS_WAITING), s.gauge(N.VLLM_NUM_REQUESTS_RUNNING)
    return None if w is None and r is None else (w or 0.0) + (r or 0.0)


def _has_vllm(s: M.Scrape) -> bool:
    return any(k.startswith(N.VLLM_PREFIX) for k in s.values)


def engine_pairs(a: Sample, b: Sample, urls: list[str], notes: list[str]) -> tuple[list[EngineObs], list[EnginePair]]:
    obs: list[EngineObs] = []
    ok: list[EnginePair] = []
    seen: set[str] = set()
    for i, url in enumerate(urls):
        try:
            key = metrics_url(url)
        except InvalidInput:
            key = url
        if key in seen:
            obs.append(EngineObs(i, url, "duplicate", "the same /metrics URL was given twice: read once"))
            notes.append(f"engine URL {url} was given more than once: counted once (a repeat would double λ)")
            continue
        seen.add(key)
        ta, tb = a.engines[i] if i < len(a.engines) else None, b.engines[i] if i < len(b.engines) else None
        if ta is None or tb is None:
            err = a.engine_error(i) if ta is None else b.engine_error(i)
            which = "first" if ta is None else "second"
            obs.append(EngineObs(i, url, "unreachable", f"{which} sample: {err or 'no data'}"))
            continue
        window = b.engine_time(i) - a.engine_time(i)
        if not window > 0:
            raise InvalidInput(f"engine {url}: its samples are not in time order (Δt = {window:.3f} s)")
        sa, sb = a.scrape(i), b.scrape(i)  # parsed once per sample (the exporter's window, the engine states)
        dup = sb if sb.duplicate_count >= sa.duplicate_count else sa
        if dup.duplicate_count:
            notes.append(f"engine {url}: its /metrics repeats a series {dup.duplicate_count} time(s) ({', '.join(dup.duplicates)}"
                         f"{', ...' if dup.duplicate_count > len(dup.duplicates) else ''}), invalid exposition: each series counted once")
        if not _has_vllm(sb):
            lines = sum(1 for ln in tb.splitlines() if ln.strip() and not ln.startswith("#"))
            obs.append(EngineObs(i, url, "no_vllm_metrics", f"/metrics held no vllm: series ({lines} sample line(s))", window))
            continue
        ok.append(EnginePair(i, url, sa, sb, window))
    return obs, ok


def engine_obs(e: EnginePair) -> EngineObs:
    finished = e.delta(e.a.counter(N.VLLM_REQUEST_SUCCESS), e.b.counter(N.VLLM_REQUEST_SUCCESS), N.VLLM_REQUEST_SUCCESS)
    if finished is None:
        finished = e.delta(e.a.hist_count(N.VLLM_REQUEST_PROMPT_TOKENS), e.b.hist_count(N.VLLM_REQUEST_PROMPT_TOKENS), f"{N.VLLM_REQUEST_PROMPT_TOKENS}_count")
    qa, qb = _queue(e.a), _queue(e.b)
    growth = None if qa is None or qb is None else qb - qa
    offered = None if finished is None else max(0.0, finished + (growth or 0.0)) / e.window_s
    return EngineObs(
        e.index, e.url, "ok", None, e.window_s, finished, qa, qb, offered,
        None if finished is None else finished / e.window_s, tuple(e.resets), offered,
        arrivals_counted=None if finished is None else max(0.0, finished + (growth or 0.0)),
    )


# --- Valkey side -------------------------------------------------------------------


def _cmd(info: dict[str, Any], field_name: str) -> float:
    return float(sum(float((info.get(c) or {}).get(field_name, 0)) for c in GET_COMMANDS))


def instance_obs(a: Sample, b: Sample, urls: list[str], instances_per_rank: int = 1) -> list[InstanceObs]:
    """Each sampled instance; sample index n is instance n mod K of rank n // K (K = ``instances_per_rank``)."""
    if len(a.valkey) != len(b.valkey):
        raise InvalidInput(f"the samples hold {len(a.valkey)} and {len(b.valkey)} Valkey instances; they must match")
    k = max(1, instances_per_rank)
    out = []
    for n, (ia, ib) in enumerate(zip(a.valkey, b.valkey)):
        rank, who = n // k, {"instance": n % k, "name": instance_name(n // k, n % k, k)}
        url = urls[n] if n < len(urls) else who["name"]
        if ia is None or ib is None:
            err = a.valkey_error(n) if ia is None else b.valkey_error(n)
            out.append(InstanceObs(rank, url, "unreachable", f"{'first' if ia is None else 'second'} sample: {err or 'no data'}", **who))
            continue
        window = b.valkey_time(n) - a.valkey_time(n)
        if not window > 0:
            raise InvalidInput(f"Valkey {who['name']}: its samples are not in time order (Δt = {window:.3f} s)")
        restarted = _cmd(ib, "calls") < _cmd(ia, "calls") or float(ib.get("total_net_output_bytes", 0)) < float(ia.get("total_net_output_bytes", 0))
        calls = M.delta(_cmd(ia, "calls"), _cmd(ib, "calls")) or 0.0
        usec = M.delta(_cmd(ia, "usec"), _cmd(ib, "usec")) or 0.0
        out_bytes = get_served_bytes(ia, ib, calls)
        evicted = M.delta(float(ia.get("evicted_keys", 0)), float(ib.get("evicted_keys", 0))) or 0.0
        out.append(
            InstanceObs(
                rank=rank, url=url, status="ok", window_s=window, get_calls=calls, get_rate_per_s=calls / window,
                bytes_out=out_bytes, bytes_out_per_s=out_bytes / window, usec_per_get=ratio(usec, calls),
                get_busy_fraction=usec / (window * 1e6),
                bandwidth_gbps=(out_bytes / (usec / 1e6) / cost.GB) if usec > 0 and out_bytes > 0 else None,
                evicted_keys=evicted, restarted=restarted, **who,
                server_version=str(ib.get("valkey_version") or ib.get("redis_version") or "") or None, io_threads=io_threads_from_info(ib),
            )
        )
    return out
