"""``kvctl runbook``: the pages and their titles, or one page drawn for a terminal (its markdown as it is, or JSON)."""

from __future__ import annotations

from kvctl.core import render
from kvctl.core.runbooks import RUNBOOK_DIR, Runbook


def show_list(pages: list[Runbook], as_json: bool) -> None:
    """Every page: its id, its title and the command that prints it."""
    if as_json:
        render.emit_json({"runbooks": [{"id": p.id, "title": p.title, "command": p.command} for p in pages]})
        return
    render.text_table("Runbooks (kvctl runbook ID prints one)", ["id", "title"], [(p.id, p.title) for p in pages])


def show_page(page: Runbook, as_json: bool, raw: bool = False) -> None:
    """One page (or one section): drawn for a terminal, its markdown as it is with ``raw``, or JSON."""
    if as_json:
        render.emit_json({"id": page.id, "title": page.title, "section": page.section, "command": page.command,
                          "path": f"{RUNBOOK_DIR}/{page.id}.md", "markdown": page.markdown})
    elif raw:
        render.plain(page.markdown, end="")
    else:
        render.markdown(page.markdown)
