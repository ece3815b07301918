"""Options shared by several commands are bundles made by one helper, ``kvctl.commands.options.options`` (issue 22).

The helper applies click.option decorators (and other bundles) in the order written, so ``--help`` lists
them as the source does; no command module stacks options in a hand-written wrapper of its own.
"""

from __future__ import annotations

import ast
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from kvctl.commands.options import options, output_options

ROOT = Path(__file__).resolve().parents[2]
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


# --- issue 49 item 4: plan and simulate take their what-if options from one table, each declared once ----------------

WHATIF_COMMANDS = ("simulate", "plan")


def _long_names(cmd: click.Command) -> list[str]:
    return [max(p.opts, key=len) for p in cmd.params if isinstance(p, click.Option) and not p.hidden and "--json" not in p.opts
            and "--help" not in p.opts]


def test_each_whatif_option_is_declared_once_and_a_second_declaration_fails():
    from kvctl.commands import whatif_options as W  # noqa: PLC0415

    declared = W.declared(W.OPTIONS)
    assert {"--arrival-rate", "--prefill-rate", "--t0", "--bytes-per-token", "--plot", "--engines", "--slo-p99", "--sweep"} <= set(declared)
    with pytest.raises(ValueError, match="--t0 is declared twice"):
        W.declared((*W.OPTIONS, W.opt("--t0", help="Again.")))
    for name in ("simulate.py", "plan.py"):  # the commands declare no option of their own: all come from the table
        text = (ROOT / "kvctl" / "commands" / name).read_text()
        assert "click.option(" not in text and "@fleet_options" not in text, name


@pytest.mark.parametrize("name", WHATIF_COMMANDS)
def test_a_whatif_command_has_the_tables_options_in_its_order(name):
    from kvctl.cli import cli  # noqa: PLC0415
    from kvctl.commands import whatif_options as W  # noqa: PLC0415

    table = [n for n, row in W.declared(W.OPTIONS).items() if name in row.commands]
    assert _long_names(cli.commands[name]) == table


def test_an_option_of_both_commands_has_one_help_and_one_type_unless_the_table_says_per_command():
    """--prefill-rate had "Prefill throughput R, tokens/s (misses cost n/R)." in simulate and "... tokens/s." in plan,
    --arrival-rate two types (floors 1e-6 and 0): one declaration gives both commands the same."""
    from kvctl.cli import cli  # noqa: PLC0415
    from kvctl.commands import whatif_options as W  # noqa: PLC0415

    declared = W.declared(W.OPTIONS)
    opts = {c: {max(p.opts, key=len): p for p in cli.commands[c].params if isinstance(p, click.Option)} for c in WHATIF_COMMANDS}
    both = sorted(set(opts["simulate"]) & set(opts["plan"]) - {"--json", "--help", "--verbose"})
    assert len(both) >= 30, both
    for name in both:
        a, b = opts["simulate"][name], opts["plan"][name]
        if not declared[name].per_command("help"):
            assert a.help == b.help, name
        if not declared[name].per_command("type"):
            assert repr(a.type) == repr(b.type), name


@pytest.mark.parametrize("name", WHATIF_COMMANDS)
def test_a_whatif_command_function_takes_one_inputs_and_its_own_options(name):
    """simulate_cmd and plan_cmd took 36 and 37 parameters and each built a 30-field Inputs by hand."""
    import inspect  # noqa: PLC0415

    from kvctl.cli import cli  # noqa: PLC0415

    params = inspect.signature(inspect.unwrap(cli.commands[name].callback)).parameters
    assert "inputs" in params and len(params) <= 9, list(params)


def test_prefill_rate_and_t0_say_one_quantity_in_every_command():
    """`--prefill-rate` and `--t0` had six help texts each ("Prefill tokens/s R", "Prefill throughput R in tokens/s", ...):
    every command's help starts with the one wording of the quantity and takes its one type."""
    from kvctl.cli import cli  # noqa: PLC0415
    from kvctl.commands.options import PREFILL_RATE, PREFILL_RATE_HELP, T0_HELP, T0_S  # noqa: PLC0415
    from tests.cli_helpers import _commands  # noqa: PLC0415

    seen = {"--prefill-rate": 0, "--t0": 0}
    for name, cmd in _commands(cli):
        for p in cmd.params:
            for flag, help_, type_ in (("--prefill-rate", PREFILL_RATE_HELP, PREFILL_RATE), ("--t0", T0_HELP, T0_S)):
                if flag in getattr(p, "opts", ()):
                    seen[flag] += 1
                    assert p.help.startswith(help_) and p.type is type_, (name, flag, p.help)
    assert seen["--prefill-rate"] >= 7 and seen["--t0"] >= 6, seen


def test_every_row_the_model_takes_is_a_field_of_inputs():
    """A new what-if option is one row of the table and one field of kvctl.sim.model.Inputs of the same name."""
    import dataclasses  # noqa: PLC0415

    from kvctl.commands import whatif_options as W  # noqa: PLC0415
    from kvctl.sim.model import Inputs  # noqa: PLC0415

    fields = {f.name for f in dataclasses.fields(Inputs)}
    for row in W.OPTIONS:
        if row.dest not in W.SIZE_OPTIONS and set(row.commands) - set(row.own):
            assert row.dest in fields, row.name
