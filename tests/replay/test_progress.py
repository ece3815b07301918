"""Issue 31, item 6: `kvctl replay` into a pipe prints progress lines on stderr (a line at the start, every few
seconds, and at the end), never on stdout; with --json stdout is the JSON alone."""

from __future__ import annotations

import json

from tests.progress_helpers import progress_lines, run_piped


def test_replay_prints_progress_lines_on_stderr_without_a_tty(standin_factory, tmp_path):
    server = standin_factory("--delay-s", "0.05")
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"offset_s": i * 0.5, "prompt": f"hello {i}"}) + "\n" for i in range(14)))
    res = run_piped(["replay", str(trace), "--engine-url", server.url, "--out", str(tmp_path / "run.jsonl")], tmp_path)
    assert res.returncode == 0, res.stderr
    lines = progress_lines(res.stderr)
    assert len(lines) >= 3, res.stderr  # 6.5 s of offsets: started, one 5 s in, done
    assert "0/14 finished" in lines[0] and "14/14 finished" in lines[-1], lines
    assert not progress_lines(res.stdout)
    res = run_piped(["replay", str(trace), "--engine-url", server.url, "--out", str(tmp_path / "run2.jsonl"), "--speed", "10",
                     "--json"], tmp_path)
    assert res.returncode == 0, res.stderr
    json.loads(res.stdout)
    assert not progress_lines(res.stdout)
