"""Issue 48 item 3: one fix per finding. For `rho_unstable` on a 1-rank engine the findings table said "run 3 Valkey
instance(s) … (one per rank)", stderr `--instances-per-rank 3`, the runbook `--ranks W`, the drill `--ranks N`. The fix
line now comes from one place (kvctl.diagnose.fixes.fix_line, given the finding's numbers and the deployment); the
table, stderr, the runbook (its template, placeholders explained) and the drill say it, and every command that adds
instances has one form (`kvctl deploy-valkey up --ranks W --instances-per-rank K`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.core.runbooks import PAGE_IDS
from kvctl.diagnose import fixes
from kvctl.diagnose.analysis import Params, analyse
from kvctl.diagnose.capture import Capture, Sample, save_capture
from kvctl.diagnose.sources import GpuSample
from kvctl.drill import scenarios as S
from tests.diagnose.engine_text import EngineState
from tests.finding_ids import all_finding_ids

ROOT = Path(__file__).resolve().parents[2]
PAGES = ROOT / "kvctl" / "runbooks"
GPU = GpuSample(note="no GPU visible (test)")
P = Params(bytes_per_token=48437.5, prefill_rate=52200, t0_s=0.1)
V8 = {"valkey_version": "8.1.8", "redis_version": "7.2.4"}  # INFO server of an 8.1 instance
#: a command that adds instances, as the fix lines, runbooks and stderr write it
UP = re.compile(r"kvctl deploy-valkey up(?: --[a-z-]+ [^\s`;,)]+)*")


def info(calls: float, usec: float, bytes_out: float) -> dict:
    return {"cmdstat_get": {"calls": calls, "usec": usec}, "total_net_output_bytes": bytes_out, "evicted_keys": 0, **V8}


def one_rank_engine(instances: int = 1, per_rank: int = 1) -> Capture:
    """A TP=1 engine (no kvctl:ranks gauge) on ``instances`` Valkey 8.1.8 instances (another host): 10 requests of 16k
    tokens in 1 s, 10 remote GETs of 300 ms moving 1e9 B: B = 1/3 GB/s, 1e8 B a request, ρ = 3: ⌈3 × n / 0.5⌉
    instances of this bandwidth for ρ 0.5 (6 with one instance)."""
    a = EngineState(engines=2)
    b = a.advance(requests=10, prompt_lengths=[16000] * 10, external_hits=100000, external_queries=160000, remote_read_bytes=1e9,
                  remote_get_ms=[300] * 10, lookup_s=[0.001] * 10, lmcache_hit_tokens=100000)
    urls = [f"resp://valkey-{i}:6379" for i in range(instances)]
    return Capture(["http://engine:8000"], urls, [Sample(100.0, [a.text()], [info(0, 0, 0)] * instances, GPU),
                                                  Sample(101.0, [b.text()], [info(10, 3e6, 1e9)] * instances, GPU)], {},
                   instances_per_rank=per_rank)


def test_a_one_rank_engine_gets_one_fix_in_the_table_on_stderr_and_in_json(tmp_path):
    """The issue's example: rho_unstable on a 1-rank engine. The finding's fix is fix_line's, says 6 instances on the
    engine's 1 rank (not "one per rank"), the server change first; every command that adds instances, on stdout and
    stderr alike, is the same one."""
    save_capture(one_rank_engine(), tmp_path / "cap")
    d = json.loads(CliRunner().invoke(cli, ["diagnose", "--from", str(tmp_path / "cap"), "--json"]).stdout)
    (f,) = [f for f in d["findings"] if f["id"] == "rho_unstable"]
    want = fixes.fix_line("rho_unstable", {"instances_for_rho_target": 6, "rho_target": 0.5},
                          fixes.Deployment(ranks=1, servers=(fixes.Server("8.1.8", None),)))
    assert f["recommendation"] == want
    assert "one per rank" not in want and "6 per rank on the engine's 1 rank(s)" in want
    assert want.startswith("first, before adding instances: Valkey 8.1.8: move to 9.1")
    res = CliRunner().invoke(cli, ["diagnose", "--from", str(tmp_path / "cap")], env={"COLUMNS": "1000"})
    assert f"fix: {want}" in res.stdout  # one line of the findings table
    said = set(UP.findall(res.stdout + res.stderr))
    assert said == {"kvctl deploy-valkey up --ranks 1 --instances-per-rank 6"}, (said, res.stderr)


@pytest.mark.parametrize("instances, per_rank, n, command", [
    (2, 1, 12, "kvctl deploy-valkey up --ranks 2 --instances-per-rank 6"),  # 2 ranks: ⌈3 × 2 / 0.5⌉ = 12 = 2 × 6
    (4, 2, 24, "kvctl deploy-valkey up --ranks 2 --instances-per-rank 12"),  # 2 ranks × 2 instances now: 24 = 2 × 12
])  # fmt: skip
def test_the_fix_says_the_tiers_ranks_and_instances_per_rank(instances, per_rank, n, command, tmp_path):
    d = analyse(one_rank_engine(instances, per_rank), P)
    (f,) = [f for f in d.findings if f.id == "rho_unstable"]
    assert f.evidence["instances_for_rho_target"] == n and f"`{command}`" in f.recommendation, f.recommendation
    assert {c for note in d.notes for c in UP.findall(note)} <= {command}, d.notes


@pytest.mark.parametrize("n, ranks, said, command", [
    (16, 8, "16 Valkey instance(s) of this bandwidth to bring ρ to ≤ 0.5: 2 per rank on the engine's 8 rank(s) (", "--ranks 8 --instances-per-rank 2"),
    (8, 8, "1 per rank on the engine's 8 rank(s) (", "--ranks 8 --instances-per-rank 1"),
    (5, 8, "1 per rank on the engine's 8 rank(s), 8 in all (", "--ranks 8 --instances-per-rank 1"),
    (3, None, "K per rank on the engine's W rank(s), K = ⌈3/W⌉ (", "--ranks W --instances-per-rank K"),
])  # fmt: skip
def test_fix_line_fills_what_it_knows_of_the_deployment(n, ranks, said, command):
    line = fixes.fix_line("rho_unstable", {"instances_for_rho_target": n, "rho_target": 0.5}, fixes.Deployment(ranks=ranks))
    assert said in line and f"`kvctl deploy-valkey up {command}`" in line, line
    assert not line.startswith("first")  # no server known: no server change


def _fix_section(page: str) -> str:
    text = (PAGES / f"{page}.md").read_text()
    body = text.split("\n## Fix\n", 1)[1].split("\n## ", 1)[0]
    return " ".join(re.sub(r"(?m)^> ?", "", body).split())


@pytest.mark.parametrize("finding", sorted(all_finding_ids()) + ["instance_down"])
def test_each_runbook_quotes_its_findings_fix_line(finding):
    """The runbook shows the command form the finding prints: its Fix section quotes every template word for word."""
    forms = fixes.templates(finding)
    assert forms, f"{finding} has no fix line"
    section = _fix_section(finding)
    for t in forms:
        assert " ".join(t.split()) in section, f"kvctl/runbooks/{finding}.md's Fix section does not quote:\n{t}"


def test_every_placeholder_of_a_quoted_fix_is_explained_on_its_page():
    for page in PAGE_IDS:
        for t in fixes.templates(page):
            section = _fix_section(page)
            for ph in set(re.findall(r"\b(STEP|N|T|W|K|E)\b", t)):
                assert re.search(rf"`?{ph}`?: ", section), f"{page}: placeholder {ph} of its fix is not explained"


def test_every_command_that_adds_instances_has_one_form():
    """Runbooks, alerts and the fix lines: `kvctl deploy-valkey up` with --ranks or --instances-per-rank gives both."""
    texts = {p.name: p.read_text() for p in PAGES.glob("*.md")}
    texts["kvctl-alerts.yaml"] = (ROOT / "configs" / "prometheus" / "kvctl-alerts.yaml").read_text()
    texts["fix lines"] = "\n".join(t for p in PAGE_IDS for t in fixes.templates(p))
    bad = []
    for name, text in texts.items():
        for cmd in UP.findall(" ".join(text.replace("\\\n", " ").split())):
            if ("--ranks" in cmd) != ("--instances-per-rank" in cmd):
                bad.append(f"{name}: {cmd}")
    assert not bad, "\n".join(bad)


def test_the_drill_says_the_diagnosis_fix():
    """The drill's fix is the one the diagnosis printed (numbers filled); listed, the scenario's fix is fix_line's for
    the drill's tier, never a command of its own (`--ranks N` was)."""
    from kvctl.drill.run import fix_of  # noqa: PLC0415

    d = analyse(one_rank_engine(), P)
    (f,) = [f for f in d.findings if f.id == "rho_unstable"]
    assert fix_of(S.SCENARIOS["overload"], d.findings) == f.recommendation
    assert S.SCENARIOS["overload"].fix == fixes.fix_line("rho_unstable", deployment=fixes.Deployment(ranks=1))
    assert "--ranks 1 --instances-per-rank K" in S.SCENARIOS["overload"].fix
    assert S.SCENARIOS["dead-instance"].fix == fixes.fix_line("instance_down", deployment=fixes.Deployment(ranks=2))
    assert "`kvctl deploy-valkey up --ranks 2 --instances-per-rank 1 --dir ./kv-tier`" in S.SCENARIOS["dead-instance"].fix
    assert fix_of(S.SCENARIOS["dead-instance"], []) == S.SCENARIOS["dead-instance"].fix


def test_diagnose_opens_with_the_verdict_and_its_one_fix():
    """Issue 48: the first lines of diagnose are the verdict and the one fix (the worst finding's), the same text the
    findings table and --json carry; a clean diagnosis says so first."""
    from kvctl.diagnose.fixes import verdict

    cap = str(Path(__file__).resolve().parents[2] / "kvctl" / "samples" / "overload-capture")
    text = CliRunner().invoke(cli, ["diagnose", "--from", cap], env={"COLUMNS": "400"})
    lines = text.output.splitlines()
    assert lines[0].startswith("verdict (critical): rho_unstable: ρ = 1.23"), lines[:3]
    assert lines[1].startswith("fix: ") and lines[2] == "runbook: kvctl runbook rho_unstable", lines[:3]
    data = json.loads(CliRunner().invoke(cli, ["diagnose", "--from", cap, "--json"]).stdout)
    worst = next(f for f in data["findings"] if f["id"] == data["verdict"]["finding"])
    assert data["verdict"]["fix"] == worst["recommendation"] == lines[1].removeprefix("fix: ")
    assert verdict([], rho=0.1).headline == "no finding: ρ = 0.10, the tier keeps up with this load"
