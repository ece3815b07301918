"""Issue 44 defect 12: no value kvctl renders into a Valkey config, a systemd unit or a k8s manifest can add a line.

Every value is refused (exit 2, one line) when it holds a control character, and quoted for Valkey's config
syntax when it holds a space, a quote or a backslash: a real valkey-server then reads back exactly the value
given (a password, a directory).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis
import yaml
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.tier.server import free_port, start_valkey
from tests.tier.helpers import free_base_port
from tests.tier.tier_procs import servers_in

INJECT = '\nrename-command CONFIG ""'
ODD_PASSWORD = "a b\"c'd\\e #f"  # a space, both quotes, a backslash, a hash


def invoke(*args: str):
    return CliRunner().invoke(cli, ["deploy-valkey", *args])


def _pw(tmp_path: Path, text: str) -> str:
    p = tmp_path / "pw"
    p.write_text(text)
    p.chmod(0o600)
    return str(p)


CASES = [
    ("systemd", ["--host", "127.0.0.1" + INJECT]),
    ("systemd", ["--host", "127.0.0.1 10.0.0.1"]),  # a second bind address the password rule never saw
    ("systemd", ["--name", "valkey" + INJECT]),
    ("k8s", ["--image", "valkey/valkey:8.1" + INJECT]),
    ("k8s", ["--service", "kv" + INJECT]),
    ("k8s", ["--namespace", "ns" + INJECT]),
    ("systemd", ["--password-file", "PW"]),
    ("k8s", ["--password-file", "PW"]),
    ("local", ["--password-file", "PW"]),
    ("local", ["--dir", "DIR"]),
    ("local", ["--host", "127.0.0.1" + INJECT]),
]


@pytest.mark.parametrize("target, args", CASES, ids=[f"{t}{a[0]}-{i}" for i, (t, a) in enumerate(CASES)])
def test_a_control_character_in_any_rendered_value_is_refused(tmp_path, no_leftover_servers, target, args):
    out = tmp_path / "out"
    args = [_pw(tmp_path, "s3cret" + INJECT + "\n") if a == "PW" else str(tmp_path / ("t" + INJECT)) if a == "DIR" else a for a in args]
    if target != "local" and "--password-file" not in args:
        args += ["--password-file", _pw(tmp_path, "s3cret\n")]
    where = ["--out", str(out)] if target != "local" else ([] if "--dir" in args else ["--dir", str(tmp_path / "t")])
    res = invoke("up", "--target", target, "--ranks", "2", "--base-port", str(free_base_port(2)), "--maxmemory", "64mb", *where, *args)
    written = [f.read_text() for f in (out.rglob("*") if out.exists() else []) if f.is_file()]
    assert not any("rename-command" in text for text in written)
    assert res.exit_code == 2, res.output
    assert res.output.startswith("Error:") and len(res.output.strip().splitlines()) == 1, res.output
    assert any(why in res.output for why in ("control character", "not a host", "DNS label")), res.output
    assert "s3cret" not in res.output  # a password is never quoted back
    assert servers_in(tmp_path / "t") == []


def test_a_space_or_a_quote_reaches_a_local_tier_exactly(tmp_path, no_leftover_servers):
    """A tier directory and a password with spaces, quotes, a backslash and a hash: quoted in the config, read back exactly."""
    d = tmp_path / "my tier 'a\"b\\c"
    res = invoke("up", "--ranks", "1", "--base-port", str(free_base_port(1)), "--maxmemory", "64mb", "--dir", str(d),
                 "--password-file", _pw(tmp_path, ODD_PASSWORD + "\n"), "--json")
    assert res.exit_code == 0, res.output
    port = json.loads(res.stdout)["instances"][0]["port"]
    try:
        with redis.Redis(port=port, password=ODD_PASSWORD) as r:
            assert r.config_get("dir")["dir"] == str(d.resolve())
            assert r.config_get("logfile")["logfile"] == str(d.resolve() / "valkey-0.log")
    finally:
        assert invoke("down", "--dir", str(d), "--purge").exit_code == 0
    assert not d.exists()


def _start_with(lines: list[str], workdir: Path, password: str):
    """A real valkey-server reading ``lines`` verbatim (an included file), on a sandbox port and directory."""
    workdir.mkdir(parents=True, exist_ok=True)
    inc = workdir / "rendered.conf"
    inc.write_text("\n".join(lines) + "\n")
    inc.chmod(0o600)
    return start_valkey(workdir, port=free_port(), settings={"include": str(inc)}, password=password)


@pytest.mark.parametrize("target", ["systemd", "k8s"])
def test_a_rendered_password_with_spaces_and_quotes_is_read_exactly(tmp_path, target):
    out = tmp_path / "out"
    res = invoke("up", "--target", target, "--ranks", "1", "--maxmemory", "64mb", "--password-file", _pw(tmp_path, ODD_PASSWORD + "\n"), "--out", str(out))
    assert res.exit_code == 0, res.output
    if target == "systemd":
        text = (out / "valkey-kv-0.conf").read_text()
        engine_pw = (out / "engine.password").read_text().strip()
    else:
        secret = yaml.safe_load((out / "secret.yaml").read_text())["stringData"]
        text, engine_pw = secret["auth.conf"], secret["engine-password"]
        assert secret["password"] == ODD_PASSWORD
    lines = [ln for ln in text.splitlines() if ln.split(" ", 1)[0] in ("requirepass", "user")]
    assert len(lines) == 2, text
    proc = _start_with(lines, tmp_path / "run", ODD_PASSWORD)
    try:
        with redis.Redis(port=proc.port, password=ODD_PASSWORD) as admin:
            assert admin.ping()
        with redis.Redis(port=proc.port, username="kvctl-engine", password=engine_pw) as r:
            assert r.set("k", b"v") and r.get("k") == b"v"
    finally:
        proc.stop()
