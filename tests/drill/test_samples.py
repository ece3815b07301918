"""The samples bundled in kvctl/samples/ load with the commands `kvctl drill samples` names."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.drill.samples import sample_commands, sample_paths
from kvctl.drill.workload import model_config_path, sizes

ROOT = Path(__file__).resolve().parents[2]


def _run(command: str, *extra: str):
    args = shlex.split(command)
    assert args[0] == "kvctl"
    return CliRunner().invoke(cli, [*args[1:], *extra])


def test_capture_sample_shows_rho_unstable():
    r = _run(sample_commands()["capture"], "--json")
    assert r.exit_code == 4, r.output  # critical finding
    data = json.loads(r.output)
    assert "rho_unstable" in [f["id"] for f in data["findings"]] and data["rho"] > 1


def test_run_sample_reports():
    r = _run(sample_commands()["run"], "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["runs"][0]["requests"] > 10


def test_trace_sample_simulates_and_replays_dry():
    r = _run(sample_commands()["trace"], "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["stable"] is False
    r = CliRunner().invoke(cli, ["replay", str(sample_paths()["trace"]), "--dry-run", "--json"])
    assert r.exit_code == 0, r.output


def test_bundled_model_config_is_the_repository_one():
    """Installed without the repository, the drill reads its model config from the package: the same file."""
    bundled = ROOT / "kvctl" / "samples" / "models" / "deepseek-v3.json"
    assert bundled.read_bytes() == (ROOT / "configs" / "models" / "deepseek-v3.json").read_bytes()
    assert model_config_path() == ROOT / "configs" / "models" / "deepseek-v3.json"
    assert sizes().chunk_bytes == int(sizes(bundled).chunk_bytes)


def test_package_data_globs_cover_every_sample_file():
    """`pip install .` (not editable) copies what setup.cfg's package_data names: every file under kvctl/samples/."""
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    globs = [g.strip() for g in cfg["options.package_data"]["kvctl"].splitlines() if g.strip()]
    covered = {p for g in globs for p in (ROOT / "kvctl").glob(g) if p.is_file()}
    files = {p for p in (ROOT / "kvctl" / "samples").rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert files and files <= covered, sorted(str(p) for p in files - covered)
    assert "kvctl.drill" in cfg["options"]["packages"].split()
