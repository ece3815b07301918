"""``kvctl simulate`` against the paper's measurements (§4, Table 2) and against queueing theory."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.sim.simulate import SimConfig, fifo, simulate
from kvctl.sim.workload import Workload, effective_gbps, poisson_workload

# The paper's hit-heavy replay: λ = 1.21 req/s, a 16k-token prompt of 0.79 GB (16 310 tokens × 48 437.5 B =
# 0.790016 GB), T0 = 0.33 s, R = 52 200 tok/s, one instance 0.85 GB/s; 8 instances 10.76 GB/s (1.345 each).
PAPER = ["--arrival-rate", "1.21", "--prompt-tokens", "16310", "--bytes-per-token", "48437.5", "--prefill-rate", "52200",
         "--t0", "0.33", "--requests", "450", "--json"]
PROMPT_GB = 16310 * 48437.5 / 1e9  # 0.790015625


def run(*args: str):
    r = CliRunner().invoke(cli, ["simulate", *args])
    return r.exit_code, r.output


def test_paper_one_instance_sync_is_an_unstable_queue():
    code, out = run(*PAPER, "--instance-gbps", "0.85")
    assert code == 0, out
    res = json.loads(out)
    # ρ = λ·n·s/B = 1.21 × 0.790016 / 0.85 = 1.1246 (the paper: ≈ 1.13 for B = 0.78–0.89 GB/s)
    assert res["rho"] == pytest.approx(1.1246, abs=1e-4)
    assert res["stable"] is False
    a, b, c = res["thirds_p50_s"]
    assert a < b < c and c > 3 * a  # latency grows through the run (paper H1b: 3.52 → 9.02 → 52.30 s)
    one_hit = 0.33 + PROMPT_GB / 0.85  # 1.259 s on an idle engine
    assert res["p50_s"] > 5 * one_hit
    assert res["max_queue"] > 20  # the paper saw up to 59 requests in the engine


def test_paper_eight_instances_are_stable_with_p50_at_t0_plus_transfer():
    code, out = run(*PAPER, "--instances", "8", "--instance-gbps", "1.345")
    assert code == 0, out
    res = json.loads(out)
    # B = 8 × 1.345 = 10.76 GB/s: ρ = 1.21 × 0.790016 / 10.76 = 0.0888 (paper ≈ 0.09)
    assert res["rho"] == pytest.approx(0.0888, abs=1e-4)
    assert res["stable"] is True
    # p50 = T0 + n·s/B = 0.33 + 0.790016 / 10.76 = 0.4034 s (paper H3: 0.41 s); at ρ 0.09 most requests never wait
    assert res["p50_s"] == pytest.approx(0.4034, rel=0.005)
    assert max(res["thirds_p50_s"]) - min(res["thirds_p50_s"]) < 0.01  # no drift
    assert res["p99_s"] < 1.0


@pytest.mark.parametrize("rho", [0.5, 0.8])
@pytest.mark.parametrize("dist", ["fixed", "exponential"])
def test_mean_wait_matches_queueing_theory(rho, dist):
    """M/D/1 (fixed prompts) and M/M/1 (exponential prompts), service mean 1 s: Pollaczek–Khinchine.

    Service = n·s/B = 1000 tokens × 1e6 B / 1 GB/s = 1 s, arrivals Poisson at λ = ρ.
    M/D/1: Wq = ρ·S / (2(1 − ρ)) → 0.5 s at ρ 0.5, 2.0 s at ρ 0.8.
    M/M/1: Wq = ρ·S / (1 − ρ)    → 1.0 s at ρ 0.5, 4.0 s at ρ 0.8.
    """
    expected = {("fixed", 0.5): 0.5, ("fixed", 0.8): 2.0, ("exponential", 0.5): 1.0, ("exponential", 0.8): 4.0}[(dist, rho)]
    w = poisson_workload(rho, 2_000_000, 1000, dist, seed=11)
    res = simulate(w, SimConfig(bytes_per_token=1e6, prefill_rate=1e9, t0_s=0.0), bandwidth_gbps=1.0)
    assert res.mean_wait_s == pytest.approx(expected, rel=0.02)
    assert res.mean_s == pytest.approx(expected + 1.0, rel=0.02)  # sojourn = wait + service
    assert res.rho == pytest.approx(rho, rel=0.01)


def test_fifo_worked_by_hand():
    # arrivals 0, 1, 2, 10 with holds 3, 1, 1, 1: starts 0, 3, 4, 10; finishes 3, 4, 5, 11
    start, finish = fifo(np.array([0.0, 1.0, 2.0, 10.0]), np.array([3.0, 1.0, 1.0, 1.0]))
    assert start.tolist() == [0.0, 3.0, 4.0, 10.0]
    assert finish.tolist() == [3.0, 4.0, 5.0, 11.0]


def test_sync_miss_holds_prefill_and_hit_adds_t0_without_holding():
    # two requests 0.1 s apart, 1000 tokens; s·n/B = 1000 × 1e6 / 1e9 = 1 s; n/R = 1000/2000 = 0.5 s
    w = Workload(np.array([0.0, 0.1]), np.array([1000.0, 1000.0]), None, "hand")
    hits = simulate(w, SimConfig(1e6, 2000.0, t0_s=0.25, hit_fraction=1.0), 1.0)
    # hit 1: 1 s transfer + 0.25 = 1.25; hit 2 waits until 1.0, transfers to 2.0, + 0.25 → 2.25 − 0.1 = 2.15
    assert hits.max_s == pytest.approx(2.15) and hits.mean_s == pytest.approx((1.25 + 2.15) / 2)
    misses = simulate(w, SimConfig(1e6, 2000.0, t0_s=0.25, hit_fraction=0.0), 1.0)
    # miss 1: 0.5; miss 2 waits until 0.5, done at 1.0 → 0.9
    assert misses.max_s == pytest.approx(0.9) and misses.mean_s == pytest.approx(0.7)


def test_hits_and_misses_apart_by_hand():
    # four requests 10 s apart (no queue), 1000 tokens; hits 1 s transfer + T0 0.25, misses n/R = 0.5 s
    w = Workload(np.arange(4) * 10.0, np.full(4, 1000.0), None, "hand", hit_tokens=np.array([1000.0, 0.0, 1000.0, 0.0]))
    res = simulate(w, SimConfig(1e6, 2000.0, t0_s=0.25, hits_from_trace=True), 1.0)
    assert res.by_class["hit"] == {"requests": 2, "p50_s": pytest.approx(1.25), "p90_s": pytest.approx(1.25), "p99_s": pytest.approx(1.25)}
    assert res.by_class["miss"] == {"requests": 2, "p50_s": pytest.approx(0.5), "p90_s": pytest.approx(0.5), "p99_s": pytest.approx(0.5)}
    none = simulate(w, SimConfig(1e6, 2000.0, t0_s=0.25, hit_fraction=0.0), 1.0).by_class
    assert none["hit"]["requests"] == 0 and none["hit"]["p50_s"] is None and none["miss"]["requests"] == 4
    code, out = run(*PAPER, "--instances", "8", "--instance-gbps", "1.345", "--hit-fraction", "0.5")
    assert code == 0, out
    by = json.loads(out)["by_class"]
    assert by["hit"]["requests"] + by["miss"]["requests"] == 450 and by["hit"]["p50_s"] > by["miss"]["p50_s"]


def test_async_timeout_recomputes_while_the_prefetch_continues():
    # three hits at 0, 0.1, 0.2 s; each load 1 s on the tier (FIFO): done at 1.0, 2.0, 3.0.
    # timeout 1.5 s: hit 1 loads (1.0 + T0 0.25 = 1.25); hit 2 would finish 1.9 s after arrival → recomputes
    # from 1.6 for n/R = 0.5 → 2.1, latency 2.0; hit 3 (2.8 s after arrival) recomputes from 1.7, waits for
    # the engine until 2.1, done 2.6 → latency 2.4.
    w = Workload(np.array([0.0, 0.1, 0.2]), np.array([1000.0] * 3), None, "hand")
    res = simulate(w, SimConfig(1e6, 2000.0, t0_s=0.25, loading="async", async_timeout_s=1.5), 1.0)
    assert res.timeouts == 2
    assert res.max_s == pytest.approx(2.4)
    assert res.p50_s == pytest.approx(2.0)
    assert res.mean_s == pytest.approx((1.25 + 2.0 + 2.4) / 3)


def test_bench_file_gives_measured_aggregate(tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"runs": [
        {"op": "get", "instances": 1, "clients": 1, "aggregate_gbps": 1.52},
        {"op": "get", "instances": 1, "clients": 8, "aggregate_gbps": 1.71},
        {"op": "get", "instances": 8, "clients": 1, "aggregate_gbps": 10.76},
        {"op": "set", "instances": 8, "clients": 1, "aggregate_gbps": 20.0},
    ]}))
    code, out = run(*PAPER, "--instances", "8", "--bench", str(bench))
    assert code == 0, out
    assert json.loads(out)["bandwidth_gbps"] == 10.76
    code, out = run(*PAPER, "--instances", "1", "--bench", str(bench))
    assert json.loads(out)["bandwidth_gbps"] == 1.71  # the best GET run at 1 instance
    code, out = run(*PAPER, "--instances", "4", "--bench", str(bench))
    assert json.loads(out)["bandwidth_gbps"] == pytest.approx(10.76 / 8 * 4)  # unmeasured: per instance × 4
    assert effective_gbps(3, instance_gbps=0.5) == 1.5


def test_bench_extrapolation_is_said_in_the_json_and_the_table(tmp_path):
    """Issue 22: simulate --bench silently scaled the largest measured instance count to any other."""
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"runs": [{"op": "get", "instances": 1, "clients": 1, "aggregate_gbps": 1.0},
                                          {"op": "get", "instances": 2, "clients": 1, "aggregate_gbps": 1.8}]}))
    code, out = run(*PAPER, "--instances", "2", "--bench", str(bench))
    assert json.loads(out)["bandwidth_basis"] == "bench_measured"
    code, out = run(*PAPER, "--instances", "8", "--bench", str(bench))
    d = json.loads(out)
    assert d["bandwidth_gbps"] == pytest.approx(1.8 / 2 * 8) and d["bandwidth_basis"] == "bench_extrapolated"
    assert "measured 1, 2 instance(s), not 8" in d["bandwidth_note"]
    code, out = run(*PAPER, "--instance-gbps", "0.85")
    assert json.loads(out)["bandwidth_basis"] == "instance_gbps"
    table = [a for a in PAPER if a != "--json"]
    code, out = run(*table, "--instances", "8", "--bench", str(bench))
    assert code == 0 and "7.2*" in out and "EXTRAPOLATED" in out, out
    code, out = run(*table, "--bench", str(bench), "--sweep", "instances=2,8")
    flat = " ".join(out.split())
    assert code == 0 and "7.2*" in flat and "1.8*" not in flat and "* B_eff EXTRAPOLATED" in flat, out
    code, out = run(*PAPER, "--bench", str(bench), "--sweep", "instances=2,8")
    assert [p["bandwidth_basis"] for p in json.loads(out)] == ["bench_measured", "bench_extrapolated"]


def test_sweep_lists_results_with_parameters(tmp_path):
    r = CliRunner().invoke(cli, ["simulate", *PAPER, "--instance-gbps", "0.85", "--sweep", "instances=1,8 loading=sync,async",
                                 "--plot", str(tmp_path / "sweep.png")])
    assert r.exit_code == 0, r.output
    points = json.loads(r.stdout)  # stderr: "plot: wrote ..."
    assert [p["parameters"] for p in points] == [
        {"instances": 1, "loading": "sync"}, {"instances": 1, "loading": "async"},
        {"instances": 8, "loading": "sync"}, {"instances": 8, "loading": "async"}]
    assert points[0]["stable"] is False and points[2]["stable"] is True
    assert points[2]["rho"] == pytest.approx(1.21 * PROMPT_GB / 6.8, rel=1e-9)  # 8 × 0.85 GB/s
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"


def test_trace_mode_reads_arrivals_and_lengths(tmp_path):
    trace = tmp_path / "t.jsonl"
    # Mooncake: arrivals at 0, 1, 2 s; 1000-token prompts; 1 s transfer each at 1 GB/s with s = 1e6
    trace.write_text("".join(json.dumps({"timestamp": 1000 * i, "input_length": 1000, "hash_ids": [i]}) + "\n" for i in range(3)))
    code, out = run("--trace", str(trace), "--bytes-per-token", "1e6", "--prefill-rate", "1e9", "--t0", "0",
                    "--instance-gbps", "1", "--json")
    assert code == 0, out
    res = json.loads(out)
    assert res["requests"] == 3 and res["max_s"] == pytest.approx(1.0) and res["rho"] == pytest.approx(1.0)


@pytest.mark.parametrize("args, message", [
    (["--bytes-per-token", "1", "--prefill-rate", "1", "--instance-gbps", "1"], "--arrival-rate"),
    (["--arrival-rate", "1", "--trace", "x", "--bytes-per-token", "1", "--prefill-rate", "1", "--instance-gbps", "1"], "exactly one"),
    (["--arrival-rate", "1", "--bytes-per-token", "1", "--prefill-rate", "1", "--instance-gbps", "1"], "--prompt-tokens"),
    (["--arrival-rate", "1", "--prompt-tokens", "5", "--bytes-per-token", "1", "--prefill-rate", "1"], "--instance-gbps"),
    (["--arrival-rate", "1", "--prompt-tokens", "5", "--bytes-per-token", "1", "--prefill-rate", "1", "--instance-gbps", "1",
      "--sweep", "colour=red"], "--sweep"),
])
def test_bad_input_is_a_usage_error(args, message):
    code, out = run(*args)
    assert code == 2, out
    assert message in out


GOOD = {"bytes_per_token": 1.0, "prefill_rate": 1.0, "rate": 1.0, "prompt_tokens": 5.0, "instance_gbps": 1.0}


@pytest.mark.parametrize("change, message", [
    ({"rate": None}, "give exactly one of --arrival-rate (per engine) or --trace FILE"),
    ({"trace_path": "t.jsonl"}, "give exactly one of --arrival-rate"),
    ({"prompt_tokens": None}, "--arrival-rate needs --prompt-tokens"),
    ({"instance_gbps": None}, "give the tier's bandwidth: --instance-gbps or --bench FILE"),
    ({"hits_from_trace": True}, "--hits-from-trace needs --trace"),
    ({"hit_gpu_s": "fit"}, "--hit-gpu-s fit needs --fit-from RUN and --fit-gpu-util PCT"),
    ({"fit_instances": 2}, "--fit-instances says what tier the --fit-from run had"),
    ({"fit_loading": "async"}, "--fit-loading says how the --fit-from run loaded"),
    ({"t0_engine_share": "fit"}, "--t0-engine-share fit needs --fit-from RUN"),
    ({"arrivals": "gamma"}, "--arrivals gamma needs --arrival-cv CV"),
    ({"arrival_cv": 0.5}, "--arrival-cv is the CV of --arrivals gamma"),
    ({"arrivals_from": "t.jsonl", "arrivals": "deterministic"}, "--arrivals-from fits the CV of gamma arrivals"),
    ({"rate": None, "prompt_tokens": None, "trace_path": "t.jsonl", "arrivals": "deterministic"}, "--trace brings its own"),
])
def test_the_model_refuses_inputs_that_do_not_go_together(change, message):
    """Issue 49 item 4: the checks that involve several options are the model's (kvctl.sim.model.Inputs), not each
    command's: a library caller gets the same usage error (InvalidInput, exit 2) as the CLI."""
    from kvctl.core.errors import InvalidInput  # noqa: PLC0415
    from kvctl.sim.model import Inputs  # noqa: PLC0415

    Inputs(**GOOD)  # the base goes together
    with pytest.raises(InvalidInput) as e:
        Inputs(**{**GOOD, **change})
    assert message in str(e.value)


def test_a_poisson_sweep_key_needs_arrival_rate_in_the_model(tmp_path):
    from kvctl.core.errors import InvalidInput  # noqa: PLC0415
    from kvctl.sim.model import Inputs, whatif  # noqa: PLC0415

    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 10, "hash_ids": [1]}) + "\n")
    i = Inputs(**{**GOOD, "rate": None, "prompt_tokens": None, "trace_path": str(trace)})
    with pytest.raises(InvalidInput, match="--sweep arrival_rate/prompt_tokens need Poisson mode"):
        whatif(i, {"arrival_rate": [1.0, 2.0]})


def test_hits_from_a_mooncake_trace_and_from_a_run_file(tmp_path):
    # blocks of 100 tokens, hash ids seen before lead each prompt's cached part:
    # [1,2] → 0 (nothing seen yet); [1,2,3] → 200; [4] → 0; [1,5] → 100 (5 is new). Arrivals 10 s apart (no queueing).
    trace = tmp_path / "t.jsonl"
    lines = [([1, 2], 200), ([1, 2, 3], 300), ([4], 100), ([1, 5], 200)]
    trace.write_text("".join(json.dumps({"timestamp": 10_000 * i, "input_length": n, "hash_ids": ids}) + "\n"
                             for i, (ids, n) in enumerate(lines)))
    # s = 1e7 B/token at 1 GB/s: 0.01 s per cached token; R = 100 tok/s: 0.01 s per recomputed token; T0 = 1 s
    base = ["--trace", str(trace), "--bytes-per-token", "1e7", "--prefill-rate", "100", "--t0", "1",
            "--instance-gbps", "1", "--block-tokens", "100", "--json"]
    code, out = run(*base, "--hits-from-trace")
    assert code == 0, out
    res = json.loads(out)
    # latencies: miss 200/100 = 2.0; hit 200 of 300: 1 + 200·0.01 + 100/100 = 4.0; miss 1.0; hit 100 of 200 (only
    # id 1 leads; 5 is new): 1 + 1.0 + 1.0 = 3.0
    assert res["hits"] == 2
    assert res["max_s"] == pytest.approx(4.0) and res["mean_s"] == pytest.approx((2.0 + 4.0 + 1.0 + 3.0) / 4)
    # a run file's cached_tokens win over hash ids: say the engine cached 300 of request 1 and nothing else
    runf = tmp_path / "run.jsonl"
    rows = [{"metadata": {}}] + [
        {"index": i, "scheduled_s": 10.0 * i, "sent_s": 10.0 * i, "first_token_s": None, "finished_s": 10.0 * i + 1,
         "latency_s": 1.0, "prompt_tokens": n, "cached_tokens": 300 if i == 1 else 0, "status": "ok",
         "request": {"timestamp": 10_000 * i, "input_length": n, "hash_ids": ids}}
        for i, (ids, n) in enumerate(lines)]
    runf.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out = run(*[a if a != str(trace) else str(runf) for a in base], "--hits-from-trace")
    assert code == 0, out
    res = json.loads(out)
    # 2.0, 1 + 300·0.01 = 4.0, 1.0, 2.0
    assert res["hits"] == 1 and res["mean_s"] == pytest.approx((2.0 + 4.0 + 1.0 + 2.0) / 4)
    code, out = run("--arrival-rate", "1", "--prompt-tokens", "5", "--bytes-per-token", "1", "--prefill-rate", "1",
                    "--instance-gbps", "1", "--hits-from-trace")
    assert code == 2 and "--trace" in out
