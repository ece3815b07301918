"""The ``kvctl`` command line: parse, call the library, render.

The only module (with ``kvctl.commands``) that imports click. Library code
raises ``KvctlError``; :class:`KvctlGroup` is the one place that turns those
into a one-line message and an exit code (``ExitStatus``).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import click

from kvctl import __version__
from kvctl.commands.options import output_options  # noqa: F401 - re-exported for plugins
from kvctl.errors import ExitStatus, InvalidInput, KvctlError

__all__ = ["cli", "main", "output_options"]

log = logging.getLogger("kvctl")


def _raise_errors() -> bool:
    return bool(os.environ.get("KVCTL_RAISE_ERRORS"))


class KvctlGroup(click.Group):
    """A click group that maps library errors to messages and exit codes."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except InvalidInput as e:
            if _raise_errors():
                raise
            raise click.UsageError(str(e), ctx=None) from e
        except KvctlError as e:
            if _raise_errors():
                raise
            from kvctl import render  # noqa: PLC0415

            render.error_line(str(e))
            ctx.exit(int(e.exit_status))
        except (click.ClickException, click.exceptions.Exit, click.Abort, KeyboardInterrupt):
            raise
        except Exception as e:  # noqa: BLE001 - last-resort one-liner for on-call users
            if _raise_errors() or os.environ.get("KVCTL_TESTING"):
                raise
            from kvctl import render  # noqa: PLC0415

            render.error_line(f"unexpected {type(e).__name__}: {e} (set KVCTL_RAISE_ERRORS=1 for a traceback)")
            ctx.exit(int(ExitStatus.ERROR))


@click.group(cls=KvctlGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="kvctl")
@click.option("-v", "--verbose", count=True, help="Log to stderr (-v info, -vv debug).")
def cli(verbose: int) -> None:
    """kvctl: diagnose and tune the remote KV-cache tier (LMCache L1 + Valkey L2) behind vLLM.

    \b
    Start here:
      kvctl cost report                   is the remote tier worth it? (B*, n*, verdicts)
      kvctl cost kv-size --model-config   bytes per token from a model's config.json
      kvctl drill overload                rehearse here: a real tier and engine, diagnose finds ρ > 1
    Every command takes --json; exit codes: 0 ok, 1 error, 2 usage,
    3 warning finding, 4 critical finding, 5 unreachable,
    6 insufficient data (diagnose; doctor given nothing to check),
    7 a drill whose fault diagnose missed, 8 a drill that could not run, 9 nothing plan tried meets the SLO.
    -v/-vv work before or after the subcommand. Shell completion:
    eval "$(_KVCTL_COMPLETE=bash_source kvctl)" (zsh_source, fish_source).
    """
    logging.basicConfig(level=_log_level(verbose), stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def _log_level(verbose: int) -> int:
    return logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG


def _verbose_after_subcommand(ctx: click.Context, param: click.Parameter, value: int) -> None:
    """``kvctl CMD ... -v``: the count adds to the one given before the subcommand."""
    if value:
        root = ctx.find_root()
        total = (root.params.get("verbose") or 0) + value
        logging.getLogger().setLevel(_log_level(total))


def _add_verbose_everywhere(group: click.Group) -> None:
    """Give every subcommand (built-in or a plugin's) a hidden ``-v/--verbose``, so it also works after the subcommand."""
    for cmd in group.commands.values():
        if not any(isinstance(p, click.Option) and {"-v", "--verbose"} & set(p.opts) for p in cmd.params):
            cmd.params.append(
                click.Option(["-v", "--verbose"], count=True, expose_value=False, hidden=True, callback=_verbose_after_subcommand, help="Log to stderr, as `kvctl -v`.")
            )
        if isinstance(cmd, click.Group):
            _add_verbose_everywhere(cmd)


def _register_plugins() -> None:
    from kvctl.hooks import plugin_manager  # noqa: PLC0415

    plugin_manager().hook.register_commands(cli=cli)
    _add_verbose_everywhere(cli)


_register_plugins()


def main() -> None:
    cli(prog_name="kvctl")


if __name__ == "__main__":  # pragma: no cover
    main()
