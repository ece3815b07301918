"""``kvctl drill --keep DIR`` and the drill's own errors (issue 30, items 1, 9 and 13).

A --keep that would lose something is refused before anything starts (exit 2): a non-empty
directory (the working directory too), a symbolic link, a directory that cannot be written. The
drill never deletes what it did not create, always removes its own work dir, and an error of a drill
that could not run quotes its child's log instead of pointing at a file it has already deleted.
Real kvctl processes; TMPDIR is the test's, so a work dir left behind is seen.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvctl.drill import scenarios as S
from kvctl.drill.run import Drill, DrillOptions
from kvctl.core.errors import KvctlError


def _drill(args: list[str], cwd: Path, tmp: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    tmp.mkdir(exist_ok=True)
    return subprocess.run([sys.executable, "-P", "-m", "kvctl.cli", "drill", "overload", "--duration", "8", *args],
                          cwd=cwd, capture_output=True, text=True, timeout=timeout, env={**os.environ, "TMPDIR": str(tmp)})


def _refused(r: subprocess.CompletedProcess, says: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout[-1000:], r.stderr[-1000:])
    assert says in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "tier:" not in r.stdout, "the drill started before refusing"


def unwritable_empty_dir(tmp_path: Path) -> Path:
    """An existing, empty directory this process cannot create files in (as root: one of sysfs)."""
    if os.geteuid() != 0:
        d = tmp_path / "read-only"
        d.mkdir()
        d.chmod(0o500)
        return d
    for cand in ("/sys/class/thermal", "/sys/kernel/security", "/sys/class/dma"):
        p = Path(cand)
        try:
            if p.is_dir() and not any(p.iterdir()):
                (p / "probe").touch()
                (p / "probe").unlink()
        except OSError:
            return p
    pytest.skip("no empty directory that root cannot write to")


@pytest.mark.parametrize("keep", ["d", "."])
def test_keep_refuses_a_directory_that_holds_files(tmp_path, keep):
    """Item 1: the issue's repro, ``--keep d`` deleted ``d/notes.txt``; ``--keep .`` emptied the working
    directory, then failed with "Invalid argument: '.'"."""
    d = tmp_path / "d"
    d.mkdir()
    (d / "notes.txt").write_text("x\n")
    r = _drill(["--keep", keep], tmp_path if keep == "d" else d, tmp_path / "tmp")
    _refused(r, "not empty")
    assert (d / "notes.txt").read_text() == "x\n"
    assert list((tmp_path / "tmp").iterdir()) == []


def test_keep_refuses_a_symbolic_link(tmp_path):
    """Item 9: a link at DIR (to an empty directory): the drill used to print PASS, then exit 1 with an
    OSError, keep nothing and leave its temp work dir behind."""
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    r = _drill(["--keep", "link"], tmp_path, tmp_path / "tmp")
    _refused(r, "symbolic link")
    assert (tmp_path / "link").is_symlink() and list(target.iterdir()) == []
    assert list((tmp_path / "tmp").iterdir()) == []


def test_keep_refuses_a_directory_it_cannot_write(tmp_path):
    """Item 9: an empty directory that cannot be written (probed, not guessed from the mode bits)."""
    d = unwritable_empty_dir(tmp_path)
    r = _drill(["--keep", str(d)], tmp_path, tmp_path / "tmp")
    _refused(r, "cannot be written")
    assert list((tmp_path / "tmp").iterdir()) == []


def test_keep_refuses_a_directory_it_cannot_create(tmp_path):
    r = _drill(["--keep", "/proc/self/kvctl-keep"], tmp_path, tmp_path / "tmp")
    _refused(r, "cannot be created")


def test_keep_with_all_checks_every_directory_before_the_first_drill(tmp_path):
    """--all keeps each drill in DIR/SCENARIO: a non-empty one of them refuses the whole run at once."""
    (tmp_path / "all" / "dead-instance").mkdir(parents=True)
    (tmp_path / "all" / "dead-instance" / "old.log").write_text("old\n")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    r = subprocess.run([sys.executable, "-P", "-m", "kvctl.cli", "drill", "--all", "--duration", "8", "--keep", "all"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60, env={**os.environ, "TMPDIR": str(tmp)})
    _refused(r, "not empty")
    assert (tmp_path / "all" / "dead-instance" / "old.log").read_text() == "old\n"


def test_a_keep_that_fails_at_the_end_still_removes_the_work_dir(tmp_path):
    """Item 9: the copy into --keep fails at cleanup (the directory cannot be created): the work dir is
    removed all the same and the failure is one message, not an OSError."""
    dr = Drill(S.SCENARIOS["overload"], DrillOptions(duration_s=8, keep_dir="/proc/self/kvctl-keep"), lambda line: None)
    (dr.work / "engine.log").write_text("something worth keeping\n")
    dr.cleanup()
    assert not dr.work.exists()
    assert dr.keep_error and "/proc/self/kvctl-keep" in dr.keep_error


def test_could_not_run_quotes_the_engine_log_it_deletes(tmp_path):
    """Item 13: a drill engine that exits at start: the error used to say "see /tmp/kvctl-drill-.../engine.log",
    a file the drill deletes on its way out. It now quotes the log's last lines."""
    dr = Drill(S.SCENARIOS["overload"], DrillOptions(duration_s=8), lambda line: None)
    try:
        with pytest.raises(KvctlError) as e:
            dr.start_engine(dr.engine_settings([]))  # no tier URL: the engine refuses its config and exits
    finally:
        dr.cleanup()
    msg = str(e.value)
    assert "remote_urls" in msg, msg  # the engine's own reason, from its log
    assert f"see {dr.work}" not in msg, msg  # nothing points the reader at a deleted file
    assert "\n" not in msg
