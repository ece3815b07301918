"""Issue 46 item 4: diagnose and the exporter read the connector's load-or-recompute decisions.

The engine side is a real local HTTP server serving Prometheus text in the format the kvctl connector registers
(``kvctl:load_decisions_total{decision,reason}``, :mod:`kvctl.plugins.vllm_stats`), written from chosen totals
(:mod:`tests.diagnose.engine_text`); the CLI and the exporter read it over HTTP and parse it with
prometheus_client's parser.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.diagnose.analysis import Params, analyse
from kvctl.diagnose.capture import Capture, Sample
from kvctl.diagnose.sources import GpuSample
from kvctl.ops.exporter import Exporter, ExporterConfig
from kvctl.ops.exporter_http import Server, parse_listen
from kvctl.records import prometheus as M
from tests.diagnose.engine_text import EngineState
from tests.diagnose.metrics_server import MetricsServer
from tests.exporter.helpers import one, scrape

P = Params(bytes_per_token=1000.0, prefill_rate=40000.0, t0_s=0.05)
MODEL = ["--bytes-per-token", "1000", "--prefill-rate", "40000", "--t0", "0.05"]
# an engine that runs the kvctl connector at W = 4 ranks (kvctl:ranks), two label sets of it (engine="0"/"1")
BASE = EngineState(engines=2, lmcache=False, kvctl_get_bytes=0, extra={"kvctl:ranks": 4},
                   decisions={("load", "wins"): 10})
SATURATED = BASE.advance(requests=20, prompt_lengths=[16000] * 20, kvctl_get_bytes=4e7, kvctl_get_s=0.1, decisions={
    ("load", "wins"): 20, ("recompute", "tier_queue"): 4, ("partial", "tier_queue"): 1,
    ("given_up", "deadline"): 2, ("recompute", "below_breakeven"): 5})


def cap_of(a: EngineState, b: EngineState) -> Capture:
    g = GpuSample(note="no GPU visible (test)")
    return Capture(["http://engine:8000"], [], [Sample(100.0, [a.text()], [], g), Sample(101.0, [b.text()], [], g)], {})


def ids(diag) -> set[str]:
    return {f.id for f in diag.findings}


def test_the_decisions_are_read_apart_by_decision_and_reason():
    """The parser sums over the engine's labels but keeps the connector's own labels apart."""
    s = M.parse(SATURATED.text())
    got = s.by_labels("kvctl:load_decisions")
    assert got == {("load", "wins"): 20, ("recompute", "tier_queue"): 4, ("partial", "tier_queue"): 1,
                   ("given_up", "deadline"): 2, ("recompute", "below_breakeven"): 5}
    assert s.counter("kvctl:load_decisions") == 32  # the sum stays what it was


def test_hits_recomputed_when_the_tier_turns_hits_away():
    d = analyse(cap_of(BASE, SATURATED), P)
    # the window: 10 more loads, 4 + 1 behind the queue, 2 given up, 5 below break-even; judged = 10 + 5 + 5 = 20
    assert d.load_decisions == {"given_up": {"deadline": 2}, "load": {"wins": 10}, "partial": {"tier_queue": 1},
                                "recompute": {"below_breakeven": 5, "tier_queue": 4}}
    assert d.hits_recomputed_share == pytest.approx(7 / 20)
    f = next(f for f in d.findings if f.id == "hits_recomputed")
    assert f.severity == "warning"
    assert (f.evidence["hits_judged"], f.evidence["hits_recomputed"]) == (20, 7)
    assert (f.evidence["recomputed_whole"], f.evidence["recomputed_in_part"], f.evidence["given_up_at_deadline"]) == (4, 1, 2)
    assert "7 of the 20 hit(s)" in f.message and "4 whole and 1 in part" in f.message
    # the fix is said for the engine's 4 ranks, with the what-if sizing that models the decision
    assert "`kvctl plan --ranks 4 --policy on`" in f.recommendation
    assert "kvctl deploy-valkey up --ranks 4 --instances-per-rank K" in f.recommendation


@pytest.mark.parametrize("window, why", [
    ({("load", "wins"): 30, ("recompute", "below_breakeven"): 20, ("recompute", "below_n_star"): 9},
     "hits that lose on an idle tier are not the tier's saturation"),
    ({("load", "wins"): 10, ("recompute", "tier_queue"): 2}, "fewer than HITS_RECOMPUTED_MIN"),
    ({("load", "wins"): 60, ("recompute", "tier_queue"): 3, ("given_up", "deadline"): 2}, "5 of 63: under 10 %"),
])
def test_no_finding_below_its_thresholds_or_for_other_reasons(window, why):
    after = BASE.advance(requests=5, prompt_lengths=[16000] * 5, decisions={k: v + BASE.decisions.get(k, 0) for k, v in window.items()})
    d = analyse(cap_of(BASE, after), P)
    assert "hits_recomputed" not in ids(d), why


def test_a_decision_or_reason_kvctl_does_not_know_is_counted_as_other():
    """An engine's labels are its own: any value outside connector/policy.py's is counted under "other", so the
    exporter's series stay a bounded set whatever an engine exports."""
    after = BASE.advance(requests=2, prompt_lengths=[16000] * 2, decisions={
        ("load", "wins"): 10, ("x" * 50, "wins"): 1, ("load", "\x1b[31mred"): 2, ("maybe", "why"): 3})
    d = analyse(cap_of(BASE, after), P)
    assert d.load_decisions == {"load": {"other": 2}, "other": {"other": 3, "wins": 1}}


def test_a_decision_first_seen_inside_the_window_counts_from_zero():
    before = EngineState(engines=1, lmcache=False, kvctl_get_bytes=0)  # no decision yet: no series at all
    after = before.advance(requests=4, prompt_lengths=[16000] * 4, decisions={("recompute", "tier_queue"): 4})
    d = analyse(cap_of(before, after), P)
    assert d.load_decisions == {"recompute": {"tier_queue": 4}} and "hits_recomputed" in ids(d)


def test_diagnose_says_it_first_with_its_runbook_in_json():
    with MetricsServer([BASE.text(), SATURATED.text()]) as srv:
        res = CliRunner().invoke(cli, ["diagnose", "--engine-url", srv.url, "--window", "0.3", *MODEL, "--json"])
    assert res.exit_code == 3, res.output  # a warning
    d = json.loads(res.stdout)
    assert d["verdict"]["finding"] == "hits_recomputed" and d["verdict"]["runbook"] == "kvctl runbook hits_recomputed"
    assert d["load_decisions"]["recompute"]["tier_queue"] == 4 and d["hits_recomputed_share"] == pytest.approx(0.35)


def test_the_exporter_exports_the_decisions():
    with MetricsServer([BASE.text(), SATURATED.text()]) as srv:
        exp = Exporter(ExporterConfig((srv.url,), (), P, interval_s=1.0, window_s=60.0))
        server = Server(exp, parse_listen("127.0.0.1:0"), sample=False)
        try:
            exp.step()
            rnd = exp.step()
            values = scrape(server.url)
        finally:
            server.stop()
    w = rnd.diagnosis.window_s
    assert one(values, "kvctl_load_decisions_per_second", decision="recompute", reason="tier_queue") * w == pytest.approx(4)
    assert one(values, "kvctl_load_decisions_per_second", decision="load", reason="wins") * w == pytest.approx(10)
    assert one(values, "kvctl_hits_recomputed_ratio") == pytest.approx(7 / 20)
    assert one(values, "kvctl_finding", id="hits_recomputed", severity="warning") == 1


def test_saves_dropped_when_the_connector_refuses_saves_behind_a_slow_tier():
    """kvctl:saves_dropped_total rising in the window is a warning with its runbook; flat, no finding."""
    before = BASE.advance(extra={"kvctl:saves_dropped_total": 2})
    after = before.advance(requests=20, prompt_lengths=[16000] * 20, kvctl_get_bytes=4e7, kvctl_get_s=0.1,
                           extra={"kvctl:saves_dropped_total": 7})
    d = analyse(cap_of(before, after), P)
    f = next(f for f in d.findings if f.id == "saves_dropped")
    assert f.severity == "warning" and f.evidence == {"saves_dropped": 5}
    assert f.message.startswith("5 save(s) dropped in the window") and "save_queue_bytes" in f.message
    assert "kvctl bench" in f.recommendation
    page = CliRunner().invoke(cli, ["runbook", "saves_dropped"])
    assert page.exit_code == 0 and "save_queue_bytes" in page.output and f.recommendation.split(";")[0].replace("`", "") in " ".join(
        page.output.replace(">", " ").split())
    flat = before.advance(requests=20, prompt_lengths=[16000] * 20, kvctl_get_bytes=4e7, kvctl_get_s=0.1)
    assert "saves_dropped" not in ids(analyse(cap_of(before, flat), P))
