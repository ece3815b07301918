"""Issue 44 defect 9: the loser of two racing `deploy-valkey up`s removes nothing of the winner's.

The race, made deterministic: this test's `up` (the loser) finds no directory, and the winner creates it and
takes its lock (``.kvctl-tier.lock``, flock) just before the loser tries to: the moment is chosen by a trace
hook on the loser's call of ``tier_lock``, the winner is a lock held by this test. The loser must be refused
and leave the winner's lock file and directory alone, so that a third, real `kvctl deploy-valkey up` is
refused too while the winner holds the lock.
"""

from __future__ import annotations

import fcntl
import os
import sys

import pytest

from kvctl.tier import local
from tests.tier.helpers import free_base_port, port_in_use
from tests.tier.tier_procs import deploy, servers_in


class Winner:
    """The other `up`: creates the directory and holds its lock, from the moment ``arm`` fires."""

    def __init__(self, d) -> None:
        self.d, self.fd = d, -1

    def take(self) -> None:
        self.d.mkdir(exist_ok=True)
        self.fd = os.open(self.d / local.LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.pwrite(self.fd, b"99999 deploy-valkey up\n", 0)

    def still_owns_the_lock_file(self) -> bool:
        try:
            now = os.stat(self.d / local.LOCK_FILE)
        except FileNotFoundError:
            return False
        held = os.fstat(self.fd)
        return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)


def _on_lock_call(winner: Winner):
    """A trace function that runs ``winner.take()`` once, as the loser calls kvctl.tier.local.tier_lock."""
    fired = []

    def trace(frame, event, arg):
        if event == "call" and not fired and frame.f_code.co_name == "tier_lock" and frame.f_globals.get("__name__", "").startswith("kvctl.tier."):
            fired.append(True)
            winner.take()
        return None

    return trace, fired


def test_the_loser_of_a_race_leaves_the_winners_lock_and_dir(tmp_path, no_leftover_servers):
    d, base = tmp_path / "t", free_base_port(1)
    winner = Winner(d)
    trace, fired = _on_lock_call(winner)
    try:
        sys.settrace(trace)
        try:
            with pytest.raises(local.TierBusy, match="another kvctl"):
                local.up(local.UpRequest(d, 1, base, "64mb"))
        finally:
            sys.settrace(None)
        assert fired, "the loser never called tier_lock"
        assert d.is_dir() and winner.still_owns_the_lock_file()
        third = deploy(["up", "--ranks", "1", "--base-port", str(base), "--maxmemory", "64mb", "--dir", str(d)], tmp_path / "home")
        assert third.returncode == 1 and "another kvctl (pid 99999, deploy-valkey up)" in third.stderr, third.output
        assert servers_in(d) == [] and not port_in_use(base)
    finally:
        winner.release()
        if servers_in(d):  # the third `up` got in: stop what it started
            local.down(d)


def test_a_lock_file_replaced_while_a_kvctl_opens_it_is_not_taken(tmp_path):
    """The lock is the file at the path, not an inode that was unlinked: a kvctl that opened the old lock file just
    before its holder removed it (and another created and took a new one) must not count as holding the directory
    when its flock on the old file succeeds."""
    d = tmp_path / "t"
    d.mkdir()
    (d / local.LOCK_FILE).write_text("")
    winner = Winner(d)

    def profile(frame, event, arg):
        if event == "c_call" and arg is fcntl.flock and winner.fd < 0 and frame.f_code.co_name == "tier_lock":
            os.unlink(d / local.LOCK_FILE)  # the old holder's cleanup, then a new holder
            winner.take()

    try:
        sys.setprofile(profile)
        try:
            with pytest.raises(local.TierBusy, match="another kvctl"):
                with local.tier_lock(d, "deploy-valkey down"):
                    pass
        finally:
            sys.setprofile(None)
        assert winner.fd >= 0 and winner.still_owns_the_lock_file()
    finally:
        winner.release()
