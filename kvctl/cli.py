"""The ``kvctl`` command line: parse, call the library, render.

The only module (with ``kvctl.commands``) that imports click. Library code
raises ``KvctlError``; :class:`KvctlGroup` is the one place that turns those
into a one-line message and an exit code (``ExitStatus``), and, for a command
given ``--json``, every error (a bad option value, a usage mistake, a library
error, a stop signal that ended a workflow) into one JSON object on stdout as well.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import click

from kvctl import __version__
from kvctl.commands.options import output_options  # noqa: F401 - re-exported for plugins
from kvctl.core.errors import ExitStatus, InvalidInput, KvctlError
from kvctl.core.signals import ExitNow, Signalled

__all__ = ["cli", "main", "output_options"]

log = logging.getLogger("kvctl")


def _raise_errors() -> bool:
    return bool(os.environ.get("KVCTL_RAISE_ERRORS"))


#: ``ctx.meta`` keys (shared by every context of one invocation): the root's arguments, and whether the JSON error was written
_ARGS = "kvctl.args"
_JSON_ERROR_WRITTEN = "kvctl.json_error_written"


def _wants_json(ctx: click.Context) -> bool:
    """``--json`` among the invocation's arguments (before a ``--``): checked on the words, since a usage error
    comes before the options are parsed."""
    args = list(ctx.meta.get(_ARGS, ()))
    return "--json" in (args[: args.index("--")] if "--" in args else args)


class KvctlGroup(click.Group):
    """A click group that maps library errors, and stop signals, to messages and exit codes.

    A stop signal inside :func:`kvctl.core.signals.signals_raise` (deploy-valkey up, drill, loading's restart command)
    arrives here as :class:`~kvctl.core.signals.Signalled` once the workflow has stopped what it started: one line,
    "interrupted by SIGTERM: <what was stopped>", and the shell's exit code 128 + N (130, 143, 129).

    Under ``--json`` every error also prints one object on stdout,
    ``{"kvctl_version", "outcome": "error", "error", "exit_code"}`` (the stderr line and the exit code
    stay as they are), unless the command already wrote its own JSON (which then carries the state).
    """

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta.setdefault(_ARGS, tuple(args))
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        from kvctl.core import render  # noqa: PLC0415

        documents = render.json_documents()

        def json_error(message: str, code: int) -> None:
            if _wants_json(ctx) and not ctx.meta.get(_JSON_ERROR_WRITTEN) and render.json_documents() == documents:
                ctx.meta[_JSON_ERROR_WRITTEN] = True
                render.emit_json({"kvctl_version": __version__, "outcome": "error", "error": message, "exit_code": int(code)})

        try:
            return super().invoke(ctx)
        except InvalidInput as e:
            json_error(str(e), e.exit_status)
            if _raise_errors():
                raise
            raise click.UsageError(str(e), ctx=None) from e
        except KvctlError as e:
            json_error(str(e), e.exit_status)
            if _raise_errors():
                raise
            render.error_line(str(e))
            ctx.exit(int(e.exit_status))
        except click.ClickException as e:
            json_error(e.format_message(), e.exit_code)
            raise
        except ExitNow:  # a second signal during an orderly stop (kvctl exporter): main() ends the process at once
            raise
        except Signalled as e:
            json_error(str(e), e.exit_code)
            render.error_line(str(e))
            ctx.exit(e.exit_code)
        except (click.exceptions.Exit, click.Abort, KeyboardInterrupt):
            raise
        except Exception as e:  # noqa: BLE001 - last-resort one-liner for on-call users
            if _raise_errors() or os.environ.get("KVCTL_TESTING"):
                raise
            message = f"unexpected {type(e).__name__}: {e} (set KVCTL_RAISE_ERRORS=1 for a traceback)"
            json_error(message, ExitStatus.ERROR)
            render.error_line(message)
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
    """The ``kvctl`` process, and the one place that ends it: commands return, raise, or ``ctx.exit`` (click turns
    that into the exit code here), so a command run in-process (a test's CliRunner) never ends its caller."""
    try:
        cli(prog_name="kvctl")
    except ExitNow as e:  # a second SIGTERM/Ctrl-C during an orderly stop (kvctl exporter): out at once
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        # os._exit, not sys.exit: "at once" skips the interpreter's exit too, whose hooks join threads (every
        # concurrent.futures worker of the process) that may be blocked in the reads the stop was cutting
        os._exit(e.exit_code)


if __name__ == "__main__":  # pragma: no cover
    main()
