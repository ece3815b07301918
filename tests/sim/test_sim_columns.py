"""One meaning per printed ρ, one set of columns whatever the loading (issue 48, item 6).

``simulate --loading async`` printed ρ 0.023 in its table (the engine's) and "tier ρ per instance 0.435" under it, and
README quoted the second as "tier ρ"; sync and async (with the async loader's bandwidth: the fleet model) had different
columns. Every simulate and plan table now names "engine ρ" and "tier ρ" as columns, explained by one legend, with the
same columns for sync and async ("—" where one does not apply, and why, in a note).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.drill.samples import sample_paths
from kvctl.views.sim import FLEET_COLS, PLAN_COLS, RESULT_COLS, RHO_LEGEND, SYNC_TIMEOUTS

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
GB_PROMPT = ["--prompt-tokens", "1000", "--bytes-per-token", "1e6", "--prefill-rate", "1e4", "--t0", "0.05"]


def _readme_simulate() -> list[str]:
    """The quick start's `kvctl simulate` line, on the bundled overload trace."""
    (line,) = [ln for ln in README.splitlines() if ln.startswith("kvctl simulate --trace ./drill/trace.jsonl")]
    return shlex.split(line.replace("./drill/trace.jsonl", str(sample_paths()["trace"])))[1:]


def _table(args: list[str]) -> str:
    r = CliRunner().invoke(cli, args, env={"COLUMNS": "250"})
    assert r.exit_code in (0, 9), r.output
    return r.output


def _header(out: str) -> list[str]:
    """The column names of the first table (one heading line at 250 columns)."""
    line = next(ln for ln in out.splitlines() if ln.startswith("┃"))
    return [c.strip() for c in line.strip("┃").split("┃")]


def _row(out: str, first: str | None = None) -> dict[str, str]:
    cols = _header(out)
    rows = [[c.strip() for c in ln.strip("│").split("│")] for ln in out.splitlines() if ln.startswith("│")]
    row = rows[0] if first is None else next(r for r in rows if r[0] == first)
    return dict(zip(cols, row))


def _rhos(out: str) -> list[str]:
    """Every ρ the output prints, with the word before it."""
    return re.findall(r"(\S*)\s+ρ", " ".join(out.split()))


def test_readme_sync_and_async_tables_have_the_same_columns_and_name_each_rho():
    async_args = _readme_simulate()
    sync_args = [a for a in async_args if a != "async"]
    sync_args[sync_args.index("--loading") + 1:sync_args.index("--loading") + 1] = ["sync"]
    a, s = _table(async_args), _table(sync_args)
    assert _header(a) == _header(s) == RESULT_COLS
    assert "ρ" not in RESULT_COLS and {"engine ρ", "tier ρ"} <= set(RESULT_COLS)
    row = _row(a)
    # the README's "tier ρ 0.44" is the tier ρ column; the engine's is another column, named so
    assert row["tier ρ"] == "0.435" and row["engine ρ"] == "0.023" and row["timeouts"] == "0"
    assert re.search(r"tier ρ 0\.44\b", README) and re.search(r"engine ρ 0\.02\b", README) and "tier ρ per instance" not in a
    assert _row(s)["timeouts"] == "—" and SYNC_TIMEOUTS in " ".join(s.split())
    for out in (a, s):
        assert RHO_LEGEND in " ".join(out.split())
        assert set(_rhos(out)) <= {"engine", "tier", "┃"}, _rhos(out)  # every ρ printed is one of the two names


def test_single_engine_model_sync_and_async_have_the_same_columns():
    base = ["simulate", "--arrival-rate", "0.5", *GB_PROMPT, "--instance-gbps", "1", "--requests", "400"]
    s, a = _table([*base, "--loading", "sync"]), _table([*base, "--loading", "async"])
    assert _header(s) == _header(a) == RESULT_COLS
    assert _row(s)["timeouts"] == "—" and _row(a)["timeouts"] != "—"


def test_a_fleet_names_each_rho_and_dashes_what_is_the_fleets_alone():
    out = _table(["simulate", "--arrival-rate", "0.1", *GB_PROMPT, "--instance-gbps", "1", "--engines", "2", "--requests", "500",
                  "--loading", "async"])
    assert _header(out) == FLEET_COLS == ["engine", *RESULT_COLS]
    engine, fleet = _row(out, "0"), _row(out, "fleet")
    assert engine["tier ρ"] == "—" and fleet["tier ρ"] not in ("—", "")
    assert engine["p50 by third (s)"] == "—" and engine["stable"] == "—" and fleet["stable"] == "yes"
    flat = " ".join(out.split())
    assert "one tier serves every engine" in flat and RHO_LEGEND in flat
    assert set(_rhos(out)) <= {"engine", "tier", "┃"}, _rhos(out)


def test_a_sweep_of_sync_and_async_has_the_result_columns_after_its_keys():
    out = _table(["simulate", "--arrival-rate", "0.5", *GB_PROMPT, "--instance-gbps", "1", "--requests", "300",
                  "--sweep", "instances=1,2 loading=sync,async"])
    assert _header(out) == ["instances", "loading", "B_eff GB/s", *RESULT_COLS]
    assert set(_rhos(out)) <= {"engine", "tier", "┃"}, _rhos(out)
    assert SYNC_TIMEOUTS in " ".join(out.split())


def test_plan_names_each_rho_as_simulate_does():
    out = _table(["plan", "--arrival-rate", "0.5", *GB_PROMPT, "--instance-gbps", "1", "--requests", "300", "--max-instances", "2",
                  "--slo-p99", "5"])
    assert _header(out) == PLAN_COLS and PLAN_COLS.index("engine ρ") + 1 == PLAN_COLS.index("tier ρ")
    flat = " ".join(out.split())
    assert "at tier ρ ≤ 0.5" in flat and RHO_LEGEND in flat


@pytest.mark.parametrize("doc", ["README.md", "docs/drill.md", "docs/reference.md", "docs/fleets.md"])
def test_docs_quote_simulates_rho_by_its_column_names(doc):
    """Docs that quote a simulate or plan ρ name it as the table does: "engine ρ" or "tier ρ", never a bare "ρ 0.4" or
    the old caption's "tier ρ per instance (all engines)"."""
    text = (ROOT / doc).read_text()
    assert "tier ρ per instance (all engines)" not in text
    lines = [ln for ln in text.splitlines() if re.search(r"kvctl (simulate|plan)\b", ln) and "#" in ln]
    for ln in lines:  # the comment of an example line quotes what it prints
        comment = ln.split("#", 1)[1]
        bare = [m for m in re.finditer(r"(\S+)\s+ρ\s+[\d.]", comment) if m.group(1) not in ("engine", "tier")]
        assert not bare, f"{doc}: {ln.strip()}"
