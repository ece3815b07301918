"""Issue 44 defect 1: `deploy-valkey down [--purge]` acts on the directory it is given, never on what a file in it says.

Every path `down --purge` deletes is derived from `--dir`; a process is stopped only when it is a valkey-server
working in that directory. A copied tier directory (`cp -a`) therefore stops and deletes nothing of the
original, and a state file naming other files gets nothing deleted. Real `kvctl` processes, real servers.
"""

from __future__ import annotations

import json
import shutil

import pytest

from kvctl.tier.server import port_in_use
from tests.tier.helpers import free_base_port
from tests.tier.tier_procs import deploy, results, servers_in


def _up(d, home, ranks: int = 2) -> int:
    base = free_base_port(ranks)
    ran = deploy(["up", "--ranks", str(ranks), "--base-port", str(base), "--maxmemory", "64mb", "--dir", str(d), "--json"], home)
    assert ran.returncode == 0, ran.output
    assert len(servers_in(d)) == ranks
    return base


def test_down_purge_of_a_copied_dir_leaves_the_original_tier_and_its_files(tmp_path, no_leftover_servers):
    d, copy, home = tmp_path / "t8", tmp_path / "t8copy", tmp_path / "home"
    base = _up(d, home)
    pids, files = servers_in(d), sorted(p.name for p in d.iterdir())
    shutil.copytree(d, copy, symlinks=True)  # cp -a ./t8 ./t8copy
    ran = deploy(["down", "--dir", str(copy), "--purge", "--json"], home)
    assert servers_in(d) == pids and all(port_in_use(base + r) for r in range(2))  # the original still runs
    assert sorted(p.name for p in d.iterdir()) == files  # and keeps every file
    assert ran.returncode == 0, ran.output
    assert set(results(ran).values()) == {"not ours"}, ran.output
    assert "another directory" in " ".join(ran.stderr.split())
    assert not copy.exists()  # the copy's own files: nothing of it ran
    ran = deploy(["down", "--dir", str(d), "--purge", "--json"], home)
    assert ran.returncode == 0, ran.output
    assert set(results(ran).values()) == {"stopped"}
    assert servers_in(d) == [] and not d.exists()


def test_down_of_a_moved_dir_stops_its_tier(tmp_path, no_leftover_servers):
    """The other side of the rule: a tier whose directory was renamed is still that directory's (the servers work in it)."""
    d, moved, home = tmp_path / "t", tmp_path / "t-moved", tmp_path / "home"
    _up(d, home)
    d.rename(moved)
    ran = deploy(["down", "--dir", str(moved), "--purge", "--json"], home)
    assert ran.returncode == 0, ran.output
    assert set(results(ran).values()) == {"stopped"} and servers_in(moved) == [] and not moved.exists()


@pytest.mark.parametrize("key", ["logfile", "config", "pidfile", "engine_password_file", "dir"])
def test_a_state_file_naming_another_file_gets_nothing_deleted(tmp_path, no_leftover_servers, key):
    d, home = tmp_path / "t", tmp_path / "home"
    _up(d, home, ranks=1)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "valkey-0.log").write_text("keep me\n")
    (victim / "keep.txt").write_text("keep me\n")
    state_file = d / "kvctl-tier.json"
    good = state_file.read_text()
    state = json.loads(good)
    if key == "dir":
        state["dir"] = str(victim)
    elif key == "engine_password_file":
        state[key] = str(victim / "keep.txt")
    else:
        state["instances"][0][key] = str(victim / "keep.txt")
    state_file.write_text(json.dumps(state))
    ran = deploy(["down", "--dir", str(d), "--purge"], home)
    assert sorted(p.name for p in victim.iterdir()) == ["keep.txt", "valkey-0.log"], ran.output
    if key == "dir":  # the recorded directory is not used: the tier in --dir is stopped and purged
        assert ran.returncode == 0, ran.output
    else:
        assert ran.returncode == 2, ran.output
        assert key in ran.stderr and len(ran.stderr.strip().splitlines()) == 1, ran.stderr
        state_file.write_text(good)
        assert deploy(["down", "--dir", str(d), "--purge"], home).returncode == 0
    assert servers_in(d) == [] and not d.exists()
