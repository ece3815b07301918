"""benchmarks/head_of_line.py: the load decision where vLLM's scheduler makes it, at the head of its line (issue 46).

The model runs the connector's own ``decide`` and ``ArrivalRate``; these runs check what the benchmark's
README table rests on, with the H100's figures of 2026-12-06: on the tier whose lone hit loses by a hair (2.55 GB/s
a load), the decision without the line's credit recomputes every hit and the line grows through the run (as the
GPU run did); with it, about half the hits load and the line stays short; where the tier is fast the decision
loads what loading every hit does; where it is slow, nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import head_of_line  # noqa: E402

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def runs(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "out.json"
    assert head_of_line.main([*args, "--json", str(out)]) == 0
    return {r["rule"]: r for r in json.loads(out.read_text())["runs"]}


def test_at_the_head_of_the_line_the_credit_keeps_a_saturated_tier_serving(tmp_path):
    r = runs(tmp_path, "--tier-gbps", "2.55", "--rate", "7.7")
    assert r["head"]["loaded_share"] == 0.0 and r["off"]["loaded_share"] == 1.0
    for rule in ("head", "off"):  # the line grows through the run
        first, _, last = r[rule]["thirds_p50_s"]
        assert last > 3 * first
    first, _, last = r["credit"]["thirds_p50_s"]
    assert last < 2 * first and 0.3 < r["credit"]["loaded_share"] < 1.0
    assert r["credit"]["p99_s"] < r["off"]["p99_s"] / 3 and r["credit"]["p99_s"] < r["head"]["p99_s"] / 5


def test_a_fast_tier_loads_like_off_and_a_slow_one_recomputes(tmp_path):
    fast = runs(tmp_path, "--tier-gbps", "10", "--rate", "7.7")
    assert fast["credit"]["loaded_share"] == 1.0 and fast["credit"]["p99_s"] == pytest.approx(fast["off"]["p99_s"])
    slow = runs(tmp_path, "--tier-gbps", "0.6", "--rate", "2.8", "--rules", "off,credit")
    assert slow["credit"]["loaded_share"] == 0.0 and slow["credit"]["p99_s"] < slow["off"]["p99_s"] / 10


def test_bad_arguments_are_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        head_of_line.main(["--rules", "sometimes"])
    assert e.value.code == 2 and "--rules of off,head,whole,credit" in capsys.readouterr().err


def test_with_the_runs_own_arrivals_the_model_reproduces_the_h100_run_that_loaded_every_hit(tmp_path):
    """The GPU run without the decision (2026-12-06 fourth, 1200 MB/s links, 4.0 GB/s a load as its trace measured,
    T0 5 ms): fed that run's own send times, the model's p50 and p99 fall within 10 % of the run's (1.465 s, 3.385 s)
    and its line grows through the run as the run's did (p50 by third 0.75 / 1.47 / 2.97 s)."""
    root = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    r = runs(tmp_path, "--arrivals", str(root / "paper_gpu-h100-2026-12-06d-sat-1200-off" / "R5.jsonl"),
             "--tier-gbps", "4.0", "--t0", "0.005", "--graph-tokens", "512", "--jump-s", "0.045", "--rules", "off,credit")
    assert r["off"]["p50_s"] == pytest.approx(1.465, rel=0.1) and r["off"]["p99_s"] == pytest.approx(3.385, rel=0.1)
    first, _, last = r["off"]["thirds_p50_s"]
    assert last > 3 * first
    assert r["credit"]["p99_s"] < r["off"]["p99_s"] / 2  # the decision's prediction for the same arrivals


def test_a_step_past_the_largest_cuda_graph_costs_the_jump(tmp_path):
    """A recomputed 16k prompt's step passes a 512-token graph: with a jump of 45 ms each such step takes longer,
    and the same Poisson run with the decision (which recomputes what the tier cannot take) is slower."""
    args = ["--tier-gbps", "3.9", "--rate", "10.3", "--rules", "credit"]
    base = runs(tmp_path, *args)["credit"]
    jump = runs(tmp_path, *args, "--graph-tokens", "512", "--jump-s", "0.045")["credit"]
    assert jump["p99_s"] > base["p99_s"] and jump["p50_s"] > base["p50_s"]


def test_arrivals_from_a_file_that_has_none_are_one_line(tmp_path, capsys):
    bad = tmp_path / "empty.jsonl"
    bad.write_text('{"metadata": {}}\n')
    with pytest.raises(SystemExit) as e:
        head_of_line.main(["--arrivals", str(bad)])
    assert e.value.code == 2 and "fewer than 3 requests with sent_s" in capsys.readouterr().err


def test_arrivals_with_a_row_whose_send_time_is_not_a_number_are_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"metadata": {}}\n' + "".join(f'{{"sent_s": {t}}}\n' for t in (0.0, 0.1)) + '{"sent_s": null}\n')
    with pytest.raises(SystemExit) as e:
        head_of_line.main(["--arrivals", str(bad)])
    assert e.value.code == 2 and "--arrivals:" in capsys.readouterr().err


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_with_the_sixth_sessions_step_costs_the_tier_serves_80_percent_of_what_it_can(tmp_path, seed):
    """The design the next GPU session runs (benchmarks/README): 7.7 requests/s, 800 MB/s links (2.9 GB/s a load),
    a 16k recompute step of 0.245 s and a hit's step of 0.033 s (the H100's, 2026-12-06 sixth). With the line's
    credit as it is since that session (a step's arrivals wait all of the recompute, at most 1.5 × it) the tier
    serves at least 80 % of its 2.9 GB/s, issue 46's target, where the credit before gave 74-84 %; and the p99 is a
    third of loading every hit's."""
    args = ["--rate", "7.7", "--tier-gbps", "2.9", "--t0", "0.005", "--graph-tokens", "512", "--jump-s", "0.045",
            "--step-s", "0.028", "--prefill-rate", "95000", "--seed", str(seed), "--rules", "off,credit"]
    r = runs(tmp_path, *args)
    assert r["credit"]["tier_gbps_over_run"] >= 0.8 * 2.9, r["credit"]
    assert r["credit"]["p99_s"] < r["off"]["p99_s"] / 3


SEVENTH = ["--arrivals", str(Path(__file__).resolve().parents[2] / "benchmarks" / "results"
                             / "paper_gpu-h100-2026-12-06g-sat-800-on" / "R5.jsonl"),
           "--tier-gbps", "3.03", "--t0", "0.0049", "--graph-tokens", "512", "--jump-s", "0.0197", "--step-s", "0.0254",
           "--rules", "credit"]


def test_with_the_seventh_runs_figures_the_model_splits_the_hits_as_the_connector_did(tmp_path):
    """The seventh H100 session's saturated run with the decision (7.7/s behind 800 MB/s links; its trace: R 92.8k
    tokens/s, a 25 ms, the jump 20 ms, T0 5 ms, 3.03 GB/s a load): fed its send times and those figures, the model's
    decision loads the run's share of the hits (0.573) and the tier moves what it did (1.97 GB/s) within 5 %."""
    r = runs(tmp_path, *SEVENTH, "--prefill-rate", "92843")["credit"]
    assert r["loaded_share"] == pytest.approx(0.573, abs=0.03) and r["tier_gbps_over_run"] == pytest.approx(1.97, rel=0.05)


def test_async_scheduling_lag_and_a_slower_engine_than_believed_cost_latency_or_loads(tmp_path):
    """``--sched-lag 1`` (a finished load or an arrival scheduled a step later, vLLM's async scheduling) makes the
    tail no shorter (p90, p99); an engine slower than the decision believes (``--est-prefill-rate`` above ``--prefill-rate``:
    with work queued the seventh run's decision priced a 16k recompute at 0.171 s of GPU, where each ran a step of
    its own at 0.235-0.245 s) loads fewer hits than one the decision knows exactly, which loads at least 70 %."""
    plain = runs(tmp_path, *SEVENTH, "--prefill-rate", "82000")["credit"]
    lag = runs(tmp_path, *SEVENTH, "--prefill-rate", "82000", "--sched-lag", "1")["credit"]
    believed = runs(tmp_path, *SEVENTH, "--prefill-rate", "82000", "--sched-lag", "1", "--est-prefill-rate", "92843")["credit"]
    assert lag["p90_s"] >= plain["p90_s"] and lag["p99_s"] >= plain["p99_s"]
    assert lag["loaded_share"] >= 0.7 and believed["loaded_share"] < lag["loaded_share"] - 0.08


def test_a_scheduling_lag_other_than_0_or_1_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        head_of_line.main(["--sched-lag", "2"])
    assert e.value.code == 2 and "--sched-lag" in capsys.readouterr().err


def test_a_believed_prefill_rate_not_above_zero_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        head_of_line.main(["--est-prefill-rate", "0"])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # argparse's usage, then the one line that says what is wrong
    assert e.value.code == 2 and ": error: " in last and "--est-prefill-rate" in last


def _reprice(tmp_path, session: str) -> dict:
    trace = RESULTS / f"paper_gpu-h100-2026-12-06{session}-sat-800-on" / "R5.connector-trace.jsonl"
    out = tmp_path / f"{session}.json"
    assert head_of_line.main(["--reprice", str(trace), "--graph-tokens", "512", "--json", str(out)]) == 0
    return json.loads(out.read_text())["counts"]


def test_reprice_reproduces_a_run_decided_by_this_tree_and_prices_the_seventh_runs_recomputes_in_steps(tmp_path):
    """--reprice decides a GPU run's traced decisions again: the eighth H100 session's saturated run, decided with
    the recompute priced in steps, comes out decision for decision as the connector made it; the seventh's, priced
    as tokens / R, loads 13 of its 40 tier_queue recomputes (each decided alone: the loads they turn into would
    queue the tier for the ones after them)."""
    assert _reprice(tmp_path, "h") == {"load/wins -> load": 70, "recompute/below_breakeven -> recompute": 5,
                                       "recompute/below_n_star -> recompute": 1, "recompute/tier_queue -> recompute": 34}
    seventh = _reprice(tmp_path, "g")
    assert seventh["recompute/tier_queue -> load"] == 13 and seventh["recompute/tier_queue -> recompute"] == 27
    assert seventh["load/wins -> load"] == 64 and "load/wins -> recompute" not in seventh


def test_reprice_of_a_missing_trace_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        head_of_line.main(["--reprice", str(tmp_path / "none.jsonl")])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and "--reprice:" in last


def test_reprice_of_a_fifo_or_a_file_without_events_is_one_line(tmp_path):
    """--reprice reads a trace with kvctl's trace reader: a FIFO is refused at once (not read forever), and a file
    that holds no event says so; each in one line, exit 2. Run as a child, killed at 60 s."""
    import os
    import subprocess

    fifo, empty = tmp_path / "fifo.jsonl", tmp_path / "empty.jsonl"
    os.mkfifo(fifo)
    empty.write_text("not json\n")
    for trace, says in ((fifo, "not a regular file"), (empty, "no connector trace events")):
        r = subprocess.run([sys.executable, str(Path(head_of_line.__file__)), "--reprice", str(trace)],
                           capture_output=True, text=True, timeout=60)
        last = r.stderr.strip().splitlines()[-1]
        assert r.returncode == 2 and "--reprice:" in last and says in last and "Traceback" not in r.stderr, r.stderr


def test_the_32k_design_with_the_runs_own_arrivals_and_the_credit_caps(tmp_path):
    """Issue 46's 32k design (2026-12-07, an H100: 60 prompts of 32k at 3.5/s behind four 800 MB/s links, a load
    3.09 GB/s, R 70k and the steps of the decision run's own trace). Fed the run's send times, the model loading every
    hit gives the run without the decision within 5 % (p50 1.288 s against 1.331, p99 2.786 s against 2.814); with the decision it is
    below the run (p99 2.576 s measured: the model has no load spread and no API server). Over the caps of the line's
    credit its best p99 stays above 1.6 s, twice issue 46's target for this design (2 x 0.378 s): the target is out of
    the decision's reach here, whatever the cap; with no credit (cap 0) half the hits recompute and p99 is the worst.
    On 300 Poisson arrivals the line without the decision grows through the run (the GPU run's 60 did not show it)."""
    runs_dir = RESULTS / "paper_gpu-h100-2026-12-07-s32-on"
    figures = ["--prompt-tokens", "32768", "--hit-tokens", "32256", "--prefill-rate", "70000", "--sched-lag", "1",
               "--tier-gbps", "3.09", "--t0", "0.0075", "--graph-tokens", "512", "--jump-s", "0.026", "--step-s", "0.029",
               "--rules", "off,credit", "--credit-caps", "0,0.5,0.75,1,1.5"]
    r = runs(tmp_path, *figures, "--arrivals", str(runs_dir / "R5.jsonl"))
    assert r["off"]["p50_s"] == pytest.approx(1.331, rel=0.05) and r["off"]["p99_s"] == pytest.approx(2.814, rel=0.03)
    caps = {k: v for k, v in r.items() if k.startswith("credit@")}
    assert sorted(v["credit_cap"] for v in caps.values()) == [0, 0.5, 0.75, 1, 1.5]
    assert min(v["p99_s"] for v in caps.values()) > 1.6 > 2 * 0.378
    assert max(caps, key=lambda k: caps[k]["p99_s"]) == "credit@0" and caps["credit@0"]["loaded_share"] < 0.55
    assert caps["credit@1.5"]["p99_s"] < 2.576
    poisson = runs(tmp_path, *figures, "--rate", "3.5", "--requests", "300", "--seed", "1")
    first, _, last = poisson["off"]["thirds_p50_s"]
    assert last > 5 * first and poisson["credit@1.5"]["p99_s"] < poisson["off"]["p99_s"] / 5
    assert head_of_line.policy.CREDIT_CAP == 1.5  # put back


def test_credit_caps_must_not_be_negative(capsys):
    with pytest.raises(SystemExit) as e:
        head_of_line.main(["--credit-caps", "1,-0.5"])
    assert e.value.code == 2 and "--credit-caps not negative" in capsys.readouterr().err
