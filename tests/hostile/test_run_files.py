"""Hostile run files (issue 44, items 17 and 18): one reader (``kvctl.records.runfile.read_run``) with one set of
rules for every command that reads a ``kvctl replay --out`` file: ``report``, ``simulate``/``plan --fit-from``
(the T0 fit), ``--t0-engine-share fit``, ``--hit-gpu-s fit``, and ``--trace RUN`` (a run file replayed or
simulated as a trace).

* every row names its request (``index``), once: a repeated index is refused naming both lines (2,000 copies of a
  row made a 32-request run report 2,032 requests and a p50 of 1.17 s for 0.291 s);
* every time is a finite number of seconds in [0, RUN_FILE_MAX_TIME_S] (1e308 passed and printed a 309-digit T0);
* a torn last line (a hard stop mid-write) is skipped with the same warning by every reader (``--fit-from``
  took it, ``--t0-engine-share fit`` refused it).

Real files, the real CLI (click's runner: no server or child process is involved).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.core.errors import InvalidInput
from kvctl.core.thresholds import RUN_FILE_MAX_TIME_S
from kvctl.records.runfile import read_run
from tests.hostile.helpers import run_row

MODEL = ["--bytes-per-token", "48437.5", "--prefill-rate", "52200", "--t0", "0.33", "--instance-gbps", "10"]
POISSON = ["--arrival-rate", "0.5", "--prompt-tokens", "16310", "--requests", "200"]
REQUESTS = 32
TORN = "line {n} is torn (the run stopped while writing it): skipped"


def row(i: int) -> dict:
    """Request i of a run: alone in flight, a hit of 16,310 tokens (0.291 s), its trace line kept (a run replays)."""
    return {**run_row(i, latency_s=0.291), "request": {"offset_s": float(i), "prompt_tokens": 16310}}


def lines(rows: list[dict] | None = None, summary: bool = True) -> list[str]:
    body = [{"metadata": {"engine_url": "http://127.0.0.1:1"}}, *(rows if rows is not None else [row(i) for i in range(REQUESTS)])]
    return [json.dumps(x) for x in body] + ([json.dumps({"summary": {"interrupted": False}})] if summary else [])


def write(tmp_path: Path, text_lines: list[str], end: str = "\n") -> str:
    p = tmp_path / "run.jsonl"
    p.write_text("\n".join(text_lines) + end)
    return str(p)


#: every command that reads a run file, and how
READERS = {
    "report": lambda run: ["report", run, "--json"],
    "simulate --fit-from": lambda run: ["simulate", *POISSON, *MODEL, "--fit-from", run, "--json"],
    "plan --fit-from": lambda run: ["plan", *POISSON, *MODEL, "--fit-from", run, "--slo-p99", "5", "--max-instances", "2", "--json"],
    "--t0-engine-share fit": lambda run: ["simulate", *POISSON, *MODEL, "--fit-from", run, "--t0-engine-share", "fit", "--json"],
    "--hit-gpu-s fit": lambda run: ["simulate", *POISSON, *MODEL, "--fit-from", run, "--hit-gpu-s", "fit", "--fit-gpu-util", "50", "--json"],
    "--trace": lambda run: ["simulate", "--trace", run, "--hits-from-trace", *MODEL],
}


def invoke(args: list[str]):
    return CliRunner().invoke(cli, args)


def refused(r, *says: str) -> str:
    assert r.exit_code == 2, (r.exit_code, r.output[-1500:])
    assert "unexpected" not in r.output and "Traceback" not in r.output, r.output[-1500:]
    out = [x for x in r.stderr.strip().splitlines() if x.strip()]  # under --json stdout holds the error's JSON object
    assert len(out) == 1, r.output[-1500:]
    for s in says:
        assert s in out[0], out[0]
    return out[0]


def test_the_run_every_reader_is_given_reads_cleanly(tmp_path):
    """The baseline of the tests below: the 32-request run is accepted by every reader, and reported as 32."""
    run = write(tmp_path, lines())
    for name, args in READERS.items():
        r = invoke(args(run))
        assert r.exit_code in (0, 3, 4), (name, r.output[-1500:])
    d = json.loads(invoke(READERS["report"](run)).stdout)["runs"][0]
    assert d["requests"] == REQUESTS and d["p50_s"] == pytest.approx(0.291)


# ----------------------------------------------------------------------------- item 17: a row counted twice


@pytest.mark.parametrize("reader", sorted(READERS))
def test_two_thousand_copies_of_one_row_are_refused_by_every_reader(tmp_path, reader):
    rows = [row(i) for i in range(REQUESTS)] + [{**row(5), "latency_s": 1.17, "finished_s": 6.17, "first_token_s": 6.17}] * 2000
    run = write(tmp_path, lines(rows))
    msg = refused(invoke(READERS[reader](run)), run, "index 5", "line 7")
    assert "(and 1995 more)" in msg  # one line however many repeats


def test_a_repeated_index_is_refused_even_when_the_rows_differ(tmp_path):
    rows = [row(i) for i in range(REQUESTS)]
    rows[9] = {**rows[9], "index": 3}
    run = write(tmp_path, lines(rows))
    with pytest.raises(InvalidInput, match=r"line 11: index 3 is on line 5 too"):
        read_run(run)


@pytest.mark.parametrize("change,says", [
    (lambda r: r.pop("index"), "missing index"),
    (lambda r: r.update(index=None), "index must be"),
    (lambda r: r.update(index="7"), "index must be"),
    (lambda r: r.update(index=10**400), "index must be"),
    (lambda r: r.update(in_flight=10**400), "in_flight must be"),
])
def test_every_row_names_its_request(tmp_path, change, says):
    rows = [row(i) for i in range(REQUESTS)]
    change(rows[4])
    run = write(tmp_path, lines(rows))
    refused(invoke(READERS["report"](run)), run, "line 6", says)


def test_two_runs_in_one_file_are_refused(tmp_path):
    """`cat a.jsonl b.jsonl`: a second metadata line, and the indexes start over."""
    run = write(tmp_path, lines() + lines())
    refused(invoke(READERS["report"](run)), run, "metadata")


# ----------------------------------------------------------------------------- item 17: times out of any range

TIME_FIELDS = ["scheduled_s", "sent_s", "first_token_s", "finished_s", "latency_s"]
BAD_TIMES = {"1e308": "1e308", "10**400": "1" + "0" * 400, "negative": "-1", "NaN": "NaN", "Infinity": "Infinity",
             "past-the-cap": repr(RUN_FILE_MAX_TIME_S + 1)}


def _with_raw(base: dict, key: str, literal: str) -> str:
    rest = {k: v for k, v in base.items() if k != key}
    return json.dumps(rest)[:-1] + f', "{key}": {literal}}}'


@pytest.mark.parametrize("field", TIME_FIELDS)
@pytest.mark.parametrize("bad", sorted(BAD_TIMES))
def test_a_time_past_its_bounds_is_refused_naming_field_and_line(tmp_path, field, bad):
    text = lines()
    text[3] = _with_raw(row(2), field, BAD_TIMES[bad])
    run = write(tmp_path, text)
    refused(invoke(READERS["report"](run)), run, "line 4", field)


@pytest.mark.parametrize("reader", sorted(READERS))
def test_every_reader_refuses_a_time_of_1e308(tmp_path, reader):
    """1e308 as every hit's TTFT passed: T0 printed as a 309-digit number and the run was called stable."""
    rows = [{**row(i), "first_token_s": 1e308} for i in range(REQUESTS)]
    run = write(tmp_path, lines(rows))
    refused(invoke(READERS[reader](run)), run, "first_token_s")


@pytest.mark.parametrize("where,edit", [
    ("metadata.metrics_before", lambda m: m["metadata"].update(metrics_before={"vllm:external_prefix_cache_hits_total": 10**400})),
    ("summary.metrics_after", lambda s: s["summary"].update(metrics_after={"kvctl:remote_hit_tokens_total": 10**400})),
    ("summary.max_in_flight", lambda s: s["summary"].update(max_in_flight=10**400)),
])
def test_a_counter_past_a_float_is_refused_not_a_crash(tmp_path, where, edit):
    text = lines()
    at = 0 if where.startswith("metadata") else len(text) - 1
    obj = json.loads(text[at])
    edit(obj)
    text[at] = json.dumps(obj)
    run = write(tmp_path, text)
    refused(invoke(READERS["report"](run)), run, where)


# ----------------------------------------------------------------------------- item 18: a torn last line


@pytest.mark.parametrize("reader", sorted(READERS))
def test_every_reader_skips_a_torn_last_line_with_the_same_warning(tmp_path, reader):
    """A run stopped hard while writing its last row: no summary, half a line, no newline. Every reader takes the
    rows before it and says the same thing (it used to be taken silently by --fit-from and refused by
    --t0-engine-share fit and --trace)."""
    text = lines(summary=False)
    text.append(json.dumps(row(REQUESTS))[:40])
    run = write(tmp_path, text, end="")
    r = invoke(READERS[reader](run))
    assert r.exit_code in (0, 3, 4), (r.exit_code, r.output[-1500:])
    assert TORN.format(n=len(text)) in " ".join(r.output.split()), r.output[-1500:]  # a table title wraps


def test_a_torn_line_that_is_not_the_last_is_refused_by_every_reader(tmp_path):
    text = lines()
    text[5] = text[5][:30]
    run = write(tmp_path, text)
    for reader, args in READERS.items():
        refused(invoke(args(run)), run, "line 6", "not JSON")
