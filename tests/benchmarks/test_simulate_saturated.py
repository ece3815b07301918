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
