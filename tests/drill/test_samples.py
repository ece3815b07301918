"""The samples bundled in kvctl/samples/ load with the commands `kvctl drill samples` names."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
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


# --- issue 31, item 2: the README's what-if of the drill agrees with the async-fix drill --------------------


def _readme_simulate_line() -> str:
    import re

    section = (ROOT / "README.md").read_text().split("## On call: a quick start", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    (line,) = [ln for ln in block.splitlines() if ln.startswith("kvctl simulate")]
    return line


def test_readme_async_simulate_reproduces_the_async_fix_drill():
    """The README simulates the overload drill's trace with async loading. The async-fix drill recovers to
    ρ = 1.2 × (16/171 + one round trip) / (16/57) = 0.45 (its async loader GETs a prompt's 16 chunks in one
    pipelined batch at 171 chunks/s after one round trip; the sync loader 57 chunks/s). The README's line names the
    two loaders' bandwidths (the drill's constants) and the simulation says the same: tier ρ ≈ 0.45, stable."""
    from kvctl.drill import scenarios as S
    from kvctl.drill.samples import loader_gbps

    line = _readme_simulate_line()
    sync_gbps, async_gbps = loader_gbps()
    import re

    given = {k: float(v) for k, v in re.findall(r"--((?:async-)?instance-gbps) (\S+)", line)}
    assert given["instance-gbps"] == pytest.approx(sync_gbps, rel=0.01) and given["async-instance-gbps"] == pytest.approx(async_gbps, rel=0.01), line
    assert "--loading async" in line
    drill_after = 1.2 * (16 / S.LINK_CHUNKS_PER_S + S.CHUNK_RTT_S) / (16 / S.STREAM_CHUNKS_PER_S)
    assert drill_after == pytest.approx(0.45, abs=0.005)
    r = _run(line.replace("./drill/trace.jsonl", str(sample_paths()["trace"])), "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["stable"] is True and d["timeouts"] == 0
    assert d["tier_rho"] == pytest.approx(drill_after, rel=0.1)
    table = _run(line.replace("./drill/trace.jsonl", str(sample_paths()["trace"]))).output
    row = next(ln for ln in table.splitlines() if ln.startswith("│"))
    assert "a queue grows" not in table and row.rstrip(" │").endswith("yes"), table  # the stable column


def test_an_unstable_async_tier_is_named_in_the_footer_not_the_engine():
    """Without the async loader's bandwidth the tier is at ρ 1.16 while the engine's ρ is 0.2: the footer says the
    tier's ρ is ≥ 1 and what that does (loads time out), not that the engine's queue grows."""
    import re

    line = re.sub(r" --async-instance-gbps \S+", "", _readme_simulate_line().replace("./drill/trace.jsonl", str(sample_paths()["trace"])))
    out = " ".join(_run(line).output.split())
    assert "tier ρ 1.16 ≥ 1" in out and "(engine ρ 0.197)" in out and "timeouts" in out, out
    assert "a queue grows" not in out
