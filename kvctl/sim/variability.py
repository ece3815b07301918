"""Variability for ``kvctl simulate``/``plan``, each fitted from a file an operator already has.

* T0 (the fixed per-hit engine cost, paper §4) as an empirical distribution: from a ``kvctl replay``
  run file, each hit's ``T0_i = t − h·s/B − (n − h)/R`` (t the time to first token from sending, h
  the cached tokens, n the prompt); hits alone in flight only when there are enough of them, so
  queueing does not pass for T0. Alone means no other request of the run was in flight at any time
  between its sending and its first token (one that arrives while a hit loads delays it too). When
  the run holds its engine's first external-cache hit (``vllm:external_prefix_cache_hits`` was 0
  before it), that hit is left out: an engine's first load pays one-time setup that later hits do not
  (0.4–1 s on an H200 with vLLM 0.32, benchmarks/README.md).
* GET time variance: a ``kvctl bench --save`` JSON's p50 and p99 per batch give a lognormal
  multiplier of the transfer time with mean 1 (``σ = ln(p99/p50) / z₉₉``), so bandwidth and ρ keep
  their means and only the spread is added.
* throughput against concurrent readers: the one-instance runs of a ``kvctl bench --sweep`` JSON
  (1, 2, 4… clients) give ``g(k) = B(k clients) / B(1 client)``; an instance serving a backlog of k
  readers works at ``g(k)`` times its one-reader bandwidth. Past the most clients measured the curve
  is held flat and the result says it was extrapolated.
* async bandwidth: the rank-0 store loads with one client, so a bench file's 1 instance × 1 client
  run is the per-instance bandwidth of an async prefetch.
* the async loader's service (:func:`fit_loads`): from a kvctl connector trace's ``load`` events, the GET bandwidth
  the engine's loads had (each rank's bytes over its GET seconds) and the seconds each load held the loader besides
  its GETs (the copy's tail, the agreed-prefix exchange, the insert). The loader serves one load at a time, so at a
  tier ρ near 1 these few ms a load count: on an H100 (2026-12-06) a 0.49 GB load took 0.128 s, 0.005 s more than its
  GETs, and its GETs ran 3 % below the bench's rate; the bench alone put the tier's ρ at 1.13 where it was 1.24.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvctl.connector.metric_names import VLLM_EXTERNAL_PREFIX_CACHE_HITS
from kvctl.core import files
from kvctl.core.cost import GB
from kvctl.core.errors import InvalidInput
from kvctl.core.thresholds import BENCH_FILE_MAX_BYTES, BESIDE_STEP_TOKENS

#: the standard normal's 99th percentile: p99/p50 of a lognormal is exp(σ·Z99)
Z99 = 2.3263478740408408
#: fewest in-flight-alone hit rows of a run file to fit T0 from them only
MIN_ALONE_ROWS = 10


@dataclass(frozen=True)
class Variability:
    """What varies from request to request; the defaults are the constant model of ``simulate``."""

    t0_samples_s: tuple[float, ...] = ()  # empirical T0 distribution (resampled); empty: the constant T0
    get_sigma: float = 0.0  # lognormal σ of the transfer-time multiplier (mean 1)
    readers_gain: dict[int, float] = field(default_factory=dict)  # k concurrent readers → g(k); {} : 1
    async_instance_gbps: float | None = None  # per-instance bandwidth of async prefetches (None: the sync one)
    async_overhead_s: float = 0.0  # added to every async request's latency
    async_load_s: float = 0.0  # seconds each async load holds the tier's loader besides its GETs (copies, exchange, insert)
    notes: tuple[str, ...] = ()  # where each input came from
    t0_fit_hit_tokens: tuple[float, float] | None = None  # shortest and longest prompt of the hits T0 was fitted on
    #: async: each load's GET-time multiplier drawn from these (a trace's loads over their median, --fit-load-spread),
    #: in place of the bench's lognormal; () : that lognormal
    load_spread: tuple[float, ...] = ()
    #: the vLLM line (--fit-load-beside): a load that starts while the engine has BESIDE_STEP_TOKENS or more to prefill
    #: draws from these (the trace's loads beside such steps), the others from load_spread (its loads alone); ()
    #: : every load from load_spread
    load_spread_beside: tuple[float, ...] = ()

    @property
    def active(self) -> bool:
        return bool(self.t0_samples_s or self.get_sigma or self.readers_gain or self.async_instance_gbps or self.async_overhead_s
                    or self.async_load_s or self.load_spread)


def read_bench_file(path: str, what: str) -> Any:
    """The JSON of a ``kvctl bench --save`` file: a regular file of at most BENCH_FILE_MAX_BYTES, nested at most
    JSON_MAX_DEPTH levels (:func:`kvctl.core.files.read_json`)."""
    from kvctl.bench.session import say_unknown_keys  # noqa: PLC0415

    data = files.read_json(path, what, BENCH_FILE_MAX_BYTES, "a `kvctl bench --save` file")
    say_unknown_keys(data, f"{what} {path}")  # a key no reader knows, with the nearest (issue 48)
    return data


def _get_runs(data: Any, path: str, what: str) -> list[dict[str, Any]]:
    runs = data.get("runs") if isinstance(data, dict) else None
    if not isinstance(runs, list):
        raise InvalidInput(f"{what} {path} is not a `kvctl bench --save` file (no runs)")
    return [r for r in runs if isinstance(r, dict) and r.get("op") == "get"]


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0 else None


def lognormal_sigma(p50: float, p99: float) -> float:
    """σ of a lognormal whose 99th percentile is ``p99`` and median ``p50`` (0 when p99 ≤ p50)."""
    return max(0.0, math.log(p99 / p50) / Z99) if p50 > 0 and p99 > 0 else 0.0


def get_sigma_from_bench(path: str, instances: int | None = None) -> tuple[float, str]:
    """Lognormal σ of batch GET time from a ``bench --save`` file: the GET run at ``instances`` with one
    client (else the one-instance one-client run, else the first GET run with percentiles)."""
    runs = [r for r in _get_runs(read_bench_file(path, "--get-times-from"), path, "--get-times-from")
            if _num(r.get("p50_batch_ms")) and _num(r.get("p99_batch_ms"))]
    if not runs:
        raise InvalidInput(f"--get-times-from {path} has no GET run with p50_batch_ms and p99_batch_ms")

    def pick(i: int | None, c: int | None) -> dict[str, Any] | None:
        return next((r for r in runs if (i is None or r.get("instances") == i) and (c is None or r.get("clients") == c)), None)

    run = pick(instances, 1) or pick(1, 1) or runs[0]
    p50, p99 = float(run["p50_batch_ms"]), float(run["p99_batch_ms"])
    sigma = lognormal_sigma(p50, p99)
    return sigma, f"GET time: lognormal σ {sigma:.3f} from p50 {p50:g} ms, p99 {p99:g} ms per batch ({run.get('instances')} × {run.get('clients')}, {path})"


def readers_gain_from_bench(path: str) -> tuple[dict[int, float], str]:
    """``g(k)`` from the one-instance runs of a ``bench --sweep`` file (needs the 1-client run)."""
    curve: dict[int, float] = {}
    for r in _get_runs(read_bench_file(path, "--readers-from"), path, "--readers-from"):
        gbps, k = _num(r.get("aggregate_gbps")), r.get("clients")
        if r.get("instances") == 1 and gbps and isinstance(k, int) and k >= 1:
            curve[k] = max(curve.get(k, 0.0), gbps)
    if 1 not in curve or len(curve) < 2:
        raise InvalidInput(f"--readers-from {path} needs one-instance GET runs at 1 and more clients (`kvctl bench --sweep`)")
    gain = {k: curve[k] / curve[1] for k in sorted(curve)}
    text = ", ".join(f"{k}: {g:.2f}×" for k, g in gain.items())
    return gain, f"throughput against readers per instance {text} ({path})"


def async_gbps_from_bench(path: str) -> tuple[float, str]:
    """The 1 instance × 1 client GET bandwidth of a bench file: one rank-0 store client's prefetch."""
    for r in _get_runs(read_bench_file(path, "--bench"), path, "--bench"):
        gbps = _num(r.get("aggregate_gbps"))
        if r.get("instances") == 1 and r.get("clients") == 1 and gbps:
            return gbps, f"async per-instance bandwidth {gbps:.3f} GB/s: the 1 × 1 run of {path}"
    raise InvalidInput(f"{path} has no 1 instance × 1 client GET run for the async bandwidth")


def gain_for(gain: dict[int, float], k: np.ndarray) -> tuple[np.ndarray, bool]:
    """``g(k)`` for each count in ``k`` (linear between measured counts, flat past the last); and
    whether any k went past the most readers measured."""
    if not gain:
        return np.ones(len(k)), False
    ks = np.array(sorted(gain), dtype=float)
    gs = np.array([gain[int(x)] for x in ks])
    return np.interp(k, ks, gs), bool((k > ks[-1]).any())


def t0_from_run(path: str, bytes_per_token: float, bandwidth_gbps: float, prefill_rate: float) -> tuple[tuple[float, ...], str]:
    """The empirical T0 distribution of a replay run file (see the module docstring)."""
    t0, note, _ = t0_fit(path, bytes_per_token, bandwidth_gbps, prefill_rate)
    return t0, note


def engines_first_hit(run: Any) -> dict[str, Any] | None:
    """The row of ``run`` (a :class:`kvctl.records.runfile.Run`) that was its engine's first external-cache hit, when
    the engine had served none before the run (``vllm:external_prefix_cache_hits`` 0 in ``metrics_before``); else None."""
    from kvctl.records.runfile import counter  # noqa: PLC0415

    if counter(run.metadata.get("metrics_before"), VLLM_EXTERNAL_PREFIX_CACHE_HITS) != 0:
        return None
    hits = [r for r in run.rows if r.get("status") == "ok" and _num(r.get("cached_tokens"))]
    return min(hits, key=lambda r: float(r["sent_s"]) if isinstance(r.get("sent_s"), (int, float)) else float(r["scheduled_s"]),
               default=None)


def _alone_in_flight(rows: list[dict[str, Any]], hits: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``hits`` no other request of ``rows`` overlapped between their sending and their first token (rows
    without those times: the ones sent with nobody else in flight)."""
    timed = [r for r in rows if isinstance(r.get("sent_s"), (int, float))]
    starts = np.array([float(r["sent_s"]) for r in timed])
    ends = np.array([float(r["finished_s"]) if _num(r.get("finished_s")) else float(r["sent_s"]) + float(r.get("latency_s") or 0.0)
                     for r in timed])
    order = np.argsort(starts, kind="stable")
    s_sorted, e_sorted = starts[order], ends[order]
    prior_end = np.maximum.accumulate(np.concatenate(([-np.inf], e_sorted)))[:-1]  # latest end of the rows sent before each
    pos = {id(timed[j]): k for k, j in enumerate(order)}
    out = []
    for r in hits:
        k, first = pos.get(id(r)), r.get("first_token_s")
        if k is None or not _num(first):
            if r.get("in_flight") == 1:
                out.append(r)
            continue
        sent = s_sorted[k]
        sent_during = int(np.searchsorted(s_sorted, float(first), "left") - np.searchsorted(s_sorted, sent, "left")) - 1
        if prior_end[k] <= sent and sent_during == 0:
            out.append(r)
    return out


def t0_fit(path: str, bytes_per_token: float, bandwidth_gbps: float,
           prefill_rate: float) -> tuple[tuple[float, ...], str, tuple[float, float]]:
    """:func:`t0_from_run`, plus the shortest and longest prompt of the hits it used: prompts, not cached tokens, as
    the simulation's hits are compared with it (an engine caches whole chunks, so a run's 4,160-token prompts hit 4,096
    tokens, where the model loads the prompt)."""
    from kvctl.records.runfile import read_run  # noqa: PLC0415

    run = read_run(path)
    rows = [r for r in run.rows if r.get("status") == "ok" and _num(r.get("cached_tokens")) and _num(r.get("prompt_tokens"))]
    if not rows:
        raise InvalidInput(f"--fit-from {path} has no successful request with cached_tokens > 0 (no hit to fit T0 from)")
    first_note = ""
    first_hit = engines_first_hit(run)
    if first_hit is not None and len(rows) > 1:
        rows = [r for r in rows if r is not first_hit]
        first_note = f"; left out its first hit (the engine's first external-cache hit: one-time setup, {float(first_hit['latency_s']):.3f} s)"
    alone = _alone_in_flight(run.rows, rows)
    use = alone if len(alone) >= MIN_ALONE_ROWS else rows
    out = []
    prompts = [float(r["prompt_tokens"]) for r in use]
    for r in use:
        n, h = float(r["prompt_tokens"]), min(float(r["cached_tokens"]), float(r["prompt_tokens"]))
        first, sent = r.get("first_token_s"), r.get("sent_s")
        t = float(first) - float(sent) if _num(first) and isinstance(sent, (int, float)) else float(r["latency_s"])
        out.append(max(0.0, t - h * bytes_per_token / (bandwidth_gbps * GB) - (n - h) / prefill_rate))
    arr = np.array(out)
    which = "alone in flight" if use is alone else f"all hits (fewer than {MIN_ALONE_ROWS} alone in flight: queueing may be in it)"
    return tuple(out), (f"T0 from {len(out)} hits of {path} ({which}, transfers at {bandwidth_gbps:.4g} GB/s): "
                        f"p50 {np.percentile(arr, 50):.3f} s, p99 {np.percentile(arr, 99):.3f} s{first_note}"
                        + "".join(f"; {w}" for w in run.warnings)), (min(prompts), max(prompts))


def bench_variability(path: str, instances: int | None = None) -> tuple[float, dict[int, float], list[str]]:
    """What a ``kvctl bench --save`` file given as ``--bench`` adds to its bandwidths: the GET-time spread (when its GET
    runs have batch percentiles) and the readers curve (when it has one-instance runs at several clients, a --sweep);
    each part the file lacks is said in a note, not refused."""
    runs = _get_runs(read_bench_file(path, "--bench"), path, "--bench")
    notes: list[str] = []
    sigma, gain = 0.0, {}
    if any(_num(r.get("p50_batch_ms")) and _num(r.get("p99_batch_ms")) for r in runs):
        sigma, note = get_sigma_from_bench(path, instances)
        notes.append(note)
    else:
        notes.append(f"GET time: constant ({path} has no batch percentiles)")
    if len({r.get("clients") for r in runs if r.get("instances") == 1 and _num(r.get("aggregate_gbps"))} - {None}) >= 2:
        gain, note = readers_gain_from_bench(path)
        notes.append(note)
    else:
        notes.append(f"throughput against readers: flat ({path} is no --sweep: no one-instance runs at several clients)")
    return sigma, gain, notes


@dataclass(frozen=True)
class LoaderFit:
    """The async loader's service as a connector trace shows it (:func:`fit_loads`)."""

    instance_gbps: float  # GET bandwidth of one instance in the engine's loads
    load_s: float  # seconds a load held the loader besides its GETs (median)
    loads: int  # the loads fitted on
    note: str
    spread: tuple[float, ...] = ()  # each load's seconds a byte over the median's, sorted (1.0: the median load)
    # the spread's loads split by what ran beside their GETs: at least half their GET time beside engine steps of
    # BESIDE_STEP_TOKENS or more prefill tokens, or not (each sorted; the same median as ``spread``)
    spread_beside: tuple[float, ...] = ()
    spread_alone: tuple[float, ...] = ()


@dataclass(frozen=True)
class TraceLoad:
    """One rank's load from a connector trace's ``load`` event: its bytes, seconds in GETs and in the loader, whether
    at least half its GET time ran beside an engine step of ``BESIDE_STEP_TOKENS`` or more (``beside``), whether it
    was given up at its deadline, and the event itself (its lanes' sums, where the trace has them)."""

    bytes: float
    get_s: float
    total_s: float
    beside: bool
    given_up: bool
    rank: int
    event: dict


def trace_loads(events: list[dict]) -> list[TraceLoad]:
    """The loads of a connector trace's events that read something (bytes, ``get_s`` and ``total_s`` each finite and
    above 0, ``total_s`` ≥ ``get_s``), in the trace's order, each classed beside a big step or not."""
    big = [(e["t_start"], e["t_start"] + e["s"]) for e in events if e.get("ev") == "step" and _num(e.get("t_start"))
           and _num(e.get("s")) and (e.get("prefill_tokens") or 0) >= BESIDE_STEP_TOKENS]
    out: list[TraceLoad] = []
    for e in events:
        if e.get("ev") != "load":
            continue
        b, g, tot = (_num(e.get(k)) for k in ("bytes", "get_s", "total_s"))
        if b is None or g is None or tot is None or tot < g:
            continue
        start = (_num(e.get("t")) or 0.0) - tot  # the GETs come first, then the copy, the exchange and the insert
        beside = sum(max(0.0, min(start + g, b1) - max(start, a1)) for a1, b1 in big) >= g / 2
        rank = e.get("rank")
        out.append(TraceLoad(b, g, tot, beside, e.get("given_up") is True,
                             rank if isinstance(rank, int) and not isinstance(rank, bool) else 0, e))
    return out


def fit_loads(path: str, instances: int) -> LoaderFit:
    """The loader's service from the ``load`` events of the connector trace at ``path``: each event is one rank's
    load (its bytes, ``get_s`` on its GETs, ``total_s`` in the loader); those that read something and were not
    given up at their deadline count. The engine's GET bandwidth is the median of each event's bytes / get_s, times
    the ranks that loaded, over ``instances`` (the trace's tier: its ranks share them evenly); the loader's own time,
    the median of ``total_s − get_s``. InvalidInput, one line, when no load qualifies."""
    from kvctl.records.connector_trace import read_events  # noqa: PLC0415

    events, _ = read_events(path, "--fit-loads trace")
    loads = [x for x in trace_loads(events) if not x.given_up]
    rates = [x.bytes / x.get_s for x in loads]
    extra = [x.total_s - x.get_s for x in loads]
    beside = [x.beside for x in loads]
    ranks = {x.rank for x in loads}
    if not rates:
        raise InvalidInput(f"--fit-loads {path}: no load that read something and was not given up (the trace's "
                           "`load` events need bytes, get_s and total_s)")
    median = float(np.median(rates))
    gbps = median * len(ranks) / instances / GB
    load_s = float(np.median(extra))
    spread = tuple(sorted(median / r for r in rates))
    split = (tuple(sorted(median / r for r, x in zip(rates, beside) if x)),
             tuple(sorted(median / r for r, x in zip(rates, beside) if not x)))
    note = (f"async loads from {path}: {len(rates)} loads, GETs at {gbps:.3g} GB/s an instance "
            f"({len(ranks)} rank(s) over {instances} instance(s)), the loader {load_s * 1e3:.1f} ms a load besides its GETs")
    return LoaderFit(gbps, load_s, len(rates), note, spread, *split)


def build(*, fit_from: str | None = None, get_times_from: str | None = None, readers_from: str | None = None,
          async_instance_gbps: float | None = None, async_overhead_s: float = 0.0, bytes_per_token: float = 0.0,
          prefill_rate: float = 0.0, fit_gbps: float | None = None, instances: int | None = None, bench_from: str | None = None,
          t0_given_s: float | None = None, fit_loads_from: str | None = None, async_load_s: float | None = None,
          fit_instances: int | None = None, fit_load_spread: bool = False, fit_load_beside: bool = False) -> Variability:
    """A :class:`Variability` from the files given (None: that input stays constant).

    ``fit_gbps``: the tier bandwidth the ``fit_from`` run saw (its transfers are taken out of T0). ``t0_given_s``: a T0
    the operator gave (``--t0``), which wins over the run's: the fit is made and said in the note, its samples unused.
    ``bench_from``: a bench file whose spread and readers curve are taken where it has them (:func:`bench_variability`);
    ``get_times_from``/``readers_from``: one part each, refused when the file lacks it. ``fit_loads_from``: a connector
    trace whose loads give the async bandwidth and the loader's time a load (:func:`fit_loads`, its tier of
    ``fit_instances``, else ``instances``); ``async_instance_gbps`` and ``async_load_s`` given win over that fit;
    ``fit_load_spread``: each async load's GET time drawn from that trace's loads (over their median) too;
    ``fit_load_beside``: from its loads beside big steps for a load that starts beside one, else from the others
    (:attr:`Variability.load_spread_beside`; the vLLM line only).
    """
    notes: list[str] = []
    t0: tuple[float, ...] = ()
    fit_range = None
    if fit_from:
        if not fit_gbps:
            raise InvalidInput("--fit-from needs the bandwidth the run saw (--instance-gbps or --bench)")
        t0, note, fit_range = t0_fit(fit_from, bytes_per_token, fit_gbps, prefill_rate)
        if t0_given_s is not None:  # the operator's T0 wins; the fit (and what the run file said) is only reported
            note = f"T0 {t0_given_s:g} s as given (--t0), not the fit ({note}); drop --t0 to simulate that distribution"
            t0, fit_range = (), None
        notes.append(note)
    sigma = 0.0
    gain: dict[int, float] = {}
    if bench_from:
        sigma, gain, said = bench_variability(bench_from, instances)
        notes.extend(said)
    if get_times_from:
        sigma, note = get_sigma_from_bench(get_times_from, instances)
        notes.append(note)
    if readers_from:
        gain, note = readers_gain_from_bench(readers_from)
        notes.append(note)
    given_gbps, given_load_s = async_instance_gbps, async_load_s
    spread: tuple[float, ...] = ()
    spread_beside: tuple[float, ...] = ()
    if fit_load_beside and not fit_load_spread:
        raise InvalidInput("--fit-load-beside splits --fit-load-spread's draws: give --fit-load-spread too")
    if fit_loads_from:
        fit = fit_loads(fit_loads_from, fit_instances or instances or 1)
        notes.append(fit.note + ("" if given_gbps is None and given_load_s is None else " (values given win)"))
        async_instance_gbps = fit.instance_gbps if given_gbps is None else given_gbps
        async_load_s = fit.load_s if given_load_s is None else given_load_s
        if fit_load_spread:
            spread = fit.spread
            q = np.percentile(spread, [90, 99])
            notes.append(f"async loads' GET times drawn from the {len(spread)} loads of {fit_loads_from} (p90 {q[0]:.2f}×, "
                         f"p99 {q[1]:.2f}×, the slowest {spread[-1]:.2f}× the median's; --fit-load-spread)")
        if fit_load_beside:
            spread, spread_beside, said = _beside_split(fit, fit_loads_from)
            notes.append(said)
    elif fit_load_spread:
        raise InvalidInput("--fit-load-spread draws from --fit-loads' trace: give --fit-loads TRACE")
    if given_gbps is not None:
        notes.append(f"async per-instance bandwidth {given_gbps:g} GB/s")
    if async_overhead_s:
        notes.append(f"async overhead {async_overhead_s:g} s per request")
    if given_load_s:
        notes.append(f"async loads hold the loader {given_load_s * 1e3:g} ms each besides their GETs")
    return Variability(t0, sigma, gain, async_instance_gbps, async_overhead_s, async_load_s or 0.0, tuple(notes), fit_range,
                       spread, spread_beside)


def _beside_split(fit: LoaderFit, path: str) -> tuple[tuple[float, ...], tuple[float, ...], str]:
    """(the draws of a load alone, of a load beside a big step, what was said) for --fit-load-beside."""
    if not fit.spread_beside or not fit.spread_alone:
        return fit.spread, (), (f"--fit-load-beside: {len(fit.spread_beside)} of the {len(fit.spread)} loads of {path} ran "
                                f"beside steps of {BESIDE_STEP_TOKENS} tokens or more: every load draws from all of them")
    mean = float(np.mean(fit.spread_beside))
    return fit.spread_alone, fit.spread_beside, (
        f"--fit-load-beside: a load that starts while the engine has {BESIDE_STEP_TOKENS} or more tokens to prefill draws "
        f"from the {len(fit.spread_beside)} loads of {path} beside such steps (mean {mean:.2f}×, the slowest "
        f"{fit.spread_beside[-1]:.2f}×), the others from its {len(fit.spread_alone)} loads alone")
