"""A local per-rank tier: start W × K ``valkey-server`` processes, report on them, stop them.

K instances per rank (``UpRequest.instances_per_rank``, default 1): instance ``i`` of rank ``r`` is
number ``n = r*K + i`` of the tier (:func:`kvctl.connector.urls.flat_instance`), listens on
``base_port + n`` and writes ``valkey-<r>-<i>.{conf,log,pid}`` (``valkey-<r>.*`` when K is 1); the
total ``maxmemory`` is split over all W × K instances and the io-threads default divides the cores
among them. The state file records each instance's rank and instance index.

``up`` is all or nothing; ``down`` signals only processes whose pid, command
line and start time match what ``up`` recorded in the tier's state file
(``kvctl-tier.json``, read by ``bench``/``diagnose`` through
:func:`kvctl.tier.targets.load_tier`).

``up`` records each instance in the state file the moment its process
exists, so whatever kills ``up`` (even SIGKILL), ``down`` finds what it had
started. ``up`` and ``down`` hold an exclusive lock on the directory
(``.kvctl-tier.lock``, released by the kernel when the process dies), so a
second ``up`` into the same directory is refused instead of racing.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator, Sequence

import psutil

from kvctl.connector.urls import MAX_INSTANCES_PER_RANK, flat_instance
from kvctl.core.errors import InvalidInput, KvctlError
from kvctl.tier import spec
from kvctl.tier.server import (
    ValkeyProcess,
    check_bind_address,
    find_valkey_server,
    port_in_use,
    server_version,
    start_valkey,
)
from kvctl.core.thresholds import TIER_MAXMEMORY
from kvctl.tier.targets import STATE_FILE, InstanceState, TierState, instance_name, load_tier, state_path

ENGINE_PASSWORD_FILE = "engine.password"
LOCK_FILE = ".kvctl-tier.lock"
#: Valkey refuses more io-threads than this (Valkey 8: "between 1 and 256").
MAX_IO_THREADS = 256

#: Called as ``on_progress(name, port)`` after each instance answers PING (or stops); name: ``rank 2`` or
#: ``rank 2 instance 1`` (:func:`kvctl.tier.targets.instance_name`).
Progress = Callable[[str, int], None]


@dataclass(frozen=True)
class UpRequest:
    """Everything ``deploy-valkey up`` needs to start a local tier."""

    dir: Path
    ranks: int
    base_port: int
    maxmemory: str | int = TIER_MAXMEMORY
    host: str = "127.0.0.1"
    io_threads: int | None = None
    password_file: str | None = None
    insecure_no_auth: bool = False
    instances_per_rank: int = 1

    @property
    def instances(self) -> int:
        return self.ranks * self.instances_per_rank


def _check_request(req: UpRequest) -> None:
    """Everything that can be refused before anything is written or started."""
    if req.ranks < 1:
        raise InvalidInput(f"--ranks must be at least 1, got {req.ranks}")
    if not 1 <= req.instances_per_rank <= MAX_INSTANCES_PER_RANK:
        raise InvalidInput(f"--instances-per-rank must be in 1..{MAX_INSTANCES_PER_RANK}, got {req.instances_per_rank}")
    if not 1 <= req.base_port or req.base_port + req.instances - 1 > 65535:
        raise InvalidInput(f"ports {req.base_port}..{req.base_port + req.instances - 1} are outside 1..65535")
    if req.io_threads is not None and not 1 <= req.io_threads <= MAX_IO_THREADS:
        raise InvalidInput(f"--io-threads must be between 1 and {MAX_IO_THREADS} (Valkey's limit), got {req.io_threads}")
    total = spec.parse_size(req.maxmemory)
    host_total = psutil.virtual_memory().total
    if total > host_total:
        raise InvalidInput(
            f"--maxmemory {req.maxmemory} ({spec.format_size(total)}) is more than this host's {spec.format_size(host_total)} of memory"
        )


class TierBusy(KvctlError):
    """Another kvctl process holds the tier directory's lock."""


@contextlib.contextmanager
def tier_lock(tier_dir: Path, what: str) -> Iterator[None]:
    """Hold the directory's exclusive lock (non-blocking): TierBusy naming the holder's pid if taken."""
    tier_dir.mkdir(parents=True, exist_ok=True)
    path = tier_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip().replace(" ", ", ", 1) or "?"
            raise TierBusy(
                f"another kvctl (pid {holder}) is working on the tier in {tier_dir} right now; "
                f"wait for it to finish, or use another --dir for a second tier"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {what}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def _identity(proc: psutil.Process) -> tuple[list[str], float]:
    return proc.cmdline(), round(proc.create_time(), 2)


def is_our_server(inst: InstanceState) -> psutil.Process | None:
    """The live process of ``inst`` when pid, command line and start time all match; else None."""
    if inst.pid <= 0:
        return None
    try:
        proc = psutil.Process(inst.pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        cmdline, created = _identity(proc)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    if not cmdline or "valkey-server" not in cmdline[0]:
        return None
    if inst.create_time and abs(created - inst.create_time) > 0.05:
        return None
    if inst.cmdline and cmdline[0].split()[0] != inst.cmdline[0].split()[0]:
        return None
    return proc


def not_running(instances: Sequence[InstanceState]) -> list[InstanceState]:
    """The instances of a local tier whose valkey-server is gone (stopped by `down`, killed, rebooted)."""
    return [i for i in instances if is_our_server(i) is None]


def _live_instances(tier_dir: Path) -> list[InstanceState]:
    if not state_path(tier_dir).exists():
        return []
    try:
        state = load_tier(tier_dir)
    except InvalidInput as e:
        raise InvalidInput(f"{tier_dir} holds an unreadable {STATE_FILE}; remove it or use another --dir ({e})") from e
    return [i for i in state.instances if is_our_server(i)]


def up(req: UpRequest, on_progress: Progress | None = None, check_ports_first: bool = True,
       held: list[ValkeyProcess] | None = None) -> TierState:
    """Start ``req.ranks`` × ``req.instances_per_rank`` instances on consecutive ports; all answer PING, or none is left running.

    ``check_ports_first`` (default) refuses before starting anything when a
    port is taken; without it a taken port is found while starting, and the
    instances already started are stopped again. ``held``: the servers stay this
    process's children (they die with it, PR_SET_PDEATHSIG) and their handles are
    appended here, for the caller to stop and reap even when the state file is gone
    (``kvctl drill``); without it they outlive this process (``deploy-valkey up``).
    """
    _check_request(req)
    per_instance = spec.split_maxmemory(req.maxmemory, req.ranks, req.instances_per_rank)
    io_threads = req.io_threads if req.io_threads is not None else spec.default_io_threads(ranks=req.instances)
    auth = spec.resolve_auth(req.host, req.password_file, req.insecure_no_auth)
    check_bind_address(req.host)
    binary = find_valkey_server()
    version = server_version(binary)
    tier_dir = req.dir.resolve()
    if tier_dir.exists() and not tier_dir.is_dir():
        raise InvalidInput(f"--dir {req.dir} is not a directory")
    created = not tier_dir.exists()
    try:
        with tier_lock(tier_dir, "deploy-valkey up"):
            return _up_locked(req, tier_dir, per_instance, io_threads, auth, binary, version, on_progress, check_ports_first, held)
    except BaseException:
        if created:  # leave no trace of a refused or failed `up` in a directory it made
            (tier_dir / LOCK_FILE).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                tier_dir.rmdir()
        raise


def _up_locked(
    req: UpRequest,
    tier_dir: Path,
    per_instance: int,
    io_threads: int,
    auth: spec.Auth,
    binary: str,
    version: str,
    on_progress: Progress | None,
    check_ports_first: bool,
    held: list[ValkeyProcess] | None = None,
) -> TierState:
    live = _live_instances(tier_dir)
    if live:
        ports = ", ".join(str(i.port) for i in live)
        raise KvctlError(f"{req.dir} already runs a tier (ports {ports}); stop it with `kvctl deploy-valkey down --dir {req.dir}` or use another --dir")
    k = req.instances_per_rank
    layout = [(r, i, req.base_port + flat_instance(r, i, k)) for r in range(req.ranks) for i in range(k)]
    if check_ports_first:
        for rank, inst, port in layout:
            if port_in_use(port, req.host):
                raise KvctlError(f"{instance_name(rank, inst, k)}: port {req.host}:{port} is already in use; nothing was started (pick another --base-port)")
    engine_password = None
    engine_password_file = None
    if auth.enabled:
        engine_password = spec.new_engine_password()
        engine_password_file = tier_dir / ENGINE_PASSWORD_FILE
        spec.write_secret(engine_password_file, engine_password + "\n")
    started: list[ValkeyProcess] = []
    state = TierState(
        dir=str(tier_dir),
        instances=[],
        binary=binary,
        server_version=version,
        maxmemory_total=per_instance * req.instances,
        password_file=auth.password_file,
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        maxmemory_per_instance=per_instance,
        io_threads=io_threads,
        engine_user=spec.ENGINE_USER if auth.enabled else None,
        engine_password_file=str(engine_password_file) if engine_password_file else None,
        complete=False,
        instances_per_rank=k,
    )
    try:
        for rank, inst, port in layout:
            name = instance_name(rank, inst, k)
            stem = f"valkey-{rank}" if k == 1 else f"valkey-{rank}-{inst}"
            settings = spec.cache_settings(per_instance, io_threads, auth, engine_password)
            settings["pidfile"] = str(tier_dir / f"{stem}.pid")
            settings["logfile"] = str(tier_dir / f"{stem}.log")

            def record(proc: ValkeyProcess, rank: int = rank, inst: int = inst, name: str = name, settings: dict = settings) -> None:
                """Into the state file before waiting for PING: a killed `up` leaves nothing `down` cannot find."""
                started.append(proc)
                try:
                    cmdline, created = _identity(psutil.Process(proc.pid))
                except psutil.NoSuchProcess as e:
                    raise KvctlError(f"{name} ({req.host}:{proc.port}) exited right after start; see {settings['logfile']}") from e
                state.instances.append(
                    InstanceState(
                        rank=rank,
                        host=req.host,
                        port=proc.port,
                        pid=proc.pid,
                        url=proc.url,
                        config=str(proc.config_path),
                        logfile=str(settings["logfile"]),
                        pidfile=str(settings["pidfile"]),
                        cmdline=[c for c in cmdline if c],
                        create_time=created,
                        instance=inst,
                    )
                )
                state.write()

            try:
                start_valkey(
                    tier_dir,
                    port=port,
                    host=req.host,
                    settings=settings,
                    binary=binary,
                    password=auth.password,
                    config_path=tier_dir / f"{stem}.conf",
                    detach=True,
                    on_spawn=record,
                    die_with_parent=held is not None,
                )
            except KvctlError as e:
                if started and started[-1].port == port:
                    started.pop()  # start_valkey already stopped it
                if state.instances and state.instances[-1].port == port:
                    state.instances.pop()
                raise KvctlError(f"{name} ({req.host}:{port}) failed to start: {e}") from e
            if on_progress:
                on_progress(name, port)
        state.complete = True
        state.write()
    except BaseException as e:
        for proc in reversed(started):
            proc.stop()
        state_path(tier_dir).unlink(missing_ok=True)  # everything it listed is stopped
        if engine_password_file is not None:
            engine_password_file.unlink(missing_ok=True)
        if isinstance(e, KvctlError) and started:
            raise KvctlError(f"{e} (stopped the {len(started)} instance(s) already started)") from e
        raise
    for proc in started:
        if held is None:
            proc._popen = None  # the servers outlive this process; `down` stops them by pid
        else:
            held.append(proc)
    return state


# ----------------------------------------------------------------------------- down


@dataclass(frozen=True)
class StopResult:
    rank: int
    port: int
    pid: int
    result: str  # stopped | killed | not running | not ours
    port_free: bool
    instance: int = 0
    name: str = ""  # "rank 2", or "rank 2 instance 1"


def _exited(proc: psutil.Process, timeout_s: float) -> bool:
    """Whether ``proc`` ends within ``timeout_s``; a zombie counts as ended.

    ``psutil.Process.wait`` on a process that is not our child (a server
    whose ``up`` has exited) lasts until init reaps it, which some inits do
    only every few seconds: that would stretch every ``--timeout``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def _stop(proc: psutil.Process, timeout_s: float) -> str:
    """SIGTERM, then SIGKILL after ``timeout_s``: "stopped" or "killed"."""
    try:
        proc.send_signal(signal.SIGCONT)  # a SIGSTOPped server cannot exit
        proc.send_signal(signal.SIGTERM)
    except psutil.NoSuchProcess:
        return "stopped"
    if _exited(proc, timeout_s):
        return "stopped"
    with contextlib.suppress(psutil.NoSuchProcess):
        proc.kill()
    _exited(proc, 5.0)
    return "killed"


def _wait_port_free(host: str, port: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while port_in_use(port, host):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def down(tier_dir: Path | str, purge: bool = False, timeout_s: float = 10.0, on_progress: Progress | None = None) -> list[StopResult]:
    """Stop every instance ``up`` started here; a dead or foreign pid is reported and skipped.

    Each instance gets SIGTERM and ``timeout_s`` to exit, then SIGKILL ("killed").
    """
    state = load_tier(tier_dir)
    with tier_lock(Path(state.dir), "deploy-valkey down"):
        return _down_locked(state, purge, timeout_s, on_progress)


def _down_locked(state: TierState, purge: bool, timeout_s: float, on_progress: Progress | None) -> list[StopResult]:
    results = []
    k = state.instances_per_rank
    for inst in state.in_tier_order():
        proc = is_our_server(inst)
        if proc is None:
            outcome = "not ours" if inst.pid > 0 and _pid_not_zombie(inst.pid) else "not running"
        else:
            outcome = _stop(proc, timeout_s)
        free = _wait_port_free(inst.host, inst.port, 2.0 if outcome != "not ours" else 0.0)
        name = instance_name(inst.rank, inst.instance, k)
        results.append(StopResult(inst.rank, inst.port, inst.pid, outcome, free, inst.instance, name))
        if on_progress:
            on_progress(name, inst.port)
    if purge:
        _purge(Path(state.dir), state)
    return results


def _pid_not_zombie(pid: int) -> bool:
    """True when ``pid`` is a live process (one we may not inspect counts as live)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def _purge(tier_dir: Path, state: TierState) -> None:
    """Remove what ``up`` wrote: configs, logs, pidfiles, the engine password, the state file."""
    paths = [Path(p) for i in state.instances for p in (i.config, i.logfile, i.pidfile)]
    if state.engine_password_file:
        paths.append(Path(state.engine_password_file))
    paths += [state_path(tier_dir), tier_dir / LOCK_FILE]
    for p in paths:
        p.unlink(missing_ok=True)
    try:
        tier_dir.rmdir()  # only when nothing else lives there
    except OSError:
        pass

