"""Docs as tests: every command and subcommand is named in README.md."""

import re
from pathlib import Path

import click

from kvctl.cli import cli

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def _commands(group: click.Group, prefix: str = "kvctl"):
    for name, cmd in group.commands.items():
        full = f"{prefix} {name}"
        yield full, cmd
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, full)


def test_every_command_in_readme():
    missing = [name for name, _ in _commands(cli) if name not in README]
    assert not missing, f"commands missing from README.md: {missing}"


def test_every_command_has_help():
    for name, cmd in _commands(cli):
        assert cmd.help, f"{name} has no help text"
        for param in cmd.params:
            if isinstance(param, click.Option) and not param.hidden:
                assert param.help, f"{name} {param.opts} has no help="


def test_readme_opens_with_the_two_commands():
    first_block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    assert "make demo" in first_block and "make test" in first_block


def test_ci_runs_readme_test_command():
    ci = (Path(__file__).resolve().parent.parent / ".ci" / "run").read_text()
    assert "make test" in ci


def test_every_command_takes_json():
    missing = []
    for name, cmd in _commands(cli):
        if isinstance(cmd, click.Group) and not cmd.invoke_without_command:
            continue
        if not any(isinstance(p, click.Option) and "--json" in p.opts for p in cmd.params):
            missing.append(name)
    assert not missing, f"commands without --json: {missing}"
