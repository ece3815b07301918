"""``kvctl explain``: why a request missed the tier or loaded slowly, from the connector's trace."""

from __future__ import annotations

import click

from kvctl.commands.options import output_options
from kvctl.hooks import hookimpl


@hookimpl
def register_commands(cli: click.Group) -> None:
    cli.add_command(explain_cmd)


@click.command("explain")
@click.argument("trace", type=click.Path(dir_okay=False))
@click.option("--request", "request_id", metavar="ID",
              help="One request: its id as vLLM logs it (or a part of it that only it contains).")
@output_options
def explain_cmd(trace: str, request_id: str | None, as_json: bool) -> None:
    """Why did a request miss the tier, or load slowly? Read from the connector's trace.

    \b
    TRACE: the file the engine wrote with KVCTL_CONNECTOR_TRACE=TRACE in its
    environment. Per request: tokens found in the tier and loaded, the
    load-or-recompute decision and its reason, predicted against actual times,
    where the time went (lookup, queued, GETs, copy, exchange, insert, step),
    and the answer: loaded, partly in the tier, policy, deadline, load came up
    short, instance down, evicted, save lost at shutdown, save dropped, save failed, save not
    written yet, key format or salt mismatch, never saved, prompt shorter than
    a chunk, not looked up.
    """
    from kvctl.ops.explain import explain  # noqa: PLC0415
    from kvctl.views.explain import show_explanation  # noqa: PLC0415

    show_explanation(explain(trace, request_id), as_json)
