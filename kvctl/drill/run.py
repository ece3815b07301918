"""Run one drill: start a tier, the drill engine and a replay; plant the fault; watch with diagnose; stop everything.

Every process it starts is recorded by pid the moment it exists (valkey-servers in the tier's state
file by ``deploy-valkey up``'s own code) and stopped in ``finally``: a drill that ends, fails, or is
interrupted (the command turns SIGINT/SIGTERM into an exception) leaves no process and no port
behind. Only pids it started are signalled. Every child is this process's own (the valkey-servers
too: their handles are held, so they are stopped and reaped even when the work dir is gone) and dies
with it (PR_SET_PDEATHSIG): a SIGKILLed drill leaves no process, and the next drill removes its work
dir (:mod:`kvctl.drill.workdir`). Library code: no click; the narration goes to ``say``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from kvctl.connector import metric_names as N
from kvctl.diagnose import capture as cap
from kvctl.diagnose.analysis import Diagnosis, Params, analyse
from kvctl.drill import scenarios as S
from kvctl.drill.config import EngineSettings, write_config
from kvctl.drill.saturated import saturated_phase
from kvctl.drill.standalone import engine_port_in, settings_for
from kvctl.drill.workload import Sizes, Workload, sizes, write_trace
from kvctl.core.errors import ExitStatus, InvalidInput, KvctlError
from kvctl.drill.workdir import WorkDir, check_keep, keep, quote_log, remove_stale
from kvctl.core.procs import child_env, die_with_parent, python_argv
from kvctl.core.runbooks import runbook_for
from kvctl.core.thresholds import RHO_HIGH, RHO_UNSTABLE
from kvctl.tier import local
from kvctl.tier.server import ValkeyProcess
from kvctl.tier.targets import Target, resolve_targets

Say = Callable[[str], None]
ENGINE_START_S = 30.0
STOP_WAIT_S = 5.0
SAMPLE_TIMEOUT_S = 1.5
#: Seconds the stall drill's FLUSHALL of its own local instance may take in all (DBSIZE, then FLUSHALL of a few chunks).
PLANT_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class DrillOptions:
    duration_s: float = S.DEFAULT_DURATION_S
    plant: bool = True  # False: the scenario's fault is left out (diagnose must then miss it: the drill fails)
    keep_dir: str | None = None  # keep the work files (tier logs, engine config and log, trace, run file, capture) here
    model_config: str | None = None
    seed: int = 0


@dataclass
class DrillResult:
    scenario: str
    passed: bool
    planted: bool
    expected: str
    found: list[str]
    runbook: str | None
    fix: str
    verdict: str
    duration_s: float = 0.0
    steps: list[dict[str, Any]] = field(default_factory=list)
    diagnoses: list[dict[str, Any]] = field(default_factory=list)
    work_dir: str | None = None


class DrillFailed(KvctlError):
    """Diagnose did not report what the drill planted."""


class DrillNotRun(KvctlError):
    """The drill could not run (a child died, the tier or the engine did not start): nothing was judged."""

    exit_status = ExitStatus.DRILL_NOT_RUN


def describe_exit(code: int) -> str:
    """``exit code 1`` / ``SIGKILL``, for a child that ended."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return signal.Signals(-code).name
    return f"exit code {code}"


class _Procs:
    """Python child processes this drill started (``python -P``: never a ``./kvctl`` of the working
    directory), by pid; stopped newest first."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, args: list[str], log: Path) -> subprocess.Popen:
        """``python -P ARGS`` with its output in ``log``."""
        with open(log, "ab") as out:
            p = subprocess.Popen(python_argv(*args), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=child_env(),
                                 preexec_fn=die_with_parent())
        self.procs.append((name, p))
        return p

    def ended(self) -> tuple[str, subprocess.Popen] | None:
        """The first child that should still run and has ended: the engine whatever its code, another one
        that failed."""
        for name, p in self.procs:
            code = p.poll()
            if code is not None and (name == "engine" or code != 0):
                return name, p
        return None

    def stop(self, p: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
        if p.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(sig)
        try:
            p.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            p.wait(STOP_WAIT_S)

    def stop_all(self) -> None:
        for _, p in reversed(self.procs):
            self.stop(p)


class Drill:
    """One drill's run: its work directory, processes, tier and narration."""

    def __init__(self, scenario: S.Scenario, opts: DrillOptions, say: Say) -> None:
        self.sc, self.opts, self._say = scenario, opts, say
        self.t0 = time.monotonic()
        self.steps: list[dict[str, Any]] = []
        self.diagnoses: list[dict[str, Any]] = []
        self.procs = _Procs()
        self.sizes: Sizes = sizes(opts.model_config)
        remove_stale(lambda text: self.say("note", text), _stop_stale_tier)
        self._dir = WorkDir(scenario.name)
        self.work = self._dir.path
        self.tier_dir = self.work / "tier"
        self.tier_up = False
        self.servers: list[ValkeyProcess] = []  # handles of the valkey-servers it started (stopped and reaped at cleanup)
        self.keep_error: str | None = None  # why --keep could not be written at cleanup
        self.stopped: list[int] = []  # pids this drill SIGSTOPped (continued before the tier goes down)
        self.engine: subprocess.Popen | None = None
        self.engine_port = 0
        self.replay: subprocess.Popen | None = None
        self.last_capture: cap.Capture | None = None  # the final diagnosis' samples (saved with --keep)
        self.findings: list[Any] = []  # the findings that showed the planted fault (their fix lines are the drill's)

    # --- narration -------------------------------------------------------------------

    def say(self, kind: str, text: str) -> None:
        t = time.monotonic() - self.t0
        self.steps.append({"t_s": round(t, 2), "kind": kind, "text": text})
        self._say(f"[{t:5.1f} s] {text}")

    # --- starting things ---------------------------------------------------------------

    def start_tier(self, ranks: int) -> list[Target]:
        last: Exception | None = None
        self.tier_up = True  # from here `down` runs at cleanup: up records each instance the moment it exists
        for _ in range(5):  # W consecutive free ports; another process may take one meanwhile
            base = local.pick_base_port(ranks, preferred=None)  # never 17400..: that is the engineer's own tier's
            try:
                local.up(local.UpRequest(dir=self.tier_dir, ranks=ranks, base_port=base, maxmemory=f"{32 * ranks}MiB"), held=self.servers)
                break
            except KvctlError as e:
                last = e
        else:
            raise KvctlError(f"could not start {ranks} valkey-server(s) on free ports: {last}")
        targets = resolve_targets(tier_dir=self.tier_dir)
        self.say("start", f"tier: {ranks} valkey-server(s) on 127.0.0.1:{targets[0].port}..{targets[-1].port} "
                          f"(`kvctl deploy-valkey up --ranks {ranks}`), one per rank")
        return targets

    def engine_settings(self, targets: list[Target], **kw: Any) -> EngineSettings:
        return settings_for([f"resp://{t.host}:{t.port}" for t in targets], self.opts.model_config, **kw)

    def start_engine(self, settings: EngineSettings, async_loading: bool = False) -> Path:
        cfg = write_config(self.work / "engine.yaml", settings, async_loading=async_loading)
        self.engine_port = 0  # a free port the engine binds itself and prints (PORT n): none to race for
        args = ["-m", "kvctl.drill.engine", "--config", str(cfg), "--port", "0"]
        self.engine = self.procs.start("engine", args, self.work / "engine.log")
        self.wait_engine()
        self.say("start", f"drill engine pid {self.engine.pid} on http://127.0.0.1:{self.engine_port} ({settings.ranks} rank(s), "
                          f"{'asynchronous' if async_loading else 'synchronous'} loading"
                          f"{' with the load-or-recompute decision' if settings.load_policy else ''}, chunks of {self.sizes.chunk_bytes / 1e3:.1f} kB = {self.sizes.model}'s "
                          f"{self.sizes.model_chunk_bytes / 1e6:.2f} MB × {self.sizes.bytes_scale:g}; config {cfg.name})")
        return cfg

    def wait_engine(self) -> None:
        assert self.engine is not None
        deadline = time.monotonic() + ENGINE_START_S
        while time.monotonic() < deadline:
            if self.engine.poll() is not None:
                raise KvctlError(f"the drill engine ended with {describe_exit(self.engine.returncode)}; {self.quote_log('engine')}")
            if not self.engine_port:
                self.engine_port = engine_port_in(self.work / "engine.log")
                if not self.engine_port:
                    time.sleep(0.05)
                    continue
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1.0) as r:  # noqa: S310 - loopback
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        raise KvctlError(f"the drill engine did not answer within {ENGINE_START_S:g} s; {self.quote_log('engine')}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.engine_port}"

    def start_replay(self, workload: Workload) -> None:
        trace = write_trace(self.work / "trace.jsonl", workload)
        args = ["-m", "kvctl.cli", "replay", str(trace), "--engine-url", self.url, "--out", str(self.work / "run.jsonl"),
                "--json", "--timeout", str(int(self.opts.duration_s * 2 + 30))]
        self.replay = self.procs.start("replay", args, self.work / "replay.log")
        self.say("start", f"replay: {len(trace.read_text().splitlines())} requests of {workload.prompt_tokens} tokens at "
                          f"λ = {workload.rate_per_s:.2f} req/s for the drill's {self.opts.duration_s:g} s (the trace runs "
                          f"{workload.duration_s - self.opts.duration_s:g} s past it, so the traffic outlasts the watch), {workload.docs} shared documents "
                          f"(`kvctl replay trace.jsonl --engine-url {self.url}`)")

    # --- watching ----------------------------------------------------------------------

    def check_children(self) -> None:
        """DrillNotRun when the engine or the replay has ended before the drill did (a drill without its
        traffic or its engine has nothing to judge: that is not "diagnose missed")."""
        ended = self.procs.ended()
        if ended is not None:
            name, p = ended
            raise DrillNotRun(f"the drill could not run: its {name} (pid {p.pid}) ended with {describe_exit(p.returncode)} "
                              f"before the drill did; {self.quote_log(name)}")

    def quote_log(self, name: str) -> str:
        """The end of child ``name``'s log, for an error (the work dir is removed before it is shown)."""
        kept = Path(self.opts.keep_dir) / f"{name}.log" if self.opts.keep_dir else None
        return quote_log(self.work / f"{name}.log", kept)

    def sample(self, targets: list[Target]) -> cap.Sample:
        self.check_children()
        return cap.take_sample([self.url], targets, SAMPLE_TIMEOUT_S)

    def analyse(self, a: cap.Sample, b: cap.Sample, targets: list[Target]) -> tuple[cap.Capture, Diagnosis]:
        params = {"bytes_per_token": self.sizes.bytes_per_token, "prefill_rate": S.PREFILL_RATE, "t0_s": self.sc.t0_s}
        c = cap.Capture([self.url], [t.url for t in targets], [a, b], params, cap.now_iso())
        return c, analyse(c, Params(**params))

    def report(self, label: str, d: Diagnosis) -> None:
        ids = [f"{f.id} ({f.severity})" for f in d.findings]
        rho = "ρ unknown" if d.rho is None else f"ρ = {d.rho:.2f}"
        q = f"queue {d.requests_waiting_start or 0:g} → {d.requests_waiting_end or 0:g}"
        lam = "" if d.arrival_rate_per_s is None else f", λ = {d.arrival_rate_per_s:.2f} req/s"
        extra = "".join(f"; unreachable: {u.split(' (')[0]}" for u in d.unreachable)
        self.say("diagnose", f"diagnose {label}: {rho}{lam}, {q}; " + (", ".join(ids) if ids else "no findings") + extra)
        self.diagnoses.append({"label": label, "rho": d.rho, "arrival_rate_per_s": d.arrival_rate_per_s,
                               "bandwidth_gbps": d.bandwidth_gbps, "findings": [f.id for f in d.findings],
                               "unreachable": list(d.unreachable), "exit_code": int(d.exit_status)})

    def watch(self, targets: list[Target], seconds: float, refreshes: int = 3, label: str = "") -> tuple[cap.Capture, Diagnosis]:
        """``diagnose --watch`` for ``seconds``: a line per refresh, then the diagnosis over the whole span."""
        first = prev = self.sample(targets)
        step = seconds / max(1, refreshes)
        for i in range(refreshes):
            cap.wait_until(first.t_s + step * (i + 1))
            new = self.sample(targets)
            if i < refreshes - 1:
                self.report(f"{label}refresh {i + 1}", self.analyse(prev, new, targets)[1])
            prev = new
        c, d = self.analyse(first, prev, targets)
        self.report(f"{label}over {prev.t_s - first.t_s:.0f} s", d)
        return c, d

    def engine_counts(self) -> tuple[float, float]:
        """(finished requests, requests on the GPU) from the engine's /metrics."""
        from kvctl.records.prometheus import parse  # noqa: PLC0415
        from kvctl.diagnose.sources import fetch_metrics  # noqa: PLC0415

        m = parse(fetch_metrics(self.url, 2.0))
        return m.counter(N.VLLM_REQUEST_SUCCESS) or 0.0, m.gauge(N.VLLM_NUM_REQUESTS_RUNNING) or 0.0

    def wait_for(self, what: str, cond: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_children()
            if cond():
                return True
            time.sleep(0.25)
        self.say("note", f"gave up waiting {timeout_s:g} s for {what}")
        return False

    # --- stopping ----------------------------------------------------------------------

    def cleanup(self) -> None:
        """Stop everything, copy the work dir to --keep (``keep_error`` says why not), always remove the work dir."""
        try:
            for pid in self.stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            if self.replay is not None:
                self.procs.stop(self.replay, signal.SIGINT)  # the replay closes its run file on SIGINT
            self.procs.stop_all()
            if self.tier_up:
                with contextlib.suppress(KvctlError, OSError):
                    local.down(self.tier_dir, purge=True)
            for server in self.servers:  # also when the state file is gone; reaps what `down` stopped
                server.stop()
            if self.opts.keep_dir:
                self.keep_error = keep(self.work, self.opts.keep_dir)
        finally:
            self._dir.remove()


def _stop_stale_tier(tier_dir: Path) -> int:
    """Stop what the tier of a dead drill left running (through its state file); how many servers."""
    return sum(r.result in ("stopped", "killed") for r in local.down(tier_dir, purge=True))


# --- the scenarios ----------------------------------------------------------------------


def _workload(sc: S.Scenario, rho: float, opts: DrillOptions) -> Workload:
    """The drill's trace: λ for ``rho`` on the scenario's ranks, for the whole drill and TRACE_TAIL_S more."""
    rate = S.arrival_rate(rho, sc.ranks, Workload(rate_per_s=1.0, duration_s=1.0).hit_chunks)
    return Workload(rate_per_s=rate, duration_s=opts.duration_s + S.TRACE_TAIL_S, seed=opts.seed)


_timeline = S.timeline


def _load_phase(dr: Drill, sc: S.Scenario, rho: float, async_after: bool) -> tuple[bool, str, list[str]]:
    d_total = dr.opts.duration_s
    targets = dr.start_tier(sc.ranks)
    dr.start_engine(dr.engine_settings(targets))
    phase = d_total / 2 if async_after else d_total
    dr.start_replay(_workload(sc, rho, dr.opts))
    warm, span = _timeline(phase)
    time.sleep(warm)
    capture, d = dr.watch(targets, span, label="(sync) " if async_after else "")
    dr.last_capture = capture
    found = [f.id for f in d.findings]
    if sc.name == "healthy":
        # healthy = ρ well below saturation and nothing critical; a passing warning of a two-sample window (one
        # request waiting at the second sample reads as queue_growing) is reported, not failed on
        rho_ids = [f for f in found if f.startswith("rho_")]
        ok = d.rho is not None and d.rho < RHO_HIGH and not rho_ids and d.worst_severity != "critical" and not d.insufficient_data
        note = f", also {', '.join(found)}" if found else ", no findings"
        return ok, (f"healthy: ρ = {d.rho:.2f}{note}" if ok else f"expected a healthy diagnosis, got ρ = {d.rho}, {found or d.insufficient_data}"), found
    unstable = "rho_unstable" in found
    if unstable:
        dr.findings = list(d.findings)
        dr.say("finding", f"found rho_unstable: runbook: {runbook_for('rho_unstable')}")
    if not async_after:
        return unstable, ("found rho_unstable" if unstable else f"diagnose did not report rho_unstable (findings: {found or 'none'})"), found
    if not unstable:
        return False, f"diagnose did not report rho_unstable before the flip (findings: {found or 'none'})", found
    cfg = dr.work / "engine.yaml"
    assert dr.engine is not None
    restart = f"kill -HUP {dr.engine.pid}"
    argv = python_argv("-m", "kvctl.cli", "loading", "async", "--config", str(cfg), "--restart-cmd", restart, "--no-backup")
    dr.say("action", f"fix: kvctl loading async --config {cfg.name} --restart-cmd '{restart}'")
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=child_env(), preexec_fn=die_with_parent())
    if r.returncode != 0:
        return False, f"`kvctl loading async` failed ({r.returncode}): {(r.stderr or r.stdout).strip()[-300:]}", found
    dr.wait_engine()
    dr.say("action", "config now says enable_async_loading: true; the engine restarted (its queue and counters start from zero)")
    time.sleep(2.0)
    _, d2 = dr.watch(targets, max(4.0, phase - 2.0 - warm), label="(async) ")
    found2 = [f.id for f in d2.findings]
    ok = "rho_unstable" not in found2 and d2.rho is not None and d2.rho < RHO_UNSTABLE
    verdict = (f"recovered: ρ {d.rho:.2f} → {d2.rho:.2f}" + (f" (still {', '.join(found2)}: more instances give headroom)" if found2 else "")
               if ok else f"no recovery after the flip (ρ {d2.rho}, findings {found2 or 'none'})")
    return ok, verdict, found + [f"after:{x}" for x in found2]


def _stall(dr: Drill, sc: S.Scenario) -> tuple[bool, str, list[str]]:
    from kvctl.diagnose import stalls  # noqa: PLC0415
    from kvctl.tier.admin import Admin  # noqa: PLC0415

    targets = dr.start_tier(sc.ranks)
    dr.start_engine(dr.engine_settings(targets, tier_client="fixed-header", lookup="index"))
    w = _workload(sc, sc.rho, dr.opts)
    dr.start_replay(w)
    dr.wait_for("every document stored", lambda: dr.engine_counts()[0] >= w.docs + 1, 10.0 + dr.opts.duration_s)
    if dr.opts.plant:
        with Admin(targets[0].url, PLANT_TIMEOUT_S) as r:  # one deadline for both commands
            n = r.dbsize()
            r.flushall()
        dr.say("plant", f"evicted all {n} chunk(s) on rank 0 behind the engine's back (FLUSHALL: what maxmemory eviction or an instance restart does)")
    else:
        dr.say("plant", "--plant-nothing: no eviction")
    last = [dr.engine_counts()[0], time.monotonic()]

    def stuck() -> bool:  # a request on the GPU and no request finished for 2 s
        done, running = dr.engine_counts()
        if done != last[0]:
            last[:] = [done, time.monotonic()]
        return running >= 1 and time.monotonic() - last[1] >= 2.0

    if dr.wait_for("the engine to stall", stuck, dr.opts.duration_s):
        dr.say("diagnose", "the engine stopped finishing requests: one sits on the GPU, the queue grows")
    assert dr.engine is not None
    dr.say("action", f"kvctl diagnose stalls --pid {dr.engine.pid} (py-spy, 3 samples 1 s apart)")
    rep = stalls.diagnose_stalls([dr.engine.pid], samples=3, interval_s=1.0)
    found = sorted({f.id for f in rep.findings})
    dr.findings = list(rep.findings)
    for f in rep.findings:
        dr.say("finding", f"{f.id} ({f.severity.value}): {f.message}; runbook: {runbook_for(f.id)}")
    dr.diagnoses.append({"label": "stalls", "findings": found, "errors": [p.error for p in rep.processes if p.error]})
    ok = "missing-key-get" in found
    errs = [p.error for p in rep.processes if p.error]
    return ok, ("found missing-key-get" if ok else f"diagnose stalls did not report missing-key-get (findings: {found or 'none'}{'; ' + errs[0] if errs else ''})"), found


def _dead(dr: Drill, sc: S.Scenario) -> tuple[bool, str, list[str]]:
    targets = dr.start_tier(sc.ranks)
    dr.start_engine(dr.engine_settings(targets, tier_timeout_s=0.5))
    dr.start_replay(_workload(sc, sc.rho, dr.opts))
    warm, span = _timeline(dr.opts.duration_s)
    time.sleep(warm)
    victim = targets[-1]
    if dr.opts.plant:
        state = {i.rank: i for i in local.load_tier(dr.tier_dir).instances}
        proc = local.is_our_server(state[victim.rank])
        if proc is None:
            raise KvctlError(f"rank {victim.rank}'s valkey-server is not the one this drill started")
        os.kill(proc.pid, signal.SIGSTOP)
        dr.stopped.append(proc.pid)
        dr.say("plant", f"SIGSTOP rank {victim.rank}'s valkey-server (pid {proc.pid}, port {victim.port}): it accepts connections and never answers")
    else:
        dr.say("plant", "--plant-nothing: every instance stays up")
    _, d = dr.watch(targets, span, refreshes=2)
    found = [f.id for f in d.findings]
    down = any(u.startswith(f"Valkey rank {victim.rank} ") for u in d.unreachable)
    if down:
        dr.say("finding", f"Valkey rank {victim.rank} unreachable (exit 5): runbook: {runbook_for('instance_down')}")
        found = ["instance_down", *found]
    return down, (f"found Valkey rank {victim.rank} unreachable" if down else f"diagnose did not report rank {victim.rank} unreachable (findings: {found or 'none'})"), found


def fix_of(sc: S.Scenario, findings: list[Any]) -> str:
    """The fix the drill says: the diagnosis's own fix line for the finding it planted (its numbers filled in), else
    the scenario's (the same line for the drill's tier)."""
    said = [f.recommendation for f in findings if f.id == sc.finding]
    return said[0] if said else sc.fix


def run_drill(name: str, opts: DrillOptions, say: Say) -> DrillResult:
    """Run scenario ``name``; the result says whether diagnose found what the drill planted."""
    sc = S.SCENARIOS[name]
    if opts.keep_dir:
        check_keep(opts.keep_dir)
    dr = Drill(sc, opts, say)
    dr.say("start", f"drill {sc.name}: {sc.summary}" + ("" if opts.plant else " (--plant-nothing: the fault is left out)"))
    try:
        if sc.name in ("healthy", "overload", "async-fix"):
            rho = sc.rho if opts.plant else sc.calm_rho
            ok, verdict, found = _load_phase(dr, sc, rho, async_after=sc.name == "async-fix")
        elif sc.name == "missing-key-stall":
            ok, verdict, found = _stall(dr, sc)
        elif sc.name == "saturated-tier":
            ok, verdict, found = saturated_phase(dr, sc)
        else:
            ok, verdict, found = _dead(dr, sc)
        dr.check_children()
        fix = fix_of(sc, dr.findings)
        if ok:
            dr.say("verdict", f"PASS: {verdict}. Fix: {fix}" + (f"; runbook: {sc.runbook}" if sc.runbook else ""))
        else:
            dr.say("verdict", f"FAIL: {verdict} (expected {sc.expect})")
        if dr.last_capture is not None and opts.keep_dir:
            cap.save_capture(dr.last_capture, dr.work / "capture")
    except (InvalidInput, DrillNotRun):
        raise
    except KvctlError as e:
        dr.check_children()  # a child that died is the cause: say that one
        raise DrillNotRun(f"the drill could not run: {e}") from e
    finally:
        dr.cleanup()
    if dr.keep_error:
        raise KvctlError(dr.keep_error)
    return DrillResult(sc.name, ok, opts.plant, sc.expect, found, sc.runbook, fix, verdict,
                       round(time.monotonic() - dr.t0, 2), dr.steps, dr.diagnoses, opts.keep_dir)
