"""One ``kvctl bench``: what it is asked (:class:`BenchRequest`) sized, specified, run and reported.

:func:`bench` reads the tier's own chunk size when none is given (a few random keys per instance), sizes the
chunk and the verdict's s (:mod:`kvctl.bench.sizing`), builds and checks the :class:`~kvctl.bench.spec.BenchSpec`
of every grid (:func:`make_spec`; the host's warnings go to ``warn``), sizes ``--embedded`` servers within the
host's memory and starts them, and runs the bench (:func:`kvctl.bench.runner.run_bench`) with its progress
through a :class:`ProgressTracker`. :func:`report_data` is the report as JSON (``--json``, ``--save``).

No click and no drawing: the caller gives ``progress`` (a bar of a total of seconds) and ``warn``, and sets
``stop_requested`` to stop (the CLI does on SIGINT/SIGTERM).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Sequence

from kvctl.core.errors import InvalidInput
from kvctl.core.files import write_atomic

if TYPE_CHECKING:
    from kvctl.bench.results import BenchReport
    from kvctl.bench.spec import BenchSpec
    from kvctl.tier.targets import Target

#: ``advance(seconds, description=..., step=...)``: one step of a progress bar (kvctl.core.render.progress)
Advance = Callable[..., None]
#: where the tier's own chunks came from, when the bench measured values of their size
TIER_CHUNKS = "the largest of a few random keys per instance (the chunks the tier holds)"


@dataclass(frozen=True)
class BenchRequest:
    """The options of ``kvctl bench``, parsed (every field as the option gives it)."""

    targets: tuple[Target, ...]  # the instances named (--valkey, --dir); () with embedded
    embedded: int | None  # start this many local servers for the run
    embedded_maxmemory: int | None  # the --embedded tier's TOTAL, split evenly; None: sized within half the host's available memory
    chunk_bytes: float | None  # None: --model-config's chunk, else the tier's own, else the paper's
    model_config: str | None
    chunk_tokens: int
    dtype: str | None
    tp: int
    batch: int
    fit_batch: bool  # --batch not given: a batch the instances' maxmemory fits
    clients: int | None
    duration_s: float
    keys: int | None
    write: bool
    sweep: bool
    engines: int | None
    timeout_s: float
    seed: int
    prefill_rate: float | None
    bytes_per_token: float | None


@dataclass(frozen=True)
class BenchOutcome:
    report: BenchReport
    chunk_bytes: float  # the value size benched
    chunk_source: str | None  # where that size came from, when it was read off the tier


class ProgressTracker:
    """The runner's progress, ``(label, elapsed, duration, live GB/s)`` per run, as steps of one bar counted in
    seconds: each run advances the bar by the seconds it ran; a run that ended early is completed when the next
    one starts, so the bar ends full."""

    def __init__(self, advance: Advance) -> None:
        self._advance = advance
        self._label: str | None = None
        self._elapsed = 0.0

    def __call__(self, label: str, elapsed: float, duration_s: float, live_gbps: float) -> None:
        if label != self._label:
            if self._label is not None:
                self._advance(max(0.0, duration_s - self._elapsed))
            self._label, self._elapsed = label, 0.0
        self._advance(max(0.0, elapsed - self._elapsed), description=f"{label}: {live_gbps:.2f} GB/s", step=label)
        self._elapsed = max(self._elapsed, elapsed)


def make_spec(req: BenchRequest, chunk_bytes: float, instances: int, keys: int | None) -> tuple[BenchSpec, list[str]]:
    """The checked spec of a bench over ``instances`` instances (InvalidInput when it cannot run), and what the host
    warns of (cores, memory) for it."""
    import psutil  # noqa: PLC0415

    from kvctl.bench.spec import BenchSpec, check_host  # noqa: PLC0415

    spec = BenchSpec(chunk_bytes=chunk_bytes, batch=req.batch, clients=req.clients or (instances if req.sweep else 1), duration_s=req.duration_s,
                     keys=keys, write=req.write, sweep=req.sweep, timeout_s=req.timeout_s, seed=req.seed, engines=req.engines or 0,
                     fit_batch=req.fit_batch)  # fmt: skip
    spec.check()
    return spec, check_host(instances, spec, os.cpu_count() or 1, psutil.virtual_memory().available)


def bench(req: BenchRequest, *, progress: Callable[[float], ContextManager[Advance]], warn: Callable[[str], None] = lambda text: None,
          stop_requested: threading.Event | None = None) -> BenchOutcome:
    """Run the bench ``req`` asks for; ``progress(total_s)`` draws its bar, ``warn`` says what the host warns of.

    Call it from the main thread: the processes it starts (clients, their forkserver, ``--embedded`` servers)
    die with the thread that started them, SIGKILL included (:mod:`kvctl.bench.guard`)."""
    import psutil  # noqa: PLC0415

    from kvctl.bench.runner import embedded_tier, run_bench, url_with_password  # noqa: PLC0415
    from kvctl.bench.sizing import bench_sizes  # noqa: PLC0415
    from kvctl.bench.spec import grid, size_embedded  # noqa: PLC0415
    from kvctl.tier.spec import split_maxmemory  # noqa: PLC0415

    chunk_bytes, chunk_source = req.chunk_bytes, None
    if req.targets and chunk_bytes is None and not req.model_config:  # the tier's own chunks, when its engines stored some
        from kvctl.bench.info import tier_chunk_bytes  # noqa: PLC0415

        with contextlib.suppress(Exception):  # an instance that does not answer is the bench's to report
            chunk_bytes = tier_chunk_bytes([url_with_password(t) for t in req.targets], req.timeout_s)
        chunk_source = TIER_CHUNKS if chunk_bytes else None
    sizes = bench_sizes(chunk_bytes, req.model_config, req.dtype, req.chunk_tokens, req.tp, req.bytes_per_token, req.prefill_rate)
    chunk, params = sizes.chunk_bytes, dict(sizes.parameters)
    if chunk_source:
        params["chunk_source"] = chunk_source

    def go(targets: Sequence[Target], keys: int | None) -> BenchReport:
        spec, warnings = make_spec(req, chunk, len(targets), keys)
        for w in warnings:
            warn(w)
        n_runs = len(grid(len(targets), spec)) * (2 if req.write else 1)
        with progress(n_runs * req.duration_s) as advance:
            return run_bench(targets, spec, ProgressTracker(advance), sizes.bytes_per_token, req.prefill_rate, params, stop_requested=stop_requested)

    if not req.embedded:
        return BenchOutcome(go(req.targets, req.keys), chunk, chunk_source)
    keys = req.keys
    if req.embedded_maxmemory is None:
        sizing = size_embedded(req.embedded, make_spec(req, chunk, req.embedded, keys)[0], psutil.virtual_memory().available)
        maxmemory, keys = sizing.maxmemory_bytes, sizing.keys
    else:  # the tier's total, as deploy-valkey up's --maxmemory
        maxmemory = split_maxmemory(req.embedded_maxmemory, req.embedded)
    params["embedded_maxmemory_bytes"] = maxmemory * req.embedded
    params["embedded_maxmemory_per_instance_bytes"] = maxmemory
    with embedded_tier(req.embedded, maxmemory) as targets:
        return BenchOutcome(go(targets, keys), chunk, chunk_source)


def report_data(report: BenchReport, interrupted_by: str | None = None) -> dict[str, Any]:
    """The report as JSON (``--json``, ``--save``): its fields, its errors, and the signal that stopped it, if one did."""
    from kvctl.core.render import to_jsonable  # noqa: PLC0415

    data = to_jsonable(report)
    data["errors"] = report.errors
    data["interrupted"] = interrupted_by
    return data


def say_unknown_keys(data: Any, where: str) -> None:
    """A key of a ``bench --save`` file (top level, or of a run) that no reader knows: one warning each, with the
    nearest key (a hand edit, or another kvctl's file; the readers go on without it)."""
    import dataclasses  # noqa: PLC0415
    import logging  # noqa: PLC0415

    from kvctl.bench.results import BenchReport, RunResult  # noqa: PLC0415
    from kvctl.core.known_keys import log_unknown, unknown  # noqa: PLC0415

    if not isinstance(data, dict):
        return
    found = unknown(data, {f.name for f in dataclasses.fields(BenchReport)} | {"errors"}, where)
    for n, run in enumerate(data.get("runs") if isinstance(data.get("runs"), list) else []):
        if isinstance(run, dict):
            found += unknown(run, {f.name for f in dataclasses.fields(RunResult)}, where, f"runs[{n}].")
    log_unknown(found, logging.getLogger(__name__), "ignored")


def save(path: str, data: dict[str, Any]) -> None:
    """``--save``: the JSON written atomically (NaN and Infinity as null), InvalidInput when it cannot be."""
    from kvctl.core.render import finite_json  # noqa: PLC0415

    try:
        write_atomic(path, json.dumps(finite_json(data), indent=2, allow_nan=False) + "\n")
    except OSError as e:
        raise InvalidInput(f"cannot write --save {path}: {e.strerror or e}") from e
