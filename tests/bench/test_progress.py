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
