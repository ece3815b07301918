"""How tests/ is laid out (issue 49 item 5): a folder per kvctl package it tests (tests/sim, tests/core, ...), one for
the command line as a whole (tests/cli) and one for whole-project checks (tests/project, this one); the environment is
a marker (``slow``, ``long``, ``gpu``), a folder only where the tests share an engine start (tests/engine, tests/gpu).
No test module sits at tests/ top level, every folder of test modules is a package (two folders may hold modules of
one name: tests/bench/test_progress.py, tests/diagnose/test_progress.py), and ARCHITECTURE.md's Tests section has a
line for every folder."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"


def loose_test_modules(tests: Path) -> list[str]:
    """The test modules at the top of ``tests`` (each belongs in the folder of what it tests)."""
    return sorted(p.name for p in tests.glob("test_*.py"))


def folders_without_init(tests: Path) -> list[str]:
    """The folders under ``tests`` holding test modules but no ``__init__.py``."""
    return sorted({str(p.parent.relative_to(tests)) for p in tests.rglob("test_*.py")
                   if p.parent != tests and not (p.parent / "__init__.py").is_file()})


def test_the_scans_find_a_planted_module_and_folder(tmp_path):
    (tmp_path / "test_loose.py").write_text("")
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "test_cost.py").write_text("")
    assert loose_test_modules(tmp_path) == ["test_loose.py"]
    assert folders_without_init(tmp_path) == ["core"]
    (tmp_path / "core" / "__init__.py").write_text("")
    assert folders_without_init(tmp_path) == []


def test_no_test_module_at_the_top_of_tests():
    loose = loose_test_modules(TESTS)
    assert not loose, ("test modules at the top of tests/ (move each into the folder of the kvctl package it tests, "
                       f"or tests/cli, tests/project: ARCHITECTURE.md, Tests): {loose}")


def test_every_folder_of_test_modules_is_a_package():
    assert not (missing := folders_without_init(TESTS)), f"test folders without an __init__.py: {missing}"


def test_architecture_has_a_line_for_every_test_folder():
    section = (ROOT / "ARCHITECTURE.md").read_text().split("\n## Tests\n", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"^\* `tests/([a-z_]+)/`", section, re.MULTILINE))
    folders = {p.parent.relative_to(TESTS).parts[0] for p in TESTS.rglob("test_*.py") if p.parent != TESTS}
    assert named == folders, (f"folders without a line in ARCHITECTURE.md's Tests section: {sorted(folders - named)}; "
                              f"lines for no folder: {sorted(named - folders)}")
