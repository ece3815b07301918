"""kvctl.core.render: cell formatting, JSON conversion, what reaches stdout/stderr, and the PNG files it writes."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvctl.core import render


@pytest.mark.parametrize(
    "value, text",
    [
        (None, "—"),
        (True, "yes"),
        (False, "no"),
        (1234567, "1,234,567"),  # ints: thousands separators
        (0.5, "0.5"),
        (2.0, "2"),  # trailing zeros and the point dropped
        (0.0, "0"),
        (1234.5678, "1,234.568"),  # 3 decimals, rounded
        (-2.5, "-2.5"),
        (1e7, "1e+07"),  # ≥ 1e6: 3 significant digits
        (0.00012345, "0.000123"),  # < 1e-3: 3 significant digits
        ("as is", "as is"),
    ],
)
def test_fmt(value, text):
    assert render.fmt(value) == text


class Color(enum.Enum):
    RED = "red"


@dataclass
class Inner:
    path: Path
    tags: set[str]


@dataclass
class Outer:
    name: str
    color: Color
    inner: Inner
    by_rank: dict[int, float]
    _private: str = field(default="hidden")


def test_to_jsonable_and_emit(capsys):
    obj = Outer("x", Color.RED, Inner(Path("/tmp/a"), {"t"}), {0: 1.5})
    want = {"name": "x", "color": "red", "inner": {"path": "/tmp/a", "tags": ["t"]}, "by_rank": {"0": 1.5}}
    assert render.to_jsonable(obj) == want  # enums by value, keys as strings, no _private field
    render.emit_json(obj)
    render.emit_json_line(obj)
    out = capsys.readouterr().out
    *pretty, line = out.splitlines()  # indented JSON over many lines, then one compact line
    assert json.loads("\n".join(pretty)) == want and len(pretty) > 5
    assert json.loads(line) == want and ", " not in line and ": " not in line


def test_literal_keeps_brackets_and_warn_goes_to_stderr(capsys):
    render.literal("keep [bold]this[/bold] as is")
    render.warn("careful")
    render.error_line("broken [x]")
    cap = capsys.readouterr()
    assert cap.out == "keep [bold]this[/bold] as is\n"
    assert "warning: careful" in cap.err and "Error: broken [x]\n" in cap.err


def test_tables_format_cells_and_escape_markup(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    render.table("runs", ["op", "GB/s", "ok"], [("get", 1234.5678, True), ("set", None, False)])
    render.text_table(None, ["frame"], [("[red]not markup[/red]",)])
    out = capsys.readouterr().out
    assert "1,234.568" in out and "yes" in out and "—" in out and "no" in out
    assert "[red]not markup[/red]" in out


def test_progress_off_a_tty_is_plain_lines_on_stderr_and_draws_a_bar_on_one(capsys, monkeypatch):
    """Issue 31, item 6: off a terminal (a pipe, a file) progress is a line per step and every few seconds on
    stderr, never on stdout; disabled (--json) it prints nothing at all."""
    with render.progress("work", total=3, what="test") as advance:  # pytest's stderr is not a TTY
        for _ in range(3):
            advance(step="one")
        advance(1, description="renamed", step="two")
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    # started, the first step, the second step (each step change is a line; the rest within 5 s is not), done
    assert [ln.split(" [")[0] for ln in lines] == ["kvctl test: work · 0.0 of 3 (0%)", "kvctl test: work · 1.0 of 3 (33%)",
                                                   "kvctl test: renamed · 4.0 of 3 (100%)", "kvctl test: renamed · done"], lines
    with render.progress("work", total=3, enabled=False) as advance:
        advance()
    with render.replay_progress(5, enabled=False) as update:
        update(object())  # never inspected when disabled
    assert capsys.readouterr() == ("", "")  # nothing on stdout or stderr
    # the same calls on a real terminal (a pty) draw the bar there: the check above can tell the two apart
    import io
    import os
    import pty
    import select
    import sys

    master, slave = pty.openpty()
    tty = io.TextIOWrapper(os.fdopen(slave, "wb", buffering=0), encoding="utf-8", write_through=True)
    try:
        monkeypatch.setattr(sys, "stderr", tty)
        with render.progress("work-on-a-tty", total=3) as advance:
            advance(3, description="done-on-a-tty")
        tty.flush()
        drawn = b""
        for _ in range(100):  # bounded in count, and each wait in time: the bar is written before this
            ready, _, _ = select.select([master], [], [], 0.5)
            if not ready:
                break
            drawn += os.read(master, 65536)
    finally:
        tty.close()
        os.close(master)
    assert b"tty" in drawn


def test_plots_are_png_files(tmp_path):
    png = tmp_path / "line.png"
    render.line_plot(str(png), "t", "x", "y", {"a": ([1, 2, 4], [1.0, 1.8, 3.1])}, hlines={"B*": 2.5}, xticks=["1", "2", "4"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = [("sync", [0.0, 1.0, 2.0], [0.5, 0.7, 0.0], 0.4, 0.25), ("async", [0.0, 1.0], [0.2, 0.3], None, None)]
    paths = render.report_plots(str(tmp_path / "plots"), runs)
    assert [Path(p).name for p in paths] == ["latency_over_time.png", "latency_cdf.png", "cache_token_share.png"]
    assert all(Path(p).read_bytes()[:4] == b"\x89PNG" and Path(p).stat().st_size > 5000 for p in paths)


def test_a_count_axis_has_integer_ticks_only(tmp_path):
    """Issue 22: bench's scaling chart had x ticks like 1.2 instances. Counts get integer ticks; other x not."""
    ticks = render.line_plot(str(tmp_path / "n.png"), "t", "instances", "GB/s", {"a": ([1, 2], [1.0, 1.9])})
    assert ticks and all(t.is_integer() for t in ticks) and {1.0, 2.0} <= set(ticks)
    ticks = render.line_plot(str(tmp_path / "x.png"), "t", "s", "GB/s", {"a": ([0.1, 0.35], [1.0, 1.9])})
    assert not all(t.is_integer() for t in ticks)  # a continuous axis keeps matplotlib's own ticks



def test_tables_never_cut_a_number_at_80_columns(capsys, monkeypatch):
    """Issue 22: at 80 columns bench's `vs 1×1` became `1.0…` and simulate's figures were cut. Labels wrap
    between words; every figure is printed whole, and the table keeps its right edge."""
    monkeypatch.setenv("COLUMNS", "80")
    cols = ["instances", "B_eff GB/s", "ρ", "tier ρ", "p50 s", "p90 s", "p99 s", "max s", "p50 by third (s)", "max queue", "stable"]
    rows = [[2, "7.2*", 0.478123, 0.478, 0.725, 1.27, 1.759, 2.3, "0.725 / 0.725 / 0.73", 4, True],
            [8, "1.00×", 0.119, 0.119, 0.429, 0.453, 0.526, 0.596, "0.429 / 0.429 / 0.429", 123456, False]]
    render.table("What if", cols, rows)
    out = capsys.readouterr().out
    assert "…" not in out
    for figure in ["7.2*", "0.478", "1.759", "0.596", "0.725", "1.00×", "123,456"]:
        assert figure in out, figure
    table = [ln.rstrip() for ln in out.splitlines() if ln[:1] in "┏┃┡│└"]
    assert table and all(ln[-1] in "┓┃┩│┘" for ln in table)  # no column lost past the edge
