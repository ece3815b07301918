"""Samples of an engine and its tier, taken live or saved to / loaded from a directory.

A capture is what ``kvctl diagnose`` analyses: two (or more) samples, each
holding every engine's ``/metrics`` text, every Valkey instance's ``INFO``
and the GPU utilisation, plus timestamps and the parameters given. Live runs
and ``--from DIR`` go through the same :class:`Capture`, so a saved capture
analyses exactly as the live run did.

Directory layout::

    DIR/capture.json               metadata, parameters, per-sample time and GPU
    DIR/sample-000/engine-0.txt    engine 0's /metrics text, first sample
    DIR/sample-000/valkey-0.json   rank 0's INFO, first sample
    DIR/sample-001/...
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from kvctl import __version__
from kvctl.diagnose import sources
from kvctl.diagnose.sources import GpuSample
from kvctl.errors import InvalidInput
from kvctl.tier.targets import Target

CAPTURE_FILE = "capture.json"
FORMAT_VERSION = 1
LAST_DIAGNOSIS = "last-diagnosis.json"


@dataclass
class Sample:
    t_s: float  # wall-clock seconds (time.time()) in the middle of the scrape
    engines: list[str]  # /metrics text, one per engine URL
    valkey: list[dict[str, Any]]  # INFO, one per instance (index = rank)
    gpu: GpuSample = field(default_factory=GpuSample)


@dataclass
class Capture:
    engine_urls: list[str]
    valkey_urls: list[str]
    samples: list[Sample]
    parameters: dict[str, Any] = field(default_factory=dict)
    created_at: str = ""
    kvctl_version: str = __version__


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def take_sample(engine_urls: Sequence[str], targets: Sequence[Target], timeout_s: float = 5.0) -> Sample:
    """Scrape every engine and instance once (Unreachable on the first that does not answer)."""
    t0 = time.time()
    texts = [sources.fetch_metrics(u, timeout_s) for u in engine_urls]
    infos = [sources.valkey_info(t, timeout_s) for t in targets]
    gpu = sources.gpu_sample()
    return Sample((t0 + time.time()) / 2, texts, infos, gpu)


def collect(
    engine_urls: Sequence[str],
    targets: Sequence[Target],
    window_s: float,
    parameters: dict[str, Any] | None = None,
    tick: Callable[[float], None] | None = None,
    timeout_s: float = 5.0,
) -> Capture:
    """Two samples ``window_s`` apart; ``tick(seconds)`` is called while waiting (progress)."""
    if window_s <= 0:
        raise InvalidInput(f"--window must be positive, got {window_s}")
    first = take_sample(engine_urls, targets, timeout_s)
    wait_until(first.t_s + window_s, tick)
    second = take_sample(engine_urls, targets, timeout_s)
    return Capture(list(engine_urls), [t.url for t in targets], [first, second], dict(parameters or {}), now_iso())


def wait_until(deadline: float, tick: Callable[[float], None] | None = None, step_s: float = 0.1) -> None:
    """Sleep until wall time ``deadline`` in small steps, reporting each to ``tick``."""
    while True:
        left = deadline - time.time()
        if left <= 0:
            return
        dt = min(step_s, left)
        time.sleep(dt)
        if tick:
            tick(dt)


def _redact(url: str) -> str:
    """Drop any password from a URL before it is written to disk."""
    if "@" not in url or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    auth, host = rest.rsplit("@", 1)
    return f"{scheme}://{auth.split(':', 1)[0]}:***@{host}" if ":" in auth else url


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
        engines, valkey = [], []
        for j, text in enumerate(s.engines):
            name = f"{sdir.name}/engine-{j}.txt"
            (out / name).write_text(text)
            engines.append(name)
        for j, info in enumerate(s.valkey):
            name = f"{sdir.name}/valkey-{j}.json"
            (out / name).write_text(json.dumps(info, indent=1, sort_keys=True, default=str) + "\n")
            valkey.append(name)
        meta_samples.append({"t_s": s.t_s, "engines": engines, "valkey": valkey, "gpu": s.gpu.to_dict()})
    meta = {
        "format": FORMAT_VERSION,
        "kvctl_version": capture.kvctl_version,
        "created_at": capture.created_at,
        "engine_urls": capture.engine_urls,
        "valkey_urls": [_redact(u) for u in capture.valkey_urls],
        "parameters": capture.parameters,
        "samples": meta_samples,
    }
    tmp = out / (CAPTURE_FILE + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, out / CAPTURE_FILE)
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
    try:
        samples = []
        for s in meta["samples"]:
            engines = [(d / name).read_text() for name in s["engines"]]
            valkey = [json.loads((d / name).read_text()) for name in s["valkey"]]
            samples.append(Sample(float(s["t_s"]), engines, valkey, GpuSample.from_dict(s.get("gpu"))))
        cap = Capture(
            list(meta["engine_urls"]),
            list(meta["valkey_urls"]),
            samples,
            dict(meta.get("parameters") or {}),
            str(meta.get("created_at", "")),
            str(meta.get("kvctl_version", "")),
        )
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InvalidInput(f"capture {d} is incomplete or corrupt: {e}") from e
    if len(cap.samples) < 2:
        raise InvalidInput(f"capture {d} has {len(cap.samples)} sample(s); a diagnosis needs two")
    return cap


def kvctl_home() -> Path:
    """kvctl's state directory: $KVCTL_HOME, else ~/.kvctl."""
    return Path(os.environ.get("KVCTL_HOME") or Path.home() / ".kvctl")


def save_last_diagnosis(data: dict[str, Any]) -> Path:
    """Keep the latest diagnosis (JSON form) for ``kvctl loading``'s safety check."""
    home = kvctl_home()
    home.mkdir(parents=True, exist_ok=True)
    path = home / LAST_DIAGNOSIS
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def last_diagnosis_path() -> Path:
    return kvctl_home() / LAST_DIAGNOSIS
