"""Real signals to a real `kvctl bench` process (the console script), against real valkey-servers.

Each test starts one bench subprocess, waits (bounded) until its clients are
sending GETs, delivers a signal, and checks what is left: processes, keys,
temp dirs, exit code and the partial report.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import redis

from tests.bench.bench_procs import get_calls, name_of, start_bench

SMALL = ["--chunk-bytes", "2e6", "--batch", "4", "--keys", "16"]


def wait_for_gets(bench: subprocess.Popen, port: int, limit_s: float = 30.0) -> None:
    """Until the bench's clients have done some GETs (bounded; fails if the bench exits first)."""
    deadline = time.monotonic() + limit_s
    while get_calls(port) < 20:
        assert bench.poll() is None, bench.communicate()
        assert time.monotonic() < deadline, "bench clients never started GETs"
        time.sleep(0.1)


def workers_of(bench: subprocess.Popen) -> list[psutil.Process]:
    """The client processes: children of the bench's forkserver."""
    kids = psutil.Process(bench.pid).children()
    server = [k for k in kids if "forkserver" in " ".join(k.cmdline())]
    return [w for s in server for w in s.children()]


def finish(bench: subprocess.Popen, limit_s: float = 30.0) -> tuple[int, str, str, float]:
    t0 = time.monotonic()
    try:
        out, err = bench.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        bench.kill()
        out, err = bench.communicate()
        pytest.fail(f"bench did not exit within {limit_s}s after the signal: {err}")
    return bench.returncode, out, err, time.monotonic() - t0


def test_sigterm_stops_clients_deletes_keys_and_reports_partial_run(valkey_server, tmp_path):
    bench = start_bench(["--valkey", valkey_server.url, *SMALL, "--duration", "30", "--timeout", "1", "--json"], tmp_path)
    wait_for_gets(bench, valkey_server.port)
    r = redis.Redis(port=valkey_server.port)
    keys = list(r.scan_iter("kvctl-bench:*"))
    assert len(keys) == 16
    # TTL: 1 run × (30 s start wait + 1 + 30 + 1 + 1 grace + 2 × 2 s INFO) + 60 s margin = 128 s
    assert all(0 < r.ttl(k) <= 128 for k in keys)
    procs = psutil.Process(bench.pid).children(recursive=True)
    assert workers_of(bench), "no client process found"
    bench.send_signal(signal.SIGTERM)
    rc, out, err, wall = finish(bench)
    assert rc == 143, err
    assert wall < 1 + 1 + 5, wall  # timeout + grace + INFO + key deletion, far below the 30 s asked for
    data = json.loads(out)
    assert data["interrupted"] == "SIGTERM" and data["runs_planned"] == 1
    run = data["runs"][0]
    assert 0 < run["duration_s"] < 30 and run["ops"] > 0  # the partial run, measured honestly
    assert "interrupted by SIGTERM" in err and "1 of 1 run(s)" in err
    assert r.dbsize() == 0  # bench keys deleted
    gone, alive = psutil.wait_procs(procs, timeout=5)
    assert not alive, alive


def serving(proc: psutil.Process) -> tuple[psutil.Process, int] | None:
    """(the process, its port) where ``proc`` is a serving valkey-server (its title ``valkey-server *:PORT``), None for
    kvctl's ``valkey-server --version`` probe of the binary, which is gone in milliseconds (its cmdline read after it
    exited failed the test once: psutil.NoSuchProcess, 2026-12-07)."""
    try:
        title = proc.cmdline()
    except psutil.Error:
        return None
    port = title[0].rsplit(":", 1)[-1] if title and ":" in title[0] else ""
    return (proc, int(port)) if port.isdigit() else None


def test_ctrl_c_stops_embedded_servers_and_removes_their_dir(tmp_path):
    saved = tmp_path / "bench.json"
    bench = start_bench(["--embedded", "1", "--embedded-maxmemory", "64mb", *SMALL, "--duration", "30", "--timeout", "1", "--save", str(saved)], tmp_path)
    deadline = time.monotonic() + 30
    servers: list[tuple[psutil.Process, int]] = []
    while not servers:
        assert bench.poll() is None and time.monotonic() < deadline, bench.communicate()
        servers = [s for k in psutil.Process(bench.pid).children() if "valkey-server" in name_of(k) and (s := serving(k))]
        time.sleep(0.1)
    server, port = servers[0]
    workdir = Path(server.cwd())  # valkey-server runs in its `dir`, inside the bench's temp dir
    wait_for_gets(bench, port)
    os.killpg(bench.pid, signal.SIGINT)  # Ctrl-C: the bench, its forkserver and its clients all get SIGINT
    rc, out, err, _ = finish(bench)
    assert rc == 130, err
    assert "INTERRUPTED: 1 of 1 runs, the last ran" in " ".join(out.split()) and "interrupted by SIGINT" in err
    assert "embedded servers stopped" in err
    data = json.loads(saved.read_text())
    run = data["runs"][0]
    assert data["interrupted"] == "SIGINT" and run["ops"] > 0 and run["errors"] == 0  # the clients outlived Ctrl-C and reported
    assert not server.is_running()
    assert not workdir.exists() and not workdir.parent.exists()


def test_sigkilled_bench_leaves_keys_that_expire_and_clients_that_stop(valkey_server, tmp_path):
    bench = start_bench(["--valkey", valkey_server.url, *SMALL, "--duration", "30", "--timeout", "1"], tmp_path)
    wait_for_gets(bench, valkey_server.port)
    workers = workers_of(bench)
    assert workers
    bench.kill()
    _, _, _, wall = finish(bench)
    assert wall < 5, wall  # nothing it started keeps its stdout open for the rest of --duration
    # orphaned clients notice at their next batch (or start-signal check) and exit
    gone, alive = psutil.wait_procs(workers, timeout=5)
    assert not alive, alive
    r = redis.Redis(port=valkey_server.port)
    keys = list(r.scan_iter("kvctl-bench:*"))
    assert len(keys) == 16 and all(0 < r.ttl(k) <= 128 for k in keys)  # they expire by themselves


def test_a_killed_client_is_reported_with_its_signal(valkey_server, tmp_path):
    bench = start_bench(["--valkey", valkey_server.url, *SMALL, "--clients", "2", "--duration", "4", "--timeout", "1", "--json"], tmp_path)
    wait_for_gets(bench, valkey_server.port)
    victim = workers_of(bench)[0]
    victim.kill()
    rc, out, err, _ = finish(bench)
    assert rc == 5, err
    inst = json.loads(out)["runs"][0]["per_instance"][0]
    assert inst["errors"] >= 1 and inst["ops"] > 0  # the other client kept measuring
    assert f"(pid {victim.pid}) killed by SIGKILL" in err


def test_a_kvctl_folder_in_the_working_directory_is_not_imported_by_clients(valkey_server, tmp_path):
    """The forkserver is a `python -c` process: without care, sys.path[0] is the cwd and ./kvctl shadows the install."""
    stale = tmp_path / "kvctl" / "bench"  # e.g. a checkout of another kvctl version
    stale.mkdir(parents=True)
    for f in (tmp_path / "kvctl" / "__init__.py", stale / "__init__.py"):
        f.write_text("")
    (stale / "worker.py").write_text("# an older kvctl: nothing the clients need is here\n")
    bench = start_bench(["--valkey", valkey_server.url, *SMALL, "--duration", "0.5", "--json"], tmp_path)
    rc, out, err, _ = finish(bench, limit_s=60)
    assert rc == 0, err
    run = json.loads(out)["runs"][0]
    assert run["errors"] == 0 and run["ops"] > 0


def test_a_client_that_cannot_import_kvctl_reports_its_exception(valkey_server, tmp_path, monkeypatch):
    """A client that dies before running reports its exit code and exception, not "did not report in time".

    spawn children take the parent's sys.path: a stale kvctl put first on it breaks only their import.
    """
    import multiprocessing as mp

    from kvctl.bench import runner
    from kvctl.bench.spec import BenchSpec
    from kvctl.tier.targets import Target

    stale = tmp_path / "stale" / "kvctl" / "bench"
    stale.mkdir(parents=True)
    for f in (stale.parent / "__init__.py", stale / "__init__.py", stale / "worker.py"):
        f.write_text("")
    monkeypatch.setattr(runner, "_mp_context", lambda: mp.get_context("spawn"))
    monkeypatch.syspath_prepend(str(tmp_path / "stale"))
    spec = BenchSpec(chunk_bytes=1000, batch=2, keys=4, duration_s=0.5, timeout_s=1)
    t0 = time.monotonic()
    run = runner.run_once([Target(0, "127.0.0.1", valkey_server.port, valkey_server.url)], 1, "get", "kvctl-bench:t:", 4, spec)
    assert time.monotonic() - t0 < 5  # not the 31 s start wait plus the run: the dead client is noticed at once
    inst = run.per_instance[0]
    assert inst.errors == 1 and run.ops == 0
    assert "exited with code 1 before reporting: ImportError: cannot import name 'WorkerConfig'" in inst.first_error


def set_calls(port: int) -> int:
    with redis.Redis(port=port, socket_timeout=1) as r:
        return int(r.info("commandstats").get("cmdstat_set", {}).get("calls", 0))


def test_keys_rewritten_by_a_sigkilled_write_run_keep_their_ttl(valkey_server, tmp_path):
    """SIGKILL in the middle of a --write SET run: every bench key still carries a TTL (SET ... EX).

    Before, the SET run used plain SETs (which drop a key's TTL) and gave the TTL back
    only after the run, so a killed run left its rewritten keys on the tier for good.
    """
    bench = start_bench(["--valkey", valkey_server.url, *SMALL, "--write", "--duration", "20", "--timeout", "1"], tmp_path)
    deadline = time.monotonic() + 30
    while set_calls(valkey_server.port) < 16 + 40:  # 16 populate SETs, then the SET run's clients
        assert bench.poll() is None, bench.communicate()
        assert time.monotonic() < deadline, "the SET run never started"
        time.sleep(0.1)
    procs = psutil.Process(bench.pid).children(recursive=True)
    os.killpg(bench.pid, signal.SIGKILL)  # the bench's own session: the bench and its clients, nothing else
    bench.communicate(timeout=30)
    psutil.wait_procs(procs, timeout=10)
    r = redis.Redis(port=valkey_server.port)
    keys = list(r.scan_iter("kvctl-bench:*"))
    assert len(keys) == 16
    # 2 runs (SET, GET) × (30 s start wait + 1 + 20 + 1 + 1 grace + 2 × 2 s INFO) + 60 s margin = 174 s
    ttls = [r.ttl(k) for k in keys]
    assert all(0 < t <= 174 for t in ttls), ttls
