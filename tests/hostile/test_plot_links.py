"""``--plot`` never writes through a planted link, and a plot appears whole or not at all (issue 30, item 2).

A link planted at the plot's name points at a file that must not change (and at a name outside that must
not appear). ``plan``, ``simulate``, ``report`` and ``bench`` (against a real embedded valkey-server) draw
through :mod:`kvctl.core.files`: a temp file next to the target, renamed over the link.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from kvctl.cli import cli
from tests.hostile.helpers import run_row, write_run_file

PNG = b"\x89PNG\r\n\x1a\n"
MODEL = ["--bytes-per-token", "48437.5", "--prefill-rate", "52200", "--t0", "0.33", "--instance-gbps", "0.85"]


def _plant(tmp_path: Path, name: str, dangling: bool) -> tuple[Path, Path]:
    """A link at ``name``: to a precious file, or dangling to a path outside (that must never be created)."""
    victim = tmp_path / "outside" / ("missing.png" if dangling else "precious.txt")
    victim.parent.mkdir(exist_ok=True)
    if not dangling:
        victim.write_text("precious\n")
    link = tmp_path / name
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(victim)
    return link, victim


def _args(kind: str, tmp_path: Path, plot: Path) -> list[str]:
    if kind == "simulate":
        return ["simulate", "--arrival-rate", "1.21", "--prompt-tokens", "16310", *MODEL, "--requests", "200", "--sweep", "instances=1,8",
                "--plot", str(plot)]
    if kind == "plan":
        return ["plan", "--arrival-rate", "1.21", "--prompt-tokens", "16310", *MODEL, "--requests", "200", "--max-instances", "2",
                "--slo-p99", "5", "--plot", str(plot)]
    if kind == "report":
        return ["report", str(write_run_file(tmp_path / "a.jsonl", [run_row(i) for i in range(5)])), "--plot", str(plot.parent)]
    return ["bench", "--embedded", "1", "--embedded-maxmemory", "64mb", "--chunk-bytes", "1e5", "--batch", "2", "--keys", "8",
            "--duration", "0.3", "--plot", str(plot)]


@pytest.mark.parametrize("dangling", [False, True], ids=["to-a-file", "dangling"])
@pytest.mark.parametrize("kind", ["simulate", "plan", "report", "bench"])
def test_plot_replaces_a_planted_link_instead_of_writing_through_it(tmp_path, kind, dangling):
    name = "plots/latency_cdf.png" if kind == "report" else "plot.png"
    link, victim = _plant(tmp_path, name, dangling)
    r = CliRunner().invoke(cli, _args(kind, tmp_path, link))
    assert r.exit_code == 0, r.output
    if dangling:
        assert not victim.exists(), "the plot was written through a dangling link"
    else:
        assert victim.read_text() == "precious\n", "the plot was written through the link"
    assert not link.is_symlink() and link.read_bytes()[:8] == PNG
    assert not [p.name for p in link.parent.iterdir() if ".kvctl-tmp-" in p.name]
