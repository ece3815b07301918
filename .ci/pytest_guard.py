#!/usr/bin/env python3
"""Run pytest and fail unless it really ran every test it collected (issue 44 defect 20, a false green).

    python .ci/pytest_guard.py -- [pytest args...]

Runs ``sys.executable -m pytest ARGS`` as a child, passes its output through unchanged (stdout and stderr
together, byte for byte), and exits non-zero, with one line on stderr saying why, when:

* the child's exit code is not 0 (5: no tests were collected), or
* pytest's final summary line (``=== 3 passed, 1 skipped in 1.2s ===``; ``3 passed in 1.2s`` under ``-q``) is
  missing: the process ended inside the run (a test or the code under test called ``os._exit(0)``), or
* the tests the summary counts (passed + failed + skipped + xfailed + xpassed + errors) are fewer than the tests
  selected (collected minus deselected), or fewer tests finished than were selected.

A run that a test ends with ``os._exit(0)`` exits 0 with no summary: make and CI took it for a pass. The
selected and finished counts come from this file loaded into the child as a pytest plugin (``-p pytest_guard``),
which writes them to a JSON file the guard names in ``PYTEST_GUARD_REPORT``; the text of the output (``collected
N items / M deselected``) is the fallback. Stdlib only.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPORT_ENV = "PYTEST_GUARD_REPORT"
ANSI = re.compile(rb"\x1b\[[0-9;]*m")
#: the final summary: "==== 2 passed, 1 skipped in 1.48s ====", "2 passed in 0.1s (0:00:00)" (-q), "no tests ran in 0.01s"
SUMMARY = re.compile(r"^(?:=+ )?(?P<body>(?:\d+ [a-z]+(?:, )?)+|no tests ran) in [\d.]+s(?: \([\d:]+\))?(?: =+)?$")
COUNT = re.compile(r"(\d+) ([a-z]+)")
COLLECTED = re.compile(r"^collected (\d+) items?(?: / (\d+) deselected)?")
RAN = ("passed", "failed", "skipped", "xfailed", "xpassed", "error", "errors")
EXIT_MEANING = {1: "tests failed", 2: "interrupted or a usage/collection error", 3: "pytest's internal error",
                4: "pytest usage error", 5: "no tests were collected"}


# --------------------------------------------------------------------------- the plugin, inside the child pytest

def _write_report(**fields: Any) -> None:
    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    try:
        old = json.loads(Path(path).read_text() or "{}")
    except (OSError, ValueError):
        old = {}
    Path(path).write_text(json.dumps({**old, **fields}))


_finished: list[str] = []


def pytest_collection_finish(session: Any) -> None:
    _write_report(selected=len(session.items), pid=os.getpid())


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    _finished.append(nodeid)


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    _write_report(finished=len(set(_finished)), exitstatus=int(exitstatus), session_finished=True)


# --------------------------------------------------------------------------- the guard

class Watch:
    """What the guard reads from the child's output, one complete line at a time."""

    def __init__(self) -> None:
        self.partial = b""
        self.summary: str | None = None
        self.collected: int | None = None
        self.deselected = 0

    def feed(self, data: bytes) -> None:
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        for line in lines:
            self.line(line)

    def line(self, raw: bytes) -> None:
        text = ANSI.sub(b"", raw).decode("utf-8", "replace").strip()
        m = COLLECTED.match(text)
        if m:
            self.collected, self.deselected = int(m.group(1)), int(m.group(2) or 0)
        elif SUMMARY.match(text):
            self.summary = text

    def close(self) -> None:
        if self.partial:
            self.line(self.partial)
            self.partial = b""


def counted(summary: str) -> tuple[int, int]:
    """(tests the summary says ran, tests it says were deselected)."""
    counts: dict[str, int] = {}
    for n, word in COUNT.findall(summary):
        counts[word] = counts.get(word, 0) + int(n)
    return sum(counts.get(w, 0) for w in RAN), counts.get("deselected", 0)


def verdict(rc: int, watch: Watch, report: dict[str, Any], collect_only: bool = False) -> str | None:
    """Why the run is not a pass, or None."""
    if rc != 0:
        return f"pytest exited {rc} ({EXIT_MEANING.get(rc, 'killed by a signal' if rc < 0 else 'unknown')})"
    if watch.summary is None:
        return ("pytest exited 0 without its summary line: the run ended early (a test, or the code it runs, ended the "
                "process, e.g. os._exit(0)); -qq hides the summary too, and the guard needs it")
    if not report.get("session_finished") and report:
        return "pytest exited 0 but its session never finished (a test ended the process)"
    if collect_only:
        return None
    ran, deselected_summary = counted(watch.summary)
    selected = report.get("selected")
    if selected is None and watch.collected is not None:
        selected = watch.collected - max(watch.deselected, deselected_summary)
    if selected is None:
        return "cannot tell how many tests were collected (no 'collected N items' line and no report from the plugin)"
    if ran < selected:
        return f"the summary counts {ran} test(s) of the {selected} selected: {selected - ran} lost ({watch.summary!r})"
    finished = report.get("finished")
    if finished is not None and finished < selected:
        return f"{finished} test(s) finished of the {selected} selected: {selected - finished} lost"
    return None


def run(args: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="pytest-guard-") as tmp:
        report_path = Path(tmp) / "report.json"
        report_path.write_text("{}")
        here = str(Path(__file__).resolve().parent)
        env = {**os.environ, REPORT_ENV: str(report_path),
               "PYTHONPATH": os.pathsep.join([here, *filter(None, [os.environ.get("PYTHONPATH")])])}
        cmd = [sys.executable, "-m", "pytest", "-p", "pytest_guard", *args]
        watch = Watch()
        out = sys.stdout.buffer
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        assert proc.stdout is not None
        try:
            while True:
                try:
                    data = os.read(proc.stdout.fileno(), 65536)
                except KeyboardInterrupt:  # Ctrl-C reached the child as well: let it print what it ran
                    continue
                if not data:
                    break
                out.write(data)
                out.flush()
                watch.feed(data)
            watch.close()
            rc = proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()
        try:
            report = json.loads(report_path.read_text() or "{}")
        except (OSError, ValueError):
            report = {}
    why = verdict(rc, watch, report, collect_only=bool({"--collect-only", "--co"} & set(args)))
    if why is None:
        return 0
    print(f"pytest_guard: FAILED: {why}", file=sys.stderr, flush=True)
    return rc if rc > 0 else 1


def main(argv: list[str]) -> int:
    args = argv[1:]
    if args and args[0] == "--":
        args = args[1:]
    return run(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
