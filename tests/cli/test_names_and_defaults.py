"""Issue 48 item 14, names and defaults: --timeout-s in vllm-config only (now --timeout, the old spelling a hidden alias);
one read-timeout default for doctor and diagnose; --dir's default ./kv-tier read by diagnose as doctor reads it; one
meaning of --window in diagnose and the exporter; the drill's printed duration; an example in every `cost` subcommand's
--help (each one runs)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.commands.options import WINDOW_HELP
from kvctl.core import thresholds
from tests.cli_helpers import _commands
from tests.engine_stub import VllmStub
from tests.tier.helpers import free_base_port

COMMANDS = dict(_commands(cli))


def option(command: str, flag: str) -> click.Option:
    return next(p for p in COMMANDS[command].params if isinstance(p, click.Option) and flag in p.opts)


# --- --timeout, not --timeout-s --------------------------------------------------------------------------------------


def test_vllm_config_takes_timeout_and_its_old_spelling_warns():
    base = ["deploy-valkey", "vllm-config", "--target", "k8s", "--ranks", "2", "--json"]
    new = CliRunner().invoke(cli, [*base, "--timeout", "1.5"])
    old = CliRunner().invoke(cli, [*base, "--timeout-s", "1.5"])
    assert new.exit_code == old.exit_code == 0, (new.output, old.output)
    assert json.loads(new.stdout)["kv_connector_extra_config"]["timeout_s"] == 1.5
    assert json.loads(old.stdout) == json.loads(new.stdout)
    assert "--timeout-s is renamed --timeout" in old.stderr and not new.stderr
    shown = CliRunner().invoke(cli, ["deploy-valkey", "vllm-config", "--help"]).output
    assert "--timeout-s" not in shown and f"default {thresholds.CONNECTOR_TIMEOUT_S:g}" in " ".join(shown.split())


def test_no_option_spells_a_unit_that_a_sibling_does_not():
    """--timeout everywhere: no command has a --timeout-s (or --window-s, --interval-s) beside the others' plain name."""
    plain = {o for cmd in COMMANDS.values() for p in cmd.params if isinstance(p, click.Option) and not p.hidden for o in p.opts}
    doubled = sorted(o for o in plain if o.endswith("-s") and o[:-2] in plain)
    assert not doubled, doubled


# --- one read-timeout default ----------------------------------------------------------------------------------------


def test_doctor_and_diagnose_read_with_one_default_timeout():
    defaults = {name: option(name, "--timeout").default for name in ("kvctl doctor", "kvctl diagnose", "kvctl diagnose run", "kvctl diagnose capture")}
    assert set(defaults.values()) == {thresholds.READ_TIMEOUT_S}, defaults
    assert f"at most {thresholds.READ_TIMEOUT_S:g}" in option("kvctl exporter", "--timeout").help


# --- --dir: the default tier, read where a tier is there ----------------------------------------------------------------


@pytest.fixture
def tier_here(tmp_path, monkeypatch):
    """A live one-instance tier in ./kv-tier of a fresh working directory; stopped afterwards."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KVCTL_TIER_DIR", raising=False)
    res = CliRunner().invoke(cli, ["deploy-valkey", "up", "--ranks", "1", "--base-port", str(free_base_port(1)), "--dir", "./kv-tier",
                                   "--maxmemory", "64mb", "--json"])
    assert res.exit_code == 0, res.output
    yield json.loads(res.stdout)["instances"][0]["url"]
    # the tier's own path: a test may have left the working directory (one goes into ./kv-tier), and a relative
    # --dir from there found no tier, so its valkey-server outlived the test
    down = CliRunner().invoke(cli, ["deploy-valkey", "down", "--dir", str(tmp_path / "kv-tier"), "--purge", "--json"])
    assert down.exit_code == 0 and not (tmp_path / "kv-tier").exists(), down.output


def _diagnose(*args: str) -> dict:
    res = CliRunner().invoke(cli, ["diagnose", *args, "--window", "0.5", "--json"])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    return json.loads(res.stdout)


def test_diagnose_reads_the_tier_in_kv_tier_as_doctor_does(tier_here, tmp_path):
    with VllmStub() as eng:
        found = _diagnose("--engine-url", eng.url)
        assert [i["url"] for i in found["instances"]] == [tier_here] and found["instances"][0]["status"] == "ok", found["instances"]
        capture = CliRunner().invoke(cli, ["diagnose", "--engine-url", eng.url, "--window", "0.5", "capture", "--out", str(tmp_path / "cap"), "--json"])
        assert capture.exit_code == 0 and json.loads(capture.stdout)["valkey_instances"] == 1, capture.output
        named = _diagnose("--engine-url", eng.url, "--valkey", tier_here)  # a URL given: the default tier is not added
        assert [i["url"] for i in named["instances"]] == [tier_here]
        os.chdir(tmp_path / "kv-tier")  # no tier here: engine-side only, as before
        assert _diagnose("--engine-url", eng.url)["instances"] == []
    assert option("kvctl diagnose", "--dir").default == option("kvctl doctor", "--dir").default == thresholds.TIER_DIR
    assert CliRunner().invoke(cli, ["diagnose", "--from", str(tmp_path / "cap"), "--json"]).exit_code in (0, 3, 4, 6)  # --from takes no tier


# --- --window: one meaning ---------------------------------------------------------------------------------------------


def test_window_means_one_thing_in_diagnose_and_the_exporter():
    for name in ("kvctl diagnose", "kvctl diagnose run", "kvctl diagnose capture", "kvctl exporter"):
        assert option(name, "--window").help.startswith(WINDOW_HELP), name
    reference = " ".join((Path(__file__).resolve().parents[2] / "docs" / "reference.md").read_text().split())
    assert f"| `--window` | {WINDOW_HELP.lower().rstrip('.')}" in reference.lower()


# --- cost: an example in every subcommand's help, and it runs ------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(n for n, c in COMMANDS.items() if n.startswith("kvctl cost ") and not isinstance(c, click.Group)))
def test_every_cost_subcommand_shows_an_example_that_runs(name):
    shown = CliRunner().invoke(cli, [*name.split()[1:], "--help"]).output
    examples = [ln.strip() for ln in shown.splitlines() if ln.strip().startswith(name + " ")]
    assert examples, shown
    for line in examples:
        args = shlex.split(line)[1:]
        res = CliRunner().invoke(cli, [*args, "--json"], catch_exceptions=False) if "--json" not in args else CliRunner().invoke(cli, args)
        assert res.exit_code == 0, (line, res.output)


# --- the drill says the duration it was given ---------------------------------------------------------------------------


@pytest.mark.long
def test_the_drill_prints_the_duration_it_was_given(tmp_path):
    res = subprocess.run([sys.executable, "-m", "kvctl.cli", "drill", "healthy", "--duration", "8"], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path, env={**os.environ, "KVCTL_HOME": str(tmp_path / "home")})
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    line = next(ln for ln in out.splitlines() if "replay:" in ln)
    assert re.search(r"req/s for the drill's 8 s\b", line) and "over 13 s" not in line, line
