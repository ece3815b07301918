"""Helpers the CLI-surface tests share (docs, thresholds, CLI surface)."""

from __future__ import annotations

import click


def _commands(group: click.Group, prefix: str = "kvctl"):
    """(full name, command) of every command and subcommand under ``group``, groups included."""
    for name, cmd in group.commands.items():
        full = f"{prefix} {name}"
        yield full, cmd
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, full)
