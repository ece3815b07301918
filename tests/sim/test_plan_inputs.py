"""Issue 48 item 10, `plan` (and `simulate`, which reads the same inputs) surprises: an explicit --t0 lost to the T0
fitted on --fit-from with only a note; a spurious "EXTRAPOLATED: T0 was fitted on hits of 4,096–4,096 cached tokens;
simulated hits span 4,160–4,160" (an engine caches whole chunks, the model loads the prompt); three options took one
`kvctl bench --save` file (--bench, --get-times-from, --readers-from); --fit-instances' help named an --instances that
plan does not have. Real run and bench files, kvctl's CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from kvctl.cli import cli
from tests.cli_helpers import _commands
from tests.hostile.helpers import run_row, write_run_file

S, R, GBPS = 274.5, 40960.0, 0.004  # the drill engine's s, R and loader (README, "Sizing a shared tier")
FITTED_T0 = 0.0615
WORKLOAD = ["--arrival-rate", "1", "--prompt-tokens", "4160", "--bytes-per-token", str(S), "--prefill-rate", str(R), "--requests", "300"]


@pytest.fixture
def run_file(tmp_path) -> str:
    """12 hits alone in flight, 4,096 of 4,160 tokens cached (the engine loads the whole chunks before the last token),
    each taking T0 = 0.0615 s more than its transfer at 0.004 GB/s and its 64-token tail."""
    t = FITTED_T0 + 4096 * S / (GBPS * 1e9) + 64 / R
    return str(write_run_file(tmp_path / "calib.jsonl", [run_row(i, 4160, 4096, t) for i in range(12)]))


@pytest.fixture
def sweep_file(tmp_path) -> str:
    """A `kvctl bench --sweep --save` file: one instance at 1, 2 and 4 clients, with batch percentiles."""
    runs = [{"op": "get", "instances": 1, "clients": c, "aggregate_gbps": g, "p50_batch_ms": 0.2, "p99_batch_ms": 0.4}
            for c, g in ((1, 0.5), (2, 0.6), (4, 0.62))]
    p = tmp_path / "sweep.json"
    p.write_text(json.dumps({"metadata": {}, "runs": runs}))
    return str(p)


def kvctl(*args: str):
    res = CliRunner().invoke(cli, [*args, "--json"])
    assert res.exit_code in (0, 3, 4, 9), (res.exit_code, res.output)
    return json.loads(res.stdout), res.stderr


# --- an explicit --t0 wins over the fit -------------------------------------------------------------------------------


def test_an_explicit_t0_wins_over_the_t0_fitted_on_the_run_and_the_note_says_so(run_file):
    plan = ["plan", *WORKLOAD, "--instance-gbps", str(GBPS), "--slo-p99", "1", "--max-instances", "2", "--fit-from", run_file]
    fitted, _ = kvctl(*plan)
    given, _ = kvctl(*plan, "--t0", "0.05")
    assert fitted["min_hit_tokens"] == pytest.approx(R * FITTED_T0, rel=0.01)  # no --t0: the run's T0
    assert given["min_hit_tokens"] == pytest.approx(R * 0.05)  # --t0 0.05 given: that, not the fit's 0.0615
    note = next(n for n in given["notes"] if "--t0" in n)
    assert "T0 0.05 s as given (--t0)" in note and "p50 0.061 s" in note and "drop --t0" in note, note
    sim = ["simulate", *WORKLOAD, "--instance-gbps", "0.02", "--t0", "0.05"]
    alone, _ = kvctl(*sim)
    with_run, _ = kvctl(*sim, "--fit-from", run_file)
    assert with_run["p99_s"] == pytest.approx(alone["p99_s"]) and with_run["p50_s"] == pytest.approx(alone["p50_s"])
    assert not with_run.get("extrapolated") and not alone.get("notes")


def test_a_fit_on_hits_of_whole_chunks_is_no_extrapolation_for_the_prompts_it_was_fitted_on(run_file):
    d, _ = kvctl("simulate", *WORKLOAD, "--instance-gbps", "0.02", "--fit-from", run_file)
    assert any("T0 from 12 hits" in n for n in d["notes"]) and not d["extrapolated"], d["extrapolated"]
    longer, _ = kvctl("simulate", *WORKLOAD[:2], "--prompt-tokens", "8000", *WORKLOAD[4:], "--instance-gbps", "0.02", "--fit-from", run_file)
    assert longer["extrapolated"] == ["T0 was fitted on hits of prompts of 4,160–4,160 tokens; simulated hits' prompts span 8,000–8,000"]


# --- one option takes the bench file ----------------------------------------------------------------------------------


def test_one_bench_option_reads_everything_a_bench_file_measured(sweep_file):
    d, _ = kvctl("simulate", *WORKLOAD, "--bench", sweep_file)
    notes = " ".join(d["notes"])
    assert d["bandwidth_basis"] == "bench_measured" and "GET time: lognormal σ" in notes and "throughput against readers" in notes, notes
    # the drill's case: B is the engine's own loader, the spread and the readers curve come from the bench
    given, err = kvctl("simulate", *WORKLOAD, "--instance-gbps", str(GBPS * 5), "--bench", sweep_file)
    assert given["bandwidth_basis"] == "instance_gbps" and "GET time: lognormal σ" in " ".join(given["notes"]) and not err
    assert any("--instance-gbps gives B" in n for n in given["notes"]), given["notes"]


def test_the_old_options_are_the_bench_option_and_warn(sweep_file, tmp_path):
    new, err = kvctl("plan", *WORKLOAD, "--instance-gbps", "0.02", "--bench", sweep_file, "--slo-p99", "1", "--max-instances", "2")
    assert not err
    old, err = kvctl("plan", *WORKLOAD, "--instance-gbps", "0.02", "--get-times-from", sweep_file, "--readers-from", sweep_file,
                     "--slo-p99", "1", "--max-instances", "2")
    assert old == new
    assert "--get-times-from is renamed --bench" in err and "--readers-from is renamed --bench" in err, err
    both, err = kvctl("plan", *WORKLOAD, "--bench", sweep_file, "--get-times-from", sweep_file, "--slo-p99", "1", "--max-instances", "2")
    assert "renamed --bench" in err
    other = tmp_path / "other.json"
    other.write_text(Path(sweep_file).read_text())
    res = CliRunner().invoke(cli, ["plan", *WORKLOAD, "--bench", sweep_file, "--readers-from", str(other), "--slo-p99", "1"])
    assert res.exit_code == 2 and "give every value as --bench" in res.output, res.output
    for command in ("plan", "simulate"):
        shown = CliRunner().invoke(cli, [command, "--help"]).output
        assert "--get-times-from" not in shown and "--readers-from" not in shown and "--bench" in shown


def test_a_bandwidth_is_still_needed(tmp_path):
    res = CliRunner().invoke(cli, ["plan", *WORKLOAD, "--slo-p99", "1"])
    assert res.exit_code == 2 and "--instance-gbps or --bench" in res.output, res.output


# --- help text names only options its command has ---------------------------------------------------------------------

#: vLLM's own flags, which kvctl's help names as what an option stands for
VLLM_FLAGS = {"--api-key", "--max-num-seqs", "--max-num-batched-tokens", "--kv-transfer-config", "--shutdown-timeout"}


def test_every_options_help_names_only_options_of_its_own_command():
    """--fit-instances said "default: --instances" in plan, which has no --instances. An option's help may name another
    command's option only inside a quoted command (`kvctl deploy-valkey up --instances-per-rank K`)."""
    bad = []
    for name, cmd in _commands(cli):
        own = {o for p in cmd.params for o in (*getattr(p, "opts", ()), *getattr(p, "secondary_opts", ()))}
        for p in cmd.params:
            if isinstance(p, click.Option) and not p.hidden:
                text = re.sub(r"`[^`]*`", "", p.help or "")
                bad += [(name, p.opts[0], o) for o in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9]", text) if o not in own | VLLM_FLAGS]
    assert not bad, bad
    helped = CliRunner().invoke(cli, ["plan", "--help"]).output.split("--fit-instances", 1)[1].split("\n  --", 1)[0]
    assert "--bench" in helped and "--instances " not in helped, helped
