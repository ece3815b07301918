"""``kvctl exporter``: the diagnosis as Prometheus metrics, over a sliding window of samples.

A background thread takes one sample every ``interval_s`` (every engine's
``/metrics`` and every Valkey instance's ``INFO``, read in parallel with a
per-source timeout: :func:`kvctl.diagnose.capture.take_sample`) and keeps the
samples of the last ``window_s``, thinned to at most ``EXPORTER_WINDOW_SAMPLES`` evenly spaced
ones (the analysis differences the oldest and the newest and reads from all of them when each engine
published a new state, for λ; memory stays bounded whatever ``--window``/``--interval``). Each round
runs the same analysis as ``kvctl diagnose`` (:func:`kvctl.diagnose.analysis.analyse`) on the
window's samples and stores the resulting series.

Stopping (SIGTERM, Ctrl-C) cuts every read in flight (engine sockets shut, Valkey connections
closed): the exporter is gone within ``EXPORTER_STOP_S`` whatever a source is doing. Engine URLs
are labelled, logged and printed masked (:func:`kvctl.core.engine_http.masked`).

``/metrics`` only reads that store (a custom prometheus_client collector), so a
slow or dead component never blocks a scrape:

* ``kvctl_engine_up`` / ``kvctl_valkey_up`` come from the newest sample and
  drop to 0 when a source did not answer, or when the sampler itself has not
  finished a round for ``stale_after_s``. Each engine is published on its own: a
  slow one costs the round at most ``timeout_s`` (one deadline for its whole
  answer), and its going ``up 0`` is logged with the reason;
* every other series keeps its last good value while a component is missing,
  and disappears once that value is older than ``stale_after_s`` (an analysis
  with every component answering replaces the series outright).

A tier of K > 1 instances per rank labels its per-instance series ``rank`` and ``instance_index``
(:data:`INSTANCE_LABEL`; ``instance`` is Prometheus' own target label), one series per instance; with
one instance per rank they carry ``rank`` alone, as before.

No click, no rich: the command lives in :mod:`kvctl.commands.exporter`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Sequence

from kvctl.core import cost
from kvctl.connector import metric_names as N
from kvctl.diagnose import capture as cap
from kvctl.diagnose.analysis import Diagnosis, Params, analyse
from kvctl.diagnose.sources import valkey_read_error
from kvctl.core.engine_http import EngineHttp, Inflight, masked
from kvctl.core.errors import InvalidInput, KvctlError
from kvctl.core.threads import DaemonPool
from kvctl.core.thresholds import EXPORTER_MIN_INTERVAL_S, EXPORTER_STOP_S, EXPORTER_WINDOW_SAMPLES, READ_TIMEOUT_S
from kvctl.tier.admin import Admin, InstanceFailure
from kvctl.tier.targets import Target
from kvctl.connector.urls import redacted_repr

log = logging.getLogger(__name__)

MAX_INTERVAL_S = 3600.0
#: Seconds :meth:`stop` waits for the HTTP thread and the sampler: the reads in flight are cut first,
#: so both only finish what they are doing (an HTTP answer, one analysis).
STOP_GRACE_S = EXPORTER_STOP_S
#: The longest the main thread sleeps before it looks at signals again (see :meth:`kvctl.ops.exporter_http.Server.wait`).
WAIT_SLICE_S = 0.1

#: name -> (help, label names). The metric names are part of kvctl's interface (alerts, dashboards).
METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    "kvctl_rho": ("ρ = λ·(L2 bytes per request)/B of the synchronous-load queue over the window (≥ 1: unstable)", ()),
    "kvctl_rho_lower_bound": ("1 when kvctl_rho is a lower bound (B from Valkey's server-side GET time), 0 when an estimate", ()),
    "kvctl_arrival_rate_per_second": ("Offered arrival rate λ, requests/s: arrivals between two states an engine published in the window (each as of its step's start), else finished + growth of waiting and running", ()),
    "kvctl_completion_rate_per_second": ("Completed requests/s over the window (capped by the tier when ρ > 1)", ()),
    "kvctl_delivered_bandwidth_bytes_per_second": ("Tier bandwidth B the analysis used, bytes/s; source: given (--tier-gbps), kvctl_connector, lmcache_client or valkey_server_upper_bound", ("source",)),
    "kvctl_breakeven_bandwidth_bytes_per_second": ("Break-even bandwidth B* = s·R, bytes/s: below it a hit is slower than recompute", ()),
    "kvctl_min_hit_tokens": ("n* = R·T0: prompts shorter than this cannot beat recompute at any bandwidth, tokens", ()),
    "kvctl_hit_token_ratio": ("Fraction of prompt tokens served from the external (L2) cache over the window", ()),
    "kvctl_valkey_get_busy_ratio": ("Fraction of the window one Valkey instance spent in GETs (its main thread)", ("rank",)),
    "kvctl_instance_rho": ("ρ of one Valkey instance summed over every engine that uses it (two or more engines; ≥ 1: unstable)", ("rank",)),
    "kvctl_engine_rho": ("One engine's ρ against the bandwidth it gets (two or more engines)", ("engine",)),
    "kvctl_valkey_up": ("1 when the instance answered INFO in the newest sample", ("rank",)),
    "kvctl_engine_up": ("1 when the engine's /metrics answered in the newest sample", ("engine",)),
    "kvctl_load_decisions_per_second": ("The kvctl connector's load-or-recompute decisions per second over the window, by decision (load, partial, recompute, given_up) and reason", ("decision", "reason")),
    "kvctl_hits_recomputed_ratio": ("Of the hits the kvctl connector judged over the window, the share it recomputed because of the tier (its queue, or an async load given up at its deadline)", ()),
    "kvctl_finding": ("1 while a kvctl diagnose finding holds over the window", ("id", "severity")),
    "kvctl_scrape_duration_seconds": ("Seconds the newest sampling round took (all sources in parallel)", ()),
    "kvctl_data_sufficient": ("1 when the window's samples can answer the diagnosis, 0 while data is insufficient", ()),
    "kvctl_window_seconds": ("Seconds between the oldest and newest sample analysed", ()),
    "kvctl_last_sample_timestamp_seconds": ("Unix time of the newest sample", ()),
}
#: Which of its rank's instances a per-instance series is about, on tiers of K > 1 instances per rank (beside ``rank``).
INSTANCE_LABEL = "instance_index"
#: series that always describe the newest sample (never kept past it)
FRESH = ("kvctl_valkey_up", "kvctl_engine_up", "kvctl_scrape_duration_seconds", "kvctl_data_sufficient", "kvctl_window_seconds", "kvctl_last_sample_timestamp_seconds")
UP = ("kvctl_valkey_up", "kvctl_engine_up")

Key = tuple[str, tuple[tuple[str, str], ...]]

#: vLLM families the analysis reads (kvctl/diagnose); lmcache: and kvctl: families are kept whole. Every other
#: family of an engine's /metrics (latency histograms, http_*, process_*) is dropped before the analysis parses
#: the text: it never reads them, and parsing them was most of the exporter's CPU. A test checks that every
#: vllm: name in kvctl/diagnose is listed here and that the analysis of filtered text equals the unfiltered one.
VLLM_FAMILIES_READ = frozenset({
    N.VLLM_REQUEST_SUCCESS, N.VLLM_REQUEST_PROMPT_TOKENS, N.VLLM_PROMPT_TOKENS, N.VLLM_NUM_REQUESTS_WAITING,
    N.VLLM_NUM_REQUESTS_RUNNING, N.VLLM_PREFIX_CACHE_HITS, N.VLLM_EXTERNAL_PREFIX_CACHE_HITS,
    N.VLLM_EXTERNAL_PREFIX_CACHE_QUERIES, N.VLLM_REQUEST_PREFILL_TIME_SECONDS, N.VLLM_PREFIX_CACHE_QUERIES,
    N.VLLM_ITERATION_TOKENS.removesuffix("_total"), N.VLLM_GENERATION_TOKENS,  # the step marks of kvctl.diagnose.arrivals
})
KEPT_PREFIXES = (N.LMCACHE_PREFIX, N.PREFIX)
_SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


def family(name: str) -> str:
    """A sample's family: ``_bucket``/``_count``/``_sum``/``_total``/``_created`` off, twice for a histogram named
    ``..._total`` (``vllm:iteration_tokens_total_count`` and its ``# TYPE vllm:iteration_tokens_total`` alike)."""
    for _ in range(2):
        for suffix in _SUFFIXES:
            if name.endswith(suffix):
                name = name[: -len(suffix)]
                break
    return name


def relevant_metrics(text: str) -> str:
    """``text`` with only the families the analysis reads; unchanged when it holds none of them."""
    keep: list[str] = []
    kept_vllm = False
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(None, 3)
            name = parts[2] if len(parts) > 2 and parts[1] in ("HELP", "TYPE", "UNIT") else ""
        else:
            name = line.split("{", 1)[0].split(" ", 1)[0]
        if not name:
            continue
        base = family(name)
        if base in VLLM_FAMILIES_READ:
            kept_vllm = kept_vllm or not line.startswith("#")
            keep.append(line)
        elif base.startswith(KEPT_PREFIXES):
            keep.append(line)
    return "\n".join(keep) + "\n" if kept_vllm else text


@dataclass(frozen=True)
class ExporterConfig:
    __repr__ = redacted_repr  # URLs shown with their passwords masked (issue 44)
    engine_urls: tuple[str, ...]
    targets: tuple[Target, ...] = ()
    params: Params = field(default_factory=Params)
    interval_s: float = 15.0
    window_s: float = 60.0
    timeout_s: float = READ_TIMEOUT_S
    stale_after_s: float | None = None  # None: max(window, 3 intervals)
    http: EngineHttp = field(default_factory=EngineHttp)  # engine credentials and the /metrics size cap

    @property
    def stale_s(self) -> float:
        return self.stale_after_s if self.stale_after_s is not None else max(self.window_s, 3 * self.interval_s)


@dataclass(frozen=True)
class Round:
    """What one sampling round produced (for logs, tests and the benchmark)."""

    t_s: float
    duration_s: float
    samples_in_window: int
    diagnosis: Diagnosis | None
    error: str | None  # why there is no diagnosis (fewer than 2 samples, analysis refused)


def sufficient(diag: Diagnosis | None) -> bool:
    """The window answers the diagnosis: an analysis ran, it read an engine in both samples and lacks nothing."""
    return diag is not None and not diag.insufficient_data and any(e.status == "ok" for e in diag.engines)


def check_config(cfg: ExporterConfig) -> None:
    if not cfg.engine_urls:
        raise InvalidInput("give at least one --engine-url")
    if not (EXPORTER_MIN_INTERVAL_S <= cfg.interval_s <= MAX_INTERVAL_S):
        raise InvalidInput(f"--interval must be in [{EXPORTER_MIN_INTERVAL_S:g}, {MAX_INTERVAL_S:g}] s, got {cfg.interval_s}")
    if not (cfg.interval_s <= cfg.window_s <= cap.MAX_WINDOW_S):
        raise InvalidInput(f"--window must be at least --interval ({cfg.interval_s:g} s) and at most {cap.MAX_WINDOW_S:g} s, got {cfg.window_s}")


class KeptOpen:
    """The sampler's threads and Valkey connections, kept open between rounds (a fresh connection per INFO
    cost more CPU than the rest of a round). Each round's read of an instance has one deadline, ``timeout_s`` for
    the connect and the whole reply (:class:`kvctl.tier.admin.Admin`, restarted each round): a dripping instance
    costs the round its timeout, once. The client checks a kept connection before reuse, so an instance restarted
    between rounds is read in the next round; a failed client is dropped and reopened."""

    def __init__(self, sources: int) -> None:
        # daemon threads registered nowhere (not ThreadPoolExecutor's, which the interpreter joins at exit): a read
        # that ignores being cut (a connect to a full accept queue) is left behind, not waited for, at the stop
        self.pool = DaemonPool(sources + 1, "kvctl-exporter-read")
        self._clients: dict[tuple[int, int], Admin] = {}  # by (rank, instance)
        self._down: set[tuple[int, int]] = set()  # instances whose failure was logged (once, until they answer again)

    def valkey_info(self, t: Target, timeout_s: float) -> dict[str, Any]:
        """INFO all of ``t`` within ``timeout_s`` in all; a failure is logged with its reason when the instance goes
        ``up 0`` (refused, timed out, an odd reply, its password refused), and its coming back once it answers."""
        key = (t.rank, t.instance)
        client = self._clients.get(key)
        if client is None or client.timeout_s != timeout_s:
            if client is not None:
                client.close()
            client = self._clients[key] = Admin(t.url, timeout_s, password=t.password)
        client.restart()
        try:
            info = client.info("all")
        except InstanceFailure as e:
            self._clients.pop(key, None)
            client.close()
            err = valkey_read_error(t, e)
            if key not in self._down:  # said once, until it answers again
                self._down.add(key)
                log.warning("kvctl_valkey_up 0: %s", err)
            raise err from e
        if key in self._down:
            self._down.discard(key)
            log.warning("kvctl_valkey_up 1: Valkey %s at %s:%d answers again", t.name, t.host, t.port)
        return info

    def close(self) -> None:
        """Stop the threads and close every connection, also one a read is blocked on (its socket is shut)."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        for c in list(self._clients.values()):
            try:
                c.abort()  # a read in flight fails at once
            except Exception:  # noqa: BLE001 - closing under a reader may raise; the socket is shut either way
                log.debug("closing a Valkey client", exc_info=True)
        self._clients.clear()


class Exporter:
    """Samples, analyses and stores series; :meth:`collect` is the prometheus_client collector."""

    def __init__(
        self,
        cfg: ExporterConfig,
        take_sample: Callable[[Sequence[str], Sequence[Target], float], cap.Sample] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        check_config(cfg)
        urls, self.merged = cap.unique_engine_urls(cfg.engine_urls)  # (dropped, kept): one engine spelled twice
        self.cfg = cfg
        self.engine_urls = urls  # as given, credentials included: only for connecting
        self.engine_labels = [masked(u) for u in urls]  # what is labelled, printed and analysed
        self._open: KeptOpen | None = None
        self.inflight = Inflight()
        http = replace(cfg.http, inflight=self.inflight)
        if take_sample is None:
            kept = self._open = KeptOpen(len(urls) + len(cfg.targets))

            def take_sample(u: Sequence[str], t: Sequence[Target], timeout_s: float) -> cap.Sample:
                return cap.take_sample(u, t, timeout_s, valkey_read=kept.valkey_info, pool=kept.pool, http=http)

        self._take = take_sample
        self._clock = clock
        self._window: deque[cap.Sample] = deque()
        self._series: dict[Key, tuple[float, float]] = {}  # key -> (value, time it was last measured)
        self._last_round_t: float | None = None
        self._engine_down: dict[str, str] = {}  # engine label -> why it went up 0 (logged once, when it did)
        self._lock = threading.Lock()
        self.rounds = 0

    # --- sampling --------------------------------------------------------------------------

    def step(self) -> Round:
        """Take one sample, slide the window, analyse it and store the series."""
        start = self._clock()
        sample = self._take(self.engine_urls, list(self.cfg.targets), self.cfg.timeout_s)
        sample.engines = [None if t is None else relevant_metrics(t) for t in sample.engines]
        duration = self._clock() - start
        self._log_engines(sample)
        self._keep(sample)
        diag, err = None, None
        if len(self._window) < 2:
            err = "one sample so far: the window needs two"
        else:
            try:
                diag = analyse(self.window_capture(), self.cfg.params)
            except KvctlError as e:
                err = str(e)
        fresh = self._fresh_series(sample, duration, diag)
        now = self._clock()
        complete = diag is not None and not diag.unreachable
        with self._lock:
            if complete:  # every component answered: what this analysis did not give does not hold
                self._series = {}
            else:  # a component is missing: its last good values stay until they age out
                self._series = {k: v for k, v in self._series.items() if k[0] not in FRESH}
            for key, value in fresh.items():
                self._series[key] = (value, now)
            self._last_round_t = now
            self.rounds += 1
        return Round(sample.t_s, duration, len(self._window), diag, err)

    def _log_engines(self, sample: cap.Sample) -> None:
        """A warning with the reason when an engine goes ``up 0``, and one when it answers again."""
        for i, (url, text) in enumerate(zip(self.engine_labels, sample.engines)):
            if text is None:
                if url not in self._engine_down:
                    self._engine_down[url] = why = sample.engine_error(i) or "no answer"
                    log.warning("kvctl_engine_up{engine=%s} 0: %s", url, why)
            elif self._engine_down.pop(url, None) is not None:
                log.warning("kvctl_engine_up{engine=%s} 1: it answers again", url)

    def _keep(self, sample: cap.Sample) -> None:
        """Slide the window to ``sample``, keeping at most about EXPORTER_WINDOW_SAMPLES samples.

        The newest sample is always the last; the one before it stays only when it lies at least
        window/EXPORTER_WINDOW_SAMPLES after its own predecessor (else the new one takes its place),
        so the kept samples are evenly spaced and the oldest is at most one such step older than
        the window's start (the analysed span is the window, up to 1/EXPORTER_WINDOW_SAMPLES more).
        """
        w = self._window
        step = self.cfg.window_s / EXPORTER_WINDOW_SAMPLES
        if len(w) >= 2 and w[-1].t_s - w[-2].t_s < step:
            w[-1] = sample
        else:
            w.append(sample)
        while len(w) >= 2 and w[1].t_s <= sample.t_s - self.cfg.window_s:
            w.popleft()

    def window_capture(self) -> cap.Capture:
        """The window's samples as a capture: the analysis differences the oldest and newest, and reads when each engine
        published a new state from all of them (kvctl.diagnose.arrivals; each sample is parsed once, the parse kept)."""
        return cap.Capture(list(self.engine_labels), [cap.masked_valkey_url(t.url) for t in self.cfg.targets], list(self._window), {}, cap.now_iso(),
                           instances_per_rank=cap.instances_per_rank_of(self.cfg.targets))

    def _fresh_series(self, sample: cap.Sample, duration: float, diag: Diagnosis | None) -> dict[Key, float]:
        out: dict[Key, float] = {}

        def put(name: str, value: float | None, **labels: str) -> None:
            if value is not None and math.isfinite(value):
                out[(name, tuple(sorted(labels.items())))] = float(value)

        for url, text in zip(self.engine_labels, sample.engines):
            put("kvctl_engine_up", 0.0 if text is None else 1.0, engine=url)
        k = cap.instances_per_rank_of(self.cfg.targets)

        def where(rank: int, instance: int) -> dict[str, str]:
            """The labels of one instance: rank, and instance_index when ranks have several."""
            return {"rank": str(rank)} if k == 1 else {"rank": str(rank), INSTANCE_LABEL: str(instance)}

        for t, info in zip(self.cfg.targets, sample.valkey):
            put("kvctl_valkey_up", 0.0 if info is None else 1.0, **where(t.rank, t.instance))
        put("kvctl_scrape_duration_seconds", duration)
        put("kvctl_last_sample_timestamp_seconds", sample.t_s)
        put("kvctl_data_sufficient", 1.0 if sufficient(diag) else 0.0)
        if diag is None:
            return out
        put("kvctl_window_seconds", diag.window_s)
        put("kvctl_rho", diag.rho)
        if diag.rho is not None:
            put("kvctl_rho_lower_bound", 1.0 if diag.rho_bound == "lower_bound" else 0.0)
        put("kvctl_arrival_rate_per_second", diag.arrival_rate_per_s)
        put("kvctl_completion_rate_per_second", diag.completion_rate_per_s)
        if diag.bandwidth_gbps is not None:
            put("kvctl_delivered_bandwidth_bytes_per_second", diag.bandwidth_gbps * cost.GB, source=diag.bandwidth_source or "unknown")
        put("kvctl_breakeven_bandwidth_bytes_per_second", None if diag.breakeven_gbps is None else diag.breakeven_gbps * cost.GB)
        put("kvctl_min_hit_tokens", diag.min_hit_tokens)
        put("kvctl_hit_token_ratio", diag.hit_token_fraction)
        for inst in diag.instances:
            if inst.status == "ok":
                put("kvctl_valkey_get_busy_ratio", inst.get_busy_fraction, **where(inst.rank, inst.instance))
        for il in diag.instance_loads:
            put("kvctl_instance_rho", il.rho, **where(il.rank, il.instance))
        for el in diag.engine_loads:
            put("kvctl_engine_rho", el.rho, engine=el.url)
        for decision, reasons in diag.load_decisions.items():
            for reason, hits in reasons.items():
                put("kvctl_load_decisions_per_second", hits / diag.window_s if diag.window_s > 0 else None,
                    decision=decision, reason=reason)
        put("kvctl_hits_recomputed_ratio", diag.hits_recomputed_share)
        for f in diag.findings:
            put("kvctl_finding", 1.0, id=f.id, severity=f.severity)
        return out

    def cancel(self) -> None:
        """Cut every read in flight and refuse new ones (stopping): engine sockets shut, Valkey clients closed."""
        self.inflight.cancel()
        if self._open is not None:
            self._open.close()

    def close(self) -> None:
        """Close the kept-open connections and threads (the series stay readable)."""
        if self._open is not None:
            self._open.close()

    def threads(self) -> list[threading.Thread]:
        """The reader threads this exporter started (daemon threads; :meth:`close` tells them to end)."""
        return [] if self._open is None else self._open.pool.threads

    def run(self, stop: threading.Event, on_round: Callable[[Round], None] | None = None) -> None:
        """Sample every ``interval_s`` until ``stop`` is set; a round that overruns skips to the next tick."""
        next_t = self._clock()
        while not stop.is_set():
            try:
                rnd = self.step()
            except Exception as e:  # noqa: BLE001 - a bug or an odd reply must not end the sampler silently
                # the round stores nothing: if every round fails, the values go stale and *_up drop to 0
                log.warning("sampling round failed", exc_info=True)
                rnd = Round(self._clock(), 0.0, len(self._window), None, f"round failed: {type(e).__name__}: {e}")
            if on_round:
                on_round(rnd)
            next_t += self.cfg.interval_s
            now = self._clock()
            if next_t < now:  # the round took longer than an interval
                next_t = now + self.cfg.interval_s - ((now - next_t) % self.cfg.interval_s)
            stop.wait(max(0.0, next_t - now))

    # --- serving ---------------------------------------------------------------------------

    def values(self) -> dict[Key, float]:
        """The series a scrape returns now: stale ones dropped, ``*_up`` 0 when the sampler is stale."""
        now = self._clock()
        stale = self.cfg.stale_s
        with self._lock:
            items = list(self._series.items())
            sampler_stale = self._last_round_t is None or now - self._last_round_t > stale
        out: dict[Key, float] = {}
        for key, (value, t) in items:
            if key[0] in UP:
                out[key] = 0.0 if sampler_stale else value
            elif now - t <= stale:
                out[key] = value
        return out

    def describe(self) -> list[Any]:
        return []  # series appear and disappear with the data: no fixed description

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily  # noqa: PLC0415

        by_name: dict[str, list[tuple[tuple[tuple[str, str], ...], float]]] = {}
        for (name, labels), value in sorted(self.values().items()):
            by_name.setdefault(name, []).append((labels, value))
        for name, (help_, label_names) in METRICS.items():
            series = by_name.get(name, [])
            names = list(label_names) + ([INSTANCE_LABEL] if any(INSTANCE_LABEL in dict(labels) for labels, _ in series) else [])
            fam = GaugeMetricFamily(name, help_, labels=names)
            for labels, value in series:
                d = dict(labels)
                fam.add_metric([d.get(n, "") for n in names], value)
            yield fam

