"""The files plan, simulate and fleets read, and the work they are asked for (issue 30, items 5, 6 and 12).

Every input file goes through ``kvctl.core.files.read_regular`` with a cap and, for JSON, a depth bound: a FIFO
never blocks (it used to hang forever), ``/dev/zero`` is refused at once (it grew to 7.5 GB and a
MemoryError), 100,000 levels of nesting are a one-line error (a RecursionError), each exit 2. Real kvctl
processes under an address-space cap and a deadline, real FIFOs and devices.
"""

from __future__ import annotations

import json
import os

import pytest

from kvctl.records.trace import MAX_TOKENS
from tests.hostile.helpers import kvctl, limits, run_row, write_run_file

MODEL = ["--bytes-per-token", "48437.5", "--prefill-rate", "52200", "--t0", "0.33"]
POISSON = ["--arrival-rate", "1.21", "--prompt-tokens", "16310", "--requests", "200"]
FILE_OPTIONS = ["--bench", "--fit-from", "--trace"]
#: --bench's old names (issue 48: one option takes the bench file; these warn for one release, then read it as --bench)
OLD_BENCH_OPTIONS = ["--get-times-from", "--readers-from"]
DEEP = 100_000


def plan_args(option: str, path: str) -> list[str]:
    """``kvctl plan`` reading ``path`` through ``option``, every other input given inline."""
    workload = ["--trace", path, "--requests", "200"] if option == "--trace" else POISSON
    bandwidth = ["--bench", path] if option == "--bench" else ["--instance-gbps", "0.85"]
    extra = [option, path] if option not in ("--trace", "--bench") else []
    return ["plan", *workload, *MODEL, *bandwidth, *extra, "--slo-p99", "5", "--max-instances", "2"]


def _refused(res, says: str, warned: int = 0) -> None:
    assert res.returncode == 2, (res.returncode, res.output[-1500:])  # None: it hung until the test's deadline
    assert says in res.output and "Traceback" not in res.output, res.output[-1500:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 + warned and all("is renamed --bench" in ln for ln in lines[:warned]), res.stderr


# ----------------------------------------------------------------------------- item 5: caps and depth


@pytest.mark.parametrize("option", FILE_OPTIONS)
def test_a_fifo_as_an_input_file_is_refused_not_waited_on(tmp_path, option):
    fifo = tmp_path / "input.fifo"
    os.mkfifo(fifo)
    res = kvctl(plan_args(option, str(fifo)), tmp_path / "home", timeout_s=20)
    _refused(res, "not a regular file")


@pytest.mark.parametrize("option", FILE_OPTIONS)
def test_dev_zero_as_an_input_file_is_refused_at_once(tmp_path, option):
    res = kvctl(plan_args(option, "/dev/zero"), tmp_path / "home", timeout_s=20, preexec=limits(as_bytes=2 << 30))
    _refused(res, "not a regular file")
    assert res.maxrss_mb < 500, res.maxrss_mb


@pytest.mark.parametrize("option", ["--bench", *OLD_BENCH_OPTIONS])
def test_json_nested_100000_deep_is_a_one_line_error(tmp_path, option):
    deep = tmp_path / "deep.json"
    deep.write_text('{"runs": ' + "[" * DEEP + "]" * DEEP + "}")
    res = kvctl(plan_args(option, str(deep)), tmp_path / "home", timeout_s=20)
    _refused(res, "levels", warned=int(option in OLD_BENCH_OPTIONS))


@pytest.mark.parametrize("option", OLD_BENCH_OPTIONS)
def test_the_old_names_of_bench_read_through_it(tmp_path, option):
    """With --instance-gbps giving B, the bench file is still read (its spread and readers curve), through the caps."""
    fifo = tmp_path / "input.fifo"
    os.mkfifo(fifo)
    res = kvctl(plan_args(option, str(fifo)), tmp_path / "home", timeout_s=20)
    _refused(res, "not a regular file", warned=1)


@pytest.mark.parametrize("option", ["--fit-from", "--trace"])
def test_a_jsonl_line_nested_100000_deep_is_a_one_line_error(tmp_path, option):
    rows = [json.dumps(r) for r in ({"metadata": {}}, run_row(0))] if option == "--fit-from" else ['{"offset_s": 0, "prompt_tokens": 100}']
    f = tmp_path / "deep.jsonl"
    f.write_text("\n".join([*rows, '{"x": ' + "[" * DEEP + "]" * DEEP + "}"]) + "\n")
    res = kvctl(plan_args(option, str(f)), tmp_path / "home", timeout_s=20)
    _refused(res, "levels")


@pytest.mark.parametrize("option, cap", [("--bench", 64 << 20), ("--trace", 256 << 20)])
def test_a_file_over_its_cap_is_refused_with_the_cap(tmp_path, option, cap):
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate(cap + 1)  # sparse: the size is what counts, never read
    res = kvctl(plan_args(option, str(big)), tmp_path / "home", timeout_s=20)
    _refused(res, f"{cap:,}-byte cap")


def test_simulate_reads_its_files_with_the_same_caps(tmp_path):
    fifo = tmp_path / "trace.fifo"
    os.mkfifo(fifo)
    res = kvctl(["simulate", "--trace", str(fifo), *MODEL, "--instance-gbps", "0.85"], tmp_path / "home", timeout_s=20)
    _refused(res, "not a regular file")
    res = kvctl(["simulate", *POISSON, *MODEL, "--bench", "/dev/zero"], tmp_path / "home", timeout_s=20)
    _refused(res, "not a regular file")


# ----------------------------------------------------------------------------- item 12: one bound on prompt tokens


@pytest.mark.parametrize("field", ["prompt_tokens", "cached_tokens"])
def test_fit_from_refuses_token_counts_past_replays_cap(tmp_path, field):
    """A run-file row with prompt_tokens 1e18 still gave a PLAN; replay caps prompts at 10M tokens (MAX_TOKENS)."""
    rows = [run_row(i) for i in range(12)]
    rows[3][field] = 10**18
    run = write_run_file(tmp_path / "run.jsonl", rows)
    res = kvctl(plan_args("--fit-from", str(run)), tmp_path / "home", timeout_s=20)
    _refused(res, f"line 5: {field}")
    assert f"{MAX_TOKENS:,}" in res.output


def test_fit_from_at_the_cap_is_still_read(tmp_path):
    rows = [run_row(i, prompt_tokens=MAX_TOKENS, cached_tokens=MAX_TOKENS) for i in range(12)]
    res = kvctl([*plan_args("--fit-from", str(write_run_file(tmp_path / "run.jsonl", rows))), "--json"], tmp_path / "home", timeout_s=30)
    assert res.returncode == 0, res.output[-1500:]


# ----------------------------------------------------------------------------- item 6: plan's budget


def test_plan_refuses_a_search_past_its_time_budget_saying_how_much_was_asked(tmp_path):
    """``--max-instances 4096 --engines 1024`` still ran after 90 s; now it stops within seconds with the figures."""
    res = kvctl(["plan", "--arrival-rate", "1.21", "--prompt-tokens", "16310", *MODEL, "--instance-gbps", "1", "--slo-p99", "0.8",
                 "--max-instances", "4096", "--engines", "1024"], tmp_path / "home", timeout_s=40)
    _refused(res, "budget")
    flat = " ".join(res.output.split())
    assert "4,096" in flat and "1,024" in flat and "20,000" in flat, flat


def test_plan_refuses_requests_that_do_not_fit_in_memory(tmp_path):
    """simulate refused what did not fit; plan went on and died of a MemoryError."""
    res = kvctl(["plan", "--arrival-rate", "1.21", "--prompt-tokens", "16310", *MODEL, "--instance-gbps", "1", "--slo-p99", "5",
                 "--requests", "10000000", "--engines", "8"], tmp_path / "home", timeout_s=40, preexec=limits(as_bytes=2 << 30))
    _refused(res, "--requests 10,000,000 needs about")
