"""``kvctl drill engine``: the drill engine on a tier of your own, left running as a replay target.

The drills start and stop it themselves; for rehearsing a sizing (``kvctl replay`` a calibration trace, then
``kvctl plan``) it has to outlive the command that starts it. :func:`start` writes its config into the tier's
directory (``drill-engine/engine.yaml``: the tier's instances as its ranks, the drill's chunk size and time
model), starts ``python -m kvctl.drill.engine`` in a session of its own on a free loopback port, waits until
``/health`` answers and records pid, command line, start time and URL in ``drill-engine.json``.
:func:`stop` signals only that process (pid, command line and start time checked), as ``deploy-valkey down``
does. Library code: no click.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from kvctl.drill import scenarios as S
from kvctl.drill.config import EngineSettings, write_config
from kvctl.drill.workload import sizes
from kvctl.core.errors import InvalidInput, KvctlError
from kvctl.core.files import write_atomic
from kvctl.tier.targets import resolve_targets

STATE_FILE = "drill-engine.json"
WORK_DIR = "drill-engine"
START_S = 30.0
STOP_S = 5.0


@dataclass(frozen=True)
class EngineState:
    url: str
    pid: int
    port: int
    create_time: float
    cmdline: list[str]
    config: str
    log: str
    ranks: int
    # what `kvctl simulate` and `kvctl plan` take to model this engine
    prefill_rate: float
    t0_s: float
    bytes_per_token: float
    instance_gbps: float  # its synchronous loader on one instance
    async_instance_gbps: float  # its asynchronous loader on one instance


def settings_for(remote_urls: list[str], model_config: str | None = None, **kw: object) -> EngineSettings:
    """The drill engine's settings over ``remote_urls`` (one per rank): the drill's chunk size and time model."""
    sz = sizes(model_config)
    return EngineSettings(
        remote_urls=remote_urls, chunk_bytes=sz.chunk_bytes, prefill_tokens_per_s=S.PREFILL_RATE, t0_s=S.T0_S,
        stream_bytes_per_s=S.LINK_CHUNKS_PER_S * sz.chunk_bytes, chunk_rtt_s=S.CHUNK_RTT_S,
        model=sz.model or "drill", **kw,  # type: ignore[arg-type]  # whole: chunk_keys escapes it injectively
    )


def _state_path(tier_dir: Path) -> Path:
    return Path(tier_dir) / STATE_FILE


def read_state(tier_dir: Path | str) -> EngineState | None:
    p = _state_path(Path(tier_dir))
    if not p.is_file():
        return None
    try:
        return EngineState(**json.loads(p.read_text()))
    except (OSError, ValueError, TypeError) as e:
        raise InvalidInput(f"{p} is not a `kvctl drill engine` state file: {e}") from e


def our_process(state: EngineState) -> psutil.Process | None:
    """The live engine the state file names, when pid, command line and start time all match."""
    try:
        proc = psutil.Process(state.pid)
        if proc.status() == psutil.STATUS_ZOMBIE or proc.cmdline() != state.cmdline:
            return None
        if abs(proc.create_time() - state.create_time) > 0.05:
            return None
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return proc


def engine_port_in(log: Path) -> int:
    """The port a drill engine started with ``--port 0`` said it listens on (its ``PORT n`` line), 0 before it says."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return 0
    return next((int(ln.split()[1]) for ln in text.splitlines() if ln.startswith("PORT ") and ln.split()[1:2] and ln.split()[1].isdigit()), 0)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1.0) as r:  # noqa: S310 - loopback
            return r.status == 200
    except OSError:
        return False


def start(tier_dir: Path | str, model_config: str | None = None, async_loading: bool = False) -> EngineState:
    """Start the drill engine over the tier in ``tier_dir`` (see the module docstring); KvctlError when it cannot."""
    from kvctl.drill.samples import loader_gbps  # noqa: PLC0415

    tier_dir = Path(tier_dir)
    old = read_state(tier_dir)
    if old is not None and our_process(old) is not None:
        raise KvctlError(f"a drill engine (pid {old.pid}) already serves this tier at {old.url}; stop it with "
                         f"`kvctl drill engine --stop --dir {tier_dir}`")
    targets = resolve_targets(tier_dir=tier_dir)
    settings = settings_for([f"resp://{t.host}:{t.port}" for t in targets], model_config)
    work = tier_dir / WORK_DIR
    work.mkdir(parents=True, exist_ok=True)
    cfg = write_config(work / "engine.yaml", settings, async_loading=async_loading)
    log = work / "engine.log"
    argv = [sys.executable, "-m", "kvctl.drill.engine", "--config", str(cfg.resolve())]
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + START_S
    port = 0
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise KvctlError(f"the drill engine exited with {proc.returncode}; see {log}")
        if not port:
            port = engine_port_in(log)
        if port and _healthy(f"http://127.0.0.1:{port}"):
            break
        time.sleep(0.1)
    else:
        _kill(proc.pid)
        raise KvctlError(f"the drill engine did not answer within {START_S:g} s; see {log}")
    p = psutil.Process(proc.pid)
    sync_gbps, async_gbps = loader_gbps(model_config)
    state = EngineState(f"http://127.0.0.1:{port}", proc.pid, port, p.create_time(), p.cmdline(), str(cfg), str(log), settings.ranks,
                        S.PREFILL_RATE, S.T0_S, settings.chunk_bytes / settings.chunk_tokens, sync_gbps, async_gbps)
    write_atomic(_state_path(tier_dir), json.dumps(asdict(state), indent=2) + "\n")
    return state


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def stop(tier_dir: Path | str) -> EngineState | None:
    """Stop the drill engine :func:`start` left on this tier (SIGTERM, SIGKILL after a few seconds); None when none
    was recorded. The state file goes either way."""
    stopped = stop_engine(tier_dir)
    return stopped.state if stopped else None


@dataclass(frozen=True)
class EngineStop:
    """What became of the drill engine a tier's directory records (``deploy-valkey down`` says it)."""

    state: EngineState
    result: str  # "stopped", "killed" (no exit within STOP_S of SIGTERM), or "not running" (recorded, gone)


def stop_engine(tier_dir: Path | str) -> EngineStop | None:
    """:func:`stop`, saying what it did; None when no drill engine is recorded in ``tier_dir``. Only the process the
    state file names (pid, command line and start time all matching) is signalled."""
    tier_dir = Path(tier_dir)
    state = read_state(tier_dir)
    if state is None:
        return None
    proc = our_process(state)
    result = "not running"
    if proc is not None:
        result = "stopped"
        proc.terminate()
        try:
            proc.wait(STOP_S)
        except psutil.TimeoutExpired:
            result = "killed"
            proc.kill()
            proc.wait(STOP_S)
    _state_path(tier_dir).unlink(missing_ok=True)
    return EngineStop(state, result)


#: what :func:`start` writes in its directory (``drill-engine/``), the names :func:`purge` removes
WORK_FILES = ("engine.yaml", "engine.log")


def purge(tier_dir: Path | str) -> list[str]:
    """Remove what :func:`start` wrote in ``tier_dir`` (its state file, ``drill-engine/``'s config and log, then that
    directory when nothing else is in it): the names removed. Links are removed, never followed; anything else stays.
    Call it once the engine is stopped."""
    tier_dir = Path(tier_dir)
    removed = []
    work = tier_dir / WORK_DIR
    for path in [*(work / n for n in WORK_FILES), *work.glob(".engine.yaml*"), _state_path(tier_dir)]:
        try:
            if stat.S_ISREG(os.lstat(path).st_mode) or stat.S_ISLNK(os.lstat(path).st_mode):
                os.unlink(path)
                removed.append(str(path.relative_to(tier_dir)))
        except FileNotFoundError:
            pass
    with contextlib.suppress(OSError):
        if not work.is_symlink():
            work.rmdir()  # only when nothing else lives there
            removed.append(f"{WORK_DIR}/")
    return removed
