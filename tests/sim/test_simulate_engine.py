"""Issue 31, item 7: the simulated engine steps as vLLM's (a token budget per step, long prompts chunked), a hit's
GPU time holds the engine and shows as GPU utilisation (fitted from a run's), and arrivals are Poisson,
deterministic, gamma with a CV, or a trace's CV. Expected numbers are worked out by hand in each test."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.sim.fleet import simulate_fleet
from kvctl.sim.simulate import SimConfig, engine_steps, simulate
from kvctl.sim.workload import poisson_workload
from kvctl.core.thresholds import VLLM_MAX_NUM_BATCHED_TOKENS
from kvctl.sim.variability import Variability

PAPER = ["--arrival-rate", "1.21", "--prompt-tokens", "16310", "--bytes-per-token", "48437.5", "--prefill-rate", "52200", "--t0", "0.33"]


def run(*args: str) -> dict:
    r = CliRunner().invoke(cli, [*args, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


# --- --max-batched-tokens: vLLM's token budget per step ------------------------------------------------------


def test_vllm_default_token_budget_is_the_one_of_vllm_032_online_serving():
    """8192: vLLM 0.32's EngineArgs default for the OpenAI server on 70-160 GiB GPUs (H100/H200); the option says so."""
    assert VLLM_MAX_NUM_BATCHED_TOKENS == 8192
    helped = " ".join(CliRunner().invoke(cli, ["simulate", "--help"]).output.split())
    assert "--max-batched-tokens" in helped and "vLLM's --max-num-batched-tokens" in helped and "default: 8192" in helped


def test_engine_steps_chunk_long_prompts_over_steps_by_hand():
    # R = 8192 tok/s: a full budget of 8192 tokens is 1 s. Two 16 384-token misses arrive at 0, M = 4.
    a, fixed, tok = np.array([0.0, 0.0]), np.zeros(2), np.full(2, 16384.0)
    # no budget: one step takes both whole, 0-4 s, and both finish at 4
    assert engine_steps(a, fixed, tok, 8192.0, 4, None)[1].tolist() == [4.0, 4.0]
    # 8192 a step: step 0-1 is request 0's first half (the budget is gone, request 1 waits), 1-2 its second:
    # request 0 done at 2; request 1 in 2-3 and 3-4, done at 4
    start, finish = engine_steps(a, fixed, tok, 8192.0, 4, 8192)
    assert start.tolist() == [0.0, 2.0] and finish.tolist() == [2.0, 4.0]
    # waiting requests are admitted first come, first served: a 100-token one arriving at 0.5 waits behind
    # request 1, which takes every budget from 2 to 4; it runs 4-4.012
    a3, tok3 = np.array([0.0, 0.0, 0.5]), np.array([16384.0, 16384.0, 100.0])
    start, finish = engine_steps(a3, np.zeros(3), tok3, 8192.0, 4, 8192)
    assert finish.tolist() == pytest.approx([2.0, 4.0, 4.0 + 100 / 8192]) and start[2] == 4.0
    # a running request leaves the rest of a budget to the next: 12 288 tokens take 8192 in 0-1, then 4096 at 1,
    # where the 100-token request arriving at 0.5 joins: that step is 4196 tokens, and both finish at 1.512
    start, finish = engine_steps(np.array([0.0, 0.5]), np.zeros(2), np.array([12288.0, 100.0]), 8192.0, 4, 8192)
    assert start.tolist() == [0.0, 1.0] and finish.tolist() == pytest.approx([1 + 4196 / 8192] * 2)
    # fixed seconds (a load, T0 on the engine) are paid in the step a request enters
    assert engine_steps(np.array([0.0]), np.array([0.5]), np.array([16384.0]), 8192.0, 4, 8192)[1].tolist() == [2.5]
    # one request at a time (M = 1): chunking changes nothing, the FIFO queue
    assert engine_steps(a, fixed, tok, 8192.0, 1, 8192)[1].tolist() == [2.0, 4.0]


def test_a_budget_keeps_an_overloaded_step_from_swallowing_the_queue():
    """Recompute at ρ 1.3 with --max-batch 1024: without a budget a step takes the whole queue and everything in it
    finishes together at its end; vLLM's 8192-token budget computes about half a prompt a step, so requests finish
    in order and the most in the engine stays bounded by what arrives meanwhile."""
    base = ["simulate", "--arrival-rate", "4.16", "--prompt-tokens", "16310", "--bytes-per-token", "48437.5", "--prefill-rate", "52200",
            "--instance-gbps", "1", "--hit-fraction", "0", "--requests", "600", "--max-batch", "1024"]
    whole = run(*base, "--max-batched-tokens", str(10**7))
    chunked = run(*base)  # the default: 8192
    # the same work at ρ = 4.16 × 16 310 / 52 200 = 1.30, so both grow; finishing together, whole steps make the
    # median wait for the step's last prompt: chunked steps finish one prompt at a time, the median comes earlier
    assert whole["rho"] == pytest.approx(chunked["rho"]) == pytest.approx(1.30, abs=0.01)
    assert chunked["p50_s"] < whole["p50_s"]
    one = run(*base[:-2])  # --max-batch 1: the FIFO queue, what a budget of 8192 reduces a 16k prompt's step to
    assert chunked["p50_s"] == pytest.approx(one["p50_s"], rel=0.01)


def test_the_fleet_solver_steps_with_the_same_budget_as_one_engine():
    w = poisson_workload(2.0, 2000, 12000.0, "exponential", 4)
    cfg = SimConfig(1e5, 30000.0, 0.2, hit_fraction=0.6, t0_engine_share=0.5, max_batch=8, max_batched_tokens=8192, hit_gpu_s=0.05)
    plain = simulate(w, cfg, 2.0)
    fleet = simulate_fleet(w, cfg, 2.0, var=Variability(readers_gain={1: 1.0, 2: 1.0}))  # the event loop, same tier
    assert fleet.solver == "event loop"
    assert fleet.mean_s == pytest.approx(plain.mean_s) and fleet.p99_s == pytest.approx(plain.p99_s)
    assert fleet.gpu_utilization_pct == pytest.approx(plain.gpu_utilization_pct)
    for loading in ("async",):
        c = SimConfig(1e5, 30000.0, 0.2, hit_fraction=0.6, loading=loading, max_batch=8, max_batched_tokens=8192, hit_gpu_s=0.05)
        assert simulate_fleet(w, c, 2.0).p99_s == pytest.approx(simulate(w, c, 2.0).p99_s)


# --- --hit-gpu-s: a hit's GPU time, and GPU utilisation in simulate and plan ----------------------------------


def test_hit_gpu_time_is_part_of_t0_holds_the_engine_and_is_gpu_utilisation():
    """The paper's H3 (8 instances, 10.76 GB/s, sync): 20-22 % GPU at ρ 0.09 is about 0.17 s of GPU per hit. With
    --hit-gpu-s 0.17 the GPU computes 1.21 × 0.17 = 20.6 % of the time; the median hit is still T0 + n·s/B =
    0.33 + 0.790 / 10.76 = 0.403 s (the GPU time is part of T0); the engine is held 0.17 + 0.073 s a hit."""
    base = ["simulate", *PAPER, "--instances", "8", "--instance-gbps", "1.345", "--requests", "20000"]
    without, with_gpu = run(*base), run(*base, "--hit-gpu-s", "0.17")
    assert without["gpu_utilization_pct"] == pytest.approx(0.0, abs=0.01)  # hits compute nothing without it
    assert with_gpu["gpu_utilization_pct"] == pytest.approx(1.21 * 0.17 * 100, rel=0.03)
    assert with_gpu["p50_s"] == pytest.approx(0.33 + 16310 * 48437.5 / 10.76e9, rel=0.005)
    assert with_gpu["rho"] == pytest.approx(1.21 * (0.17 + 16310 * 48437.5 / 10.76e9), rel=0.03)
    assert with_gpu["p99_s"] > without["p99_s"]  # the engine queues behind hits' GPU time
    table = CliRunner().invoke(cli, base + ["--hit-gpu-s", "0.17"]).output
    assert "GPU util %" in table and "20." in table
    plan = run("plan", *PAPER, "--instance-gbps", "1.345", "--slo-p99", "1", "--requests", "2000", "--max-instances", "2", "--hit-gpu-s", "0.17",
               "--loading", "sync")
    assert all(p["gpu_utilization_pct"] is not None for p in plan["points"] if p["simulated"])
    assert "GPU util %" in CliRunner().invoke(cli, ["plan", *PAPER, "--instance-gbps", "1.345", "--slo-p99", "1", "--requests", "500",
                                                    "--max-instances", "1"]).output


def test_hit_gpu_time_is_fitted_from_a_runs_gpu_utilisation(tmp_path):
    """20 hits of 1000 tokens (100 uncached) and 10 misses of 1000 over 20 s at R = 1000 tok/s: prefill is
    10 × 1 + 20 × 0.1 = 12 s. At 30 % GPU the run computed 6 s... less than its prefill: 0. At 80 %: 16 s, so each
    hit's GPU time is (16 − 12) / 20 = 0.2 s."""
    rows = [{"metadata": {"requests": 30}}]
    for i in range(30):
        hit = i % 3 != 0
        rows.append({"index": i, "scheduled_s": i * 20 / 29, "sent_s": i * 20 / 29, "first_token_s": i * 20 / 29 + 0.5,
                     "finished_s": i * 20 / 29 + (0.5 if i < 29 else 0.0), "latency_s": 0.5, "prompt_tokens": 1000,
                     "cached_tokens": 900 if hit else 0, "status": "ok", "in_flight": 1, "capped": False, "request": {}})
    rows.append({"summary": {"requests": 30}})
    run_file = tmp_path / "calib.jsonl"
    run_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = ["simulate", "--arrival-rate", "1", "--prompt-tokens", "1000", "--bytes-per-token", "1000", "--prefill-rate", "1000", "--t0", "0.5",
            "--instance-gbps", "1", "--requests", "200", "--fit-from", str(run_file), "--hit-gpu-s", "fit"]
    d = run(*base, "--fit-gpu-util", "80")
    assert any("hit GPU time 0.2 s" in n for n in d["notes"]), d["notes"]
    low = run(*base, "--fit-gpu-util", "30")
    assert any("hit GPU time 0 s" in n and "prefill alone" in n for n in low["notes"]), low["notes"]
    bad = CliRunner().invoke(cli, base)
    assert bad.exit_code == 2 and "--fit-gpu-util" in bad.output


# --- --arrivals: Poisson, deterministic, gamma with a CV, or a trace's CV ----------------------------------


def test_arrival_processes_have_the_rate_and_the_spread_asked_for():
    for process, cv, want in [("poisson", None, 1.0), ("deterministic", None, 0.0), ("gamma", 0.5, 0.5), ("gamma", 2.0, 2.0)]:
        w = poisson_workload(2.0, 40000, 100.0, "fixed", 3, process, cv)
        gaps = np.diff(w.arrival_s)
        assert gaps.mean() == pytest.approx(0.5, rel=0.03), process
        assert gaps.std() / gaps.mean() == pytest.approx(want, abs=0.04), (process, cv)
    # Poisson is what it always was: the same seed gives the same arrivals as before the option existed
    assert np.array_equal(poisson_workload(2.0, 100, 100.0, seed=7).arrival_s, poisson_workload(2.0, 100, 100.0, seed=7, arrivals="poisson").arrival_s)


def test_smoother_arrivals_queue_less_and_burstier_more():
    """Recompute at ρ = 0.378 (the paper's B1): evenly spaced arrivals never queue (p99 = n/R = 0.3125 s), Poisson
    ones do (the M/D/1 tail), gamma CV 2 more still."""
    base = ["simulate", *PAPER, "--instance-gbps", "1", "--hit-fraction", "0", "--requests", "20000"]
    det = run(*base, "--arrivals", "deterministic")
    assert det["p99_s"] == pytest.approx(16310 / 52200) and det["max_queue"] == 0
    poisson, bursty = run(*base), run(*base, "--arrivals", "gamma", "--arrival-cv", "2")
    assert det["p99_s"] < poisson["p99_s"] < bursty["p99_s"]
    assert run(*base, "--arrivals", "gamma", "--arrival-cv", "1")["p99_s"] == pytest.approx(poisson["p99_s"], rel=0.1)


def test_arrivals_from_a_trace_take_its_inter_arrival_cv(tmp_path):
    # gaps alternate 1 s and 3 s: mean 2, std 1, CV 0.5
    t, lines = 0.0, []
    for i in range(201):
        lines.append(json.dumps({"offset_s": t, "prompt_tokens": 100}))
        t += 1.0 if i % 2 == 0 else 3.0
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    d = run("simulate", *PAPER, "--instance-gbps", "1", "--requests", "500", "--arrivals-from", str(trace))
    assert any(n.startswith("arrivals: gamma CV 0.5 fitted on the 200 inter-arrival gaps") for n in d["notes"]), d["notes"]
    on_trace = ["simulate", "--trace", str(trace), "--bytes-per-token", "1000", "--prefill-rate", "1000", "--instance-gbps", "1"]
    for args, message in [(["simulate", *PAPER, "--instance-gbps", "1", "--arrivals", "gamma"], "--arrival-cv"),
                          (["simulate", *PAPER, "--instance-gbps", "1", "--arrival-cv", "0.5"], "--arrivals gamma"),
                          ([*on_trace, "--arrivals", "deterministic"], "--trace brings its own")]:
        r = CliRunner().invoke(cli, args)
        assert r.exit_code == 2 and message in r.output, (args, r.output)


# --- the paper-fidelity check of docs/fleets.md --------------------------------------------------------------


def _fleets_counts() -> dict[str, int]:
    from pathlib import Path
    import re

    text = (Path(__file__).resolve().parents[2] / "docs" / "fleets.md").read_text()
    rows = re.findall(r"\| (before issue 31|now) \(`--model (before|after)`[^|]*\| \*\*(\d+) of 64\*\*", text)
    return {model: int(n) for _, model, n in rows}


def test_fleets_md_states_the_paper_fidelity_counts_of_both_models():
    assert set(_fleets_counts()) == {"before", "after"}


@pytest.mark.long
@pytest.mark.parametrize("model", ["before", "after"])
def test_paper_fidelity_script_gives_the_counts_docs_fleets_md_states(model):
    """benchmarks/paper_fidelity.py re-run: the number of the paper's 64 within 20 % is the one docs/fleets.md says."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "paper_fidelity.py"), "--model", model, "--json"],
                         capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["numbers"] == 64 and d["within_20pct"] == _fleets_counts()[model]
