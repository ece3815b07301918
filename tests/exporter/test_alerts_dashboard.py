"""configs/prometheus/kvctl-alerts.yaml and configs/grafana/kvctl-dashboard.json against what the exporter serves.

Static checks (always): the rules file has Prometheus's rule-file structure, every
metric, label and finding id an alert or panel uses exists. With promtool (found on
PATH, in $KVCTL_PROMTOOL, or unpacked by `make promtool` into .tools/):
`promtool check rules`, and `promtool test rules` fed with series scraped from a real
exporter run, so the alerts are shown to fire on what the exporter really serves.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from kvctl.ops.exporter import METRICS, Exporter, ExporterConfig
from kvctl.core.thresholds import GPU_NOT_COMPUTE_BOUND_PCT, RHO_HIGH, RHO_UNSTABLE
from kvctl.tier.targets import resolve_targets
from tests.diagnose.metrics_server import MetricsServer
from tests.exporter.helpers import AFTER, BASE, PARAMS, RULES, load_rules, rules_by_name
from tests.finding_ids import diagnose_finding_ids

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "configs" / "grafana" / "kvctl-dashboard.json"
TARGET_LABELS = {"instance", "job"}  # added by Prometheus to every scraped series
RULE_KEYS = {"alert", "expr", "for", "labels", "annotations", "keep_firing_for"}
DURATION = re.compile(r"^([0-9]+(ms|s|m|h|d|w|y))+$")


def expr_metrics(expr: str) -> set[str]:
    return set(re.findall(r"\b(kvctl_[a-z_]+)\b", expr))


def expr_labels(expr: str) -> set[str]:
    """Label names in matchers ``{a="x"}`` and in ``by (...)``/``without (...)`` clauses."""
    out: set[str] = set()
    for body in re.findall(r"\{([^}]*)\}", expr):
        out |= set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", body))
    for body in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        out |= {x.strip() for x in body.split(",") if x.strip()}
    return out


def matched_ids(expr: str) -> set[str]:
    """Finding ids an ``id="..."`` or ``id=~"a|b"`` matcher selects."""
    ids: set[str] = set()
    for op, value in re.findall(r'\bid\s*(=~|=)\s*"([^"]*)"', expr):
        ids |= set(value.split("|")) if op == "=~" else {value}
    return ids


def check_expr(expr: str, where: str) -> None:
    metrics = expr_metrics(expr)
    assert metrics, f"{where}: no kvctl metric in {expr!r}"
    unknown = metrics - set(METRICS)
    assert not unknown, f"{where}: {unknown} not served by kvctl exporter"
    allowed = TARGET_LABELS.union(*(METRICS[m][1] for m in metrics))
    assert expr_labels(expr) <= allowed, f"{where}: labels {expr_labels(expr) - allowed} not on {metrics}"
    assert matched_ids(expr) <= diagnose_finding_ids(), f"{where}: unknown finding ids {matched_ids(expr) - diagnose_finding_ids()}"


# --- the rules file ------------------------------------------------------------------------


def test_rules_file_has_prometheus_structure():
    doc = yaml.safe_load(RULES.read_text())
    assert set(doc) == {"groups"}
    names = set()
    for g in doc["groups"]:
        assert set(g) <= {"name", "interval", "rules", "limit"} and g["name"] and g["rules"]
        for r in g["rules"]:
            assert set(r) <= RULE_KEYS and "alert" in r and "expr" in r, r
            assert r["alert"] not in names
            names.add(r["alert"])
            assert DURATION.match(r["for"]), r["for"]
            assert r["labels"]["severity"] in ("warning", "page")
            ann = r["annotations"]
            assert {"summary", "description", "runbook_url", "next_step"} <= set(ann), r["alert"]
            assert ann["next_step"].startswith("kvctl "), r["alert"]
            check_expr(r["expr"], r["alert"])
            metrics = expr_metrics(r["expr"])
            used = set(re.findall(r"\$labels\.(\w+)", ann["summary"] + ann["description"]))
            grouped = set(re.findall(r"without\s*\(([^)]*)\)", r["expr"]))
            dropped = {x.strip() for g_ in grouped for x in g_.split(",")}
            assert used <= TARGET_LABELS.union(*(METRICS[m][1] for m in metrics)) - dropped, (r["alert"], used)


@pytest.mark.parametrize(
    "alert, expr, for_, severity",
    [
        ("KvctlRhoHigh", f"kvctl_rho >= {RHO_HIGH:g}", "5m", "warning"),  # kvctl.core.thresholds: the values diagnose, doctor and loading judge by
        ("KvctlRhoUnstable", f"kvctl_rho >= {RHO_UNSTABLE:g}", "2m", "page"),
        # the others' expressions are not restated here (a copy of the YAML proves nothing): the metrics they use
        # are checked against what the exporter serves, and promtool's unit tests and a live Prometheus fire them
        ("KvctlBandwidthBelowBreakeven", None, "10m", "warning"),
        ("KvctlQueueGrowingGpuIdle", None, "2m", "page"),
        ("KvctlDataInsufficient", None, "10m", "warning"),
        ("KvctlInstanceSaturated", f"kvctl_instance_rho >= {RHO_HIGH:g}", "5m", "warning"),  # ρ per instance, summed over engines
        ("KvctlHitsRecomputed", None, "10m", "warning"),  # issue 46: the decision recomputing hits, the tier saturated
    ],
)
def test_the_alerts_the_issue_asks_for(alert, expr, for_, severity):
    r = rules_by_name()[alert]
    assert (r["for"], r["labels"]["severity"]) == (for_, severity)
    if expr is not None:  # a threshold from kvctl.core.thresholds: the rule must state that value
        assert r["expr"] == expr


def rho_thresholds_stated(rule: dict) -> set[float]:
    """Every ρ value an alert states: in its expression and in the words of its summary and description."""
    ann = rule["annotations"]
    words = re.findall(r"(?:≥|at least)\s*([0-9]+(?:\.[0-9]+)?)", ann["summary"] + " " + ann["description"])
    return {float(x) for x in re.findall(r"kvctl_rho\s*>=\s*([0-9.]+)", rule["expr"]) + words}


def test_the_rho_alerts_state_the_thresholds_kvctl_judges_by():
    """KvctlRhoHigh says 0.7 where kvctl.core.thresholds.RHO_HIGH is 0.7, in the expression and in its text; KvctlRhoUnstable 1."""
    rules = rules_by_name()
    assert rho_thresholds_stated(rules["KvctlRhoHigh"]) == {RHO_HIGH}
    assert rho_thresholds_stated(rules["KvctlRhoUnstable"]) == {RHO_UNSTABLE}
    # the check can fail: a rule edited to 0.75 in its text only no longer matches
    edited = dict(rules["KvctlRhoHigh"], annotations=dict(rules["KvctlRhoHigh"]["annotations"], summary="ρ (≥ 0.75)"))
    assert rho_thresholds_stated(edited) == {RHO_HIGH, 0.75}


def test_the_gpu_alert_names_diagnoses_threshold_not_idle():
    """queue_growing_gpu_idle fires below GPU_NOT_COMPUTE_BOUND_PCT mean utilisation (not compute-bound), not on idle GPUs."""
    ann = rules_by_name()["KvctlQueueGrowingGpuIdle"]["annotations"]
    assert f"below {GPU_NOT_COMPUTE_BOUND_PCT:g} %" in ann["summary"] and "idle" not in ann["summary"]


def test_a_stall_finding_pages():
    r = rules_by_name()["KvctlLookupStalled"]
    assert r["labels"]["severity"] == "page" and {"timeouts_rising", "l2_no_hits"} <= matched_ids(r["expr"])


def test_checks_catch_a_typo():
    """The checks above must be able to fail: a misspelt metric, label or finding id is refused."""
    for bad in ["kvctl_rhoo >= 1", 'kvctl_valkey_up{rnak="0"} == 0', 'kvctl_finding{id="rho_unstabel"} == 1', "max by (rank) (kvctl_rho)"]:
        with pytest.raises(AssertionError):
            check_expr(bad, "typo")


# --- the dashboard -------------------------------------------------------------------------


def dashboard_targets() -> list[tuple[str, dict]]:
    d = json.loads(DASHBOARD.read_text())
    return [(p["title"], t) for p in d["panels"] for t in p.get("targets", [])]


def test_every_panel_query_uses_served_metrics_and_labels():
    targets = dashboard_targets()
    assert targets
    for title, t in targets:
        check_expr(t["expr"], title)
        legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", t.get("legendFormat", "")))
        assert legend <= TARGET_LABELS.union(*(METRICS[m][1] for m in expr_metrics(t["expr"]))), (title, legend)


def test_the_panels_the_issue_asks_for():
    d = json.loads(DASHBOARD.read_text())
    panels = {p["title"]: p for p in d["panels"]}
    exprs = {title: {t["expr"] for t in p["targets"]} for title, p in panels.items()}
    rho = next(p for p in d["panels"] if exprs[p["title"]] == {"kvctl_rho"})
    steps = [s["value"] for s in rho["fieldConfig"]["defaults"]["thresholds"]["steps"]]
    assert steps == [None, RHO_HIGH, RHO_UNSTABLE]  # bands at 0.7 and 1 (kvctl.core.thresholds)
    assert {"kvctl_delivered_bandwidth_bytes_per_second", "kvctl_breakeven_bandwidth_bytes_per_second"} in exprs.values()
    assert {"kvctl_arrival_rate_per_second", "kvctl_completion_rate_per_second"} in exprs.values()
    assert {"kvctl_valkey_get_busy_ratio"} in exprs.values()
    assert {"kvctl_instance_rho"} in exprs.values()  # ρ per instance, all engines that share it
    assert any(any("kvctl_finding" in e for e in es) for es in exprs.values())
    assert d["__inputs"][0]["pluginId"] == "prometheus"


# --- promtool ------------------------------------------------------------------------------


def promtool() -> str | None:
    for cand in (os.environ.get("KVCTL_PROMTOOL"), shutil.which("promtool"), str(ROOT / ".tools" / "prometheus" / "usr" / "bin" / "promtool")):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    return None


needs_promtool = pytest.mark.skipif(promtool() is None, reason="promtool not found (make promtool, or put it on PATH)")


@needs_promtool
def test_promtool_check_rules():
    res = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SUCCESS: {len(load_rules())} rules found" in res.stdout


def _series_line(name: str, labels: tuple, value: float) -> dict:
    lab = ",".join(f'{k}="{v}"' for k, v in (*labels, ("instance", "kvctl:9808"), ("job", "kvctl")))
    return {"series": f"{name}{{{lab}}}", "values": f"{value!r}+0x30"}


def _promtool_test(tmp_path: Path, series: list[dict], expected: dict[str, dict[str, list[dict]]]) -> subprocess.CompletedProcess:
    """Run promtool's unit test of the rules (annotations stripped: promtool compares them verbatim)."""
    doc = yaml.safe_load(RULES.read_text())
    for g in doc["groups"]:
        for r in g["rules"]:
            r.pop("annotations", None)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(doc))
    tests = [
        {"alertname": name, "eval_time": at, "exp_alerts": [{"exp_labels": lab} for lab in alerts]}
        for at, by_name in expected.items()
        for name in rules_by_name()
        for alerts in [by_name.get(name, [])]
    ]
    spec = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": tests}]}
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(spec, allow_unicode=True))
    return subprocess.run([promtool(), "test", "rules", "test.yaml"], capture_output=True, text=True, timeout=60, cwd=tmp_path)


@needs_promtool
def test_alerts_fire_on_what_the_exporter_serves(tmp_path, valkey_server):
    """A real exporter over ρ ≈ 2 and B = 1 GB/s < B* = 2.53 GB/s: these series, held for 30 min, fire exactly
    ρ ≥ 1 after 2 m, ρ ≥ 0.7 after 5 m and B < B* after 10 m (worked out from the inputs, see test_exporter)."""
    with MetricsServer([BASE.text(), AFTER.text()]) as srv:
        exp = Exporter(ExporterConfig((srv.url,), tuple(resolve_targets([valkey_server.url])), PARAMS, interval_s=1.0, window_s=60.0))
        exp.step()
        time.sleep(1.0)
        exp.step()
    values = exp.values()
    assert 1.5 < values[("kvctl_rho", ())] < 2.5
    series = [_series_line(name, labels, v) for (name, labels), v in values.items()]
    base = {"instance": "kvctl:9808", "job": "kvctl"}
    res = _promtool_test(
        tmp_path,
        series,
        {
            "3m": {"KvctlRhoUnstable": [{"severity": "page", **base}]},
            "6m": {"KvctlRhoUnstable": [{"severity": "page", **base}], "KvctlRhoHigh": [{"severity": "warning", **base}]},
            "11m": {
                "KvctlRhoUnstable": [{"severity": "page", **base}], "KvctlRhoHigh": [{"severity": "warning", **base}],
                "KvctlBandwidthBelowBreakeven": [{"severity": "warning", **base}],
            },
        },
    )
    assert res.returncode == 0, res.stdout + res.stderr


@needs_promtool
def test_down_stalled_and_blind_alerts(tmp_path):
    """Series as the exporter serves them when rank 1 is down, a lookup stalls and the window is insufficient."""
    series = [
        _series_line("kvctl_valkey_up", (("rank", "0"),), 1.0),
        _series_line("kvctl_valkey_up", (("rank", "1"),), 0.0),
        _series_line("kvctl_engine_up", (("engine", "http://e:8000"),), 1.0),
        _series_line("kvctl_finding", (("id", "timeouts_rising"), ("severity", "warning")), 1.0),
        _series_line("kvctl_finding", (("id", "queue_growing_gpu_idle"), ("severity", "critical")), 1.0),
        _series_line("kvctl_finding", (("id", "hits_recomputed"), ("severity", "warning")), 1.0),
        _series_line("kvctl_data_sufficient", (), 0.0),
        _series_line("kvctl_rho", (), 0.5),
    ]
    base = {"instance": "kvctl:9808", "job": "kvctl"}
    res = _promtool_test(
        tmp_path,
        series,
        {
            "0m": {},  # pending: nothing has held for its `for` yet
            "3m": {
                "KvctlValkeyDown": [{"severity": "page", "rank": "1", **base}],
                "KvctlLookupStalled": [{"severity": "page", "id": "timeouts_rising", **base}],
                "KvctlQueueGrowingGpuIdle": [{"severity": "page", "id": "queue_growing_gpu_idle", **base}],
            },
            "11m": {
                "KvctlValkeyDown": [{"severity": "page", "rank": "1", **base}],
                "KvctlLookupStalled": [{"severity": "page", "id": "timeouts_rising", **base}],
                "KvctlQueueGrowingGpuIdle": [{"severity": "page", "id": "queue_growing_gpu_idle", **base}],
                "KvctlDataInsufficient": [{"severity": "warning", **base}],
                "KvctlHitsRecomputed": [{"severity": "warning", "id": "hits_recomputed", **base}],
            },
        },
    )
    assert res.returncode == 0, res.stdout + res.stderr

