"""Issue 44 defect 7: a `deploy-valkey up` SIGKILLed at any point leaves nothing `down` cannot stop.

`down` finds a tier's servers by the directory itself (a valkey-server working in it), not only by the state
file, which a killed `up` may not have written yet; and `down --purge` never reports success while a server of
the directory still runs. The kill points are chosen by a wrapper around the real valkey-server
(``KVCTL_VALKEY_SERVER``) that SIGKILLs the `up` that spawned it, as the Nth server starts, then becomes that
server: the `up` dies between spawning a server and recording it. Real `kvctl` processes, real servers.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from kvctl.tier.server import find_valkey_server, port_in_use
from tests.hostile.helpers import kvctl_env
from tests.tier.helpers import free_base_port
from tests.tier.tier_procs import deploy, results, servers_in

K = 3


def _killer(tmp_path, at: int):
    """A valkey-server wrapper that SIGKILLs its parent (the `up`) when instance ``at`` of rank 0 starts."""
    w = tmp_path / "valkey-server-killer"
    w.write_text(f"""#!/bin/sh
case "$1" in *valkey-0-{at}.conf) kill -9 $PPID;; esac
exec {find_valkey_server()} "$@"
""")
    w.chmod(w.stat().st_mode | stat.S_IXUSR)
    return w


def _until(cond, limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.parametrize("at", range(K))
def test_down_purge_stops_every_server_of_an_up_killed_as_it_spawned_one(tmp_path, no_leftover_servers, at):
    d, home, base = tmp_path / "t", tmp_path / "home", free_base_port(K)
    ran = deploy(["up", "--ranks", "1", "--instances-per-rank", str(K), "--base-port", str(base), "--maxmemory", "96mb", "--dir", str(d)],
                 home, KVCTL_VALKEY_SERVER=str(_killer(tmp_path, at)))
    assert ran.returncode != 0  # killed
    _until(lambda: len(servers_in(d)) == at + 1)  # every server it spawned, the last one unrecorded or not
    _until(lambda: port_in_use(base + at))
    ran = deploy(["down", "--dir", str(d), "--purge", "--json"], home)
    assert ran.returncode == 0, ran.output
    assert set(results(ran).values()) <= {"stopped", "not running"} and list(results(ran).values()).count("stopped") == at + 1, ran.output
    assert servers_in(d) == [] and not any(port_in_use(base + n) for n in range(K))
    assert not d.exists()  # purged: what `up` wrote, the unrecorded server's files too


def test_down_without_a_state_file_stops_the_servers_working_in_the_dir(tmp_path, no_leftover_servers):
    """A killed `up` that never wrote its state file: `down` (no --purge) still stops the server, then says what it did."""
    d, home, base = tmp_path / "t", tmp_path / "home", free_base_port(K)
    deploy(["up", "--ranks", "1", "--instances-per-rank", str(K), "--base-port", str(base), "--maxmemory", "96mb", "--dir", str(d)],
           home, KVCTL_VALKEY_SERVER=str(_killer(tmp_path, 0)))
    _until(lambda: len(servers_in(d)) == 1 and port_in_use(base))
    (d / "kvctl-tier.json").unlink(missing_ok=True)  # as if the kill came before the first write
    ran = deploy(["down", "--dir", str(d), "--json"], home)
    assert ran.returncode == 0, ran.output
    assert list(results(ran).values()) == ["stopped"]
    assert servers_in(d) == [] and not port_in_use(base)
    ran = deploy(["down", "--dir", str(d)], home)  # nothing left: no tier there
    assert ran.returncode == 2 and "holds no kvctl tier" in ran.stderr


def test_down_purge_never_reports_success_while_a_server_of_the_dir_runs(tmp_path, no_leftover_servers):
    """A supervisor (as systemd's Restart=always would) starts the tier's server again as soon as `down` stops it:
    `down --purge` says so, exit 1, and purges nothing."""
    d, home, base = tmp_path / "t", tmp_path / "home", free_base_port(1)
    assert deploy(["up", "--ranks", "1", "--base-port", str(base), "--maxmemory", "64mb", "--dir", str(d)], home).returncode == 0
    assert deploy(["down", "--dir", str(d)], home).returncode == 0
    stop = tmp_path / "stop-supervising"
    sup = subprocess.Popen(["sh", "-c", f'while [ ! -e "{stop}" ]; do "{find_valkey_server()}" valkey-0.conf; done'], cwd=d,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _until(lambda: len(servers_in(d)) == 1 and port_in_use(base))
        ran = deploy(["down", "--dir", str(d), "--purge"], home)
        assert ran.returncode == 1, ran.output
        assert "still runs" in ran.stderr and "nothing was purged" in ran.stderr, ran.stderr
        assert (d / "valkey-0.conf").exists() and (d / "kvctl-tier.json").exists()
    finally:
        stop.touch()
        os.killpg(sup.pid, signal.SIGKILL)  # the supervisor this test started, and the server it runs
        sup.wait(10)
    _until(lambda: servers_in(d) == [])
    assert deploy(["down", "--dir", str(d), "--purge"], home).returncode == 0 and not d.exists()


@pytest.mark.parametrize("delay_s", [0.4, 0.8, 1.2])
def test_an_up_sigkilled_at_any_moment_leaves_nothing_down_cannot_stop(tmp_path, no_leftover_servers, delay_s):
    """SIGKILL at a moment, not a chosen spawn: before the directory exists, amid the spawns, or after `up` is done."""
    d, home, base = tmp_path / "t", tmp_path / "home", free_base_port(2 * K)
    up = subprocess.Popen([sys.executable, "-m", "kvctl.cli", "deploy-valkey", "up", "--ranks", "2", "--instances-per-rank", str(K),
                           "--base-port", str(base), "--maxmemory", "192mb", "--dir", str(d)],
                          env=kvctl_env(home), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(delay_s)
    up.kill()  # the `up` this test started
    up.wait(10)
    time.sleep(0.3)  # a server spawned at the kill finishes its exec
    ran = deploy(["down", "--dir", str(d), "--purge"], home)
    if ran.returncode == 2:  # killed before it started anything
        assert "holds no kvctl tier" in ran.stderr and servers_in(d) == [], ran.output
    else:
        assert ran.returncode == 0, ran.output
        assert servers_in(d) == [] and not d.exists()
    assert not any(port_in_use(base + n) for n in range(2 * K))
