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

import json
import os
import signal
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
            port = next((int(ln.split()[1]) for ln in log.read_text(errors="replace").splitlines() if ln.startswith("PORT ")), 0)
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
    tier_dir = Path(tier_dir)
    state = read_state(tier_dir)
    if state is None:
        return None
    proc = our_process(state)
    if proc is not None:
        proc.terminate()
        try:
            proc.wait(STOP_S)
        except psutil.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_S)
    _state_path(tier_dir).unlink(missing_ok=True)
    return state
