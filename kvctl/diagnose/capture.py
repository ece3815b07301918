"""Samples of an engine and its tier, taken live or saved to / loaded from a directory.

A capture is what ``kvctl diagnose`` analyses: two samples, each
holding every engine's ``/metrics`` text, every Valkey instance's ``INFO``
and the GPU utilisation (and between them, engine reads that show when each engine published a new state), plus timestamps and the parameters given. Live runs
and ``--from DIR`` go through the same :class:`Capture`, so a saved capture
analyses exactly as the live run did.

Every source is read in parallel and stamped with its own time (the middle
of its own request), so a slow engine does not skew another's window. A
source that does not answer (down, SIGSTOPped, timing out) is recorded with
its error instead of aborting the sample: the rest is kept and analysed.

Directory layout (format 2; format 1 captures still load)::

    DIR/capture.json               metadata, parameters, per-sample and per-source times, errors, GPU
    DIR/sample-000/engine-0.txt    engine 0's /metrics text, first sample (absent when it did not answer)
    DIR/sample-000/valkey-0.json   rank 0's INFO, first sample (instance n = r*K + i with K instances per rank)
    DIR/sample-001/...             engine reads between the first and last sample (engines only: kvctl.diagnose.polls),
                                   then the last sample, which has every source again

With K instances per rank ``capture.json`` says ``instances_per_rank: K`` (absent: 1), and
``valkey_urls`` and the ``valkey-<n>.json`` files are in tier order: instance i of rank r at n = r*K + i.
"""

from __future__ import annotations

import concurrent.futures
import datetime as _dt
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from kvctl import __version__
from kvctl.connector.urls import InvalidUrl, parse_resp_url
from kvctl.diagnose import sources
from kvctl.diagnose.sources import GpuSample
from kvctl.core.engine_http import EngineHttp, masked
from kvctl.core.errors import InvalidInput, KvctlError, Unreachable
from kvctl.core.files import write_atomic
from kvctl.core.thresholds import READ_TIMEOUT_S
from kvctl.tier.targets import Target

CAPTURE_FILE = "capture.json"
FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)
LAST_DIAGNOSIS = "last-diagnosis.json"
NO_WINDOW_S = 1e-3  # the "window" of a capture nothing answered: its two samples this far apart


@dataclass
class Sample:
    """One round of reads. ``engines[i]``/``valkey[r]`` is None when that source did not answer."""

    t_s: float  # wall-clock seconds (time.time()) when the round started
    engines: list[str | None]  # /metrics text, one per engine URL
    valkey: list[dict[str, Any] | None]  # INFO, one per instance (index = rank)
    gpu: GpuSample = field(default_factory=GpuSample)
    engine_t_s: list[float | None] = field(default_factory=list)  # each read's own time; t_s where absent
    valkey_t_s: list[float | None] = field(default_factory=list)
    engine_errors: list[str | None] = field(default_factory=list)
    valkey_errors: list[str | None] = field(default_factory=list)
    engines_only: bool = False  # a read between the window's first and last sample (kvctl.diagnose.polls): no Valkey, no GPU
    _parsed: dict[int, tuple[str, Any]] = field(default_factory=dict, repr=False, compare=False)

    def scrape(self, i: int) -> Any:
        """Engine i's text parsed (:func:`kvctl.records.prometheus.parse`), once per text: the exporter's window
        and the engine states (:mod:`kvctl.diagnose.arrivals`) read a sample again and again."""
        from kvctl.records.prometheus import parse  # noqa: PLC0415 - prometheus_client only when a text is read

        text = self.engines[i]
        if text is None:
            return None
        got = self._parsed.get(i)
        if got is None or got[0] is not text:
            got = self._parsed[i] = (text, parse(text, f"engine {i} metrics"))
        return got[1]

    def engine_time(self, i: int) -> float:
        return _at(self.engine_t_s, i, None) or self.t_s

    def valkey_time(self, r: int) -> float:
        return _at(self.valkey_t_s, r, None) or self.t_s

    def engine_error(self, i: int) -> str | None:
        return _at(self.engine_errors, i, None)

    def valkey_error(self, r: int) -> str | None:
        return _at(self.valkey_errors, r, None)


def _at(xs: list[Any], i: int, default: Any) -> Any:
    return xs[i] if i < len(xs) else default


@dataclass
class Capture:
    engine_urls: list[str]
    valkey_urls: list[str]
    samples: list[Sample]
    parameters: dict[str, Any] = field(default_factory=dict)
    created_at: str = ""
    kvctl_version: str = __version__
    instances_per_rank: int = 1  # K: valkey_urls[r*K + i] is instance i of rank r
    engine_states: list[int] | None = None  # states each engine published in the window (kvctl.diagnose.polls), when polled
    notes: list[str] = field(default_factory=list)  # said with the diagnosis (why the window is none)


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def _timed(read: Callable[[], Any]) -> tuple[Any, float, str | None]:
    """(value or None, the middle of this read's own request, error text or None)."""
    start = time.time()
    try:
        value, err = read(), None
    except KvctlError as e:
        value, err = None, str(e)
    return value, (start + time.time()) / 2, err


def take_sample(
    engine_urls: Sequence[str],
    targets: Sequence[Target],
    timeout_s: float = READ_TIMEOUT_S,
    *,
    valkey_read: Callable[[Target, float], dict[str, Any]] | None = None,
    pool: concurrent.futures.Executor | None = None,
    http: EngineHttp | None = None,
) -> Sample:
    """Read every engine and instance once, in parallel, each stamped with its own time.

    A source that fails (down, hung, timing out after ``timeout_s``) is kept as
    None with its error; one hung component costs one timeout, not one each.
    ``valkey_read`` replaces :func:`sources.valkey_info` and ``pool`` (at least
    one worker per source, plus one) the per-call thread pool: ``kvctl exporter``
    samples every few seconds and keeps both (connections and threads) open. ``http``: the engine
    credentials, the /metrics size cap and the registry of reads in flight.
    """
    t0 = time.time()
    read_valkey = valkey_read or sources.valkey_info
    reads: list[Callable[[], Any]] = [lambda u=u: sources.fetch_metrics(u, timeout_s, http) for u in engine_urls]
    reads += [lambda t=t: read_valkey(t, timeout_s) for t in targets]
    ex = pool or concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(reads) + 1))
    try:
        gpu_f = ex.submit(sources.gpu_sample)
        results = list(ex.map(_timed, reads))
        gpu = gpu_f.result()
    finally:
        if pool is None:
            ex.shutdown()
    n = len(engine_urls)
    eng, val = results[:n], results[n:]
    return Sample(
        t0,
        [v for v, _, _ in eng],
        [v for v, _, _ in val],
        gpu,
        engine_t_s=[t for _, t, _ in eng],
        valkey_t_s=[t for _, t, _ in val],
        engine_errors=[e for _, _, e in eng],
        valkey_errors=[e for _, _, e in val],
    )


def unique_engine_urls(engine_urls: Sequence[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """The engine URLs with every engine once, and the (dropped, kept) pairs of URLs that reach an engine
    already listed: the same /metrics URL, or another spelling of its host and port (``localhost`` and
    ``127.0.0.1``; :func:`sources.engine_address`). Counting one engine twice doubles λ and every ρ."""
    resolve = len(engine_urls) > 1
    kept: list[tuple[str, tuple[tuple[str, int | None, str, str], frozenset[str]]]] = []
    dropped: list[tuple[str, str]] = []
    for u in engine_urls:
        key, addrs = sources.engine_address(u, resolve)
        same = next((k for k, (key2, addrs2) in kept if key2 == key and addrs2 & addrs), None)
        if same is None:
            kept.append((u, (key, addrs)))
        else:
            dropped.append((u, same))
    return [u for u, _ in kept], dropped


def merged_warning(dropped: Sequence[tuple[str, str]]) -> str:
    """One line saying which --engine-url were read once, for the commands to warn with."""
    pairs = "; ".join(f"{masked(d)} and {masked(k)}" for d, k in dropped)
    return f"--engine-url {pairs} reach the same engine: read once (counting it twice would double λ and ρ)"


def nothing_answered(first: Sample) -> bool:
    """Not one engine or instance answered ``first``: waiting the window for a second sample of nothing cost a
    minute of silence (issue 48)."""
    return not any(t is not None for t in first.engines) and not any(i is not None for i in first.valkey)


def without_a_window(first: Sample, window_s: float) -> tuple[Sample, str]:
    """The second sample of a window nothing answered the first read of: the same failures, at once (every source is
    then reported unreachable with its reason, exit 5), and the note that says why the window is none."""
    again = Sample(first.t_s + NO_WINDOW_S, list(first.engines), list(first.valkey), first.gpu, engine_errors=list(first.engine_errors),
                   valkey_errors=list(first.valkey_errors))
    return again, f"nothing answered the first sample, so diagnose did not wait the {window_s:g} s window"


def refuse_when_nothing_answered(first: Sample, engine_urls: Sequence[str], targets: Sequence[Target], window_s: float) -> None:
    """Unreachable (exit 5) naming every source and its reason when nothing answered ``first`` (``--watch``)."""
    if not nothing_answered(first):
        return
    names = [f"engine {masked(u)}" for u in engine_urls] + [f"Valkey {t.name} ({masked_valkey_url(t.url)})" for t in targets]
    errors = list(first.engine_errors) + list(first.valkey_errors)
    why = "; ".join(_at(errors, i, None) or f"{n}: no answer" for i, n in enumerate(names))  # each error names its source
    raise Unreachable(f"{without_a_window(first, window_s)[1]}: {why}")


def failures(capture: Capture, engine_names: Sequence[str], valkey_names: Sequence[str]) -> list[str]:
    """Each source that did not answer, once, ``"engine NAME: error"`` / ``"Valkey NAME: error"``, with the number of
    samples it failed in when not every one (``engine_names`` masked: they are shown)."""
    seen: dict[str, int] = {}
    full = [s for s in capture.samples if not s.engines_only]  # the reads between them judge no source
    for s in full:
        for kind, names, errs in (("engine", engine_names, s.engine_errors), ("Valkey", valkey_names, s.valkey_errors)):
            for name, err in zip(names, errs):
                if err:
                    seen[f"{kind} {name}: {err}"] = seen.get(f"{kind} {name}: {err}", 0) + 1
    n = len(full)
    return [m if k == 1 else f"{m} (in {k} of {n} samples)" for m, k in seen.items()]


def instances_per_rank_of(targets: Sequence[Target]) -> int:
    """K of the tier the targets name (1 when none is named)."""
    return max((t.instances_per_rank for t in targets), default=1)


MAX_WINDOW_S = 86400.0


def wait_until(deadline: float, tick: Callable[[float], None] | None = None, step_s: float = 0.1) -> None:
    """Sleep until wall time ``deadline`` in small steps, reporting each to ``tick``."""
    if not (deadline - time.time() <= MAX_WINDOW_S + 60):  # also False for NaN
        raise InvalidInput(f"refusing to wait until {deadline!r}: not within {MAX_WINDOW_S:g} s from now")
    while True:
        left = deadline - time.time()
        if left <= 0:
            return
        dt = min(step_s, left)
        time.sleep(dt)
        if tick:
            tick(dt)


def masked_valkey_url(url: str) -> str:
    """A Valkey URL as a capture keeps it (printed, saved): unchanged without a password, else masked
    by :meth:`RespUrl.redacted`, so a live run and ``--from`` show the same URLs and neither a secret.

    Targets are parsed URLs, so every real one parses; a string that does not
    is kept only when it cannot hold a password (no ``@``).
    """
    try:
        parsed = parse_resp_url(url)
        return url if parsed.password is None else parsed.redacted()
    except InvalidUrl:
        return url if "@" not in url else "(unparseable URL with credentials: not stored)"


def save_capture(capture: Capture, out_dir: Path | str) -> Path:
    """Write ``capture`` under ``out_dir`` (created); refuses to overwrite another capture."""
    out = Path(out_dir)
    if (out / CAPTURE_FILE).exists():
        raise InvalidInput(f"{out} already holds a capture ({CAPTURE_FILE}); choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    meta_samples = []
    for i, s in enumerate(capture.samples):
        sdir = out / f"sample-{i:03d}"
        sdir.mkdir(exist_ok=True)
        engines: list[str | None] = []
        valkey: list[str | None] = []
        for j, text in enumerate(s.engines):
            name = None if text is None else f"{sdir.name}/engine-{j}.txt"
            if name:
                write_atomic(out / name, text)
            engines.append(name)
        for j, info in enumerate(s.valkey):
            name = None if info is None else f"{sdir.name}/valkey-{j}.json"
            if name:
                write_atomic(out / name, json.dumps(info, indent=1, sort_keys=True, default=str) + "\n")
            valkey.append(name)
        meta_samples.append(
            {
                "t_s": s.t_s,
                "engines": engines,
                "valkey": valkey,
                "engine_t_s": [s.engine_time(j) for j in range(len(s.engines))],
                "valkey_t_s": [s.valkey_time(j) for j in range(len(s.valkey))],
                "engine_errors": [s.engine_error(j) for j in range(len(s.engines))],
                "valkey_errors": [s.valkey_error(j) for j in range(len(s.valkey))],
                "gpu": s.gpu.to_dict(),
                **({"engines_only": True} if s.engines_only else {}),
            }
        )
    meta = {
        "format": FORMAT_VERSION,
        "kvctl_version": capture.kvctl_version,
        "created_at": capture.created_at,
        "engine_urls": [masked(u) for u in capture.engine_urls],
        "valkey_urls": [masked_valkey_url(u) for u in capture.valkey_urls],
        "parameters": capture.parameters,
        "samples": meta_samples,
    }
    if capture.instances_per_rank > 1:
        meta["instances_per_rank"] = capture.instances_per_rank
    if capture.engine_states is not None:
        meta["engine_states"] = list(capture.engine_states)
    if capture.notes:
        meta["notes"] = list(capture.notes)
    write_atomic(out / CAPTURE_FILE, json.dumps(meta, indent=2) + "\n")  # last: its presence means a whole capture
    return out


def load_capture(in_dir: Path | str) -> Capture:
    """Read a directory written by :func:`save_capture`; InvalidInput naming what is wrong."""
    d = Path(in_dir)
    path = d / CAPTURE_FILE
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise InvalidInput(f"{d} holds no capture ({CAPTURE_FILE} missing); make one with `kvctl diagnose capture --out {d}`") from e
    except (OSError, ValueError) as e:
        raise InvalidInput(f"cannot read capture {path}: {e}") from e
    if not isinstance(meta, dict):
        raise InvalidInput(f"capture {path} is not a JSON object")
    fmt = meta.get("format")
    if isinstance(fmt, bool) or fmt not in READABLE_FORMATS:
        raise InvalidInput(
            f"capture {d} has format {fmt!r}; this kvctl ({__version__}) reads formats {', '.join(map(str, READABLE_FORMATS))}"
            + (": upgrade kvctl to analyse it" if isinstance(fmt, int) and fmt > FORMAT_VERSION else "")
        )
    root = d.resolve()

    def inside(name: Any) -> Path:
        """A file named by the capture, refused unless it lies inside the capture directory."""
        if not isinstance(name, str) or not name:
            raise InvalidInput(f"capture {d} names a file as {name!r}")
        p = (d / name).resolve()
        if p != root and root not in p.parents:
            raise InvalidInput(f"capture {d} names {name!r}, outside the capture directory: refused")
        return p

    def number(x: Any, what: str) -> float:
        v = float(x)
        if v != v or v in (float("inf"), float("-inf")):
            raise InvalidInput(f"capture {d}: {what} is {x!r}, not a finite time")
        return v

    try:
        samples = []
        for s in meta["samples"]:
            engines = [None if n is None else inside(n).read_text() for n in s["engines"]]
            valkey = [None if n is None else json.loads(inside(n).read_text()) for n in s["valkey"]]
            samples.append(
                Sample(
                    number(s["t_s"], "t_s"),
                    engines,
                    valkey,
                    GpuSample.from_dict(s.get("gpu")),
                    engine_t_s=[None if t is None else number(t, "engine_t_s") for t in s.get("engine_t_s") or []],
                    valkey_t_s=[None if t is None else number(t, "valkey_t_s") for t in s.get("valkey_t_s") or []],
                    engine_errors=[None if e is None else str(e) for e in s.get("engine_errors") or []],
                    valkey_errors=[None if e is None else str(e) for e in s.get("valkey_errors") or []],
                    engines_only=s.get("engines_only") is True,
                )
            )
        cap = Capture(
            [masked(str(u)) for u in meta["engine_urls"]],
            list(meta["valkey_urls"]),
            samples,
            dict(meta.get("parameters") or {}),
            str(meta.get("created_at", "")),
            str(meta.get("kvctl_version", "")),
            _instances_per_rank(meta.get("instances_per_rank", 1), len(meta["valkey_urls"]), d),
            None if meta.get("engine_states") is None else [int(n) for n in meta["engine_states"]],
            [str(n) for n in meta.get("notes") or []],
        )
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InvalidInput(f"capture {d} is incomplete or corrupt: {e}") from e
    if len(cap.samples) < 2:
        raise InvalidInput(f"capture {d} has {len(cap.samples)} sample(s); a diagnosis needs two")
    return cap


def _instances_per_rank(k: Any, n_urls: int, d: Path) -> int:
    """The capture's K: a whole number in 1..64 that divides its instances, else InvalidInput."""
    from kvctl.connector.urls import MAX_INSTANCES_PER_RANK  # noqa: PLC0415

    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_INSTANCES_PER_RANK or n_urls % k:
        raise InvalidInput(f"capture {d}: instances_per_rank is {k!r}, not a whole number in 1..{MAX_INSTANCES_PER_RANK} "
                           f"dividing its {n_urls} Valkey instance(s)")
    return k


def kvctl_home() -> Path:
    """kvctl's state directory: $KVCTL_HOME, else ~/.kvctl."""
    return Path(os.environ.get("KVCTL_HOME") or Path.home() / ".kvctl")


def save_last_diagnosis(data: dict[str, Any]) -> Path:
    """Keep a diagnosis (JSON form) as its tier's, for ``kvctl loading sync`` and ``kvctl doctor`` (:mod:`kvctl.diagnose.saved`:
    one per tier, 0600, it names URLs); the path it is kept at."""
    from kvctl.diagnose import saved  # noqa: PLC0415

    return saved.save(data)


def last_diagnosis_path() -> Path:
    """The latest diagnosis of any tier, for a person to read: kvctl itself reads its tier's (:func:`kvctl.diagnose.saved.find`)."""
    return kvctl_home() / LAST_DIAGNOSIS
