"""The connector's counters, carried the way vLLM 0.32 carries connector stats to ``/metrics``.

Workers (and the scheduler-side connector) return a :class:`KvctlConnectorStats`
from ``get_kv_connector_stats()`` with the counts of the last interval; vLLM
sums the workers' objects with ``aggregate`` (KVOutputAggregator), adds the
scheduler's, sends ``to_dict()`` to the API server process, which rebuilds
the object with ``build_kv_connector_stats`` and hands the dict to
:class:`KvctlPromMetrics.observe` -- registered by ``build_prom_metrics`` in
the process that serves ``/metrics``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvctl.connector.metric_names import COUNTERS, GAUGES, LABELS, RANKS, RANKS_HELP, labelled, split_labelled

__all__ = ["COUNTERS", "KvctlConnectorStats", "KvctlPromMetrics", "StatsCollector"]

#: the most series the metrics keep (labelled counters make theirs as values arrive: decisions x reasons, ranks)
_MAX_SERIES = 1024



@dataclass
class KvctlConnectorStats(KVConnectorStats):
    """Counter increments of one interval, ``data = {counter name: value}``; sums on aggregate."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KvctlConnectorStats":
        for k, v in (other.data or {}).items():
            # counters add up; a gauge keeps the largest value (vLLM may fold several steps of one
            # worker into one object, where a sum would count one backlog twice)
            self.data[k] = max(self.data.get(k, 0), v) if k in GAUGES else self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k.removeprefix("kvctl:"): v for k, v in self.data.items()}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class StatsCollector:
    """Thread-safe accumulator; ``take()`` returns and clears the interval's increments."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, float] = {}

    def add(self, name: str, value: float, *labels: object) -> None:
        """Add ``value`` to counter ``name`` (a labelled one's series: its label values, :data:`LABELS` order)."""
        if name not in COUNTERS or bool(labels) != (name in LABELS):
            raise KeyError(name)
        key = labelled(name, *labels) if labels else name
        if value:
            with self._lock:
                self._data[key] = self._data.get(key, 0) + value

    def set(self, name: str, value: float) -> None:
        """A gauge's current value (:data:`GAUGES`), sent with the interval's counters; ranks' values add up."""
        if name not in GAUGES:
            raise KeyError(name)
        with self._lock:
            self._data[name] = value

    def take(self) -> KvctlConnectorStats | None:
        with self._lock:
            data, self._data = self._data, {}
        return KvctlConnectorStats(data=data) if data else None


class KvctlPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per entry of :data:`COUNTERS`, labelled per engine like vLLM's own, and the gauge
    ``kvctl:ranks``: W, the ranks whose GET seconds ``kvctl:l2_get_seconds`` sums (``kvctl diagnose`` divides by it)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues, ranks: int = 1) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        ranks_gauge = self._gauge_cls(
            name=RANKS, documentation=RANKS_HELP,
            labelnames=labelnames, multiprocess_mode="mostrecent")
        for values in per_engine_labelvalues.values():
            ranks_gauge.labels(*values).set(ranks)
        self._children: dict[tuple[str, int], Any] = {}
        self._counters = {
            name: self._counter_cls(name=name + "_total", documentation=doc,
                                    labelnames=[*labelnames, *LABELS.get(name, ())])
            for name, doc in COUNTERS.items()
        }
        self._values = dict(per_engine_labelvalues)
        self._gauges = {
            name: self._gauge_cls(name=name, documentation=doc, labelnames=labelnames, multiprocess_mode="mostrecent")
            for name, doc in GAUGES.items()
        }
        for name, metric in (*self._counters.items(), *self._gauges.items()):
            if name in LABELS:
                continue  # a series per label values, made when first observed
            for idx, values in per_engine_labelvalues.items():
                self._children[(name, idx)] = metric.labels(*values)

    def _child(self, key: str, engine_idx: int):
        child = self._children.get((key, engine_idx))
        if child is not None:
            return child
        name, values = split_labelled(key)
        engine = self._values.get(engine_idx)
        if name not in LABELS or engine is None or len(values) != len(LABELS[name]) or \
                len(self._children) >= _MAX_SERIES:
            return None
        child = self._children[(key, engine_idx)] = self._counters[name].labels(*engine, *values)
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in (transfer_stats_data or {}).items():
            child = self._child(name, engine_idx)
            if child is None:
                continue
            if name in GAUGES:
                child.set(value)
            elif value > 0:
                child.inc(value)
