"""benchmarks/lmcache_ops.py's checks without an engine: a run of report's whose cached tokens are all LMCache's L2
must give an L2 share equal to its cached share, and one that gives none disagrees (on the H100 of 2026-12-07 three
of four runs had none, and the check had skipped them). The GPU run's own output is kept in
benchmarks/results/lmcache_ops-h100-2026-12-07/ (docs/gpu.md)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ops():
    sys.path.insert(0, str(ROOT))
    spec = importlib.util.spec_from_file_location("lmcache_ops", ROOT / "benchmarks" / "lmcache_ops.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _report_checks(ops, tmp_path: Path, runs: list[dict]) -> list[dict]:
    (tmp_path / "25-report-all.json").write_text(json.dumps({"runs": runs}))
    rows = [{"step": "25-report-all", "json": "25-report-all.json"}]
    return [c for c in ops.agreement(tmp_path, rows, 31104.0) if c["check"].startswith("report ")]


def test_a_run_with_cached_tokens_and_no_l2_share_disagrees(ops, tmp_path):
    checks = _report_checks(ops, tmp_path, [
        {"name": "run-1.jsonl", "l2_token_share": 0.583, "cached_token_share": 0.583},
        {"name": "run-2.jsonl", "l2_token_share": None, "cached_token_share": 0.863,
         "l2_token_share_source": "the engine's metrics have no L2 counter"}])
    assert [(c["check"].split(":")[0], c["agrees"]) for c in checks] == [("report run-1", True), ("report run-2", False)]
    assert "no L2 counter" in checks[1]["actual"]


def test_an_l2_share_off_the_cached_share_disagrees_and_a_run_with_nothing_cached_is_not_checked(ops, tmp_path):
    checks = _report_checks(ops, tmp_path, [
        {"name": "run-1.jsonl", "l2_token_share": 0.0625, "cached_token_share": 0.5},
        {"name": "run-2.jsonl", "l2_token_share": None, "cached_token_share": 0.0}])
    assert [(c["check"].split(":")[0], c["agrees"]) for c in checks] == [("report run-1", False)]


def test_the_gpu_runs_kept_output_names_what_disagreed():
    """The H100 run's printed summary (all that came back of it but eight step files): one DISAGREES line, LMCache's
    num_hit_tokens flat under async loading while vLLM counted the external hits."""
    text = (ROOT / "benchmarks" / "results" / "lmcache_ops-h100-2026-12-07" / "lmcache-ops.txt").read_text()
    disagree = [line for line in text.splitlines() if line.startswith("  DISAGREES")]
    assert len(disagree) == 1 and "Δlmcache:num_hit_tokens against Δvllm:external_prefix_cache_hits" in disagree[0]
    assert disagree[0].endswith("got 0 vs 2.46e+04")
    assert "run-2: hit rate 0.987, L2 share None" in text


def test_the_summary_names_reports_own_reason_for_a_missing_l2_share(ops):
    """The GPU run's summary said "the engine exports no L2 counter" for every run whose L2 share report could not
    give; report says why (here a failed scrape), and the summary now passes that on."""
    line = ops.key_report({"runs": [{"name": "run-2.jsonl", "hit_rate": 0.987, "l2_token_share": None,
                                     "l2_token_share_max": 0.863, "cached_token_share": 0.863, "p50_s": 0.05,
                                     "l2_token_share_source": "no counters after the run (the scrape failed: 'timed out')"}]},
                          "", 0)
    assert "≤ 0.863: no counters after the run (the scrape failed" in line and "exports no L2 counter" not in line
