"""Everything that draws: rich tables, progress, messages, plots.

The only module that imports rich or matplotlib. Library code returns data;
the CLI passes it here. JSON output never goes through rich.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import sys
from typing import Any, Iterable, Iterator, Sequence

from kvctl.core.files import write_atomic


def to_jsonable(obj: Any) -> Any:
    """Dataclasses, paths and enums to plain JSON types."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj) if not f.name.startswith("_")}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [to_jsonable(v) for v in obj]
    if hasattr(obj, "value") and hasattr(obj, "name") and not isinstance(obj, (int, float, str)):
        return obj.value
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


def finite_json(obj: Any) -> Any:
    """``obj`` (plain JSON types) with NaN and ±Infinity as null: JSON has no such numbers, and
    strict parsers (jq, JavaScript's JSON.parse, Go) refuse the ``NaN``/``Infinity`` Python would print."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [finite_json(v) for v in obj]
    return obj


#: JSON documents written to stdout by this process (``kvctl.cli`` adds no error object after a command's own)
_json_documents = 0


def json_documents() -> int:
    """How many JSON documents :func:`emit_json` and :func:`emit_json_line` wrote so far."""
    return _json_documents


def emit_json(obj: Any) -> None:
    """Plain JSON on stdout, no styling; never NaN or Infinity (null)."""
    global _json_documents
    _json_documents += 1
    sys.stdout.write(json.dumps(finite_json(to_jsonable(obj)), indent=2, sort_keys=False, allow_nan=False) + "\n")
    sys.stdout.flush()


def emit_json_line(obj: Any) -> None:
    """One compact JSON object per line on stdout (for streams such as ``--watch --json``); never NaN or Infinity."""
    global _json_documents
    _json_documents += 1
    sys.stdout.write(json.dumps(finite_json(to_jsonable(obj)), separators=(",", ":"), allow_nan=False) + "\n")
    sys.stdout.flush()


def clear_screen() -> None:
    """Clear the terminal before a refresh (no-op when stdout is not a TTY)."""
    if sys.stdout.isatty():
        _console().clear()


def _console(stderr: bool = False, width: int | None = None):
    from rich.console import Console  # noqa: PLC0415 - keep `--help` light

    stream = sys.stderr if stderr else sys.stdout
    # rich assumes 80 columns when output is piped (CI logs, `| tee`): use a width that fits our tables
    if width is None:
        width = None if stream.isatty() or os.environ.get("COLUMNS") else 160
    return Console(stderr=stderr, highlight=False, soft_wrap=False, width=width)


def fmt(value: Any, digits: int = 3) -> str:
    """Compact human formatting for table cells."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value != 0 and (abs(value) >= 1e6 or abs(value) < 10 ** -digits):
            return f"{value:.{digits}g}"
        return f"{value:,.{digits}f}".rstrip("0").rstrip(".") if "." in f"{value:.{digits}f}" else f"{value:,}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


#: how many columns a table may grow past the width its longest words need, one at a time, until it is whole
MAX_WIDEN_STEPS = 64


def table(
    title: str | None,
    columns: Sequence[str],
    rows: Iterable[Sequence[Any]],
    caption: str | None = None,
    styles: Sequence[str | None] | None = None,
) -> None:
    """Print one rich table to stdout; cells are formatted with :func:`fmt`.

    A narrow terminal wraps a cell or a heading between words, never inside one: no number is cut to
    ``1.0…`` (each column is at least as wide as its longest word); a table wider than the terminal
    than that runs past its edge rather than lose a figure.
    """
    from rich.table import Table  # noqa: PLC0415
    from rich.text import Text  # noqa: PLC0415

    cells = [[c if isinstance(c, str) else fmt(c) for c in row] for row in rows]
    t = Table(title=title, caption=caption, title_justify="left", caption_justify="left")
    widths = []
    for i, col in enumerate(columns):
        words = [w for text in [col, *(r[i] for r in cells if i < len(r))] for w in Text.from_markup(text).plain.split()]
        widths.append(max(map(len, words), default=1))
        t.add_column(col, justify="left" if i == 0 else "right", style=(styles[i] if styles else None), min_width=widths[-1], overflow="fold")
    for row in cells:
        t.add_row(*row)
    console = _console()
    width = max(console.width, sum(w + 3 for w in widths) + 1)  # each column: its words, a space either side, a rule
    for _ in range(MAX_WIDEN_STEPS):  # rich's column collapse is not exact: widen until the right edge is drawn
        lines = console.render_lines(t, console.options.update(width=width), pad=False)
        top = next(("".join(seg.text for seg in ln).rstrip() for ln in lines if "".join(seg.text for seg in ln).startswith("┏")), "┓")
        if top.endswith("┓"):
            break
        width += 1
    if width != console.width:
        console = _console(width=width)
    console.print(t)


def key_values(title: str | None, pairs: Iterable[tuple[str, Any]], caption: str | None = None) -> None:
    """A two-column table of names and values."""
    table(title, ["", "value"], [(k, v) for k, v in pairs], caption=caption)


def message(text: str, style: str | None = None, stderr: bool = False) -> None:
    _console(stderr=stderr).print(text, style=style)


def literal(text: str, style: str | None = None, stderr: bool = False) -> None:
    """Text printed as it is: no markup (``[...]`` stays), no highlighting, long lines not wrapped (diffs, paths)."""
    _console(stderr=stderr).print(text, style=style, markup=False, highlight=False, soft_wrap=True)


def markdown(text: str) -> None:
    """A markdown page drawn for a terminal (headings, lists, code, tables), wrapped between words at its width."""
    from rich.markdown import Markdown  # noqa: PLC0415

    console = _console()
    if not sys.stdout.isatty() and not os.environ.get("COLUMNS"):
        console = _console(width=100)  # a pipe: a page reads at 100 columns, not the tables' 160
    console.print(Markdown(text, code_theme="ansi_dark", inline_code_lexer=None, hyperlinks=False))


def plain(text: str, end: str = "\n") -> None:
    """``text`` on stdout byte for byte, no console at all: a value a shell reads with ``$(...)`` (a URL, a path,
    a rendered config)."""
    sys.stdout.write(text + end)
    sys.stdout.flush()


def warn(text: str) -> None:
    message(f"warning: {text}", style="yellow", stderr=True)


def plots_written(paths: Sequence[str]) -> None:
    """Where ``--plot`` wrote, one ``plot: wrote PATH`` line each on stderr (under --json too: stdout stays one document)."""
    for path in paths:
        literal(f"plot: wrote {path}", stderr=True)


def error_line(text: str) -> None:
    """One-line error on stderr (no rich markup interpretation)."""
    sys.stderr.write(f"Error: {text}\n")


class ProgressLines:
    """Progress for a stderr that is not a terminal (a pipe, a file, a CI log): plain lines, never a bar.

    A line when the work starts, one whenever its step changes (a bench run, a drill phase), one every
    :data:`kvctl.core.thresholds.PROGRESS_LINE_S` seconds in between, and one when it is done; each starts
    ``kvctl WHAT: `` so a log can be grepped for them. Only stderr: stdout stays the command's output.
    """

    def __init__(self, what: str, every_s: float | None = None) -> None:
        import time  # noqa: PLC0415

        from kvctl.core.thresholds import PROGRESS_LINE_S  # noqa: PLC0415

        self.what, self.every_s, self._clock = what, PROGRESS_LINE_S if every_s is None else every_s, time.monotonic
        self.started = self._clock()
        self._last = -math.inf
        self._step: str | None = None

    def line(self, text: str, step: str | None = None, force: bool = False) -> None:
        """Print ``text`` when forced, when ``step`` changed, or when the last line is ``every_s`` old."""
        now = self._clock()
        changed = step is not None and step != self._step
        if force or changed or now - self._last >= self.every_s:
            sys.stderr.write(f"kvctl {self.what}: {text} [{now - self.started:.0f} s]\n")
            sys.stderr.flush()
            self._last = now
            if step is not None:
                self._step = step


@contextlib.contextmanager
def progress(description: str, total: float | None, enabled: bool = True, what: str | None = None, unit: str = "",
             lines: bool = True) -> Iterator[Any]:
    """Progress on stderr; yields ``advance(n=1, description=None, step=None)``.

    A rich bar when stderr is a terminal; :class:`ProgressLines` when it is not (``what`` names the command,
    ``step`` the part of the work a line is printed for when it changes; ``lines`` False: nothing, for work
    of a second or two). A no-op when ``enabled`` is False (``--json``: nothing but the JSON).
    """
    if not enabled or (not lines and not sys.stderr.isatty()):
        yield lambda n=1, description=None, step=None: None
        return
    if not sys.stderr.isatty():
        lines = ProgressLines(what or description)
        state = {"done": 0.0, "text": description}

        def advance_line(n: float = 1, description: str | None = None, step: str | None = None) -> None:
            state["done"] += n
            if description:
                state["text"] = description
            lines.line(f"{state['text']} · {_of(state['done'], total, unit)}", step)

        lines.line(f"{description} · {_of(0.0, total, unit)}", force=True)
        yield advance_line
        lines.line(f"{state['text']} · done", force=True)
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn  # noqa: PLC0415

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}%"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=_console(stderr=True),
        transient=True,
    ) as prog:
        task = prog.add_task(description, total=total)

        def advance(n: float = 1, description: str | None = None, step: str | None = None) -> None:
            kwargs = {"description": description} if description else {}
            prog.update(task, advance=n, **kwargs)

        yield advance


def _of(done: float, total: float | None, unit: str = "") -> str:
    """``3 of 60 s (5%)`` for a progress line (a decimal below 10)."""
    if not total:
        return f"{done:g}{unit}"
    shown = f"{done:.1f} of {total:g}" if total < 10 else f"{done:.0f} of {total:.0f}"
    return f"{shown}{unit} ({min(done / total, 1.0):.0%})"


def line_plot(
    path: str,
    title: str,
    xlabel: str,
    ylabel: str,
    series: dict[str, tuple[Sequence[float], Sequence[float]]],
    hlines: dict[str, float] | None = None,
    xticks: Sequence[str] | None = None,
) -> list[float]:
    """Save a simple line/marker chart to ``path`` (PNG) with optional reference lines; returns the x ticks
    drawn. An x axis of counts (every x an integer: instances, clients, engines) gets integer ticks only."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    for label, y in (hlines or {}).items():
        ax.axhline(y, linestyle="--", linewidth=1, color="grey")
        ax.annotate(label, xy=(0.01, y), xycoords=("axes fraction", "data"), va="bottom", fontsize=8)
    if xticks is not None:
        first = next(iter(series.values()))[0] if series else []
        ax.set_xticks(list(first), list(xticks))
    elif all(float(x).is_integer() for xs, _ in series.values() for x in xs):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    _save_figure(fig, path)
    lo, hi = ax.get_xlim()
    ticks = [float(t) for t in ax.get_xticks() if lo <= t <= hi]
    plt.close(fig)
    return ticks


def text_table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]], caption: str | None = None) -> None:
    """A left-justified table of literal text (no markup), cells wrapped; for frames and free-form evidence."""
    from rich.markup import escape  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    t = Table(title=title, caption=escape(caption) if caption else None, title_justify="left", caption_justify="left", show_lines=True)
    for col in columns:
        t.add_column(col, justify="left", overflow="fold")
    for row in rows:
        t.add_row(*[escape(c if isinstance(c, str) else fmt(c)) for c in row])
    _console().print(t)


# --- replay / report / simulate (kvctl replay, kvctl report, kvctl simulate) ---


@contextlib.contextmanager
def replay_progress(total: int, enabled: bool = True) -> Iterator[Any]:
    """Progress of an open-loop replay on stderr; yields ``update(state)`` for a sender state.

    ``state`` has ``finished``, ``sent``, ``errors``, ``in_flight``, ``cap_hits`` and ``started``
    (a ``time.monotonic()`` value), and ``note``: what the replay waits for after its last answer, shown beside them
    (a line of its own without a terminal). A bar on a terminal, :class:`ProgressLines` otherwise; a no-op when
    disabled (``--json``).
    """
    import time  # noqa: PLC0415

    def stats(state: Any) -> str:
        elapsed = max(time.monotonic() - state.started, 1e-9)
        return (f"{state.finished / elapsed:.1f} req/s · in flight {state.in_flight} · sent {state.sent}"
                f" · errors {state.errors}" + (f" · capped {state.cap_hits}" if state.cap_hits else "")
                + (f" · {state.note}" if getattr(state, "note", None) else ""))

    if not enabled:
        yield lambda state: None
        return
    if not sys.stderr.isatty():
        lines = ProgressLines("replay")
        last: list[Any] = []

        def update_line(state: Any) -> None:
            last[:] = [state]
            lines.line(f"{state.finished}/{total} finished · {stats(state)}", step=getattr(state, "note", None))

        lines.line(f"0/{total} finished · sending", force=True)
        yield update_line
        if last:
            lines.line(f"{last[0].finished}/{total} finished · {stats(last[0])} · done", force=True)
        return

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: PLC0415

    with Progress(
        TextColumn("replay"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[stats]}"),
        TimeElapsedColumn(),
        console=_console(stderr=True),
        transient=True,
    ) as prog:
        task = prog.add_task("replay", total=total, stats="")

        def update(state: Any) -> None:
            prog.update(task, completed=state.finished, stats=stats(state))

        yield update


def _save_figure(fig: Any, path: str) -> None:
    """The figure as a PNG at ``path`` through :func:`kvctl.core.files.write_atomic`: whole or not at all, and a
    link planted at ``path`` is replaced, never written through."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    write_atomic(path, buf.getvalue())


def _pyplot():
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def _save_chart(fig: Any, ax: Any, path: str, title: str, xlabel: str | None, ylabel: str) -> str:
    ax.set_title(title)
    if xlabel:
        ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend()
    fig.tight_layout()
    _save_figure(fig, path)
    _pyplot().close(fig)
    return path


#: The files ``kvctl report --plot DIR`` writes into DIR, in the order it writes them.
REPORT_PLOT_FILES = ("latency_over_time.png", "latency_cdf.png", "cache_token_share.png")


def report_plots(directory: str, runs: Sequence[tuple[str, Sequence[float], Sequence[float], float | None, float | None]]) -> list[str]:
    """Write the three ``kvctl report --plot`` charts (:data:`REPORT_PLOT_FILES`) into ``directory``; returns their paths.

    ``runs``: (name, scheduled seconds, latencies in seconds, share of prompt tokens cached,
    share of prompt tokens from L2) per run.
    """
    plt = _pyplot()
    os.makedirs(directory, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=120)
    for name, xs, ys, _, _ in runs:
        ax.plot(xs, ys, linewidth=1, marker=".", markersize=3, label=name)
    ax.grid(True, alpha=0.3)
    paths.append(_save_chart(fig, ax, os.path.join(directory, REPORT_PLOT_FILES[0]), "Latency over the run",
                             "scheduled time (s from start)", "latency (s)"))

    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=120)
    for name, _, ys, _, _ in runs:
        s = sorted(y for y in ys if y > 0)
        if s:
            ax.step(s, [(i + 1) / len(s) for i in range(len(s))], where="post", label=name)
    ax.set_xscale("log")
    ax.grid(True, alpha=0.3, which="both")
    paths.append(_save_chart(fig, ax, os.path.join(directory, REPORT_PLOT_FILES[1]), "Latency CDF",
                             "latency (s, log)", "fraction of requests"))

    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=120)
    xs = list(range(len(runs)))
    ax.bar([x - 0.2 for x in xs], [r[3] or 0.0 for r in runs], width=0.4, label="cached (any tier)")
    ax.bar([x + 0.2 for x in xs], [r[4] or 0.0 for r in runs], width=0.4, label="from L2")
    ax.set_xticks(xs, [r[0] for r in runs])
    ax.set_ylim(0, 1)
    paths.append(_save_chart(fig, ax, os.path.join(directory, REPORT_PLOT_FILES[2]),
                             "Share of prompt tokens served from cache", None, "share of prompt tokens"))
    return paths


def by_class_line(by_class: dict) -> str:
    """``hits p50/p90/p99 0.310/0.52/0.60 s (79) · misses … (17)``: one line of :func:`kvctl.records.stats.latency_by_class`'s result."""
    parts = []
    for name, label in (("hit", "hits"), ("miss", "misses")):
        c = by_class.get(name) or {}
        parts.append(f"{label} p50/p90/p99 " + "/".join(fmt(c.get(k)) for k in ("p50_s", "p90_s", "p99_s"))
                     + f" s ({c.get('requests', 0):,})")
    return " · ".join(parts)
