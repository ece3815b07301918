"""One option set names the Valkey instances of every command (issue 13, the CLI surface).

`bench`, `diagnose` (and its `run`/`capture`), `exporter`, `doctor` and
`deploy-valkey status` all take `--valkey URL` with `--url` as its alias
(repeatable, index = rank, or one `{rank}` template with `--ranks N`), `--dir`
of a `deploy-valkey up` tier and `--password-file` (also from
`KVCTL_PASSWORD_FILE`), and turn them into instances through one function, so
the same bad input gets the same message everywhere.

Real components: valkey-server processes on free loopback ports (with and
without a password; tests/conftest.py), a real HTTP engine serving vLLM-format
/metrics text (tests/diagnose/metrics_server.py), and the real `kvctl exporter`
process, scraped over HTTP.
"""

from __future__ import annotations

import json
import os
import time

import click
import pytest
import redis
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.tier.server import free_port
from tests.diagnose.engine_text import EngineState
from tests.diagnose.metrics_server import MetricsServer
from tests.exporter.helpers import ExporterProcess, one, scrape

PASSWORD = "inst-opts-pw"
SMALL_BENCH = ["--chunk-bytes", "1e5", "--batch", "2", "--keys", "8", "--duration", "0.3"]
ENGINE_TEXTS = [EngineState().text(), EngineState().advance(requests=2, prompt_lengths=[1000, 1000]).text()]

#: Every command that talks to Valkey instances it is told about.
COMMANDS = [("bench",), ("diagnose",), ("diagnose", "run"), ("diagnose", "capture"), ("exporter",), ("doctor",), ("deploy-valkey", "status")]
SHARED = ("valkey_urls", "ranks", "tier_dir", "password_file")


def command(path: tuple[str, ...]) -> click.Command:
    cmd: click.Command = cli
    for name in path:
        cmd = cmd.commands[name]  # type: ignore[attr-defined]
    return cmd


def invoke(args, env=None, code=None):
    res = CliRunner().invoke(cli, args, env=env)
    if code is not None:
        assert res.exit_code == code, (res.output, res.exception)
    return res


@pytest.fixture
def passworded(valkey_factory, tmp_path):
    """A real valkey-server with requirepass, and a 0600 file holding its password."""
    v = valkey_factory(password=PASSWORD)
    pw = tmp_path / "tier.pw"
    pw.write_text(PASSWORD + "\n")
    os.chmod(pw, 0o600)
    return v, str(pw)


# --- one option set --------------------------------------------------------------------


@pytest.mark.parametrize("path", COMMANDS, ids=" ".join)
def test_every_command_has_the_same_instance_options(path):
    """Same spellings, env var, repeatability and help text as `kvctl bench` (drift is a failure)."""
    ref = {p.name: p for p in command(("bench",)).params}
    mine = {p.name: p for p in command(path).params}
    assert mine["valkey_urls"].opts == ["--valkey"] and mine["valkey_urls"].multiple
    assert mine["valkey_urls"].old_names == ("--url",) and mine["valkey_urls"].hidden is False  # --url: old name, one release
    assert mine["ranks"].opts == ["--ranks"] and mine["tier_dir"].opts == ["--dir"] and mine["password_file"].opts == ["--password-file"]
    assert mine["password_file"].envvar == "KVCTL_PASSWORD_FILE"
    for name in SHARED:
        assert mine[name].help == ref[name].help, (path, name)


def _capture_urls(out_dir) -> list[str]:
    return json.loads((out_dir / "capture.json").read_text())["valkey_urls"]


def test_diagnose_takes_the_old_url_in_rank_order_and_refuses_mixed_spellings(tmp_path, valkey_factory):
    """--url is --valkey's old name (issue 31): kept for one release, with a warning on stderr. Mixed with
    --valkey the order of the two (index = rank) would be lost: refused."""
    a, b = valkey_factory(), valkey_factory()
    with MetricsServer(ENGINE_TEXTS) as eng:
        res = invoke(["diagnose", "capture", "--engine-url", eng.url, "--url", a.url, "--url", b.url, "--window", "0.2", "--out", str(tmp_path / "c1"), "--json"], code=0)
        assert "warning: --url is renamed --valkey; the old name works until the next release" in res.stderr
        # given before the subcommand, the old name is carried to it like --valkey
        invoke(["diagnose", "--url", b.url, "capture", "--engine-url", eng.url, "--window", "0.2", "--out", str(tmp_path / "c2"), "--json"], code=0)
        res = invoke(["diagnose", "capture", "--engine-url", eng.url, "--url", a.url, "--valkey", b.url, "--window", "0.2", "--out", str(tmp_path / "c3")], code=2)
        assert "give every value as --valkey (--url is its old name; do not mix the two)" in res.output
    assert _capture_urls(tmp_path / "c1") == [a.url, b.url]  # rank 0 = first given
    assert _capture_urls(tmp_path / "c2") == [b.url]


def test_bench_takes_valkey(valkey_server):
    res = invoke(["bench", "--valkey", valkey_server.url, *SMALL_BENCH, "--json"], code=0)
    (run,) = json.loads(res.stdout)["runs"]
    assert [i["url"] for i in run["per_instance"]] == [f"{valkey_server.url}/0"] and run["errors"] == 0  # bench writes the db


def test_doctor_and_exporter_take_valkey(valkey_server, monkeypatch):
    monkeypatch.delenv("KVCTL_LMCACHE_PYTHON", raising=False)  # `make test` sets it: LMCache 0.5.6's known-bugs warning
    data = json.loads(invoke(["doctor", "--valkey", valkey_server.url, "--no-host-checks", "--json"], code=0).stdout)
    assert [c["status"] for c in data["checks"] if c["name"] == "up"] == ["ok"]
    assert exporter_valkey_up(["--valkey", valkey_server.url]) == 1


# --- KVCTL_PASSWORD_FILE is read by every command ------------------------------------------


def test_diagnose_reads_the_password_env_var(tmp_path, passworded):
    v, pw = passworded
    with MetricsServer(ENGINE_TEXTS) as eng:
        args = ["diagnose", "capture", "--engine-url", eng.url, "--valkey", v.url, "--window", "0.2", "--json"]
        refused = json.loads(invoke([*args, "--out", str(tmp_path / "no-pw")], code=5).stdout)
        ok = json.loads(invoke([*args, "--out", str(tmp_path / "env-pw")], env={"KVCTL_PASSWORD_FILE": pw}, code=0).stdout)
    assert refused["unreachable"] and ok["unreachable"] == [] and ok["valkey_instances"] == 1


def test_doctor_reads_the_password_env_var(passworded, monkeypatch):
    monkeypatch.delenv("KVCTL_LMCACHE_PYTHON", raising=False)  # `make test` sets it: LMCache 0.5.6's known-bugs warning
    v, pw = passworded
    refused = json.loads(invoke(["doctor", "--valkey", v.url, "--no-host-checks", "--json"], code=4).stdout)
    assert [c["status"] for c in refused["checks"] if c["name"] == "auth"] == ["fail"]
    ok = json.loads(invoke(["doctor", "--valkey", v.url, "--no-host-checks", "--json"], env={"KVCTL_PASSWORD_FILE": pw}, code=0).stdout)
    assert [c["status"] for c in ok["checks"] if c["name"] == "up"] == ["ok"]


def test_bench_reads_the_password_env_var(passworded):
    v, pw = passworded
    res = invoke(["bench", "--url", v.url, *SMALL_BENCH, "--json"], env={"KVCTL_PASSWORD_FILE": pw}, code=0)
    assert json.loads(res.stdout)["runs"][0]["errors"] == 0


def exporter_valkey_up(args: list[str], env: dict[str, str] | None = None) -> float:
    """Run the real `kvctl exporter` until it has sampled twice; ``kvctl_valkey_up{rank="0"}`` as scraped."""
    with MetricsServer(ENGINE_TEXTS) as eng:
        environ = {**{k: v for k, v in os.environ.items() if k != "KVCTL_PASSWORD_FILE"}, "KVCTL_TESTING": "1", **(env or {})}
        with ExporterProcess(["--engine-url", eng.url, *args, "--interval", "0.2", "--window", "0.4", "--timeout", "1"], environ) as exp:
            up = None
            deadline = time.monotonic() + 20
            for _ in range(200):  # at most 200 scrapes and 20 s
                values = scrape(exp.start["metrics_url"])
                if ("kvctl_valkey_up", (("rank", "0"),)) in values and eng.hits >= 2:
                    up = one(values, "kvctl_valkey_up", rank=0)
                    break
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)
    assert exp.returncode == 0, exp.err
    assert up is not None, "kvctl_valkey_up{rank=0} never served"
    return up


def test_exporter_reads_the_password_env_var(passworded):
    v, pw = passworded
    assert exporter_valkey_up(["--valkey", v.url]) == 0  # no password: the instance refuses INFO
    assert exporter_valkey_up(["--valkey", v.url], env={"KVCTL_PASSWORD_FILE": pw}) == 1


# --- one function turns them into instances: one message per mistake ----------------------

#: What each command needs besides the instances to get as far as naming them.
BEFORE = {
    ("bench",): [],
    ("diagnose",): ["--engine-url", "http://127.0.0.1:1"],
    ("diagnose", "capture"): ["--engine-url", "http://127.0.0.1:1", "--out", "unused-capture"],
    ("exporter",): ["--engine-url", "http://127.0.0.1:1"],
    ("doctor",): ["--no-host-checks"],
    ("deploy-valkey", "status"): [],
}


@pytest.mark.parametrize("path", list(BEFORE), ids=" ".join)
@pytest.mark.parametrize(
    "args, message",
    [
        (["--valkey", "resp://127.0.0.1:1", "--dir", "some-tier"], "name the Valkey instances with --valkey"),
        (["--valkey", "resp://127.0.0.1:{rank}"], "a {rank} URL template needs --ranks N"),
        (["--ranks", "2"], "--ranks goes with one {rank} --valkey template"),
        (["--ranks", "2", "--dir", "some-tier"], "--ranks goes with one {rank} --valkey template"),
        (["--valkey", "resp://127.0.0.1:1", "--valkey", "resp://127.0.0.1:2", "--ranks", "3"], "--ranks 3 does not match the 2 URLs given"),
    ],
)
def test_the_same_mistake_gets_the_same_message_everywhere(path, args, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = invoke([*path, *BEFORE[path], *args])
    assert res.exit_code == 2, res.output
    assert message in res.output and "Traceback" not in res.output


def test_bench_without_instances_names_every_way():
    res = invoke(["bench"], code=2)
    assert "--valkey" in res.output and "--dir" in res.output and "--embedded" in res.output


# --- deploy-valkey status of any instance ---------------------------------------------------


def test_status_of_instances_named_by_url(valkey_factory):
    a, b = valkey_factory(), valkey_factory()
    with redis.Redis(port=b.port) as r:
        r.mset({"k1": b"x", "k2": b"y", "k3": b"z"})
    data = json.loads(invoke(["deploy-valkey", "status", "--valkey", a.url, "--valkey", b.url, "--json"], code=0).stdout)
    got = [(i["rank"], i["port"], i["up"], i["keys"]) for i in data["instances"]]
    assert got == [(0, a.port, True, 0), (1, b.port, True, 3)]
    assert data["instances"][1]["maxmemory"] == 256 * 2**20  # the fixture's maxmemory 256mb


def test_status_of_a_url_nothing_listens_on_exits_5(valkey_server):
    dead = f"resp://127.0.0.1:{free_port()}"
    res = invoke(["deploy-valkey", "status", "--valkey", valkey_server.url, "--valkey", dead], code=5)
    assert f"rank 1 (127.0.0.1:{dead.rsplit(':', 1)[1]}): down" in res.output
    assert "deploy-valkey down" not in res.output  # not a tier kvctl started: no restart recipe for it


def test_status_of_a_passworded_url(passworded):
    v, pw = passworded
    res = invoke(["deploy-valkey", "status", "--valkey", v.url], code=1)
    assert "--password-file" in res.output
    data = json.loads(invoke(["deploy-valkey", "status", "--valkey", v.url, "--json"], env={"KVCTL_PASSWORD_FILE": pw}, code=0).stdout)
    assert [i["up"] for i in data["instances"]] == [True]


def test_status_url_beats_the_tier_dir_from_the_environment(valkey_server, monkeypatch, tmp_path):
    """KVCTL_TIER_DIR (and the ./kv-tier default) name the tier only when no URL is given."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVCTL_TIER_DIR", str(tmp_path / "no-tier-here"))
    invoke(["deploy-valkey", "status", "--valkey", valkey_server.url], code=0)
    assert "holds no kvctl tier" in invoke(["deploy-valkey", "status"], code=2).output
