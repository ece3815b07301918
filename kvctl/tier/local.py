"""A local per-rank tier: start W × K ``valkey-server`` processes, report on them, stop them.

K instances per rank (``UpRequest.instances_per_rank``, default 1): instance ``i`` of rank ``r`` is
number ``n = r*K + i`` of the tier (:func:`kvctl.connector.urls.flat_instance`), listens on
``base_port + n`` and writes ``valkey-<r>-<i>.{conf,log,pid}`` (``valkey-<r>.*`` when K is 1); the
total ``maxmemory`` is split over all W × K instances and the io-threads default divides this host's cores
among them (:func:`kvctl.tier.sizing.io_threads_for`; a 9.x server also gets its copy-free reply at those
threads). The state file records each instance's rank and instance index, the server's version and the io-threads.

``up`` is all or nothing. Each server runs in the tier's directory from its first instruction, and ``up``
records it in the state file (``kvctl-tier.json``, :mod:`kvctl.tier.state_file`, read by ``bench``/``diagnose``
too) the moment its process exists. ``down`` stops the valkey-servers working in the directory it is given
(:mod:`kvctl.tier.tier_dir`), recorded or not: whatever kills ``up`` (even SIGKILL between a spawn and its
record), ``down`` finds what it had started; a pid the state file names that is not a server of this
directory (a copied directory's, a reused pid) is reported and never signalled; and ``--purge`` removes only
the files ``up`` names in that directory, never a path a file in it names, and not while a server of the
directory still runs. ``up`` and ``down`` hold an exclusive lock on the directory (``.kvctl-tier.lock``,
released by the kernel when the process dies), so a second ``up`` into the same directory is refused instead
of racing, and an ``up`` removes a directory (and its lock file) only when it created the directory and
holds the lock.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Sequence

import psutil

from kvctl.connector.urls import MAX_INSTANCES_PER_RANK, flat_instance
from kvctl.core.errors import InvalidInput, KvctlError
from kvctl.tier import sizing, spec
from kvctl.tier.server import (
    ValkeyProcess,
    check_bind_address,
    find_valkey_server,
    format_version,
    free_base_port,
    port_in_use,
    server_version,
    start_valkey,
)
from kvctl.core.thresholds import BASE_PORT, DOWN_SETTLE_S, TIER_MAXMEMORY
from kvctl.tier.spec import MAX_IO_THREADS  # noqa: F401 - re-exported
from kvctl.tier.state_file import (  # noqa: F401 - re-exported for the tier's callers
    ENGINE_PASSWORD_FILE, LOCK_FILE, STATE_FILE, InstanceState, TierState, instance_stem, load_tier, state_path,
)
from kvctl.tier.targets import instance_name
from kvctl.tier.tier_dir import (  # noqa: F401 - re-exported for the tier's callers
    TierBusy, TierLock, is_our_server, is_valkey, listening_port, make_dir, pidfile_names, purge_files, servers_of, tier_lock,
    working_dir,
)

#: Called as ``on_progress(name, port)`` after each instance answers PING (or stops); name: ``rank 2`` or
#: ``rank 2 instance 1`` (:func:`kvctl.tier.targets.instance_name`).
Progress = Callable[[str, int], None]


@dataclass(frozen=True)
class UpRequest:
    """Everything ``deploy-valkey up`` needs to start a local tier."""

    dir: Path
    ranks: int
    base_port: int | None  # None: free loopback ports (:func:`pick_base_port`)
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
    spec.check_text(str(req.dir.resolve()), "--dir")  # the directory is written into every instance's config
    spec.check_host(req.host)
    if not 1 <= req.instances_per_rank <= MAX_INSTANCES_PER_RANK:
        raise InvalidInput(f"--instances-per-rank must be in 1..{MAX_INSTANCES_PER_RANK}, got {req.instances_per_rank}")
    if req.base_port is not None and (not 1 <= req.base_port or req.base_port + req.instances - 1 > 65535):
        raise InvalidInput(f"ports {req.base_port}..{req.base_port + req.instances - 1} are outside 1..65535")
    if req.io_threads is not None and not 1 <= req.io_threads <= MAX_IO_THREADS:
        raise InvalidInput(f"--io-threads must be between 1 and {MAX_IO_THREADS} (Valkey's limit), got {req.io_threads}")
    total = spec.parse_size(req.maxmemory)
    host_total = psutil.virtual_memory().total
    if total > host_total:
        raise InvalidInput(
            f"--maxmemory {req.maxmemory} ({spec.format_size(total)}) is more than this host's {spec.format_size(host_total)} of memory"
        )


def _identity(proc: psutil.Process) -> tuple[list[str], float]:
    return proc.cmdline(), round(proc.create_time(), 2)


#: how many runs of free ports :func:`pick_base_port` tries before it gives up
PICK_PORT_TRIES = 100


def pick_base_port(n: int, host: str = "127.0.0.1", preferred: int | None = BASE_PORT, tries: int = PICK_PORT_TRIES) -> int:
    """A base port whose ``n`` consecutive ports are free on ``host`` now: ``preferred`` (17400) when its run is free,
    else a free run below the kernel's ephemeral range (:func:`~kvctl.tier.server.candidate_base_port`; a bounded
    search). A shared host's other tiers keep theirs; nothing is reserved, so :func:`up` checks the run again before
    it starts anything."""
    try:
        return free_base_port(n, tries, host, preferred)
    except RuntimeError as exc:
        raise KvctlError(f"{exc}; give --base-port") from None


def not_running(instances: Sequence[InstanceState], tier_dir: Path | str | None = None) -> list[InstanceState]:
    """The instances of a local tier whose valkey-server is gone (stopped by `down`, killed, rebooted), or, given
    ``tier_dir``, is not a server of that directory (the state file of a copied directory)."""
    return [i for i in instances if is_our_server(i, tier_dir) is None]


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
    io_threads = req.io_threads if req.io_threads is not None else sizing.io_threads_for(instances=req.instances)
    auth = spec.resolve_auth(req.host, req.password_file, req.insecure_no_auth)
    check_bind_address(req.host)
    binary = find_valkey_server()
    version = format_version(server_version(binary))
    tier_dir = req.dir.resolve()
    if tier_dir.exists() and not tier_dir.is_dir():
        raise InvalidInput(f"--dir {req.dir} is not a directory")
    created = make_dir(tier_dir)  # True only when this `up` made it: a racing `up` may have, a moment ago
    with tier_lock(tier_dir, "deploy-valkey up") as lock:  # TierBusy: nothing here is this `up`'s to remove
        try:
            return _up_locked(req, tier_dir, per_instance, io_threads, auth, binary, version, on_progress, check_ports_first, held)
        except BaseException:
            if created:  # leave no trace of a refused or failed `up` in a directory it made, holding its lock
                lock.remove()
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
    live = servers_of(tier_dir)
    if live:
        pids = ", ".join(str(p.pid) for p in live)
        raise KvctlError(f"{req.dir} already runs a tier (valkey-server pid {pids}); stop it with `kvctl deploy-valkey down --dir {req.dir}` or use another --dir")
    k = req.instances_per_rank
    base = req.base_port if req.base_port is not None else pick_base_port(req.instances, req.host)
    layout = [(r, i, base + flat_instance(r, i, k)) for r in range(req.ranks) for i in range(k)]
    if check_ports_first:
        for rank, inst, port in layout:
            if port_in_use(port, req.host):
                again = "pick another --base-port, or leave it out for free ports" if req.base_port is not None else "run `up` again"
                raise KvctlError(f"{instance_name(rank, inst, k)}: port {req.host}:{port} is already in use; nothing was started ({again})")
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
            stem = instance_stem(rank, inst, k)
            settings = spec.cache_settings(per_instance, io_threads, auth, engine_password, version=version)
            settings["pidfile"] = str(tier_dir / f"{stem}.pid")
            settings["logfile"] = str(tier_dir / f"{stem}.log")

            def record(proc: ValkeyProcess, rank: int = rank, inst: int = inst, name: str = name, settings: dict = settings,
                       stem: str = stem) -> None:
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
                        config=f"{stem}.conf",  # names in the tier directory, never paths
                        logfile=f"{stem}.log",
                        pidfile=f"{stem}.pid",
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
    note: str = ""  # why a pid was not ours, or that a server stopped was not in the state file


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


def tier_to_stop(tier_dir: Path | str) -> TierState:
    """What ``down`` works from: the state file in ``tier_dir`` or, when there is none yet valkey-servers work in
    the directory (an ``up`` killed before writing it), no recorded instance. InvalidInput when neither."""
    d = Path(tier_dir).resolve()
    if not os.path.lexists(state_path(d)) and d.is_dir() and servers_of(d):
        return TierState(dir=str(d), instances=[], complete=False)
    return load_tier(tier_dir)


def down(tier_dir: Path | str, purge: bool = False, timeout_s: float = 10.0, on_progress: Progress | None = None) -> list[StopResult]:
    """Stop every valkey-server working in ``tier_dir``: the instances its state file records, and any ``up``
    started without recording it. A recorded pid that is not a server of this directory is reported and never
    signalled. Each server gets SIGTERM and ``timeout_s`` to exit, then SIGKILL ("killed"). KvctlError, and
    nothing purged, when a server of the directory still runs after that.
    """
    state = tier_to_stop(tier_dir)
    d = Path(state.dir)
    with tier_lock(d, "deploy-valkey down") as lock:
        return _down_locked(d, state, purge, timeout_s, on_progress, lock)


def _down_locked(d: Path, state: TierState, purge: bool, timeout_s: float, on_progress: Progress | None, lock: TierLock) -> list[StopResult]:
    found = {p.pid: p for p in servers_of(d)}
    results = []
    k = state.instances_per_rank
    for inst in state.in_tier_order():
        name = instance_name(inst.rank, inst.instance, k)
        proc = found.pop(inst.pid, None)
        if proc is None:
            outcome, note = _not_here(inst.pid)
        else:
            outcome, note = _stop(proc, timeout_s), ""
        free = _wait_port_free(inst.host, inst.port, 2.0 if outcome in ("stopped", "killed") else 0.0)
        results.append(StopResult(inst.rank, inst.port, inst.pid, outcome, free, inst.instance, name, note))
        if on_progress:
            on_progress(name, inst.port)
    labels = pidfile_names(d)
    for pid, proc in sorted(found.items()):  # working here, not recorded: spawned by an `up` killed before it wrote them down
        port = listening_port(proc)
        rank, inst_no = labels.get(pid, (-1, 0))
        name = instance_name(rank, inst_no, k) if rank >= 0 else f"pid {pid}"
        outcome = _stop(proc, timeout_s)
        free = not port or _wait_port_free("127.0.0.1", port, 2.0)
        results.append(StopResult(rank, port, pid, outcome, free, inst_no, name, "not in the state file (an `up` killed before recording it)"))
        if on_progress:
            on_progress(name, port)
    left = servers_of(d)
    settle = time.monotonic() + DOWN_SETTLE_S
    while not left and time.monotonic() < settle:  # one started again meanwhile (a supervisor) still runs here
        time.sleep(0.05)
        left = servers_of(d)
    if left:
        raise KvctlError(f"valkey-server pid {', '.join(str(p.pid) for p in left)} still runs in {d} after `down` stopped its servers"
                         + ("; nothing was purged" if purge else "") + ": is something restarting it (a supervisor)? stop that, then "
                         "`kvctl deploy-valkey down` again")
    if purge:
        purge_files(d, lock)
    elif os.path.lexists(state_path(d)) and state.instances:  # the files stay: they say the tier was stopped, not lost
        state.stopped_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        state.write()
    return results


def stopped_tier(tier_dir: Path | str) -> TierState | None:
    """The tier in ``tier_dir`` when ``down`` stopped it and left its files (its state says when) and no server of the
    directory runs since; None otherwise (no tier there, one that runs, or one that died without a ``down``)."""
    d = Path(tier_dir)
    if not os.path.lexists(state_path(d)):
        return None
    state = load_tier(d)
    return state if state.stopped_at and not servers_of(d.resolve()) else None


def remove_if_empty(tier_dir: Path | str) -> bool:
    """Remove ``tier_dir`` when nothing is left in it (after a purge of the files of a drill engine that ran there)."""
    try:
        Path(tier_dir).rmdir()
    except OSError:
        return False
    return True


def left_in(tier_dir: Path | str) -> list[str]:
    """What is left in ``tier_dir`` (names, directories with a trailing /; the lock file aside); [] when it is gone."""
    d = Path(tier_dir)
    try:
        names = sorted(os.listdir(d))
    except OSError:
        return []
    return [f"{n}/" if (d / n).is_dir() and not (d / n).is_symlink() else n for n in names if n != LOCK_FILE]


def _not_here(pid: int) -> tuple[str, str]:
    """A recorded pid that is no valkey-server of this directory: "not running", or "not ours" and why."""
    if pid <= 0:
        return "not running", ""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return "not running", ""
        if is_valkey(proc):
            return "not ours", (f"pid {pid} is a valkey-server of another directory ({working_dir(proc)}), not of this one "
                                "(a copy of a tier's directory?); left it alone")
    except psutil.NoSuchProcess:
        return "not running", ""
    except psutil.AccessDenied:
        return "not ours", f"pid {pid} belongs to another user; left it alone"
    return "not ours", f"pid {pid} now belongs to another process; left it alone"
