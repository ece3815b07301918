"""`kvctl loading` against odd files and hostile runs: symlinks, other owners, read-only modes,
non-env files, bad numbers, SIGKILLed runs and their temp files (issue 13, "kvctl loading").

Everything here is real: files, symlinks, ownership set with os.chown to another uid (the
tests run as root; they skip otherwise), modes, and kvctl subprocesses killed with SIGKILL.
"""

from __future__ import annotations

import fcntl
import json
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from click.testing import CliRunner

from kvctl.loading import edit as loading
from kvctl.cli import cli
from tests.loading.helpers import CONFIG, backups, run

ROOT = Path(__file__).resolve().parents[2]
OTHER_UID, OTHER_GID = 12345, 23456  # no such user needs to exist: ownership is numbers
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="changing a file's owner needs root")

VLLM_UNIT = (
    "[Service]\n"
    "ExecStart=/opt/vllm/bin/vllm serve /models/m --kv-transfer-config "
    '\'{"kv_connector": "KvctlConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"urls": ["resp://h:1"], "async_loading": false}}\'\n'
)


@pytest.fixture(autouse=True)
def _no_lmcache_env(monkeypatch):
    monkeypatch.delenv("LMCACHE_CONFIG_FILE", raising=False)
    monkeypatch.delenv(loading.ENV_VAR, raising=False)


def temps(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if ".kvctl-tmp-" in p.name)


def kvctl_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_", "KVCTL_RAISE"))}
    env.update(KVCTL_HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT), COLUMNS="200")
    return env


# a kvctl run that stops at the moment it would rename its temp file over the config and waits there to be
# SIGKILLed: the temp file is written and fsynced, exactly what a kill at the worst moment leaves
STOP_BEFORE_REPLACE = textwrap.dedent(
    """
    import os, sys, time
    def stop(*args, **kwargs):
        print("about to replace", flush=True)
        time.sleep(60)
    os.replace = stop
    from kvctl.cli import cli
    cli(sys.argv[1:], prog_name="kvctl")
    """
)


def killed_before_replace(args, tmp_path, prefix=()) -> None:
    """Run kvctl (under ``prefix``), SIGKILL it when it is about to replace the file, wait until it is gone."""
    proc = subprocess.Popen([*prefix, sys.executable, "-c", STOP_BEFORE_REPLACE, *args], env=kvctl_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "about to replace", (line, proc.stderr.read() if proc.poll() is not None else "")
        victims = [proc.pid]
        if prefix:  # unshare's child, PID 1 of its namespace, dies with it (--kill-child)
            victims += [int(c) for c in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
        proc.kill()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        proc.stdout.close()
        proc.stderr.close()
    deadline = time.monotonic() + 10
    while any(_alive(v) for v in victims) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(v) for v in victims)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def kvctl_proc(args, tmp_path, prefix=(), script=None, **kw) -> subprocess.CompletedProcess:
    code = script if script is not None else "from kvctl.cli import cli; import sys; cli(sys.argv[1:], prog_name='kvctl')"
    return subprocess.run([*prefix, sys.executable, "-c", code, *args], env=kvctl_env(tmp_path), capture_output=True, text=True, timeout=60, **kw)


# ----------------------------------------------------------------------------- symlinks, owner, mode


def test_symlinked_config_edits_the_target_and_keeps_the_link(tmp_path):
    real_dir = tmp_path / "etc-lmcache"
    real_dir.mkdir()
    target = real_dir / "lmcache.yaml"
    target.write_text(CONFIG)
    target.chmod(0o640)
    link = tmp_path / "current.yaml"
    link.symlink_to(target)
    out = run(["loading", "async", "--config", str(link)]).output
    assert f"{target}: now asynchronous (via the symlink {link})" in " ".join(out.split())
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert yaml.safe_load(target.read_text())["enable_async_loading"] is True
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    (bak,) = backups(target)  # the backup sits next to the file that changed
    assert bak.read_text() == CONFIG
    assert not temps(real_dir) and not temps(tmp_path)


def test_a_relative_path_to_a_plain_file_is_no_symlink(tmp_path, monkeypatch):
    """Issue 22: any relative --config path was reported as reached "via the symlink"."""
    (tmp_path / "lmcache.yaml").write_text(CONFIG)
    monkeypatch.chdir(tmp_path)
    out = " ".join(run(["loading", "async", "--config", "lmcache.yaml"]).output.split())
    assert "symlink" not in out and f"{tmp_path / 'lmcache.yaml'}: now asynchronous (backup" in out


def test_chain_of_symlinks_to_a_vllm_unit(tmp_path):
    target = tmp_path / "units" / "vllm.service"
    target.parent.mkdir()
    target.write_text(VLLM_UNIT)
    (tmp_path / "a.service").symlink_to("units/vllm.service")  # relative link
    (tmp_path / "b.service").symlink_to(tmp_path / "a.service")
    run(["loading", "async", "--vllm", str(tmp_path / "b.service")])
    assert (tmp_path / "b.service").is_symlink() and (tmp_path / "a.service").is_symlink()
    assert target.read_text() == VLLM_UNIT.replace('"async_loading": false', '"async_loading": true')


@as_root
@pytest.mark.parametrize("kind", ["yaml", "env", "vllm"])
def test_owner_group_and_mode_are_kept(tmp_path, kind):
    name, text, option = {
        "yaml": ("lmcache.yaml", CONFIG, "--config"),
        "env": ("engine.env", "VLLM_PORT=8000\nLMCACHE_ENABLE_ASYNC_LOADING=False\n", "--env-file"),
        "vllm": ("vllm.service", VLLM_UNIT, "--vllm"),
    }[kind]
    p = tmp_path / name
    p.write_text(text)
    os.chown(p, OTHER_UID, OTHER_GID)
    p.chmod(0o600)  # the engine's user, and only it, can read it
    run(["loading", "async", option, str(p)])
    st = p.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (OTHER_UID, OTHER_GID, 0o600)
    assert p.read_text() != text
    (bak,) = backups(p)  # the backup is as private as the file
    bst = bak.stat()
    assert (bst.st_uid, bst.st_gid, stat.S_IMODE(bst.st_mode)) == (OTHER_UID, OTHER_GID, 0o600)


@as_root
def test_owner_kept_through_a_symlink(tmp_path):
    target = tmp_path / "real.yaml"
    target.write_text(CONFIG)
    os.chown(target, OTHER_UID, OTHER_GID)
    target.chmod(0o640)
    link = tmp_path / "link.yaml"
    link.symlink_to(target)
    os.lchown(link, 0, 0)
    run(["loading", "async", "--config", str(link)])
    st = target.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (OTHER_UID, OTHER_GID, 0o640) and link.is_symlink()


@as_root
def test_a_user_who_cannot_keep_the_owner_is_refused():
    """kvctl run as an ordinary user (a forked process that really drops to another uid) on a
    group-writable file owned by someone else: os.replace would hand the file to the runner, so
    the write is refused and nothing changes."""
    base = Path(tempfile.mkdtemp(prefix="kvctl-owner-"))  # not under pytest's 0700 tmp dir
    try:
        base.chmod(0o755)
        d = base / "cfg"
        d.mkdir()
        d.chmod(0o777)
        p = d / "lmcache.yaml"
        p.write_text(CONFIG)
        os.chown(p, OTHER_UID, OTHER_GID)
        p.chmod(0o664)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: become uid OTHER_UID + 1 in group OTHER_GID, run kvctl in-process
            try:
                os.close(read)
                os.setgroups([])
                os.setgid(OTHER_GID)
                os.setuid(OTHER_UID + 1)
                os.environ["KVCTL_HOME"] = str(d)
                res = CliRunner().invoke(cli, ["loading", "async", "--config", str(p)])
                os.write(write, json.dumps([res.exit_code, res.output]).encode())
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read) as f:
            code, output = json.loads(f.read() or '[null, "child wrote nothing"]')
        os.waitpid(pid, 0)
        assert code == 1, output
        assert "owned by" in output and f"uid {OTHER_UID}" in output and "no file was changed" in output
        assert p.read_text() == CONFIG and p.stat().st_uid == OTHER_UID
        assert not temps(d) and not backups(p)
    finally:
        shutil.rmtree(base)


# ----------------------------------------------------------------------------- read-only


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_read_only_file_refused_without_force_is_untouched(tmp_path, mode):
    p = tmp_path / "lmcache.yaml"
    p.write_text(CONFIG.replace("false  #", "true  #") if mode == "sync" else CONFIG)
    p.chmod(0o444)
    before = p.read_bytes()
    diag = tmp_path / "diag.json"  # a fresh diagnosis with a low ρ: only the file's mode stands in the way
    diag.write_text(json.dumps({"rho": 0.1, "rho_bound": "estimate", "created_at": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())}))
    res = run(["loading", mode, "--config", str(p)] + (["--diagnosis", str(diag)] if mode == "sync" else []), 1)
    assert "read-only" in res.stderr and "0444" in res.stderr and "--force" in res.stderr
    assert p.read_bytes() == before and not backups(p) and not temps(tmp_path)


def test_read_only_file_written_with_force_keeps_its_mode(tmp_path):
    p = tmp_path / "lmcache.yaml"
    p.write_text(CONFIG)
    p.chmod(0o444)
    run(["loading", "async", "--force", "--config", str(p)])
    assert yaml.safe_load(p.read_text())["enable_async_loading"] is True
    assert stat.S_IMODE(p.stat().st_mode) == 0o444


def test_read_only_second_file_means_nothing_is_written(tmp_path):
    """Never half-apply: the writable first file stays as it was when the second is refused."""
    cfg = tmp_path / "lmcache.yaml"
    cfg.write_text(CONFIG)
    env = tmp_path / "engine.env"
    env.write_text("LMCACHE_ENABLE_ASYNC_LOADING=False\n")
    env.chmod(0o400)
    run(["loading", "async", "--config", str(cfg), "--env-file", str(env)], 1)
    assert cfg.read_text() == CONFIG and not backups(cfg) and not temps(tmp_path)


def test_dry_run_of_a_read_only_file_is_allowed(tmp_path):
    p = tmp_path / "lmcache.yaml"
    p.write_text(CONFIG)
    p.chmod(0o444)
    assert "+enable_async_loading: true" in run(["loading", "async", "--dry-run", "--config", str(p)]).stdout


def test_a_failed_write_of_the_second_file_leaves_the_first_unchanged(tmp_path):
    """A real write failure (RLIMIT_FSIZE: the second, larger file cannot be written) after the first
    file was staged: neither file changes, no temp file is left."""
    small = tmp_path / "small.env"
    small.write_text("LMCACHE_ENABLE_ASYNC_LOADING=False\n")
    big = tmp_path / "big.yaml"
    big.write_text("# padding\n" * 100 + CONFIG)  # > 1000 bytes

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (600, 600))

    res = kvctl_proc(["loading", "async", "--no-backup", "--env-file", str(small), "--config", str(big)], tmp_path, preexec_fn=limit)
    assert res.returncode == 1, res
    assert "cannot write" in res.stderr and "no file was changed" in res.stderr
    assert small.read_text() == "LMCACHE_ENABLE_ASYNC_LOADING=False\n"
    assert big.read_text() == "# padding\n" * 100 + CONFIG
    assert not temps(tmp_path)


# ----------------------------------------------------------------------------- --env-file must be an env file


@pytest.mark.parametrize(
    "text, line",
    [
        (CONFIG, 2),  # line 1 is a comment
        ("LMCACHE_ENABLE_ASYNC_LOADING: true\n", 1),  # YAML, with the env var's name
        ("VLLM_PORT=8000\n[Service]\n", 2),
    ],
)
def test_env_file_that_is_not_an_env_file_is_refused(tmp_path, text, line):
    p = tmp_path / "engine.env"
    p.write_text(text)
    for cmd in (["show"], ["async"]):
        res = run(["loading", *cmd, "--env-file", str(p)], 2)
        assert "not an env file" in res.output and f"line {line}" in res.output
    assert p.read_text() == text and not backups(p)


def test_env_file_forms_that_are_accepted(tmp_path):
    p = tmp_path / "engine.env"
    text = "# engine\n\nexport A=1\nB = 2\nC='x y'\nD=\"long \\\n  continued\"\nE\n"
    p.write_text(text)
    run(["loading", "async", "--env-file", str(p)])
    assert p.read_text() == text + "LMCACHE_ENABLE_ASYNC_LOADING=True\n"


# ----------------------------------------------------------------------------- numbers checked before anything is touched


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "0", "1e9", "NaN"])
def test_bad_restart_timeout_is_refused_before_any_write(tmp_path, value):
    p = tmp_path / "lmcache.yaml"
    p.write_text(CONFIG)
    marker = tmp_path / "restarted"
    res = run(["loading", "async", "--config", str(p), "--restart-cmd", f"touch {marker}", "--restart-timeout", value], 2)
    assert "--restart-timeout" in res.output
    assert p.read_text() == CONFIG and not backups(p) and not marker.exists()


@pytest.mark.parametrize("value", ["nan", "inf", "1e400", "-1h", "0", "400d", ""])
def test_bad_max_age_is_refused_before_any_write(tmp_path, value):
    p = tmp_path / "lmcache.yaml"
    p.write_text(CONFIG.replace("false  #", "true  #"))
    before = p.read_text()
    res = run(["loading", "sync", "--force", "--config", str(p), "--max-age", value], 2)
    assert "--max-age" in res.output
    assert p.read_text() == before and not backups(p)


def test_empty_restart_cmd_is_a_usage_error(tmp_path):
    p = tmp_path / "lmcache.yaml"
    p.write_text(CONFIG)
    res = run(["loading", "async", "--config", str(p), "--restart-cmd", "  "], 2)
    assert "--restart-cmd" in res.output and p.read_text() == CONFIG


def test_restart_timeout_is_honoured(tmp_path):
    p = tmp_path / "lmcache.yaml"
    p.write_text(CONFIG)
    t0 = time.monotonic()
    res = run(["loading", "async", "--json", "--config", str(p), "--restart-cmd", "sleep 30", "--restart-timeout", "0.5"], 1)
    assert time.monotonic() - t0 < 20
    assert json.loads(res.stdout)["restart"]["timed_out"] is True


# ----------------------------------------------------------------------------- temp files of killed runs


def test_sigkilled_run_leaves_a_temp_that_the_next_run_removes(tmp_path):
    p = tmp_path / "lmcache.yaml"
    p.write_text(CONFIG)
    killed_before_replace(["loading", "async", "--no-backup", "--config", str(p)], tmp_path)
    (left,) = temps(tmp_path)  # the killed run's fully written temp file
    assert yaml.safe_load(left.read_text())["enable_async_loading"] is True
    assert p.read_text() == CONFIG  # the config itself is untouched
    run(["loading", "async", "--config", str(p)])
    assert yaml.safe_load(p.read_text())["enable_async_loading"] is True
    assert not temps(tmp_path)


def test_many_killed_runs_never_break_a_later_one(tmp_path):
    """Every run killed at the worst moment; the leftovers never accumulate past one and never fail a run."""
    p = tmp_path / "lmcache.yaml"
    p.write_text(CONFIG)
    for _ in range(3):
        killed_before_replace(["loading", "async", "--no-backup", "--config", str(p)], tmp_path)
        assert len(temps(tmp_path)) == 1  # the previous run's leftover was removed, this run's remains
        assert p.read_text() == CONFIG
    res = kvctl_proc(["loading", "async", "--no-backup", "--config", str(p)], tmp_path)
    assert res.returncode == 0, res
    assert not temps(tmp_path) and yaml.safe_load(p.read_text())["enable_async_loading"] is True


@pytest.mark.skipif(subprocess.run(["unshare", "-pf", "true"], capture_output=True).returncode != 0, reason="needs unshare -p (a PID namespace)")
def test_kvctl_as_pid_1_after_a_killed_pid_1_run(tmp_path):
    """In a container kvctl is PID 1 on every run: the old ``.NAME.kvctl-tmp-1`` made every later run fail with
    "File exists". Here kvctl really is PID 1 of a new PID namespace, killed once, then run again."""
    p = tmp_path / "lmcache.yaml"
    p.write_text(CONFIG)
    old_style = tmp_path / ".lmcache.yaml.kvctl-tmp-1"  # left by a killed run of an older kvctl
    old_style.write_text("half a config")
    pid1 = ["unshare", "-pf", "--kill-child"]
    probe = kvctl_proc([], tmp_path, prefix=pid1, script="import os; print(os.getpid())")
    assert probe.stdout.strip() == "1", probe
    killed_before_replace(["loading", "async", "--no-backup", "--config", str(p)], tmp_path, prefix=pid1)
    assert p.read_text() == CONFIG and len(temps(tmp_path)) == 1 and not old_style.exists()
    res = kvctl_proc(["loading", "async", "--no-backup", "--config", str(p)], tmp_path, prefix=pid1)
    assert res.returncode == 0, res
    assert yaml.safe_load(p.read_text())["enable_async_loading"] is True and not temps(tmp_path)


def test_a_temp_file_of_a_live_run_is_left_alone(tmp_path):
    """A temp file whose writer still holds its lock belongs to a kvctl run in progress: not removed."""
    p = tmp_path / "lmcache.yaml"
    p.write_text(CONFIG)
    busy = tmp_path / ".lmcache.yaml.kvctl-tmp-999-abcdef"
    busy.write_text("being written")
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import fcntl, sys, time; f = open({str(busy)!r}); fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(30)"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        run(["loading", "async", "--no-backup", "--config", str(p)])
        assert busy.exists() and yaml.safe_load(p.read_text())["enable_async_loading"] is True
    finally:
        holder.kill()
        holder.wait()
    run(["loading", "sync", "--force", "--no-backup", "--config", str(p)])  # the holder is dead now
    assert not busy.exists()


def test_stale_temps_of_other_files_and_non_files_are_not_touched(tmp_path):
    p = tmp_path / "lmcache.yaml"
    p.write_text(CONFIG)
    other = tmp_path / ".other.yaml.kvctl-tmp-5"
    other.write_text("another file's leftover")
    a_dir = tmp_path / ".lmcache.yaml.kvctl-tmp-7"
    a_dir.mkdir()  # not a regular file: not kvctl's, left alone, and no failure because of it
    run(["loading", "async", "--config", str(p)])
    assert other.exists() and a_dir.is_dir()
    assert yaml.safe_load(p.read_text())["enable_async_loading"] is True


def test_temp_names_are_unique_within_one_process(tmp_path):
    p = tmp_path / "lmcache.yaml"
    p.write_text(CONFIG)
    a = loading.open_temp(p)
    b = loading.open_temp(p)
    try:
        assert a.path != b.path and a.path.parent == b.path.parent == tmp_path
        with pytest.raises(BlockingIOError):  # each is locked by its writer while it exists
            with open(a.path) as f:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        a.discard()
        b.discard()
    assert not temps(tmp_path)


# ----------------------------------------------------------------------------- what a file says, and where


def test_duplicated_key_cites_the_effective_line(tmp_path):
    p = tmp_path / "lmcache.yaml"
    p.write_text("enable_async_loading: false\nchunk_size: 256\nenable_async_loading: true\n")
    d = json.loads(run(["loading", "show", "--json", "--config", str(p)]).stdout)
    (s,) = d["sources"]
    assert (s["async_loading"], s["line"]) == (True, 3)  # YAML keeps the last one, as LMCache reads it


def test_duplicated_env_var_cites_the_effective_line(tmp_path):
    p = tmp_path / "engine.env"
    p.write_text("LMCACHE_ENABLE_ASYNC_LOADING=True\nA=1\nLMCACHE_ENABLE_ASYNC_LOADING=False\n")
    (s,) = json.loads(run(["loading", "show", "--json", "--env-file", str(p)]).stdout)["sources"]
    assert (s["async_loading"], s["line"]) == (False, 3)


@pytest.mark.parametrize(
    "text, line, what",
    [
        ("chunk_size: 256\nlocal_cpu: true\nenable_async_loading: [true]\n", 3, "a list"),
        ("chunk_size: 256\nenable_async_loading:\n  - true\n", 2, "a list"),
        ("enable_async_loading: {on: true}\nchunk_size: 256\n", 1, "a mapping"),
    ],
)
def test_non_boolean_value_is_named_with_its_line(tmp_path, text, line, what):
    p = tmp_path / "lmcache.yaml"
    p.write_text(text)
    for cmd in (["show"], ["async"], ["sync", "--force"]):
        res = run(["loading", *cmd, "--config", str(p)], 2)
        assert f"line {line}" in res.output and what in res.output and "true or false" in res.output, res.output
        assert "malformed" not in res.output
    assert p.read_text() == text and not backups(p)


def test_diff_with_brackets_is_printed_verbatim(tmp_path):
    """rich markup must not eat ``[...]`` in a diff or a path."""
    d = tmp_path / "cfg[prod]"
    d.mkdir()
    p = d / "lmcache.yaml"
    p.write_text("remote_url: \"resp://[::1]:6379\"  # [bold]v6[/bold]\nenable_async_loading: false\n")
    out = run(["loading", "async", "--config", str(p)]).stdout
    assert str(p) in out and "[bold]v6[/bold]" in out


def test_read_only_vllm_file_is_refused_unless_forced(tmp_path):
    p = tmp_path / "vllm.service"
    p.write_text(VLLM_UNIT)
    p.chmod(0o440)
    res = run(["loading", "async", "--vllm", str(p)], 1)
    assert "read-only" in res.stderr and "0440" in res.stderr and p.read_text() == VLLM_UNIT
    run(["loading", "async", "--force", "--vllm", str(p)])
    assert '"async_loading": true' in p.read_text() and stat.S_IMODE(p.stat().st_mode) == 0o440


def _acl(*entries: tuple[int, int, int]) -> bytes:
    """A POSIX access ACL in the kernel's xattr format: version 2, then (tag, perm, id) entries."""
    import struct  # noqa: PLC0415

    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", tag, perm, uid) for tag, perm, uid in entries)


@as_root
def test_acl_and_xattrs_are_kept(tmp_path):
    """An ACL that lets the engine's user read the file (``setfacl -m u:12345:r``) must survive the rewrite."""
    p = tmp_path / "lmcache.yaml"
    p.write_text(CONFIG)
    p.chmod(0o640)
    none = 0xFFFFFFFF
    acl = _acl((0x01, 6, none), (0x02, 4, OTHER_UID), (0x04, 4, none), (0x10, 4, none), (0x20, 0, none))  # u::rw u:12345:r g::r m::r o::-
    try:
        os.setxattr(p, "system.posix_acl_access", acl)
        os.setxattr(p, "user.owner-team", b"inference")
    except OSError as e:
        pytest.skip(f"this filesystem has no ACLs/user xattrs: {e}")
    run(["loading", "async", "--config", str(p)])
    assert yaml.safe_load(p.read_text())["enable_async_loading"] is True
    assert os.getxattr(p, "system.posix_acl_access") == acl
    assert os.getxattr(p, "user.owner-team") == b"inference"
    assert stat.S_IMODE(p.stat().st_mode) == 0o640


def test_hard_linked_file_is_refused_unless_forced(tmp_path):
    """A rename gives this name a new inode; the file's other hard links would keep the old text."""
    p = tmp_path / "lmcache.yaml"
    p.write_text(CONFIG)
    other = tmp_path / "engine-copy.yaml"
    os.link(p, other)
    res = run(["loading", "async", "--config", str(p)], 1)
    assert "2 hard links" in res.stderr and "--force" in res.stderr
    assert p.read_text() == CONFIG and not backups(p)
    run(["loading", "async", "--force", "--config", str(p)])
    assert yaml.safe_load(p.read_text())["enable_async_loading"] is True
    assert other.read_text() == CONFIG  # what --force accepts: the other name is a separate file now


# a kvctl run that gets a real SIGTERM (or SIGINT) from itself between renaming the first and the second file
SIGNAL_AT_SECOND_REPLACE = textwrap.dedent(
    """
    import os, signal, sys
    real_replace, calls = os.replace, []
    def replace(*args, **kwargs):
        calls.append(args)
        if len(calls) == 2:
            os.kill(os.getpid(), getattr(signal, os.environ["KVCTL_TEST_SIGNAL"]))
        return real_replace(*args, **kwargs)
    os.replace = replace
    from kvctl.cli import cli
    cli(sys.argv[1:], prog_name="kvctl")
    """
)


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_during_the_renames_does_not_half_apply(tmp_path, sig):
    cfg = tmp_path / "lmcache.yaml"
    cfg.write_text(CONFIG)
    env_file = tmp_path / "engine.env"
    env_file.write_text("LMCACHE_ENABLE_ASYNC_LOADING=False\n")
    env = kvctl_env(tmp_path)
    env["KVCTL_TEST_SIGNAL"] = sig
    res = subprocess.run(
        [sys.executable, "-c", SIGNAL_AT_SECOND_REPLACE, "loading", "async", "--config", str(cfg), "--env-file", str(env_file)],
        env=env, capture_output=True, text=True, timeout=60,
    )
    assert res.returncode != 0, res  # the signal still ends the run, after the renames
    assert yaml.safe_load(cfg.read_text())["enable_async_loading"] is True
    assert env_file.read_text() == "LMCACHE_ENABLE_ASYNC_LOADING=True\n"
    assert not temps(tmp_path)
