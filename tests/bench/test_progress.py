"""Issue 31, item 6: `kvctl bench` into a pipe prints a line per run (and every few seconds) on stderr, never on
stdout; with --json stdout is the JSON alone."""

from __future__ import annotations

import json

from tests.progress_helpers import progress_lines, run_piped


def test_bench_prints_a_line_per_run_on_stderr_without_a_tty(valkey_server, tmp_path):
    args = ["bench", "--valkey", valkey_server.url, "--chunk-bytes", "1e6", "--batch", "2", "--keys", "8", "--duration", "1",
            "--write"]
    res = run_piped(args, tmp_path)
    assert res.returncode == 0, res.stderr
    lines = progress_lines(res.stderr)
    assert any("SET 1 instance(s) × 1 client(s)" in ln for ln in lines), res.stderr
    assert any("GET 1 instance(s) × 1 client(s)" in ln for ln in lines), res.stderr
    assert "done" in lines[-1], lines
    assert not progress_lines(res.stdout)
    res = run_piped([*args, "--json"], tmp_path)
    assert res.returncode == 0, res.stderr
    json.loads(res.stdout)
    assert not progress_lines(res.stdout)


def test_the_tracker_turns_run_progress_into_steps_of_one_bar():
    """Issue 32 item 2: bench's progress tracking is kvctl.bench.session's, not the command's: each run advances
    the bar by the seconds it ran, one that ended early is completed when the next starts."""
    from kvctl.bench.session import ProgressTracker  # noqa: PLC0415

    steps = []
    track = ProgressTracker(lambda seconds, **kw: steps.append((round(seconds, 3), kw.get("step"))))
    track("GET 1×1", 0.5, 2.0, 1.0)
    track("GET 1×1", 1.5, 2.0, 1.2)
    track("GET 2×1", 0.25, 2.0, 2.0)  # the first run stopped at 1.5 of its 2 s
    assert steps == [(0.5, "GET 1×1"), (1.0, "GET 1×1"), (0.5, None), (0.25, "GET 2×1")]
    assert sum(s for s, _ in steps) == 2.25
