"""Hostile runs against what kvctl writes and prints: planted links, file modes, secrets in errors
and in URLs (issue 21, "Security"). Real kvctl processes, real files, links, FIFOs and HTTP servers."""

from __future__ import annotations

import datetime as _dt
import stat
from pathlib import Path

import pytest

from tests.hostile.helpers import kvctl, limits

SECRET = "s3cr3t-PW-4c1d"
CONFIG = f"""\
chunk_size: 256
remote_url: "resp://:{SECRET}@valkey-{{rank}}:6379"
enable_async_loading: false
"""


def test_backup_never_follows_a_link_planted_at_the_guessable_name(tmp_path):
    """Item 1: dangling links at every ``lm.yaml.<stamp>.bak`` name of the next minute point outside the
    directory; the flip must not create their targets, and its backup is a new regular file."""
    shared, outside = tmp_path / "shared", tmp_path / "outside"
    shared.mkdir()
    outside.mkdir()
    cfg = shared / "lm.yaml"
    cfg.write_text(CONFIG)
    cfg.chmod(0o600)
    now = _dt.datetime.now()
    for s in range(-2, 60):
        stamp = (now + _dt.timedelta(seconds=s)).strftime("%Y%m%dT%H%M%S")
        for suffix in ("", "-1", "-2"):
            (shared / f"lm.yaml.{stamp}{suffix}.bak").symlink_to(outside / f"stolen-{s}{suffix}")
    res = kvctl(["loading", "async", "--config", str(cfg)], tmp_path / "home")
    assert res.returncode == 0, res.output
    assert list(outside.iterdir()) == [], "the backup followed a planted link out of the directory"
    baks = [p for p in shared.iterdir() if p.name.endswith(".bak") and not p.is_symlink()]
    assert len(baks) == 1 and baks[0].read_text() == CONFIG
    assert stat.S_IMODE(baks[0].lstat().st_mode) == 0o600
    assert "enable_async_loading: true" in cfg.read_text()


def test_a_backup_is_never_readable_by_others_not_even_half_written(tmp_path):
    """Item 2: the backup is created 0600. A real write failure half-way through it (RLIMIT_FSIZE one
    byte short of the old text; the new text, one byte shorter, fits) must leave nothing group- or
    world-readable behind; the run fails cleanly and the config is unchanged."""
    cfg = tmp_path / "lm.yaml"
    cfg.write_text(CONFIG)
    cfg.chmod(0o600)
    new_len = len(CONFIG.replace("false", "true").encode())
    res = kvctl(["loading", "async", "--config", str(cfg)], tmp_path / "home", preexec=limits(fsize=new_len, umask=0o022))
    assert res.returncode == 1 and "cannot back up" in res.output, res.output
    assert cfg.read_text() == CONFIG
    leaked = {p.name: oct(stat.S_IMODE(p.lstat().st_mode)) for p in tmp_path.iterdir() if p.is_file() and p.lstat().st_mode & 0o077}
    assert leaked == {}, f"readable by others: {leaked}"
    assert [p.name for p in tmp_path.iterdir() if p.is_file()] == ["lm.yaml"]  # no half backup left either


def test_env_file_errors_never_quote_the_file(tmp_path):
    """Item 4: ``--env-file`` pointed at a secret (a token file, a key) is refused without echoing it."""
    token = tmp_path / "engine.token"
    token.write_text(f"{SECRET}\n")
    for cmd in ("show", "async"):
        res = kvctl(["loading", cmd, "--env-file", str(token)], tmp_path / "home")
        assert res.returncode == 2 and "not an env file" in res.output and "line 1" in res.output, res.output
        assert SECRET not in res.output and SECRET[:8] not in res.output
    assert token.read_text() == f"{SECRET}\n"


# ----------------------------------------------------------------------------- item 3: engine URL credentials

import base64  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402

from tests.diagnose.engine_text import EngineState  # noqa: E402
from tests.exporter.helpers import ExporterProcess  # noqa: E402
from tests.hostile.helpers import HostileHTTP, kvctl_env, send_head  # noqa: E402

TOKEN, QTOKEN, KEY = "t0k3n-IN-URL-91f", "qs-T0KEN-77ab", "api-K3Y-from-file-5e"
METRICS = EngineState(requests=3, prompt_lengths=(100.0, 100.0, 100.0)).text().encode()


def guarded(expect: str):
    """A /metrics that answers only with the ``Authorization`` header ``expect`` (vLLM's --api-key behaves so)."""

    def body(server, h):
        if h.headers.get("Authorization") != expect:
            h.send_response(401)
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        send_head(h, len(METRICS))
        h.wfile.write(METRICS)

    return body


def basic(user: str, pw: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{pw}".encode()).decode()


def _no_secret(text: str, *secrets: str) -> None:
    for s in secrets:
        assert s not in text, f"{s} leaked: ...{text[max(0, text.find(s) - 80): text.find(s) + 40]}..."


def test_exporter_sends_url_credentials_as_basic_auth_and_masks_them(tmp_path):
    """The label, the --json listening line and the logs mask the password and a query token; the engine
    gets them as an Authorization header (before: "Name or service not known", and the token in the label)."""
    with HostileHTTP(guarded(basic("admin", TOKEN))) as eng:
        url = f"http://admin:{TOKEN}@127.0.0.1:{eng.port}/metrics?access_token={QTOKEN}"
        with ExporterProcess(["-v", "--engine-url", url, "--interval", "0.2", "--window", "0.4"], env=kvctl_env(tmp_path / "home")) as ex:
            body, deadline = "", time.monotonic() + 10
            while "kvctl_engine_up{" not in body and time.monotonic() < deadline:
                time.sleep(0.2)
                with urllib.request.urlopen(ex.start["metrics_url"], timeout=5) as r:
                    body = r.read().decode()
    start, out, err = ex.start, ex.out, ex.err
    up = [ln for ln in body.splitlines() if ln.startswith("kvctl_engine_up{")]
    assert len(up) == 1 and up[0].endswith(" 1.0"), up  # the credentials worked
    for text in (json.dumps(start), body, out, err):
        _no_secret(text, TOKEN, QTOKEN)
    assert "admin:***@" in up[0] and "access_token=***" in up[0]
    paths_and_hosts = " ".join(p + h.get("host", "") for p, h in eng.seen)
    _no_secret(paths_and_hosts, TOKEN)  # never in the request line or Host header


def test_diagnose_takes_a_bearer_key_from_a_file_or_env_and_saves_0600(tmp_path):
    """--engine-api-key-file (vLLM's --api-key) and $KVCTL_ENGINE_API_KEY become ``Authorization: Bearer``;
    last-diagnosis.json is 0600 and holds neither the key nor a URL password."""
    keyfile = tmp_path / "engine.key"
    keyfile.write_text(KEY + "\n")
    keyfile.chmod(0o600)
    home = tmp_path / "home"
    with HostileHTTP(guarded(f"Bearer {KEY}")) as eng:
        for extra, env in ((["--engine-api-key-file", str(keyfile)], {}), ([], {"KVCTL_ENGINE_API_KEY": KEY})):
            res = subprocess.run([sys.executable, "-m", "kvctl.cli", "diagnose", "--engine-url", eng.url, *extra, "--window", "0.3", "--json"],
                                 env=kvctl_env(home, **env), capture_output=True, text=True, timeout=60)
            d = json.loads(res.stdout)
            assert [e["status"] for e in d["engines"]] == ["ok"], (extra, env, d["engines"])
            _no_secret(res.stdout + res.stderr, KEY)
        url = f"http://admin:{TOKEN}@127.0.0.1:{eng.port}/?token={QTOKEN}"
        res = subprocess.run([sys.executable, "-m", "kvctl.cli", "diagnose", "--engine-url", url, "--window", "0.3", "--json"],
                             env=kvctl_env(home), capture_output=True, text=True, timeout=60)
    _no_secret(res.stdout + res.stderr, TOKEN, QTOKEN)
    saved = home / "last-diagnosis.json"
    assert stat.S_IMODE(saved.stat().st_mode) == 0o600
    _no_secret(saved.read_text(), TOKEN, QTOKEN, KEY)


def test_replay_run_file_masks_the_engine_url_and_is_0600(tmp_path):
    """Replay's run file (metadata: engine_url, options.url) keeps no credentials and is private."""
    from tests.replay.conftest import start_standin

    server = start_standin()
    try:
        trace = tmp_path / "t.jsonl"
        trace.write_text(json.dumps({"offset_s": 0, "prompt": "hello there"}) + "\n")
        out = tmp_path / "run.jsonl"
        url = f"http://admin:{TOKEN}@127.0.0.1:{server.port}"
        res = subprocess.run([sys.executable, "-m", "kvctl.cli", "replay", str(trace), "--engine-url", url, "--out", str(out), "--json"],
                             env=kvctl_env(tmp_path / "home"), capture_output=True, text=True, timeout=60)
    finally:
        server.stop()
    assert res.returncode == 0, res.stderr
    text = out.read_text()
    _no_secret(text + res.stdout + res.stderr, TOKEN)
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    md = json.loads(text.splitlines()[0])["metadata"]
    assert md["engine_url"] == f"http://127.0.0.1:{server.port}" and md["options"]["url"] == f"http://admin:***@127.0.0.1:{server.port}"


# ----------------------------------------------------------------------------- item 5: YAML injection


import yaml  # noqa: E402


def _tier_state(d: Path) -> None:
    d.mkdir()
    inst = {"rank": 0, "host": "127.0.0.1", "port": 17400, "pid": 1, "url": "resp://127.0.0.1:17400", "config": "", "logfile": "", "pidfile": ""}
    (d / "kvctl-tier.json").write_text(json.dumps({"dir": str(d), "instances": [inst]}))


@pytest.mark.parametrize("where", ["dir", "name"])
def test_a_newline_in_a_name_cannot_add_a_yaml_line(tmp_path, where):
    """Item 5: a tier directory (or --name) with a newline and a YAML line after it: refused (exit 2), and
    never a config whose parsed mapping holds the injected key."""
    evil = "x\nevil_key: [injected]"
    if where == "dir":
        d = tmp_path / evil
        _tier_state(d)
        args = ["deploy-valkey", "lmcache-config", "--dir", str(d)]
    else:
        args = ["deploy-valkey", "lmcache-config", "--target", "k8s", "--ranks", "2", "--name", evil]
    res = kvctl(args, tmp_path / "home")
    if res.returncode == 0:
        assert "evil_key" not in (yaml.safe_load(res.stdout) or {}), res.stdout
    assert res.returncode == 2 and "control character" in res.output, (res.returncode, res.output)


def test_lmcache_yaml_comments_escape_control_characters():
    """The renderer itself: whatever a title or note holds, the YAML parses to exactly the mapping given."""
    from kvctl.tier.lmcache_config import render_lmcache_yaml

    cfg = {"chunk_size": 256, "remote_url": "resp://h:1\nevil: 1", "extra_config": {"k": "a\r\nb: 2"}}
    text = render_lmcache_yaml(cfg, "tier in /tmp/x\nevil_key: 1\r\n", ["note\u2028other: 3"])
    assert yaml.safe_load(text) == cfg
