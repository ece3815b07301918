"""Parse Prometheus text from vLLM's ``/metrics`` into sums kvctl can difference.

Parsing uses ``prometheus_client.parser``. Values are summed over label sets
(several engines behind one API server, several model names, several
scrapes of different engines), because every quantity kvctl derives is a
total over the deployment. A series (name and label set) that appears twice
in one text is invalid exposition: counted once and listed in
:attr:`Scrape.duplicates`, never summed.

On the wire a counter ``vllm:prompt_tokens`` appears as
``vllm:prompt_tokens_total``; histograms as ``_bucket``/``_sum``/``_count``.
Some LMCache versions export counts as gauges without ``_total``
(``lmcache:get_blocking_failed_count``); :meth:`Scrape.counter` accepts both.

Metric names kvctl reads (checked against vLLM's v1 Prometheus logger and
LMCache's ``PrometheusLogger``):

* vLLM: ``vllm:request_success`` (counter, label ``finished_reason``),
  ``vllm:prompt_tokens`` (counter), ``vllm:request_prompt_tokens``
  (histogram, tokens per request), ``vllm:prefix_cache_hits``/``_queries``
  and ``vllm:external_prefix_cache_hits``/``_queries`` (counters, tokens),
  ``vllm:num_requests_waiting``/``_running`` (gauges),
  ``vllm:request_prefill_time_seconds`` (histogram).
* LMCache: ``lmcache:num_hit_tokens``, ``lmcache:num_requested_tokens``,
  ``lmcache:num_remote_read_bytes``, ``lmcache:num_remote_read_requests``
  (counters), ``lmcache:remote_time_to_get`` (histogram, **milliseconds**),
  ``lmcache:time_to_lookup`` (histogram, seconds),
  ``lmcache:get_blocking_failed_count`` (gauge or counter).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvctl.connector.metric_names import LABELS
from kvctl.core.errors import InvalidInput

MAX_LISTED_DUPLICATES = 3
#: labelled counters whose series are also kept apart by their own labels (the connector's decisions by decision
#: and reason, its per-rank GETs): the sample name on the wire -> the label names, in kvctl.connector.metric_names
#: order. Every other label (the engine's model_name, ...) is still summed over.
SPLIT = {f"{name}_total": names for name, names in LABELS.items()}


@dataclass
class Scrape:
    """One scrape (or the sum of several): sample name → value summed over labels.

    ``buckets[family][le]`` holds cumulative histogram bucket counts, also
    summed over label sets.
    """

    values: dict[str, float] = field(default_factory=dict)
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)
    #: repeats of a series (name and label set) already seen in the same text: invalid exposition, counted once
    duplicate_count: int = 0
    duplicates: list[str] = field(default_factory=list)  # the first MAX_LISTED_DUPLICATES of them
    #: the :data:`SPLIT` counters by their own label values: wire name -> (values) -> sum over the other labels
    split: dict[str, dict[tuple[str, ...], float]] = field(default_factory=dict)

    def has(self, name: str) -> bool:
        return any(n in self.values for n in (name, f"{name}_total", f"{name}_count"))

    def counter(self, name: str) -> float | None:
        """A counter by its base name (``_total`` on the wire), or a gauge holding a count."""
        for n in (f"{name}_total", name):
            if n in self.values:
                return self.values[n]
        return None

    def gauge(self, name: str) -> float | None:
        return self.values.get(name)

    def by_labels(self, name: str) -> dict[tuple[str, ...], float]:
        """A :data:`SPLIT` counter (by its base name) per value of its own labels; {} when the text has none."""
        return dict(self.split.get(f"{name}_total", {}))

    def hist_sum(self, name: str) -> float | None:
        return self.values.get(f"{name}_sum")

    def hist_count(self, name: str) -> float | None:
        return self.values.get(f"{name}_count")


def parse(text: str, source: str = "<metrics>") -> Scrape:
    """Parse Prometheus exposition text; InvalidInput naming ``source`` when it is not."""
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    out = Scrape()
    seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name.endswith("_created") or s.value is None or math.isnan(s.value):
                    continue
                series = (s.name, tuple(sorted(s.labels.items())))
                if series in seen:  # the same series twice is an error in the exposition format: never doubled
                    out.duplicate_count += 1
                    if len(out.duplicates) < MAX_LISTED_DUPLICATES:
                        out.duplicates.append(s.name + ("{" + ",".join(f'{k}="{v}"' for k, v in series[1]) + "}" if series[1] else ""))
                    continue
                seen.add(series)
                if s.name.endswith("_bucket") and "le" in s.labels:
                    le = float(s.labels["le"])
                    bks = out.buckets.setdefault(s.name[: -len("_bucket")], {})
                    bks[le] = bks.get(le, 0.0) + float(s.value)
                    continue
                out.values[s.name] = out.values.get(s.name, 0.0) + float(s.value)
                if s.name in SPLIT:
                    own = out.split.setdefault(s.name, {})
                    key = tuple(str(s.labels.get(n, "")) for n in SPLIT[s.name])
                    own[key] = own.get(key, 0.0) + float(s.value)
    except (ValueError, TypeError, IndexError) as e:
        raise InvalidInput(f"{source} is not Prometheus text: {e}") from e
    return out


def labels(text: str, name: str, source: str = "<metrics>") -> dict[str, str]:
    """The labels of the first sample called ``name`` (an ``_info`` gauge's settings, e.g. vLLM's cache
    config for ``kvctl doctor``), or {}; InvalidInput naming ``source`` when the text is not Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == name:
                    return dict(s.labels)
    except (ValueError, TypeError, IndexError) as e:
        raise InvalidInput(f"{source} is not Prometheus text: {e}") from e
    return {}


def delta(a: float | None, b: float | None) -> float | None:
    """``b − a`` for a counter, or None when either side is missing.

    A counter that went down (engine restarted within the window) counts from
    zero: the delta is ``b``.
    """
    if a is None or b is None:
        return None
    return b - a if b >= a else b


def bucket_delta(a: Scrape, b: Scrape, family: str) -> dict[float, float]:
    """Cumulative bucket counts of the observations made between scrape ``a`` and ``b``."""
    before, after = a.buckets.get(family, {}), b.buckets.get(family, {})
    return {le: max(0.0, c - before.get(le, 0.0)) for le, c in sorted(after.items())}


def count_above(buckets: dict[float, float], threshold: float) -> float:
    """Observations above ``threshold`` (at bucket resolution: above the largest bound ≤ threshold)."""
    if not buckets:
        return 0.0
    total = buckets.get(math.inf, max(buckets.values()))
    below = [c for le, c in buckets.items() if le <= threshold]
    return max(0.0, total - (max(below) if below else 0.0))


@dataclass(frozen=True)
class QuantileEstimate:
    """A quantile from a histogram, and how it was found: ``basis`` is ``one_bucket_mean`` (every observation in
    one bucket: the histogram's sum/count, their exact mean), ``bucket_estimate`` (interpolated inside the
    bucket and clamped to [lo, hi], what the bucket's bounds and the histogram's sum allow that order
    statistic to be) or ``bucket_interpolation`` (no sum given: interpolated inside the bucket)."""

    value: float
    basis: str
    lo: float
    hi: float


def quantile_estimate(buckets: dict[float, float], q: float, total_sum: float | None = None) -> QuantileEstimate | None:
    """The q-quantile of a cumulative histogram that never leaves what the histogram allows.

    Interpolating inside a bucket puts 4,160-token prompts at 6,144 in (4096, 8192]. With the histogram's
    sum: when one bucket holds every observation, sum/count is their mean (exact when they are alike);
    otherwise the bucket's sum is bounded by the other buckets' bounds, which bounds its r-th value v:
    the values from the r-th up are ≥ v and the rest > lo, so ``v ≤ (Σ_k − (r−1)·lo) / (c_k − r + 1)``;
    the values up to the r-th are ≤ v and the rest ≤ hi, so ``v ≥ (Σ_k − (c_k − r)·hi) / r``.
    """
    items = sorted(buckets.items())
    if not items or items[-1][1] <= 0:
        return None
    total = items[-1][1]
    rank = q * total
    prev_le, prev_c = 0.0, 0.0
    spans: list[tuple[float, float, float]] = []  # (lower bound, upper bound, count) of every non-empty bucket
    found: tuple[int, float, float, float] | None = None  # (index in spans, lo, hi, rank inside the bucket)
    for le, c in items:
        if c > prev_c:
            spans.append((prev_le, le, c - prev_c))
            if found is None and c >= rank:
                found = (len(spans) - 1, prev_le, le, rank - prev_c)
        prev_le, prev_c = (le if not math.isinf(le) else prev_le), max(c, prev_c)
    if found is None:
        return QuantileEstimate(prev_le, "bucket_interpolation", prev_le, prev_le)
    k, lo, hi, r_in = found
    c_k = spans[k][2]
    if total_sum is not None and math.isfinite(total_sum) and len(spans) == 1:
        mean = total_sum / total
        return QuantileEstimate(min(max(mean, lo), hi), "one_bucket_mean", lo, hi)
    value = lo if math.isinf(hi) else lo + (hi - lo) * r_in / c_k
    if total_sum is None or not math.isfinite(total_sum):
        return QuantileEstimate(value, "bucket_interpolation", lo, hi)
    others = [s for i, s in enumerate(spans) if i != k]
    sum_hi = total_sum - sum(a * n for a, _, n in others)  # the others as small as their bounds allow
    sum_lo = total_sum - sum(b * n for _, b, n in others)  # ... and as large
    r = min(max(math.ceil(r_in), 1), int(c_k)) if c_k >= 1 else 1
    v_hi = (sum_hi - (r - 1) * lo) / max(c_k - r + 1, 1e-12)
    v_lo = (sum_lo - (c_k - r) * hi) / r if math.isfinite(sum_lo) else lo
    b_lo, b_hi = max(lo, v_lo), min(hi, v_hi)
    if b_lo > b_hi:  # counters caught mid-update: keep the bucket's own bounds
        b_lo, b_hi = lo, hi
    return QuantileEstimate(min(max(value, b_lo), b_hi), "bucket_estimate", b_lo, b_hi)


def quantile(buckets: dict[float, float], q: float) -> float | None:
    """The q-quantile of a cumulative histogram, linearly interpolated inside the bucket (see :func:`quantile_estimate`)."""
    est = quantile_estimate(buckets, q)
    return None if est is None else est.value
