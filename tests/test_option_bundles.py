"""Options shared by several commands are bundles made by one helper, ``kvctl.commands.options.options`` (issue 22).

The helper applies click.option decorators (and other bundles) in the order written, so ``--help`` lists
them as the source does; no command module stacks options in a hand-written wrapper of its own.
"""

from __future__ import annotations

import ast
from pathlib import Path

import click
from click.testing import CliRunner

from kvctl.commands.options import options, output_options

ROOT = Path(__file__).resolve().parents[1]
COMMAND_SOURCES = sorted((ROOT / "kvctl" / "commands").rglob("*.py")) + [ROOT / "kvctl" / "cli.py"]


def test_a_bundle_applies_its_options_in_the_order_written_and_nests():
    inner = options(click.option("--b", help="B."), click.option("--c", type=int, default=3, show_default=True, help="C."))

    @click.command()
    @options(click.option("--a", help="A."), inner, output_options)
    def cmd(a, b, c, as_json):
        click.echo(f"{a} {b} {c} {as_json}")

    assert [p.name for p in cmd.params] == ["a", "b", "c", "as_json"]
    res = CliRunner().invoke(cmd, ["--a", "x", "--json"])
    assert res.exit_code == 0, res.output
    assert res.output == "x None 3 True\n"


def _option_stacks(tree: ast.AST) -> list[tuple[int, str]]:
    """Inner functions decorated with ``click.option(...)``: hand-written option wrappers."""
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        for inner in ast.walk(fn):
            if inner is fn or not isinstance(inner, ast.FunctionDef):
                continue
            opts = [d for d in inner.decorator_list
                    if isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr == "option"]
            if opts:
                found.append((inner.lineno, f"{fn.name}.{inner.name}"))
    return found


def test_the_scan_finds_a_hand_written_wrapper():
    src = ("def opts(func):\n    @click.option('--a')\n    @click.option('--b')\n    @functools.wraps(func)\n"
           "    def wrapper(*a, **k):\n        return func(*a, **k)\n    return wrapper\n")
    assert _option_stacks(ast.parse(src)) == [(5, "opts.wrapper")]


def test_no_command_module_stacks_options_by_hand():
    found = {str(p.relative_to(ROOT)): s for p in COMMAND_SOURCES if (s := _option_stacks(ast.parse(p.read_text())))}
    assert not found, f"option wrappers written by hand (use kvctl.commands.options.options): {found}"
