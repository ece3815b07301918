"""Run files: what RunWriter puts on disk line by line, and what read_run accepts or refuses (real files)."""

from __future__ import annotations

import json
import os

import pytest

from kvctl.core.errors import InvalidInput
from kvctl.records.runfile import RunWriter, read_run

META = {"trace": "t.jsonl", "engine_url": "http://127.0.0.1:8000"}


def _row(i: int, latency: float = 0.5, status: str = "ok") -> dict:
    return {"index": i, "scheduled_s": i * 1.0, "sent_s": i * 1.0, "first_token_s": i + 0.1, "finished_s": i + latency,
            "latency_s": latency, "prompt_tokens": 100, "cached_tokens": 50, "status": status}


def test_each_line_is_on_disk_as_soon_as_written(tmp_path):
    path = tmp_path / "run.jsonl"
    w = RunWriter(path, META)
    assert json.loads(path.read_text()) == {"metadata": META}  # before any row: a crash keeps the metadata
    w.row(_row(0))
    w.row(_row(1, status="HTTP 500"))
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[2])["status"] == "HTTP 500" and w.rows == 2
    w.close({"finished": 2})
    w.close({"finished": 99})  # a second close writes nothing
    run = read_run(path)
    assert run.metadata == META and [r["index"] for r in run.rows] == [0, 1]
    assert run.summary == {"finished": 2} and run.name == "run"


def test_a_run_cut_short_reads_without_its_summary(tmp_path):
    path = tmp_path / "cut.jsonl"
    w = RunWriter(path, META)
    w.row(_row(0))
    with open(path, "a") as fh:
        fh.write("\n")  # a blank line is skipped
    run = read_run(path)  # never closed: as after a SIGKILL
    assert run.summary is None and len(run.rows) == 1


def test_writer_refuses_to_overwrite_unless_told(tmp_path):
    path = tmp_path / "run.jsonl"
    path.write_text("old\n")
    with pytest.raises(InvalidInput, match="exists"):
        RunWriter(path, META)
    assert path.read_text() == "old\n"
    RunWriter(path, META, overwrite=True).close({})
    assert read_run(path).summary == {}


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_writer_names_an_unwritable_path(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises(InvalidInput, match="cannot write --out"):
        RunWriter(ro / "run.jsonl", META)


def test_writer_missing_directory(tmp_path):
    with pytest.raises(InvalidInput, match="cannot write --out"):
        RunWriter(tmp_path / "no" / "such" / "run.jsonl", META)


@pytest.mark.parametrize(
    "lines, message",
    [
        ([{"index": 0}], "no {\"metadata\""),  # a trace, not a run
        ([{"metadata": {}}, "{broken"], "line 2: not JSON"),
        ([{"metadata": {}}, [1, 2]], "line 2: not a JSON object"),
        ([{"metadata": {}}, {k: v for k, v in _row(0).items() if k != "latency_s"}], "line 2: missing latency_s"),
        ([{"metadata": {}}, _row(0, latency=-1.0)], "latency_s must be a non-negative number"),
        ([{"metadata": {}}, {**_row(0), "status": 200}], "status must be a string"),
    ],
)
def test_read_names_file_and_line_of_what_is_wrong(tmp_path, lines, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    with pytest.raises(InvalidInput, match=message) as e:
        read_run(path)
    assert str(path) in str(e.value)


def test_failed_requests_need_no_latency(tmp_path):
    path = tmp_path / "errs.jsonl"
    path.write_text(json.dumps({"metadata": {}}) + "\n" + json.dumps({**_row(0, status="timeout"), "latency_s": None}) + "\n")
    (row,) = read_run(path).rows
    assert row["status"] == "timeout" and row["latency_s"] is None


def test_unreadable_run_file(tmp_path):
    with pytest.raises(InvalidInput, match="cannot read run file"):
        read_run(tmp_path / "missing.jsonl")
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(InvalidInput, match="run file .* is not UTF-8 text"):
        read_run(tmp_path / "bin.jsonl")
