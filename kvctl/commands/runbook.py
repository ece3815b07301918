"""``kvctl runbook``: the on-call pages that ship with kvctl, listed or printed (kvctl.core.runbooks)."""

from __future__ import annotations

import click

from kvctl.commands.options import output_options
from kvctl.hooks import hookimpl


@hookimpl
def register_commands(cli: click.Group) -> None:
    cli.add_command(runbook_cmd)


@click.command("runbook")
@click.argument("page_id", metavar="[ID]", required=False)
@click.argument("section", metavar="[SECTION]", required=False)
@click.option("--markdown", "raw", is_flag=True, help="Print the page's markdown as it is (for a file or a pager), not drawn for a terminal.")
@output_options
def runbook_cmd(page_id: str | None, section: str | None, raw: bool, as_json: bool) -> None:
    """Print the runbook of a finding or an alert; without ID, list them.

    \b
    kvctl runbook                           every page: its id and title
    kvctl runbook rho_unstable              one page: symptom, what to run, the fix, how to verify
    kvctl runbook tier_settings io-threads  one section (kvctl doctor's lines name theirs)
    Every finding of `kvctl diagnose` and `kvctl diagnose stalls` names its page
    this way; the pages ship inside the package, so they print wherever kvctl is
    installed.
    """
    from kvctl.core.runbooks import list_runbooks, read_runbook  # noqa: PLC0415
    from kvctl.views.runbook import show_list, show_page  # noqa: PLC0415

    if page_id is None:
        if raw:
            raise click.UsageError("--markdown prints one page: give its ID")
        show_list(list_runbooks(), as_json)
        return
    show_page(read_runbook(page_id, section), as_json, raw)
