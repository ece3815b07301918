"""benchmarks/simulate_saturated.py: ``kvctl simulate`` against issue 46's saturated tier on an H100 (2026-12-06).

The run loaded every hit behind 1200 MB/s links (results/paper_gpu-h100-2026-12-06d-sat-1200-off) and its line grew
through the run. These check what benchmarks/README.md quotes: from the bench alone simulate puts the tier's ρ at 1.13
and its waits at about two thirds of the run's; with the loader's service fitted from another run of the same links
(``--fit-loads``, the decision-on run's trace) ρ is 1.24 and p50 / p90 / p99 are within 5 % of the run's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import simulate_saturated  # noqa: E402

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
OFF = RESULTS / "paper_gpu-h100-2026-12-06d-sat-1200-off"
ON = RESULTS / "paper_gpu-h100-2026-12-06d-sat-1200-on"


def test_the_loaders_service_brings_the_saturated_run_within_five_per_cent(tmp_path):
    out = tmp_path / "out.json"
    assert simulate_saturated.main([str(OFF), "--fit-run", str(ON), "--json", str(out)]) == 0
    row = json.loads(out.read_text())[OFF.name]
    m, bench, fit = row["measured"], row["bench"], row["fit_loads"]
    for k in simulate_saturated.KEYS:
        assert 0.55 < bench[k] / m[k] < 0.7, (k, bench[k], m[k])  # the bench alone: a third short
        assert abs(fit[k] / m[k] - 1) < 0.05, (k, fit[k], m[k])
    assert round(bench["tier_rho"], 2) == 1.13 and round(fit["tier_rho"], 2) == 1.24
    assert any("13 loads" in n for n in fit["notes"])  # the on-run's loads that read something


def test_the_steps_cost_brings_the_decision_run_closer_but_not_within_a_quarter(tmp_path):
    """The eighth session's saturated tier with the decision on (results/paper_gpu-h100-2026-12-06h-sat-800-on): with
    the loader fitted alone simulate put p50 / p90 / p99 at 0.38 / 0.37 / 0.41 of the run's; each engine step's own
    cost fitted from the same trace (``--steps``: --fit-steps, a 22.9 ms a step and 30.1 ms above 512 tokens) brings
    them to 0.61 / 0.59 / 0.54, the GPU's share and the hits loaded near the run's. Issue 46's 25 % is still missed
    (benchmarks/README.md); the run that loaded every hit stays within 5 % either way."""
    on, off = RESULTS / "paper_gpu-h100-2026-12-06h-sat-800-on", RESULTS / "paper_gpu-h100-2026-12-06h-sat-800-off"
    out = tmp_path / "out.json"
    assert simulate_saturated.main([str(on), str(off), "--prefill-rate", "91000", "--steps", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    kept = json.loads((RESULTS / "simulate_saturated-h100-2026-12-06h-steps.json").read_text())
    for name, row in rows.items():
        for label in ("fit_loads", "fit_steps"):
            for k in simulate_saturated.KEYS:  # the figures benchmarks/README.md quotes
                assert abs(row[label][k] - kept[name][label][k]) < 1e-9, (name, label, k)
    m, loads, steps = (rows[on.name][x] for x in ("measured", "fit_loads", "fit_steps"))
    for k, lo, hi in (("p50_s", 0.55, 0.7), ("p90_s", 0.55, 0.7), ("p99_s", 0.5, 0.6)):
        assert loads[k] / m[k] < 0.45 and lo < steps[k] / m[k] < hi, (k, loads[k], steps[k], m[k])
    assert any("--fit-steps" in n and "22.9 ms" in n and "30.1 ms more above 512 tokens" in n for n in steps["notes"]), steps["notes"]
    m, steps = rows[off.name]["measured"], rows[off.name]["fit_steps"]
    assert all(abs(steps[k] / m[k] - 1) < 0.05 for k in simulate_saturated.KEYS)


def test_vllms_scheduler_with_the_loads_own_spread_brings_the_decision_runs_median_seed_within_a_quarter(tmp_path):
    """``--line`` (2026-12-07): the same fits with ``--scheduler vllm`` (the decision and the load at the head of the
    line, the decision's bandwidth measured as the connector measures it), each load's GET time drawn from the trace's
    own loads (``--fit-load-spread``) and 0.06 s a request outside the engine (``--async-overhead``, the unshaped run's
    p50 over the model's). Over 20 seeds the decision run's median p50 / p90 / p99 come within issue 46's 25 %
    (0.95 / 0.79 / 0.76), all three at 55 % of the seeds; the run that loaded every hit within 3 % at every seed. The
    unshaped run's tail is still not the model's (p90 and p99 about half), and the model gives up a median 9 loads at
    their deadline where the run gave up 7 (benchmarks/README.md). Two seeds are run again here against the kept file."""
    on, off, fast = (RESULTS / f"paper_gpu-h100-2026-12-06h-{x}" for x in ("sat-800-on", "sat-800-off", "sat-0-on"))
    out = tmp_path / "out.json"
    assert simulate_saturated.main([str(on), str(off), str(fast), "--prefill-rate", "91000", "--line", "--seeds", "0,7",
                                    "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    kept = json.loads((RESULTS / "simulate_saturated-h100-2026-12-06h-line.json").read_text())
    for name, row in rows.items():
        for seed, p in row["vllm_line"].items():
            for k in simulate_saturated.KEYS:  # each seed as the kept file has it
                assert abs(p[k] - kept[name]["vllm_line"][seed][k]) < 1e-9, (name, seed, k)
        sm = kept[name]["vllm_line_summary"]  # the summary benchmarks/README.md quotes, from the kept seeds
        assert sm == simulate_saturated.line_summary(kept[name]["vllm_line"], kept[name]["measured"]) and sm["seeds"] == 20
    on_sm, off_sm, fast_sm = (kept[x.name]["vllm_line_summary"] for x in (on, off, fast))
    assert all(0.75 < v < 1.25 for v in on_sm["median"]) and on_sm["within_25"] > 0.5 and 5 <= on_sm["timeouts_median"] <= 12
    assert all(0.97 < v < 1.03 for v in off_sm["p10"] + off_sm["p90"]) and off_sm["within_25"] == 1.0
    assert abs(fast_sm["median"][0] - 1) < 0.1 and max(fast_sm["median"][1:]) < 0.6


def test_a_calibration_run_alone_fits_the_32k_decision_runs_median_seed_but_overstates_the_run_without_it(tmp_path):
    """``--calib`` (2026-12-07, an H100, 32k prompts at 3.5/s behind four 800 MB/s links): R, T0, the API server's
    seconds and the loads' and steps' fits all from the calibration run (``PAPER_STEPS=calib`` with the runs' flags).
    The decision run's median seed comes within issue 46's 25 % (1.06 / 0.80 / 0.81, all three at 75 % of seeds); the
    run without the decision is overstated (1.32 / 1.25 / 1.22): two of the calibration's fourteen loads shared the
    links with a miss's 1 GB save (1.48x and 1.75x the median GET time), and the model's tier serves no saves
    (benchmarks/README.md). Two seeds are run again here against the kept file; the fits are recomputed from the
    calibration's own files."""
    import statistics

    from kvctl.sim.variability import fit_loads

    base = RESULTS / "paper_gpu-h100-2026-12-07-s32-"
    on, off, calib = (Path(f"{base}{x}") for x in ("on", "off", "calib"))
    fits = simulate_saturated.calib_fits(calib)
    assert round(fits["prefill_rate"]) == 64979 and round(fits["t0"] * 1e3, 1) == 7.5
    assert round(fits["api_s"] * 1e3, 1) == 37.7 and fits["hits_timed"] == 14
    spread = fit_loads(fits["trace"], 4).spread
    assert len(spread) == 14 and sum(x > 1.4 for x in spread) == 2 and abs(statistics.median(spread) - 1) < 1e-6
    events = [json.loads(line) for line in Path(fits["trace"]).read_text().splitlines()]
    saves = [(e["t"] - e["s"], e["t"]) for e in events if e["ev"] == "save" and e["chunks"] == 128]  # a miss's whole prompt
    median_get = statistics.median(e["get_s"] for e in events if e["ev"] == "load")
    for e in (e for e in events if e["ev"] == "load" and e["get_s"] > 1.4 * median_get):  # each slow load beside a save
        assert any(a < e["t"] and b > e["t"] - e["total_s"] for a, b in saves)
    out = tmp_path / "out.json"
    assert simulate_saturated.main([str(on), str(off), "--calib", str(calib), "--line", "--seeds", "0,7",
                                    "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    kept = json.loads((RESULTS / "simulate_saturated-h100-2026-12-07-s32-calib.json").read_text())
    def numbers(f: dict) -> dict:  # the fits, not where the file was read from
        return {k: v for k, v in f.items() if k != "trace"}
    assert numbers(rows["calib_fits"]) == numbers(kept["calib_fits"]) == numbers(fits)
    for name in (on.name, off.name):
        for seed, p in rows[name]["vllm_line"].items():
            for k in simulate_saturated.KEYS:
                assert abs(p[k] - kept[name]["vllm_line"][seed][k]) < 1e-9, (name, seed, k)
        sm = kept[name]["vllm_line_summary"]
        assert sm == simulate_saturated.line_summary(kept[name]["vllm_line"], kept[name]["measured"]) and sm["seeds"] == 20
    on_sm, off_sm = kept[on.name]["vllm_line_summary"], kept[off.name]["vllm_line_summary"]
    assert all(0.75 <= round(v, 2) <= 1.25 for v in on_sm["median"]) and on_sm["within_25"] == 0.75
    assert min(off_sm["median"]) > 1.2 and off_sm["within_25"] == 0.25


def test_calib_and_the_figures_it_fits_are_one_or_the_other(capsys):
    import pytest

    with pytest.raises(SystemExit) as e:
        simulate_saturated.main([str(ON), "--calib", str(RESULTS / "paper_gpu-h100-2026-12-07-s32-calib"), "--t0", "0.005"])
    assert e.value.code == 2 and "--calib fits --t0 on the calibration run" in capsys.readouterr().err


def test_a_calibration_directory_without_its_files_is_one_line(tmp_path):
    import pytest

    with pytest.raises(SystemExit) as e:
        simulate_saturated.main([str(ON), "--calib", str(tmp_path)])
    assert str(e.value).startswith("--calib: ") and "calib.connector-trace.jsonl" in str(e.value)
    assert "\n" not in str(e.value)


def test_an_async_calibration_at_rho_1_3_fits_the_run_without_the_decision_and_understates_the_decision_run(tmp_path):
    """``--calib`` on the 2026-12-07 third session's runs (an H100, 32k prompts at 3.9/s, rho_tier 1.3), the
    calibration loading asynchronously (``--calib-loading async``). Its 14 loads were all within 3 % of their median
    GET time, two of them beside steps of 8k tokens or more, so the model's loads are never slow. The run without the
    decision comes within 25 % at every seed (0.93 / 0.94 / 0.95 at the median); the decision run is understated
    (0.78 / 0.61 / 0.61, no seed within): the run cut 7 loads short at their deadline (1.2-1.9x GET times beside its
    recompute steps), the model none (benchmarks/README.md). Two seeds run again against the kept file."""
    from kvctl.sim.variability import fit_loads

    base = RESULTS / "paper_gpu-h100-2026-12-07-s39-"
    on, off, calib = (Path(f"{base}{x}") for x in ("on", "off", "calib"))
    assert json.loads((calib / "meta.json").read_text())["calib_loading"] == "async"
    fits = simulate_saturated.calib_fits(calib)
    assert round(fits["prefill_rate"]) == 64026 and round(fits["t0"] * 1e3, 1) == 9.4
    assert round(fits["api_s"] * 1e3, 1) == 37.8 and fits["hits_timed"] == 14
    spread = fit_loads(fits["trace"], 4).spread
    assert len(spread) == 14 and 0.98 < min(spread) and max(spread) < 1.035
    out = tmp_path / "out.json"
    assert simulate_saturated.main([str(on), str(off), "--calib", str(calib), "--line", "--seeds", "0,7",
                                    "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    kept = json.loads((RESULTS / "simulate_saturated-h100-2026-12-07-s39-calib.json").read_text())
    for name in (on.name, off.name):
        for seed, p in rows[name]["vllm_line"].items():
            for k in simulate_saturated.KEYS:
                assert abs(p[k] - kept[name]["vllm_line"][seed][k]) < 1e-9, (name, seed, k)
    on_sm, off_sm = kept[on.name]["vllm_line_summary"], kept[off.name]["vllm_line_summary"]
    assert [round(v, 2) for v in on_sm["median"]] == [0.78, 0.61, 0.61] and on_sm["within_25"] == 0.0
    assert on_sm["timeouts_median"] == 0
    assert [round(v, 2) for v in off_sm["median"]] == [0.93, 0.94, 0.95] and off_sm["within_25"] == 1.0


def test_the_decision_runs_own_loads_reproduce_it_and_the_beside_draw_fits_both_runs(tmp_path):
    """The model's mechanism at rho_tier 1.3 (2026-12-07, third), fitted on the decision run's own trace (not a
    calibration: what a calibration would need to show). Drawn from all its loads, the decision run comes within 25 %
    at the median seed (1.05 / 0.81 / 0.77) and gives up 7 loads, as it did, but the run without the decision is
    overstated (1.30 / 1.29 / 1.25: its loads never ran beside a big step). With --fit-load-beside, a load beside a
    big prefill draws from the loads that ran beside big steps and the others from the rest: 0.94 / 0.79 / 0.74 and
    1.11 / 1.11 / 1.09, the run without the decision within 25 % at 80 % of seeds. Two seeds run again."""
    base = RESULTS / "paper_gpu-h100-2026-12-07-s39-"
    on, off = base.with_name(base.name + "on"), base.with_name(base.name + "off")
    kept = {k: json.loads((RESULTS / f"simulate_saturated-h100-2026-12-07-s39-own-{k}.json").read_text())
            for k in ("pooled", "beside")}
    med = {k: {n: [round(v, 2) for v in kept[k][n.name]["vllm_line_summary"]["median"]] for n in (on, off)} for k in kept}
    assert med["pooled"] == {on: [1.05, 0.81, 0.77], off: [1.3, 1.29, 1.25]}
    assert med["beside"] == {on: [0.94, 0.79, 0.74], off: [1.11, 1.11, 1.09]}
    assert kept["pooled"][on.name]["vllm_line_summary"]["timeouts_median"] == 7
    assert kept["beside"][off.name]["vllm_line_summary"]["within_25"] == 0.8
    out = tmp_path / "out.json"
    args = [str(on), str(off), "--fit-run", str(on), "--prefill-rate", "64026", "--t0", "0.0094", "--api-s", "0.0378",
            "--line", "--beside", "--seeds", "0,7", "--json", str(out)]
    assert simulate_saturated.main(args) == 0
    rows = json.loads(out.read_text())
    for name in (on.name, off.name):
        for seed, p in rows[name]["vllm_line"].items():
            for k in simulate_saturated.KEYS:
                assert abs(p[k] - kept["beside"][name]["vllm_line"][seed][k]) < 1e-9, (name, seed, k)


def test_a_calibration_with_loads_beside_big_steps_fits_the_fixed_decision_runs(tmp_path):
    """2026-12-07, sixth (benchmarks/README.md): ``s39-calib2`` sent 10 of its 26 hits 50 ms after a miss
    (``--calib-beside-s 0.05``), so its loads include some beside 16k steps. Fitted on it alone, ``--line --beside``
    puts the two decision runs with the given-up load's save fixed (``s39fix-on``, ``s39fix-sw05``) within 25 % at
    every one of 20 seeds; their twin ``s39fix-on2``, whose p50 was 1.5x ``s39fix-on``'s, at one seed in 20. Here
    two seeds of ``s39fix-sw05`` again, against the kept file."""
    base = RESULTS / "paper_gpu-h100-2026-12-07f-"
    run, calib = Path(f"{base}s39fix-sw05"), Path(f"{base}s39-calib2")
    fits = simulate_saturated.calib_fits(calib)
    assert round(fits["prefill_rate"]) == 66272 and round(fits["t0"] * 1e3, 1) == 19.4 and fits["hits_timed"] == 26
    out = tmp_path / "out.json"
    assert simulate_saturated.main([str(run), "--calib", str(calib), "--line", "--beside", "--seeds", "0,7",
                                    "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    kept = json.loads((RESULTS / "simulate_saturated-h100-2026-12-07f-s39-calib2.json").read_text())
    for seed, p in rows[run.name]["vllm_line"].items():
        for k in simulate_saturated.KEYS:
            assert abs(p[k] - kept[run.name]["vllm_line"][seed][k]) < 1e-9, (seed, k)
    within = {name: kept[f"paper_gpu-h100-2026-12-07f-{name}"]["vllm_line_summary"]["within_25"]
              for name in ("s39fix-on", "s39fix-on2", "s39fix-sw05")}
    assert within == {"s39fix-on": 1.0, "s39fix-on2": 0.05, "s39fix-sw05": 1.0}
