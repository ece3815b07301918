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


def test_the_second_gpu_run_shows_why_lmcache_counts_no_hit_tokens_under_async_loading():
    """The H100 rerun (2026-12-07, third), whose archive kept the engines' logs: report's L2 share now agrees with the
    cached share in all four runs, and LMCache's flat num_hit_tokens under async loading is LMCache's own count.
    That counter adds the tokens LMCache's retrieve wrote into vLLM's cache. The sync engine's worker retrieved 231
    times (its log's ``Retrieved N out of M`` lines); the async engine's ran no retrieve at all (no such line,
    num_retrieve_requests and num_lookup_requests 0), while its lookup server read every hit's chunks from the tier
    (12 remote reads, 0.76 GB, one ``retrieved length 2048`` answer a lookup) and vLLM counted 24 564 external hits."""
    import re
    import tarfile

    d = ROOT / "benchmarks" / "results" / "lmcache_ops-h100-2026-12-07-third"
    text = (d / "lmcache-ops.txt").read_text()
    disagree = [line for line in text.splitlines() if line.startswith("  DISAGREES")]
    assert len(disagree) == 1 and disagree[0].endswith("got 0 vs 2.46e+04")
    for run, share in (("run-2", "0.863"), ("run-3", "1"), ("run-4", "1")):
        assert f"  agrees    report {run}: L2 share" in text and f"got {share} vs {share}" in text
    with tarfile.open(d / "lmcache-ops.tar.gz") as tar:
        read = {m.name.split("/", 1)[1]: tar.extractfile(m).read().decode() for m in tar.getmembers()
                if m.isfile() and m.name.endswith((".log", ".prom"))}

    def counter(prom: str, name: str) -> float:
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in read[prom].splitlines() if ln.startswith(f"lmcache:{name}_total{{"))

    retrieved = {e: [int(n) for n in re.findall(r"Retrieved (\d+) out of", read[f"{e}/server.log"])]
                 for e in ("engine-1", "engine-2")}
    assert len(retrieved["engine-1"]) == 231 and sum(retrieved["engine-1"]) == 413952 and retrieved["engine-2"] == []
    answers = re.findall(r"Responding to scheduler for lookup id \S+ with retrieved length (\d+)", read["engine-2/server.log"])
    assert len(answers) == 133 and set(answers) == {"2048"}
    sync, asyn = "engine-metrics.prom", "engine-metrics-async.prom"
    assert (counter(sync, "num_retrieve_requests"), counter(sync, "num_hit_tokens")) == (8, 14336)
    assert [counter(asyn, n) for n in ("num_retrieve_requests", "num_lookup_requests", "num_hit_tokens")] == [0, 0, 0]
    assert counter(asyn, "num_remote_read_requests") == 12 and round(counter(asyn, "num_remote_read_bytes") / 1e9, 2) == 0.76
