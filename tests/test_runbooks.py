"""docs/runbooks/: a page for every finding id and every alert, and every kvctl command or option a page
(or an alert's next step) names exists in the click command tree."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import click
import pytest
import yaml
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.core.runbooks import ALERT_PAGES, DIAGNOSE_FINDINGS, RUNBOOK_DIR, STALL_FINDINGS, all_pages, runbook_for
from tests.diagnose.engine_text import EngineState
from tests.diagnose.metrics_server import MetricsServer
from tests.diagnose.stall_helpers import run_stalls, spawn, wait_ready
from tests.finding_ids import diagnose_finding_ids, stall_finding_ids

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / RUNBOOK_DIR
ALERTS = ROOT / "configs" / "prometheus" / "kvctl-alerts.yaml"
SECTIONS = ("## Symptom", "## Run, in order", "## Fix", "## Verify")


def alert_rules() -> list[dict]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def test_every_finding_id_has_a_page():
    assert diagnose_finding_ids() == set(DIAGNOSE_FINDINGS), "kvctl/core/runbooks.py DIAGNOSE_FINDINGS differs from kvctl/diagnose/rules.py"
    assert stall_finding_ids() == set(STALL_FINDINGS), "kvctl/core/runbooks.py STALL_FINDINGS differs from kvctl/diagnose/stalls.py"
    for fid in diagnose_finding_ids() | stall_finding_ids():
        page = runbook_for(fid)
        assert page and (ROOT / page).is_file(), f"finding {fid} has no runbook page"


def test_every_alert_has_a_page():
    for r in alert_rules():
        url = r["annotations"]["runbook_url"]
        assert url.startswith(f"{RUNBOOK_DIR}/") and (ROOT / url).is_file(), f"{r['alert']}: {url}"
        assert r["alert"] in (DOCS / "README.md").read_text(), f"{r['alert']} missing from the runbook index"


def test_pages_have_the_four_sections_and_no_orphans():
    on_disk = {p.relative_to(ROOT).as_posix() for p in DOCS.glob("*.md") if p.name != "README.md"}
    assert on_disk == set(all_pages())
    for page in all_pages():
        text = (ROOT / page).read_text()
        positions = [text.find(s) for s in SECTIONS]
        assert all(p >= 0 for p in positions) and positions == sorted(positions), f"{page}: sections {SECTIONS} in order"
        assert Path(page).stem in text.splitlines()[0] or Path(page).stem in ALERT_PAGES, f"{page}: title names its id"


# --- kvctl commands named in the docs ------------------------------------------------------


def kvctl_invocations(text: str) -> list[str]:
    """Every ``kvctl ...`` in fenced blocks (one per line) and in inline code spans."""
    found: list[str] = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        joined = block.replace("\\\n", " ")
        found += [line.strip() for line in joined.splitlines() if line.strip().startswith("kvctl ")]
    rest = re.sub(r"```.*?```", "", text, flags=re.S)
    for span in re.findall(r"`([^`]+)`", rest):
        span = " ".join(span.split())
        if span.startswith("kvctl "):
            found.append(span)
    return found


def resolve(invocation: str) -> list[str]:
    """Problems with one invocation: an unknown subcommand or option."""
    tokens = shlex.split(invocation)
    for stop in ("|", "&&", ";", "(then:"):
        if stop in tokens:
            tokens = tokens[: tokens.index(stop)]
    cmd: click.Command = cli
    i = 1
    while isinstance(cmd, click.Group) and i < len(tokens) and tokens[i] in cmd.commands:
        cmd = cmd.commands[tokens[i]]
        i += 1
    problems = []
    if isinstance(cmd, click.Group) and i < len(tokens) and not tokens[i].startswith("-"):
        problems.append(f"{invocation!r}: {tokens[i]!r} is not a subcommand of {cmd.name}")
    opts = {"--help"}
    for p in cmd.params:
        opts |= set(getattr(p, "opts", [])) | set(getattr(p, "secondary_opts", []))
    for tok in tokens[i:]:
        if tok.startswith("--") and tok.split("=")[0] not in opts:
            problems.append(f"{invocation!r}: {cmd.name} has no option {tok.split('=')[0]}")
    return problems


def test_every_kvctl_command_and_option_in_the_runbooks_exists():
    seen = 0
    problems = []
    for page in sorted(DOCS.glob("*.md")):
        for inv in kvctl_invocations(page.read_text()):
            seen += 1
            problems += [f"{page.name}: {p}" for p in resolve(inv)]
    for r in alert_rules():
        seen += 1
        problems += [f"{r['alert']} next_step: {p}" for p in resolve(r["annotations"]["next_step"])]
    assert seen > 50
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "bad",
    ["kvctl diagnose --engine-urll http://e", "kvctl deploy-valkey start --dir d", "kvctl loading async --restart 'x'", "kvctl doctr"],
)
def test_the_command_check_catches_a_typo(bad):
    assert resolve(bad)


# --- diagnose carries the page -------------------------------------------------------------


def test_diagnose_json_and_table_name_the_runbook():
    base = EngineState()
    unstable = base.advance(requests=10, prompt_lengths=[16000] * 10, external_hits=100000, remote_read_bytes=4e9, remote_get_ms=[1000] * 5)
    model = ["--bytes-per-token", "48437.5", "--prefill-rate", "52200"]
    with MetricsServer([base.text(), unstable.text()]) as srv:
        res = CliRunner().invoke(cli, ["diagnose", "--engine-url", srv.url, "--window", "0.3", *model, "--json"])
    d = json.loads(res.stdout)
    (f,) = [f for f in d["findings"] if f["id"] == "rho_unstable"]
    assert f["runbook"] == "docs/runbooks/rho_unstable.md" and (ROOT / f["runbook"]).is_file()
    assert all(f["runbook"] for f in d["findings"])
    with MetricsServer([base.text(), unstable.text()]) as srv:
        res = CliRunner().invoke(cli, ["diagnose", "--engine-url", srv.url, "--window", "0.3", *model], env={"COLUMNS": "400"})
    assert "runbook: docs/runbooks/rho_unstable.md" in res.stdout  # a line in the findings table


def test_diagnose_stalls_json_and_table_name_the_runbook(pyspy_attach):
    """A real stalled program (lost completion), read with the real py-spy."""
    with spawn("lost_completion.py") as proc:
        wait_ready(proc)
        data = json.loads(run_stalls("--pid", str(proc.pid), "--json").stdout)
        text = run_stalls("--pid", str(proc.pid)).stdout
    assert [f["runbook"] for f in data["findings"]] == ["docs/runbooks/lost-completion.md"]
    assert "docs/runbooks/lost-completion.md" in text
