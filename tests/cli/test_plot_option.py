"""Every ``--plot`` behaves one way (issue 48, item 11): a command that draws one chart writes FILE.png when FILE does not
end in .png (FILE as given when it does), says where on stderr, and its --help says so in the same words, from one place
(kvctl.commands.options); ``report --plot DIR`` writes its three charts into DIR. Real files, every command.

The planted-link safety of every --plot is tests/hostile/test_plot_links.py's.
"""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.commands.options import PLOT_DIR_RULE, PLOT_FILE_RULE
from kvctl.core.render import REPORT_PLOT_FILES
from tests.cli_helpers import _commands
from tests.hostile.helpers import run_row, write_run_file

PNG = b"\x89PNG\r\n\x1a\n"
MODEL = ["--bytes-per-token", "48437.5", "--prefill-rate", "52200", "--t0", "0.33", "--instance-gbps", "0.85"]
#: Each command that draws one chart, with what it needs besides --plot.
ONE_CHART = {
    "simulate": ["simulate", "--arrival-rate", "1.21", "--prompt-tokens", "16310", *MODEL, "--requests", "200", "--sweep", "instances=1,8"],
    "plan": ["plan", "--arrival-rate", "1.21", "--prompt-tokens", "16310", *MODEL, "--requests", "200", "--max-instances", "2", "--slo-p99", "5"],
    "bench": ["bench", "--embedded", "1", "--embedded-maxmemory", "64mb", "--chunk-bytes", "1e5", "--batch", "2", "--keys", "8", "--duration", "0.3"],
}


def _words(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("given, written", [("chart", "chart.png"), ("chart.png", "chart.png"), ("chart.PNG", "chart.PNG"),
                                            ("sub/chart", "sub/chart.png")])
@pytest.mark.parametrize("kind", ["simulate", "plan"])
def test_one_chart_goes_to_file_png_and_stderr_says_where(tmp_path, kind, given, written):
    r = CliRunner().invoke(cli, [*ONE_CHART[kind], "--plot", str(tmp_path / given)])
    assert r.exit_code == 0, r.output
    assert (tmp_path / written).read_bytes()[:8] == PNG
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()) == [written]
    assert f"plot: wrote {tmp_path / written}" in _words(r.stderr)


def test_bench_plot_goes_to_file_png_and_stderr_says_where(tmp_path):
    """Against a real embedded valkey-server, --json on: stdout stays one JSON document."""
    r = CliRunner().invoke(cli, [*ONE_CHART["bench"], "--plot", str(tmp_path / "scaling"), "--json"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "scaling.png").read_bytes()[:8] == PNG and not (tmp_path / "scaling").exists()
    assert f"plot: wrote {tmp_path / 'scaling.png'}" in _words(r.stderr)
    json.loads(r.stdout)


@pytest.mark.parametrize("kind", ["simulate", "plan"])
def test_a_plot_name_whose_png_is_a_directory_is_a_usage_error(tmp_path, kind):
    (tmp_path / "chart.png").mkdir()
    r = CliRunner().invoke(cli, [*ONE_CHART[kind], "--plot", str(tmp_path / "chart")])
    assert r.exit_code == 2, r.output
    assert "is a directory" in r.output


def test_report_writes_its_three_charts_into_dir_and_refuses_a_png_name(tmp_path):
    run = write_run_file(tmp_path / "a.jsonl", [run_row(i) for i in range(5)])
    r = CliRunner().invoke(cli, ["report", str(run), "--plot", str(tmp_path / "plots"), "--json"])
    assert r.exit_code == 0, r.output
    paths = json.loads(r.stdout)["plots"]
    assert paths == [str(tmp_path / "plots" / n) for n in REPORT_PLOT_FILES]
    assert all(Path(p).read_bytes()[:8] == PNG for p in paths)
    assert all(f"plot: wrote {p}" in _words(r.stderr) for p in paths)
    r = CliRunner().invoke(cli, ["report", str(run), "--plot", str(tmp_path / "chart.png")])
    assert r.exit_code == 2 and "takes a directory" in r.output, r.output
    assert not (tmp_path / "chart.png").exists()


def test_every_plot_option_of_every_command_takes_the_one_rule():
    """Each --plot in the CLI, whatever command: FILE with the file rule, or DIR with the directory rule, in the same words."""
    seen = {}
    for name, cmd in _commands(cli):
        for p in cmd.params:
            if isinstance(p, click.Option) and "--plot" in p.opts:
                seen[name] = p
    assert set(seen) == {"kvctl simulate", "kvctl plan", "kvctl bench", "kvctl report"}, sorted(seen)
    for name, p in seen.items():
        rule = PLOT_DIR_RULE if name == "kvctl report" else PLOT_FILE_RULE
        assert rule in p.help, (name, p.help)
        assert p.metavar == ("DIR" if name == "kvctl report" else "FILE"), (name, p.metavar)
        r = CliRunner().invoke(cli, [*name.split()[1:], "--help"], terminal_width=400)
        assert rule in _words(r.output), (name, r.output)
