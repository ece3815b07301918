"""`kvctl bench` logs in as the URL's ACL user, with the --password-file password before the URL's (issue 22).

Real valkey-servers with a default-user password and a second ACL user; the bench either authenticates
and measures, or exits 1 with the login message.
"""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvctl.cli import cli

SMALL = ["--chunk-bytes", "1e6", "--batch", "2", "--keys", "4", "--duration", "0.5", "--json"]


def _pw_file(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text + "\n")
    p.chmod(0o600)
    return str(p)


def test_bench_logs_in_as_the_urls_acl_user(valkey_factory, tmp_path):
    """Before: resp://engine@h + the engine's password file became resp://:pw@h, the default user: WRONGPASS."""
    srv = valkey_factory(password="admin-secret", settings={"maxmemory": "64mb", "user": [("engine", "on", ">engine-secret", "~*", "+@all")]})
    pw = _pw_file(tmp_path, "engine.pw", "engine-secret")
    result = CliRunner().invoke(cli, ["bench", "--valkey", f"resp://engine@127.0.0.1:{srv.port}", "--password-file", pw, *SMALL])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["runs"][0]["ops"] > 0


def test_password_file_wins_over_the_urls_password(valkey_factory, tmp_path):
    """As in every other command (tier/targets.py): before, the URL's (wrong) password was used."""
    srv = valkey_factory(password="right", settings={"maxmemory": "64mb"})
    pw = _pw_file(tmp_path, "pw", "right")
    result = CliRunner().invoke(cli, ["bench", "--valkey", f"resp://:wrong@127.0.0.1:{srv.port}", "--password-file", pw, *SMALL])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["runs"][0]["ops"] > 0
