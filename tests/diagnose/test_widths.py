"""Issue 48 item 16 (diagnose and replay): no 90-character label widening the diagnose summary, no path wrapped inside.

The summary's label column is as wide as its longest label: "typical (median) prompt tokens, exact mean: every
prompt in one histogram bucket (sum/count)" made it 109 columns wide in a pipe (and 160 beside the findings). The
replay's title, ``Replay of TRACE → RUN FILE``, was a table title that rich wrapped inside a path.
"""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.diagnose.capture import save_capture
from kvctl.replay.sender import ReplayResult
from kvctl.records.trace import read_trace
from kvctl.views.diagnose import show_capture
from kvctl.views.replay import show_replay
from tests.diagnose import paper_runs as PR


def test_the_diagnose_summary_fits_in_eighty_columns(tmp_path):
    save_capture(PR.capture("R2"), tmp_path / "cap")
    out = CliRunner().invoke(cli, ["diagnose", "--from", str(tmp_path / "cap")]).stdout  # a pipe: 160 columns to fill
    lines = out.splitlines()
    start = lines.index(next(ln for ln in lines if ln.startswith("Diagnosis over")))  # after the verdict and its fix
    summary = lines[start + 1:lines.index(next(ln for ln in lines if ln.startswith("└"))) + 1]
    assert max(len(ln) for ln in summary) <= 80, "\n".join(summary)
    assert any("median prompt tokens (exact)" in ln for ln in summary), out


def _long_dir(tmp_path):
    d = tmp_path / ("a-rather-long-directory-name-for-the-on-call-runs-" * 2) / "2026-12-02"
    d.mkdir(parents=True)
    return d


def test_the_replay_dry_run_title_keeps_its_path_whole(tmp_path):
    trace = _long_dir(tmp_path) / "main.trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 100.0 * i, "input_length": 512, "output_length": 1, "hash_ids": [i]}) + "\n" for i in range(3)))
    out = CliRunner(env={"COLUMNS": "80"}).invoke(cli, ["replay", str(trace), "--dry-run"]).stdout
    assert any(str(trace) in ln for ln in out.splitlines()), out


def test_the_replay_summary_title_keeps_both_paths_whole(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    d = _long_dir(tmp_path)
    trace = d / "main.trace.jsonl"
    trace.write_text(json.dumps({"timestamp": 0.0, "input_length": 512, "output_length": 1, "hash_ids": [1]}) + "\n")
    out = str(d / "R2.jsonl")
    show_replay(read_trace(trace), ReplayResult(out, "m", 1, 1, 1, 0, 1, 0, 0.5, False, None), as_json=False)
    lines = capsys.readouterr().out.splitlines()
    assert any(str(trace) in ln for ln in lines) and any(out in ln for ln in lines), "\n".join(lines)
    assert f"kvctl report {out}" in lines, "\n".join(lines)  # the next step's command too, whole


def test_a_saved_capture_is_named_with_its_path_whole(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    cap = _long_dir(tmp_path) / "cap"
    show_capture(cap, PR.capture("R4"), 1, 4, [], as_json=False)
    assert any(f"capture saved to {cap}" in ln for ln in capsys.readouterr().out.splitlines())
