"""The CLI surface (issue 13): ``-v`` before or after the subcommand, shell completion as README documents it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
CONFIG = "chunk_size: 256\nenable_async_loading: false\n"


def kvctl(args, tmp_path, extra_env=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_", "_KVCTL"))}
    env.update(KVCTL_HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT), **(extra_env or {}))
    return subprocess.run([sys.executable, "-c", "from kvctl.cli import main; main()", *args], env=env, capture_output=True, text=True, timeout=60)


@pytest.fixture
def leftover(tmp_path):
    """A config and a temp file a killed run left next to it: removing it is logged at info level."""
    p = tmp_path / "lmcache.yaml"
    p.write_text(CONFIG)
    (tmp_path / ".lmcache.yaml.kvctl-tmp-4242").write_text("half")
    return p


@pytest.mark.parametrize(
    "where",
    [
        ["-v", "loading", "async"],  # before the subcommand, as always
        ["loading", "async", "-v"],  # after it
        ["loading", "-v", "async"],  # on the group in between
    ],
)
def test_verbose_anywhere_logs_info(tmp_path, leftover, where):
    res = kvctl([*where, "--no-backup", "--config", str(leftover)], tmp_path)
    assert res.returncode == 0, res
    assert re.search(r"kvctl\.core\.files INFO removed .*\.lmcache\.yaml\.kvctl-tmp-4242, a temp file left by a kvctl run that died", res.stderr), res.stderr
    assert "DEBUG" not in res.stderr


def test_without_verbose_nothing_is_logged(tmp_path, leftover):
    res = kvctl(["loading", "async", "--no-backup", "--config", str(leftover)], tmp_path)
    assert res.returncode == 0 and "INFO" not in res.stderr, res


def test_vv_after_and_v_before_add_up_to_debug(tmp_path, leftover):
    res = kvctl(["-v", "loading", "async", "-v", "--no-backup", "--config", str(leftover)], tmp_path)
    assert res.returncode == 0, res
    assert "kvctl.core.files DEBUG writing" in res.stderr and "INFO removed" in res.stderr


def test_every_subcommand_accepts_verbose(tmp_path):
    from click.testing import CliRunner  # noqa: PLC0415

    from kvctl.cli import cli  # noqa: PLC0415
    from tests.cli_helpers import _commands  # noqa: PLC0415

    for name, _ in _commands(cli):
        res = CliRunner().invoke(cli, [*name.split()[1:], "-v", "--help"])
        assert res.exit_code == 0, (name, res.output)


def test_bash_completion_script_is_produced_and_completes(tmp_path):
    """The line README gives, run in a real bash: the script defines the completion, which then completes."""
    res = kvctl([], tmp_path, {"_KVCTL_COMPLETE": "bash_source"})
    assert res.returncode == 0 and "complete -o nosort -F _kvctl_completion kvctl" in res.stdout, res
    script = tmp_path / "kvctl-completion.bash"
    script.write_text(res.stdout)
    shim = tmp_path / "bin" / "kvctl"  # `kvctl` on PATH, whatever the install
    shim.parent.mkdir()
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'from kvctl.cli import main; main()' \"$@\"\n")
    shim.chmod(0o755)
    probe = (
        f"source {script}; "
        "COMP_WORDS=(kvctl loading s); COMP_CWORD=2; _kvctl_completion kvctl; echo \"${COMPREPLY[@]}\"; COMPREPLY=(); "
        "COMP_WORDS=(kvctl loading async --restart-t); COMP_CWORD=3; _kvctl_completion kvctl; echo \"${COMPREPLY[@]}\""
    )
    env = {**os.environ, "PATH": f"{shim.parent}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT), "KVCTL_HOME": str(tmp_path / "home")}
    out = subprocess.run(["bash", "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.splitlines() == ["show sync", "--restart-timeout"], out


@pytest.mark.parametrize("shell", ["zsh_source", "fish_source"])
def test_other_shells_get_a_script(tmp_path, shell):
    res = kvctl([], tmp_path, {"_KVCTL_COMPLETE": shell})
    assert res.returncode == 0 and "kvctl" in res.stdout and len(res.stdout) > 200, res


def test_readme_documents_completion_and_verbose():
    assert 'eval "$(_KVCTL_COMPLETE=bash_source kvctl)"' in README
    assert "_KVCTL_COMPLETE=zsh_source" in README and "_KVCTL_COMPLETE=fish_source" in README
    assert re.search(r"`-v`.*before or after the subcommand", README, re.S)


def test_help_lists_every_exit_code():
    """Issue 22: `kvctl --help` listed exit codes 0-5, not 6. Every ExitStatus value is named, as in the README."""
    from click.testing import CliRunner

    from kvctl.cli import cli
    from kvctl.core.errors import ExitStatus

    text = " ".join(CliRunner().invoke(cli, ["--help"]).output.split())
    for status in ExitStatus:
        assert f"{int(status)} " in text.split("exit codes:", 1)[1], status
        assert f"{int(status)} " in README.split("Exit codes:", 1)[1][:400], status
