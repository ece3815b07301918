"""Hostile runs against what kvctl writes and prints: planted links, file modes, secrets in errors
and in URLs (issue 21, "Security"). Real kvctl processes, real files, links, FIFOs and HTTP servers."""

from __future__ import annotations

import datetime as _dt
import os
import stat
from pathlib import Path

from tests.hostile.helpers import kvctl, limits

SECRET = "s3cr3t-PW-4c1d"
CONFIG = f"""\
chunk_size: 256
remote_url: "resp://:{SECRET}@valkey-{{rank}}:6379"
enable_async_loading: false
"""


def test_backup_never_follows_a_link_planted_at_the_guessable_name(tmp_path):
    """Item 1: dangling links at every ``lm.yaml.<stamp>.bak`` name of the next minute point outside the
    directory; the flip must not create their targets, and its backup is a new regular file."""
    shared, outside = tmp_path / "shared", tmp_path / "outside"
    shared.mkdir()
    outside.mkdir()
    cfg = shared / "lm.yaml"
    cfg.write_text(CONFIG)
    cfg.chmod(0o600)
    now = _dt.datetime.now()
    for s in range(-2, 60):
        stamp = (now + _dt.timedelta(seconds=s)).strftime("%Y%m%dT%H%M%S")
        for suffix in ("", "-1", "-2"):
            (shared / f"lm.yaml.{stamp}{suffix}.bak").symlink_to(outside / f"stolen-{s}{suffix}")
    res = kvctl(["loading", "async", "--config", str(cfg)], tmp_path / "home")
    assert res.returncode == 0, res.output
    assert list(outside.iterdir()) == [], "the backup followed a planted link out of the directory"
    baks = [p for p in shared.iterdir() if p.name.endswith(".bak") and not p.is_symlink()]
    assert len(baks) == 1 and baks[0].read_text() == CONFIG
    assert stat.S_IMODE(baks[0].lstat().st_mode) == 0o600
    assert "enable_async_loading: true" in cfg.read_text()


def test_a_backup_is_never_readable_by_others_not_even_half_written(tmp_path):
    """Item 2: the backup is created 0600. A real write failure half-way through it (RLIMIT_FSIZE one
    byte short of the old text; the new text, one byte shorter, fits) must leave nothing group- or
    world-readable behind; the run fails cleanly and the config is unchanged."""
    cfg = tmp_path / "lm.yaml"
    cfg.write_text(CONFIG)
    cfg.chmod(0o600)
    new_len = len(CONFIG.replace("false", "true").encode())
    res = kvctl(["loading", "async", "--config", str(cfg)], tmp_path / "home", preexec=limits(fsize=new_len, umask=0o022))
    assert res.returncode == 1 and "cannot back up" in res.output, res.output
    assert cfg.read_text() == CONFIG
    leaked = {p.name: oct(stat.S_IMODE(p.lstat().st_mode)) for p in tmp_path.iterdir() if p.is_file() and p.lstat().st_mode & 0o077}
    assert leaked == {}, f"readable by others: {leaked}"
    assert [p.name for p in tmp_path.iterdir() if p.is_file()] == ["lm.yaml"]  # no half backup left either


def test_env_file_errors_never_quote_the_file(tmp_path):
    """Item 4: ``--env-file`` pointed at a secret (a token file, a key) is refused without echoing it."""
    token = tmp_path / "engine.token"
    token.write_text(f"{SECRET}\n")
    for cmd in ("show", "async"):
        res = kvctl(["loading", cmd, "--env-file", str(token)], tmp_path / "home")
        assert res.returncode == 2 and "not an env file" in res.output and "line 1" in res.output, res.output
        assert SECRET not in res.output and SECRET[:8] not in res.output
    assert token.read_text() == f"{SECRET}\n"
