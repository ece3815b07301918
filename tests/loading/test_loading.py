"""`kvctl loading show|sync|async`: line-preserving flips, backups, the ρ safety check."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest
import yaml

from kvctl.diagnose.capture import save_last_diagnosis
from kvctl.loading import edit as loading
from kvctl.loading import restart as loading_restart
from tests.loading.helpers import CONFIG, backups, run  # noqa: F401 - shared with the other loading tests


@pytest.fixture(autouse=True)
def _no_lmcache_env(monkeypatch):
    monkeypatch.delenv("LMCACHE_CONFIG_FILE", raising=False)
    monkeypatch.delenv(loading.ENV_VAR, raising=False)


@pytest.fixture
def config(tmp_path) -> Path:
    p = tmp_path / "lmcache.yaml"
    p.write_text(CONFIG)
    p.chmod(0o640)
    return p


def test_async_flips_one_line_and_keeps_everything_else(config):
    res = run(["loading", "async", "--config", str(config)])
    new = config.read_text()
    old_lines, new_lines = CONFIG.splitlines(), new.splitlines()
    changed = [(a, b) for a, b in zip(old_lines, new_lines) if a != b]
    assert len(old_lines) == len(new_lines)
    assert changed == [("enable_async_loading: false  # flipped by kvctl loading", "enable_async_loading: true  # flipped by kvctl loading")]
    assert yaml.safe_load(new)["enable_async_loading"] is True
    assert "-enable_async_loading: false" in res.stdout and "+enable_async_loading: true" in res.stdout  # the diff
    assert "LMCACHE_ENABLE_ASYNC_LOADING=True" in res.stdout
    (bak,) = backups(config)
    assert bak.read_text() == CONFIG
    assert stat.S_IMODE(config.stat().st_mode) == 0o640
    assert not [p for p in config.parent.iterdir() if "kvctl-tmp" in p.name]


def test_already_in_mode_writes_nothing(config):
    run(["loading", "async", "--config", str(config)])
    mtime = config.stat().st_mtime_ns
    res = run(["loading", "async", "--config", str(config), "--restart-cmd", "false"])
    assert "nothing to change" in res.stdout and "not run" in res.stdout
    assert config.stat().st_mtime_ns == mtime and len(backups(config)) == 1


def test_missing_key_is_appended(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("chunk_size: 256\n# end")
    run(["loading", "async", "--config", str(p)])
    assert p.read_text() == "chunk_size: 256\n# end\nenable_async_loading: true\n"


def test_show_json_and_table(config, tmp_path):
    env = tmp_path / "engine.env"
    env.write_text("VLLM_PORT=8000\nexport LMCACHE_ENABLE_ASYNC_LOADING=\"True\"\n")
    d = json.loads(run(["loading", "show", "--config", str(config), "--env-file", str(env), "--json"]).stdout)
    assert [(s["kind"], s["async_loading"], s["line"]) for s in d["sources"]] == [("yaml", False, 9), ("env", True, 2)]
    out = run(["loading", "show", "--config", str(config), "--env-file", str(env)]).output
    assert "synchronous" in out and "asynchronous" in out and "disagree" in out


def test_env_file_form(tmp_path):
    env = tmp_path / "engine.env"
    env.write_text("# engine env\nexport LMCACHE_ENABLE_ASYNC_LOADING='True'  # set by ops\nLMCACHE_CHUNK_SIZE=256\n")
    run(["loading", "sync", "--env-file", str(env), "--force"])
    assert env.read_text() == "# engine env\nexport LMCACHE_ENABLE_ASYNC_LOADING='False'  # set by ops\nLMCACHE_CHUNK_SIZE=256\n"
    assert loading.env_state(env).async_loading is False


def test_sync_refused_when_last_diagnosis_rho_high(config):
    run(["loading", "async", "--config", str(config)])
    flipped = config.read_text()
    # of this config's tier (remote_url resp://valkey-{rank}:6379, one rank): issue 48, a diagnosis is its tier's
    save_last_diagnosis({"rho": 0.93, "saved_at": "2026-01-01T00:00:00+00:00", "instances": [{"url": "resp://valkey-0:6379"}]})
    res = run(["loading", "sync", "--config", str(config)], 1)
    assert "refusing" in res.stderr and "0.93" in res.stderr and "--force" in res.stderr
    assert config.read_text() == flipped  # untouched
    run(["loading", "sync", "--config", str(config), "--force"])
    assert yaml.safe_load(config.read_text())["enable_async_loading"] is False


@pytest.mark.parametrize("rho, code", [(0.7, 1), (0.69, 0)])
def test_sync_threshold_from_diagnosis_file(config, tmp_path, rho, code):
    run(["loading", "async", "--config", str(config)])
    diag = tmp_path / "diag.json"
    fresh = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(time.time() - 60))
    diag.write_text(json.dumps({"rho": rho, "rho_bound": "estimate", "created_at": fresh, "findings": []}))
    run(["loading", "sync", "--config", str(config), "--diagnosis", str(diag)], code)


def test_sync_without_diagnosis_is_refused_unless_forced(config):
    run(["loading", "async", "--config", str(config)])
    res = run(["loading", "sync", "--config", str(config)], 1)
    assert "no diagnosis found" in res.stderr and "--force" in res.stderr
    res = run(["loading", "sync", "--config", str(config), "--force"])
    assert "no diagnosis found" in res.stderr


def test_malformed_yaml_refused_with_line_and_untouched(tmp_path):
    p = tmp_path / "bad.yaml"
    text = "chunk_size: 256\nlocal_cpu: true\n  remote_url: resp://x\nenable_async_loading: false\n"
    p.write_text(text)
    res = run(["loading", "async", "--config", str(p)], 2)
    assert "malformed YAML at line 3" in res.output
    assert p.read_text() == text and not backups(p)


def test_malformed_line_number_exact(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("a: 1\nb: 2\n  c: 3\n")
    with pytest.raises(Exception, match="line 3"):
        loading.yaml_state(p)


def test_restart_cmd_runs_and_reports(config, tmp_path):
    marker = tmp_path / "restarted"
    res = run(["loading", "async", "--config", str(config), "--restart-cmd", f"echo restarting; touch {marker}", "--json"])
    d = json.loads(res.stdout)
    assert marker.exists()
    assert d["restart"]["ok"] is True and d["restart"]["returncode"] == 0 and "restarting" in d["restart"]["output_tail"]
    assert d["changes"][0]["backup"] and d["env_var"] == "LMCACHE_ENABLE_ASYNC_LOADING=True"


def test_failed_restart_is_an_error_after_the_write(config):
    res = run(["loading", "async", "--config", str(config), "--restart-cmd", "echo nope >&2; exit 7"], 1)
    assert "exit 7" in res.output
    assert yaml.safe_load(config.read_text())["enable_async_loading"] is True


def test_dry_run_writes_nothing(config):
    res = run(["loading", "async", "--config", str(config), "--dry-run"])
    assert "+enable_async_loading: true" in res.stdout
    assert config.read_text() == CONFIG and not backups(config)


def test_needs_a_file():
    assert "--config" in run(["loading", "show"], 2).output


def test_config_from_lmcache_env_var(config, monkeypatch):
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(config))
    run(["loading", "async"])
    assert yaml.safe_load(config.read_text())["enable_async_loading"] is True


def test_a_leftover_with_the_old_temp_name_does_not_block_the_write(tmp_path):
    """The temp name used to be fixed per PID, so this directory made the write fail ("File exists");
    a real write failure is tested in tests/loading/test_loading_files.py (RLIMIT_FSIZE)."""
    p = tmp_path / "c.yaml"
    p.write_text(CONFIG)
    (tmp_path / f".c.yaml.kvctl-tmp-{os.getpid()}").mkdir()
    loading.apply(loading.plan(p, "yaml", True), backup=False)
    assert yaml.safe_load(p.read_text())["enable_async_loading"] is True


def test_crlf_config_keeps_its_line_endings(tmp_path):
    p = tmp_path / "c.yaml"
    original = CONFIG.replace("\n", "\r\n").encode()
    p.write_bytes(original)
    run(["loading", "async", "--config", str(p)])
    new = p.read_bytes()
    assert new == original.replace(b"enable_async_loading: false", b"enable_async_loading: true")
    (bak,) = backups(p)
    assert bak.read_bytes() == original


def test_crlf_env_file_keeps_its_line_endings(tmp_path):
    env = tmp_path / "engine.env"
    env.write_bytes(b"VLLM_PORT=8000\r\nLMCACHE_ENABLE_ASYNC_LOADING=True\r\n")
    run(["loading", "sync", "--env-file", str(env), "--force"])
    assert env.read_bytes() == b"VLLM_PORT=8000\r\nLMCACHE_ENABLE_ASYNC_LOADING=False\r\n"


def test_non_utf8_config_is_a_usage_error_and_untouched(tmp_path):
    p = tmp_path / "c.yaml"
    original = b"chunk_size: 256\n# caf\xe9 (latin-1)\nenable_async_loading: false\n"
    p.write_bytes(original)
    res = run(["loading", "async", "--config", str(p)], 2)
    assert "not UTF-8" in res.output
    assert p.read_bytes() == original and not backups(p)


def test_missing_key_appended_to_crlf_file_ends_in_crlf(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_bytes(b"chunk_size: 256\r\n# end")
    run(["loading", "async", "--config", str(p)])
    assert p.read_bytes() == b"chunk_size: 256\r\n# end\r\nenable_async_loading: true\r\n"


def test_restart_timeout_stops_what_the_command_started(tmp_path):
    pidfile = tmp_path / "child.pid"
    res = loading_restart.run_restart(f"sleep 60 & echo $! > {pidfile}; wait", timeout_s=0.5)
    assert res.timed_out and not res.ok and res.returncode is None
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while Path(f"/proc/{child}").exists() and _state(child) != "Z" and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = Path(f"/proc/{child}").exists() and _state(child) != "Z"
    if alive:  # the test's own child: do not leave it behind
        os.kill(child, 9)
    assert not alive, "the restart command's child outlived the timeout"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"


LMCACHE_PY = Path(__file__).resolve().parents[2] / ".venv-lmcache" / "bin" / "python"


@pytest.mark.parametrize("word, lmcache_reads", [("yes", False), ("on", False), ("1", True), ("True", True), ("off", False)])
def test_env_words_read_as_lmcache_reads_them(tmp_path, word, lmcache_reads):
    """LMCache's env converter (_to_bool) takes only "true" and "1" as true: LMCACHE_ENABLE_ASYNC_LOADING=yes loads
    synchronously. kvctl must say so (and `loading async` must then change the file), not report async."""
    env = tmp_path / "engine.env"
    env.write_text(f"LMCACHE_ENABLE_ASYNC_LOADING={word}\n")
    assert loading.env_state(env).async_loading is lmcache_reads
    if not lmcache_reads:
        run(["loading", "async", "--env-file", str(env)])
        assert env.read_text() == "LMCACHE_ENABLE_ASYNC_LOADING=True\n"


@pytest.mark.skipif(not LMCACHE_PY.exists(), reason="LMCache venv absent (make lmcache-venv)")
def test_the_words_match_the_real_lmcache(tmp_path):
    """The real LMCache 0.5.6 reads each word of the test above as that test expects, from the env and from a quoted YAML value."""
    import subprocess  # noqa: PLC0415

    words = ["yes", "on", "1", "True", "off"]
    (tmp_path / "w.json").write_text(json.dumps(words))
    script = (
        "import json, os, sys; from lmcache.v1.config import LMCacheEngineConfig as C\n"
        "out = []\n"
        "for w in json.load(open(sys.argv[1])):\n"
        "    os.environ['LMCACHE_ENABLE_ASYNC_LOADING'] = w; env = C.from_env().enable_async_loading\n"
        "    open(sys.argv[2], 'w').write(f'enable_async_loading: \"{w}\"\\n'); out.append([env, C.from_file(sys.argv[2]).enable_async_loading])\n"
        "print(json.dumps(out))\n"
    )
    res = subprocess.run([str(LMCACHE_PY), "-c", script, str(tmp_path / "w.json"), str(tmp_path / "c.yaml")], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got == [[False, False], [False, False], [True, True], [True, True], [False, False]]
    for w, (from_env, _) in zip(words, got):
        (tmp_path / "e.env").write_text(f"LMCACHE_ENABLE_ASYNC_LOADING={w}\n")
        (tmp_path / "q.yaml").write_text(f'enable_async_loading: "{w}"\n')
        assert loading.env_state(tmp_path / "e.env").async_loading is from_env
        assert loading.yaml_state(tmp_path / "q.yaml").async_loading is from_env


def test_the_flip_workflow_is_a_library_call(config, tmp_path):
    """kvctl.loading.flip.flip: check → plan → apply → restart, with no click; the command only renders its result."""
    from kvctl.loading import flip as loading_flip  # noqa: PLC0415

    dry = loading_flip.flip(True, [(str(config), "yaml")], dry_run=True, restart_cmd="exit 3")
    assert dry.mode == "async" and dry.changes[0].changed and dry.restart is None
    assert config.read_text() == CONFIG  # a dry run writes nothing and restarts nothing

    done = loading_flip.flip(True, [(str(config), "yaml")], restart_cmd="exit 3", backup=False)
    assert yaml.safe_load(config.read_text())["enable_async_loading"] is True and not backups(config)
    assert done.restart is not None and done.restart.returncode == 3 and not done.restart.ok
    with pytest.raises(loading.KvctlError, match="restart command failed \\(exit 3\\)"):
        done.raise_if_restart_failed()

    with pytest.raises(loading.Refused, match="no diagnosis found"):  # back to sync: refused without a diagnosis
        loading_flip.flip(False, [(str(config), "yaml")], diagnosis_default=tmp_path / "none.json")
    assert yaml.safe_load(config.read_text())["enable_async_loading"] is True
