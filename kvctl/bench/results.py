"""Typed bench results and the functions that compute them (no rendering here).

Units are in field names: ``_gbps`` is 10^9 bytes/s, ``_ms`` milliseconds,
``_usec`` microseconds, ``_frac`` a fraction in [0, 1]. ``summarize_*``
functions are pure: they take raw worker results and server deltas.

An instance is instance ``instance`` of rank ``rank``; with K instances per rank a rank's
bandwidth is the sum over its K instances (``per_rank_gbps``: it loads from all of them at once).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from kvctl.core import cost
from kvctl.bench.info import ServerDelta
from kvctl.records.stats import mean, percentile
from kvctl.bench.worker import WorkerResult
from kvctl.tier.sizing import up_command
from kvctl.tier.targets import instance_name


@dataclass(frozen=True)
class InstanceRun:
    """One instance during one run: client side and server side."""

    rank: int
    url: str  # password redacted
    clients: int
    ops: int  # keys fetched (or written) in completed batches, hits + misses
    misses: int
    bytes: int
    client_gbps: float
    server_calls: int | None
    server_usec_per_call: float | None
    server_busy_frac: float | None
    server_gbps: float | None
    server_net_bytes: int | None
    errors: int
    first_error: str | None
    instance: int = 0  # which of its rank's instances
    name: str = ""  # "rank 2", or "rank 2 instance 1" (kvctl.tier.targets.instance_name)


@dataclass(frozen=True)
class RunResult:
    """One grid point: ``instances`` × ``clients`` (per instance) doing ``op``."""

    op: str  # "get" or "set"
    instances: int
    clients: int  # per instance
    chunk_bytes: int
    batch: int
    duration_s: float  # measured client window (start signal → last batch done)
    batches: int
    ops: int
    misses: int
    bytes: int
    aggregate_gbps: float
    per_instance_gbps: tuple[float, ...]
    p50_batch_ms: float | None
    p99_batch_ms: float | None
    mean_batch_ms: float | None
    max_batch_ms: float | None
    server_gbps: float | None  # sum over instances of server-side bytes / window
    server_usec_per_get: float | None  # all instances' GET usec / GET calls (None for SET runs)
    server_usec_per_set: float | None
    server_busy_frac: float | None  # the busiest instance's main-thread fraction in GET (or SET)
    errors: int
    per_instance: tuple[InstanceRun, ...]
    scaling_vs_1x1: float | None = None  # aggregate_gbps / the 1 instance × 1 client run of the same op
    engines: int | None = None  # bench --engines: engines sharing the instances (= clients per instance)
    per_engine: tuple[Any, ...] = ()  # kvctl.bench.engines.EngineRun, one per engine
    ranks: int = 0  # distinct ranks among the instances (= instances with one instance per rank)
    per_rank_gbps: tuple[float, ...] = ()  # per rank, the sum of its instances' client GB/s


@dataclass(frozen=True)
class Verdict:
    """Measured tier bandwidth against the break-even B* = s·R (paper §4).

    s is the whole model's bytes per token and is compared with the whole
    tier's bandwidth; each of the ``ranks`` instances serves s / ranks of every
    token (``bytes_per_token_per_rank``), compared with one instance's bandwidth.
    The two comparisons agree; a per-rank s against the tier's sum never appears.
    """

    bytes_per_token: float  # whole model (s)
    prefill_rate_tok_s: float
    breakeven_gbps: float  # s·R: the whole tier
    ranks: int  # ranks of the run judged (its instances, with one instance per rank)
    per_rank_gbps: float  # mean per-rank GET bandwidth of that run (a rank's: the sum over its instances)
    tier_gbps: float  # what one prompt sees when every rank loads its share at once
    per_rank_needed_gbps: float  # B* / ranks = (s / ranks)·R
    loading_wins: bool  # tier_gbps > B*, i.e. load_us_per_token < recompute_us_per_token
    text: str
    bytes_per_token_per_rank: float = 0.0  # s / ranks: one rank's share of every token
    load_us_per_token: float = 0.0  # s / tier bandwidth, µs
    recompute_us_per_token: float = 0.0  # 1 / R, µs
    instances: int = 0  # instances of the run judged (ranks × instances per rank)


@dataclass(frozen=True)
class BenchMetadata:
    date_utc: str
    kvctl_version: str
    server_versions: tuple[str, ...]
    host: str
    host_cores: int
    python: str
    parameters: dict[str, Any] = field(default_factory=dict)
    server_io_threads: tuple[int | None, ...] = ()  # each instance's io-threads (main thread included); None: not readable


@dataclass(frozen=True)
class BenchReport:
    metadata: BenchMetadata
    runs: tuple[RunResult, ...]
    verdict: Verdict | None = None
    interrupted: bool = False  # stopped early (SIGINT/SIGTERM): ``runs`` are those measured, the last maybe shortened
    runs_planned: int = 0
    advice: str | None = None  # the server change to make before adding instances (kvctl.bench.sizing.instance_advice)

    @property
    def errors(self) -> int:
        return sum(r.errors for r in self.runs)


def summarize_run(
    op: str,
    ranks: Sequence[int],
    urls: Sequence[str],
    clients: int,
    chunk_bytes: int,
    batch: int,
    workers: Sequence[WorkerResult],
    deltas: Sequence[ServerDelta | str],
    extra_errors: Sequence[Sequence[str]] = (),
    instances: Sequence[int] = (),
    instances_per_rank: int = 1,
) -> RunResult:
    """Combine the workers' raw results and each instance's server delta into a :class:`RunResult`.

    ``deltas[i]`` is instance i's counter delta, or the message saying why none
    could be read. ``extra_errors[i]`` lists failures the parent saw for
    instance i (a worker that never reported, ...). ``instances[i]``: which of
    rank ``ranks[i]``'s ``instances_per_rank`` instances it is (0 when not given).
    """
    n = len(ranks)
    per: list[InstanceRun] = []
    window = max((w.elapsed_s for w in workers), default=0.0)
    for i in range(n):
        ws = [w for w in workers if w.instance == i]
        extra = list(extra_errors[i]) if i < len(extra_errors) else []
        errors = sum(w.errors for w in ws) + len(extra)
        first = next((w.first_error for w in ws if w.first_error), None) or (extra[0] if extra else None)
        inst_window = max((w.elapsed_s for w in ws), default=0.0)
        nbytes = sum(w.bytes for w in ws)
        d = deltas[i] if i < len(deltas) else "no server snapshot"
        if isinstance(d, str):
            errors += 1
            first = first or d
            s_calls = s_usec_per = s_busy = s_gbps = s_bytes = None
        else:
            s_calls, s_usec_per, s_busy, s_gbps, s_bytes = d.calls, d.usec_per_call, d.busy_frac, d.gbps, d.net_bytes
        inst = instances[i] if i < len(instances) else 0
        per.append(
            InstanceRun(
                instance=inst,
                name=instance_name(ranks[i], inst, instances_per_rank),
                rank=ranks[i],
                url=urls[i],
                clients=clients,
                ops=sum(w.ops for w in ws),
                misses=sum(w.misses for w in ws),
                bytes=nbytes,
                client_gbps=nbytes / inst_window / cost.GB if inst_window > 0 else 0.0,
                server_calls=s_calls,
                server_usec_per_call=s_usec_per,
                server_busy_frac=s_busy,
                server_gbps=s_gbps,
                server_net_bytes=s_bytes,
                errors=errors,
                first_error=first,
            )
        )
    lat_ms = [s * 1e3 for w in workers for s in w.batch_s]
    total_bytes = sum(w.bytes for w in workers)
    good = [(p, d) for p, d in zip(per, deltas) if not isinstance(d, str)]
    calls = sum(d.calls for _, d in good)
    usec = sum(d.usec for _, d in good)
    usec_per = usec / calls if calls else None
    rank_ids = sorted(set(ranks))
    per_rank = tuple(sum(p.client_gbps for p in per if p.rank == r) for r in rank_ids)
    return RunResult(
        ranks=len(rank_ids),
        per_rank_gbps=per_rank,
        op=op,
        instances=n,
        clients=clients,
        chunk_bytes=chunk_bytes,
        batch=batch,
        duration_s=window,
        batches=sum(w.batches for w in workers),
        ops=sum(w.ops for w in workers),
        misses=sum(w.misses for w in workers),
        bytes=total_bytes,
        aggregate_gbps=total_bytes / window / cost.GB if window > 0 else 0.0,
        per_instance_gbps=tuple(p.client_gbps for p in per),
        p50_batch_ms=percentile(lat_ms, 50),
        p99_batch_ms=percentile(lat_ms, 99),
        mean_batch_ms=mean(lat_ms),
        max_batch_ms=max(lat_ms) if lat_ms else None,
        server_gbps=sum(p.server_gbps for p, _ in good) if good else None,
        server_usec_per_get=usec_per if op == "get" else None,
        server_usec_per_set=usec_per if op == "set" else None,
        server_busy_frac=max(p.server_busy_frac for p, _ in good) if good else None,
        errors=sum(p.errors for p in per),
        per_instance=tuple(per),
    )


def with_scaling(runs: Sequence[RunResult]) -> tuple[RunResult, ...]:
    """Each run's aggregate bandwidth relative to the 1 × 1 run of the same op (when there is one)."""
    from dataclasses import replace  # noqa: PLC0415

    base = {r.op: r.aggregate_gbps for r in runs if r.instances == 1 and r.clients == 1 and r.aggregate_gbps > 0}
    return tuple(replace(r, scaling_vs_1x1=(r.aggregate_gbps / base[r.op]) if r.op in base else None) for r in runs)


def summarize_verdict(runs: Sequence[RunResult], bytes_per_token: float, prefill_rate: float, first_step: str | None = None) -> Verdict | None:
    """Judge the GET run with the most instances (best aggregate among those) against B* = s·R.

    ``bytes_per_token`` is the WHOLE model's s (kvctl.core.kvsize ``bytes_per_token``,
    never the per-rank share): it is compared with the run's aggregate bandwidth. ``first_step``: the server change
    that gives each instance more (a newer Valkey, more io-threads), advised before more instances when recompute wins.
    """
    cost.require_positive("--bytes-per-token", bytes_per_token)
    cost.require_positive("--prefill-rate", prefill_rate)
    gets = [r for r in runs if r.op == "get" and r.aggregate_gbps > 0]
    if not gets:
        return None
    most = max(r.instances for r in gets)
    run = max((r for r in gets if r.instances == most), key=lambda r: r.aggregate_gbps)
    b_star = cost.breakeven_gbps(bytes_per_token, prefill_rate)
    ranks = run.ranks or run.instances
    per_rank = sum(run.per_instance_gbps) / ranks
    tier = run.aggregate_gbps
    wins = tier > b_star
    s_rank = bytes_per_token / ranks
    load_us, recompute_us = bytes_per_token / (tier * cost.GB) * 1e6, 1e6 / prefill_rate
    who = f"{run.instances} instance(s)" if ranks == run.instances else f"{ranks} rank(s) × {run.instances // ranks} instances"
    text = (
        f"{who} deliver {tier:.3f} GB/s per prompt ({per_rank:.3f} GB/s per rank); "
        f"B* = s·R = {bytes_per_token:,.0f} B × {prefill_rate:,.0f} tok/s = {b_star:.3f} GB/s for the tier, "
        f"i.e. {s_rank:,.0f} B/token × R = {b_star / ranks:.3f} GB/s per rank; "
        f"loading costs {load_us:.1f} µs/token against {recompute_us:.1f} µs to recompute: "
        + ("loading from the tier beats recompute for prompts above n* = R·T0." if wins else "recompute wins — every hit is slower than recomputing; "
              + (f"first {first_step}; then " if first_step else "") + "add instances (one per rank, then several per rank: "
              f"{up_command()}) or stop loading.")
    )
    return Verdict(
        bytes_per_token=bytes_per_token,
        prefill_rate_tok_s=prefill_rate,
        breakeven_gbps=b_star,
        ranks=ranks,
        per_rank_gbps=per_rank,
        tier_gbps=tier,
        per_rank_needed_gbps=b_star / ranks,
        loading_wins=wins,
        text=text,
        bytes_per_token_per_rank=s_rank,
        load_us_per_token=load_us,
        recompute_us_per_token=recompute_us,
        instances=run.instances,
    )
