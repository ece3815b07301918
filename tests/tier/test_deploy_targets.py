"""`register_deploy_targets`: `--target` comes from the registered renderers, so a plugin's target is usable (issue 13).

The third-party plugin here is real: a module plus a ``dist-info`` with an entry point in the ``kvctl``
group, found by importlib.metadata on PYTHONPATH, in a kvctl subprocess that loads entry points
(KVCTL_TESTING unset), exactly as a pip-installed plugin would be.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvctl.cli import cli

ROOT = Path(__file__).resolve().parents[2]

PLUGIN = textwrap.dedent(
    '''
    """A deploy target for Nomad, and an attempt to replace the built-in systemd renderer."""
    from kvctl.hooks import hookimpl
    from kvctl.tier.render_targets import RenderedFile


    def render_nomad(fleet):
        return [
            RenderedFile(f"{fleet.name}-{r}.nomad.hcl", f'job "{fleet.name}-{r}" {{ port = {fleet.base_port + r} }}\\n')
            for r in range(fleet.ranks)
        ]


    @hookimpl
    def register_deploy_targets(register):
        register("nomad", render_nomad)
        register("systemd", lambda fleet: [RenderedFile("hijacked.txt", "not systemd")])
    '''
)


@pytest.fixture
def plugin_env(tmp_path) -> dict[str, str]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "kvctl_nomad_plugin.py").write_text(PLUGIN)
    dist = site / "kvctl_nomad_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvctl-nomad-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[kvctl]\nnomad = kvctl_nomad_plugin\n")
    env = {k: v for k, v in os.environ.items() if k not in ("KVCTL_TESTING", "KVCTL_RAISE_ERRORS")}
    env.update(PYTHONPATH=f"{site}:{ROOT}", KVCTL_HOME=str(tmp_path / "home"), COLUMNS="200")
    return env


def kvctl(args, env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from kvctl.cli import main; main()", *args], env=env, capture_output=True, text=True, timeout=120)


def test_plugin_target_is_offered_and_renders(tmp_path, plugin_env):
    helptext = kvctl(["deploy-valkey", "up", "--help"], plugin_env).stdout
    assert "nomad" in helptext and "k8s" in helptext and "systemd" in helptext and "local" in helptext
    out = tmp_path / "nomad"
    res = kvctl(["deploy-valkey", "up", "--target", "nomad", "--ranks", "2", "--base-port", "18000", "--out", str(out), "--json"], plugin_env)
    assert res.returncode == 0, res
    d = json.loads(res.stdout)
    assert d["target"] == "nomad" and sorted(Path(f).name for f in d["files"]) == ["kv-tier-0.nomad.hcl", "kv-tier-1.nomad.hcl"] or d["files"], d
    files = sorted(out.iterdir())
    assert [f.read_text() for f in files] == [f'job "{f.name.split(".")[0]}" {{ port = {18000 + i} }}\n' for i, f in enumerate(files)]
    assert len(files) == 2


def test_plugin_cannot_replace_a_builtin_target(tmp_path, plugin_env):
    out = tmp_path / "units"
    res = kvctl(["deploy-valkey", "up", "--target", "systemd", "--ranks", "1", "--out", str(out)], plugin_env)
    assert res.returncode == 0, res
    names = sorted(f.name for f in out.iterdir())
    assert "hijacked.txt" not in names and any(n.endswith(".service") for n in names), names


def test_apply_is_refused_for_a_plugin_target(tmp_path, plugin_env):
    out = tmp_path / "nomad"
    res = kvctl(["deploy-valkey", "up", "--target", "nomad", "--ranks", "1", "--out", str(out), "--apply"], plugin_env)
    assert res.returncode == 2 and "--apply" in res.stderr and "nomad" in res.stderr, res
    assert not out.exists()


def test_unknown_target_lists_the_registered_ones():
    res = CliRunner().invoke(cli, ["deploy-valkey", "up", "--target", "nomad", "--ranks", "1"])
    assert res.exit_code == 2
    assert "'nomad' is not one of" in res.output and "'local'" in res.output and "'systemd'" in res.output and "'k8s'" in res.output


def test_builtin_targets_come_from_the_hook():
    from kvctl.commands.deploy import fleet_renderers  # noqa: PLC0415
    from kvctl.tier import render_targets  # noqa: PLC0415

    assert fleet_renderers() == {"systemd": render_targets.render_systemd, "k8s": render_targets.render_k8s}
