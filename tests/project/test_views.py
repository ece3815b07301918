"""Commands parse, call the library and hand the result to a view (issue 32 item 2): every table, key-value list,
text table, plot and JSON document a command shows is drawn in kvctl/views/, which imports no click; the
simulation model is built in one place (kvctl.sim.model), whose request defaults the commands' help reads."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = sorted((ROOT / "kvctl" / "commands").glob("*.py"))
VIEWS = sorted((ROOT / "kvctl" / "views").glob("*.py"))
#: what draws a result; a command may still warn, say a line, show progress and print a bare value for a shell
DRAWS = {"table", "key_values", "text_table", "line_plot", "report_plots", "emit_json", "emit_json_line", "clear_screen"}


def drawing_calls(tree: ast.AST) -> list[tuple[int, str]]:
    return [(n.lineno, ast.unparse(n.func)) for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr in DRAWS and ast.unparse(n.func.value) == "render"]


def test_the_scan_finds_drawing():
    tree = ast.parse("render.table('t', [], [])\nrender.warn('w')\nrender.emit_json({})\nx.table()\n")
    assert [line for line, _ in drawing_calls(tree)] == [1, 3]


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: p.name)
def test_commands_draw_through_views(path):
    found = drawing_calls(ast.parse(path.read_text()))
    assert not found, f"kvctl/commands/{path.name} draws instead of calling kvctl/views: {found}"


@pytest.mark.parametrize("path", VIEWS, ids=lambda p: p.name)
def test_views_import_no_click(path):
    tree = ast.parse(path.read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not {m for m in names if m == "click" or m.startswith("click.")}, path.name


def test_every_command_module_with_output_has_a_view():
    """The views package's docstring names each view module, and each exists."""
    import kvctl.views  # noqa: PLC0415

    named = {line.split("`")[1].split(".")[-1] for line in kvctl.views.__doc__.splitlines() if line.startswith("* :mod:`kvctl.views.")}
    assert named == {p.stem for p in VIEWS if p.stem != "__init__"}


def test_the_model_is_built_in_one_place():
    """simulate, plan and their fleet options build no SimConfig or Variability of their own, and their help
    says the request defaults kvctl.sim.model holds."""
    from click.testing import CliRunner  # noqa: PLC0415

    from kvctl.sim import model as sim_model  # noqa: PLC0415
    from kvctl.cli import cli  # noqa: PLC0415

    for name in ("simulate.py", "plan.py", "whatif_options.py"):
        text = (ROOT / "kvctl" / "commands" / name).read_text()
        assert "SimConfig(" not in text and "variability.build(" not in text and "poisson_workload(" not in text, name
    sim = CliRunner().invoke(cli, ["simulate", "--help"], terminal_width=300).output
    plan = CliRunner().invoke(cli, ["plan", "--help"], terminal_width=300).output
    assert f"default {sim_model.SIMULATE_REQUESTS}" in sim and f"default {sim_model.PLAN_REQUESTS}" in plan
    assert f"[default: {sim_model.BLOCK_TOKENS};" in sim
