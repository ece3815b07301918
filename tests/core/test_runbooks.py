"""The runbooks ship inside the package (kvctl/runbooks/, package data): a page for every finding id and every alert,
`kvctl runbook` lists and prints them anywhere kvctl is installed, every finding names that command (never a path of
the repository), and every kvctl command or option a page (or an alert's next step) names exists in the click
command tree. Issue 48 item 2."""

from __future__ import annotations

import configparser
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import click
import pytest
import yaml
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.core.runbooks import ALERT_PAGES, DIAGNOSE_FINDINGS, PAGE_IDS, RUNBOOK_DIR, STALL_FINDINGS, all_pages, runbook_for
from tests.diagnose.engine_text import EngineState
from tests.diagnose.metrics_server import MetricsServer
from tests.diagnose.stall_helpers import run_stalls, spawn, wait_ready
from tests.finding_ids import diagnose_finding_ids, stall_finding_ids

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "kvctl" / "runbooks"
ALERTS = ROOT / "configs" / "prometheus" / "kvctl-alerts.yaml"
SECTIONS = ("## Symptom", "## Run, in order", "## Fix", "## Verify")


def alert_rules() -> list[dict]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def test_every_finding_id_has_a_page():
    assert diagnose_finding_ids() == set(DIAGNOSE_FINDINGS), "kvctl/core/runbooks.py DIAGNOSE_FINDINGS differs from kvctl/diagnose/rules.py"
    assert stall_finding_ids() == set(STALL_FINDINGS), "kvctl/core/runbooks.py STALL_FINDINGS differs from kvctl/diagnose/stalls.py"
    for fid in diagnose_finding_ids() | stall_finding_ids():
        assert runbook_for(fid) == f"kvctl runbook {fid}" and (DOCS / f"{fid}.md").is_file(), f"finding {fid} has no runbook page"


def test_every_alert_has_a_page():
    for r in alert_rules():
        url = r["annotations"]["runbook_url"]
        assert url.startswith(f"{RUNBOOK_DIR}/") and (ROOT / url).is_file(), f"{r['alert']}: {url}"
        assert r["annotations"]["runbook"] == f"kvctl runbook {Path(url).stem}", r["alert"]  # printed wherever kvctl runs
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


# --- diagnose carries the command that prints the page ------------------------------------------------


def _unstable_diagnosis(*extra: str, columns: str = "400"):
    base = EngineState()
    unstable = base.advance(requests=10, prompt_lengths=[16000] * 10, external_hits=100000, remote_read_bytes=4e9, remote_get_ms=[1000] * 5)
    model = ["--bytes-per-token", "48437.5", "--prefill-rate", "52200"]
    with MetricsServer([base.text(), unstable.text()]) as srv:
        return CliRunner().invoke(cli, ["diagnose", "--engine-url", srv.url, "--window", "0.3", *model, *extra], env={"COLUMNS": columns})


def test_diagnose_json_and_table_name_the_runbook_command():
    d = json.loads(_unstable_diagnosis("--json").stdout)
    (f,) = [f for f in d["findings"] if f["id"] == "rho_unstable"]
    assert f["runbook"] == "kvctl runbook rho_unstable"
    assert all(f["runbook"] == f"kvctl runbook {f['id']}" for f in d["findings"])
    assert "runbook: kvctl runbook rho_unstable" in _unstable_diagnosis().stdout  # a line in the findings table


@pytest.mark.parametrize("columns", ["100", "80"])
def test_the_runbook_command_is_never_wrapped_inside_a_word(columns, tmp_path):
    """Issue 48 item 2: at 100 columns the findings table cut `docs/runbooks/rho_unstable.md` mid-word. Each finding's
    runbook line is whole on one line of the table, and no word of the table is cut (one saved capture, read twice)."""
    assert _unstable_diagnosis("--save", str(tmp_path / "cap"), "--json").exit_code == 4
    d = json.loads(CliRunner().invoke(cli, ["diagnose", "--from", str(tmp_path / "cap"), "--json"]).stdout)
    res = CliRunner().invoke(cli, ["diagnose", "--from", str(tmp_path / "cap")], env={"COLUMNS": columns})
    lines = res.stdout.splitlines()
    assert max(len(ln.rstrip()) for ln in lines[lines.index(next(ln for ln in lines if ln.startswith("Findings"))):]) <= int(columns)
    for f in d["findings"]:
        assert any(f"runbook: kvctl runbook {f['id']}" in ln for ln in lines), (f["id"], res.stdout)
    said = " ".join(f"{f['id']} {f['severity']} {f['message']} fix: {f['recommendation']} runbook: {f['runbook']}" for f in d["findings"])
    words = set(re.findall(r"\S+", said + " Findings finding what it means · fix · runbook"))
    table = res.stdout[res.stdout.index("Findings"):]
    cut = [w for w in re.findall(r"[^\s│┃─┼├┤┌┐└┘┬┴━┏┓┗┛┳┻┡┩╇]+", table) if w not in words]
    assert not cut, f"words cut at {columns} columns: {cut}"


def test_diagnose_stalls_json_and_table_name_the_runbook_command(pyspy_attach):
    """A real stalled program (lost completion), read with the real py-spy."""
    with spawn("lost_completion.py") as proc:
        wait_ready(proc)
        data = json.loads(run_stalls("--pid", str(proc.pid), "--json").stdout)
        text = run_stalls("--pid", str(proc.pid)).stdout
    assert [f["runbook"] for f in data["findings"]] == ["kvctl runbook lost-completion"]
    assert "kvctl runbook lost-completion" in text


def test_no_output_names_a_runbook_by_its_repository_path():
    """The class of item 2: no string in kvctl's code that a user sees points into docs/runbooks/ (dead outside a
    checkout); pages are named by the command that prints them."""
    offenders = []
    for path in sorted((ROOT / "kvctl").rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if "docs/runbooks" in line:
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    assert not offenders, "\n".join(offenders)


# --- kvctl runbook: the pages ship with the package -------------------------------------------------------


def test_the_pages_live_in_the_package_and_docs_keeps_no_copy():
    """One source of truth: the pages are kvctl/runbooks/*.md; docs/runbooks/ holds at most a pointer to them."""
    assert {p.stem for p in DOCS.glob("*.md")} == {*PAGE_IDS, "README"}
    old = ROOT / "docs" / "runbooks"
    assert not [p.name for p in old.glob("*") if p.name != "README.md"], "a copy of a page under docs/runbooks/"
    if (old / "README.md").exists():
        pointer = (old / "README.md").read_text()
        assert "kvctl/runbooks/" in pointer and "kvctl runbook" in pointer and len(pointer.splitlines()) < 15


def test_package_data_covers_every_page():
    """`pip install .` copies what setup.cfg's package_data names: every page and the index."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    globs = [g.strip() for g in cfg["options.package_data"]["kvctl"].splitlines() if g.strip()]
    covered = {p for g in globs for p in (ROOT / "kvctl").glob(g) if p.is_file()}
    assert set(DOCS.glob("*.md")) <= covered


def test_the_built_wheel_holds_every_page_and_prints_one_outside_the_checkout(tmp_path):
    """A real wheel, built from a copy of the sources (no network: the venv's setuptools), holds every page; installed
    on its own (pip --target) and run from another directory, `kvctl runbook rho_unstable --json` prints the page."""
    t0 = time.monotonic()
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("kvctl", "connector", "plugins"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "w"), str(src)],
                   check=True, capture_output=True, timeout=120, cwd=tmp_path)
    (wheel,) = (tmp_path / "w").glob("kvctl-*.whl")
    with zipfile.ZipFile(wheel) as z:
        pages = {Path(n).stem for n in z.namelist() if n.startswith("kvctl/runbooks/") and n.endswith(".md")}
    assert pages == {*PAGE_IDS, "README"}
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--no-compile", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=120, cwd=tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")} | {"PYTHONPATH": str(site), "KVCTL_HOME": str(tmp_path / "home")}
    code = "import kvctl, sys; sys.stderr.write(kvctl.__file__ + chr(10)); from kvctl.cli import main; main()"
    r = subprocess.run([sys.executable, "-c", code, "runbook", "rho_unstable", "--json"], capture_output=True, text=True,
                       timeout=60, cwd=elsewhere, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines()[0].startswith(str(site)), r.stderr  # the installed copy, not the checkout
    assert json.loads(r.stdout)["markdown"] == (DOCS / "rho_unstable.md").read_text()
    assert time.monotonic() - t0 < 60


def test_kvctl_runbook_lists_every_page_with_its_title():
    res = CliRunner().invoke(cli, ["runbook", "--json"])
    assert res.exit_code == 0, res.output
    listed = json.loads(res.stdout)["runbooks"]
    assert [r["id"] for r in listed] == list(PAGE_IDS)
    by_id = {r["id"]: r for r in listed}
    assert by_id["rho_unstable"]["title"] == "ρ ≥ 1: the synchronous-load queue is unstable"
    assert by_id["rho_unstable"]["command"] == "kvctl runbook rho_unstable"
    assert all(r["title"] and "\n" not in r["title"] for r in listed)
    text = CliRunner().invoke(cli, ["runbook"], env={"COLUMNS": "100"}).stdout
    for r in listed:
        assert re.search(rf"│ {re.escape(r['id'])} +│", text), (r["id"], text)


def test_kvctl_runbook_prints_one_page_for_a_terminal_and_as_json():
    page = (DOCS / "rho_unstable.md").read_text()
    res = CliRunner().invoke(cli, ["runbook", "rho_unstable", "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert d["id"] == "rho_unstable" and d["markdown"] == page and d["section"] is None
    assert d["path"] == "kvctl/runbooks/rho_unstable.md"
    text = CliRunner().invoke(cli, ["runbook", "rho_unstable"], env={"COLUMNS": "100"}).stdout
    assert "Run, in order" in text and "## " not in text and "```" not in text  # rendered, not the raw markdown
    assert max(len(ln.rstrip()) for ln in text.splitlines()) <= 100
    word = r"[\w/:=|.'-]*\w"  # a word, without the punctuation after it
    src_words = set(re.findall(word, re.sub(r"[`*]", "", page)))
    cut = [w for w in re.findall(word, text) if w not in src_words]
    assert not cut, f"words not in the page (cut at a line end?): {cut}"
    raw = CliRunner().invoke(cli, ["runbook", "rho_unstable", "--markdown"])
    assert raw.exit_code == 0 and raw.stdout == page


def test_kvctl_runbook_prints_one_section():
    """doctor's lines name a section: `kvctl runbook tier_settings io-threads` prints that one."""
    d = json.loads(CliRunner().invoke(cli, ["runbook", "tier_settings", "io-threads", "--json"]).stdout)
    assert d["section"] == "io-threads" and d["markdown"].startswith("### io-threads") and "### maxmemory" not in d["markdown"]


@pytest.mark.parametrize("args, said", [
    (["rho_unstabel"], "did you mean rho_unstable"),
    (["no-such-page"], "kvctl runbook` lists them"),
    (["tier_settings", "io-thread"], "did you mean io-threads"),
])  # fmt: skip
def test_kvctl_runbook_refuses_an_unknown_page_or_section(args, said):
    res = CliRunner().invoke(cli, ["runbook", *args])
    assert res.exit_code == 2 and said in res.stderr, res.output
