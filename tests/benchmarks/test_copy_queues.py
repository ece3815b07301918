"""benchmarks/copy_queues.py: which copy lanes waited beside a step, and its refusals.

The measurement itself needs a CUDA device (the GPU host's); here the summary of a child's result, built as
``child`` returns it, and the one-line exits on bad arguments and without CUDA (this machine's torch has none).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import copy_queues  # noqa: E402


def test_the_lanes_whose_worst_copy_passed_the_bound_are_named():
    res = {"connections_env": None, "mode": "gpu-step", "alone_s": [0.0004, 0.0003, 0.0005],
           "rounds": [{"step_s": 0.251, "worst_s": [0.004, 0.240, 0.005], "copies": [50, 2, 48]},
                      {"step_s": 0.249, "worst_s": [0.004, 0.006, 0.005], "copies": [51, 49, 50]}]}
    s = copy_queues.summarize(res, waited_ms=20.0)
    assert s["connections"] == "default (8)" and s["alone_median_ms"] == 0.4
    assert [r["waited_lanes"] for r in s["rounds"]] == [[1], []]
    assert s["rounds"][0]["worst_ms"] == 240.0 and s["rounds"][0]["copies"] == 100
    line = copy_queues.render([s], 3).splitlines()[1]
    assert line.startswith("gpu-step") and "1 [1] 240.0" in line and "0 [] 6.0" in line


def test_bad_arguments_and_no_cuda_exit_2_with_one_line(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the run would measure, not refuse")
    assert copy_queues.main(["--modes", "gpu-step,bogus"]) == 2
    assert copy_queues.main(["--connections", "default,many"]) == 2
    assert copy_queues.main(["--lanes", "0"]) == 2
    capsys.readouterr()
    assert copy_queues.main(["--rounds", "1"]) == 2  # this machine has no CUDA device
    err = capsys.readouterr().err.strip()
    assert err == "copy_queues: needs torch with a CUDA device (none here)"


def test_the_h100_runs_of_2026_12_07_fifth_read_back_as_benchmarks_readme_says():
    """The kept runs (benchmarks/README.md, 2026-12-07 fifth). The first run's steps of matrix products lasted 7-10 ms
    (the step was sized with cuBLAS's set-up in its timing), so only its python-step rows count: every lane's copy
    waited 52-96 ms beside a thread holding the GIL, with 8 hardware queues or 32. The second run, with the set-up out
    of the timing: beside a 0.26-0.29 s step on another stream no lane copy waited a step (worst 22 ms), the engine's
    own copies queued in the step's middle or not, 8 queues or 32."""
    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    first = json.loads((results / "copy_queues-h100-2026-12-07e-first.json").read_text())["results"]
    fixed = json.loads((results / "copy_queues-h100-2026-12-07e.json").read_text())["results"]
    py = [copy_queues.summarize(r, 20.0) for r in first if r["mode"] == "python-step"]
    assert [s["connections"] for s in py] == ["default (8)", "32"]
    assert all(len(r["waited_lanes"]) >= 11 and 50 < r["worst_ms"] < 100 for s in py for r in s["rounds"])
    assert max(r["step_s"] for x in first if x["mode"] != "python-step" for r in x["rounds"]) < 0.02  # the sizing bug
    gpu = [copy_queues.summarize(r, 25.0) for r in fixed]
    assert sorted((s["mode"], s["connections"]) for s in gpu) == [
        ("gpu-step", "32"), ("gpu-step", "default (8)"), ("gpu-step-io", "32"), ("gpu-step-io", "default (8)")]
    rounds = [r for s in gpu for r in s["rounds"]]
    assert all(0.25 < r["step_s"] < 0.3 and r["waited_lanes"] == [] for r in rounds)
    assert round(max(r["worst_ms"] for r in rounds), 1) == 21.8
