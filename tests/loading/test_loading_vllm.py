"""`kvctl loading show|sync|async --vllm FILE`: async_loading of kvctl's vLLM connector flipped in place in a
vLLM --config YAML or an env/systemd-unit file, every result read back by vLLM's own loaders."""

from __future__ import annotations

import datetime as dt
import json
import shlex
import stat
from pathlib import Path

import pytest

from kvctl.loading import vllm as loading_vllm
from tests import vllm_loaders
from tests.loading.helpers import backups, run

pytest.importorskip("vllm")

SAMPLES = Path(__file__).resolve().parents[2] / "configs" / "vllm"

JSON_NO_ASYNC = '{"kv_connector":"KvctlConnector","kv_connector_module_path":"kvctl.plugins.vllm","kv_role":"kv_both","kv_connector_extra_config":{"urls":["resp://127.0.0.1:17400","resp://127.0.0.1:17401"],"chunk_tokens":128}}'

BLOCK_NO_ASYNC = """\
# vLLM serve config (kept by ops)
model: /models/m
kv_transfer_config:
  kv_connector: KvctlConnector
  kv_connector_module_path: kvctl.plugins.vllm
  kv_role: kv_both
  kv_connector_extra_config:
    urls:
    - resp://127.0.0.1:17400   # rank 0
    - resp://127.0.0.1:17401   # rank 1
    chunk_tokens: 256
# the port the API listens on
port: 8000
"""

FLOW_NO_ASYNC = """\
model: /models/m
kv-transfer-config: {"kv_connector": "KvctlConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"url": "resp://valkey-{rank}:6379"}}
"""

UNIT_CRLF = (
    "[Service]\r\n"
    "ExecStart=/opt/vllm/bin/python -m vllm.entrypoints.openai.api_server --model /models/m \\\r\n"
    "    --kv-transfer-config '{\"kv_connector\": \"KvctlConnector\", \"kv_role\": \"kv_both\", \"kv_connector_extra_config\": {\"urls\": [\"resp://h:1\"], \"async_loading\": true}}'\r\n"
    "Restart=on-failure\r\n"
)


@pytest.fixture(autouse=True)
def _no_lmcache_config_env(monkeypatch):
    monkeypatch.delenv("LMCACHE_CONFIG_FILE", raising=False)  # --config's default would add a source


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    with open(p, "w", newline="") as f:
        f.write(text)
    return p


def sample(tmp_path: Path, name: str) -> Path:
    return write(tmp_path, name, (SAMPLES / name).read_text())


def vllm_view(path: Path):
    """(KVTransferConfig fields without the random engine_id, the other parsed serve args) as vLLM reads the file."""
    text = path.read_text()
    if path.suffix == ".yaml":
        args = vars(vllm_loaders.parse_serve_args(["--config", str(path)]))
    else:
        line = next(ln for ln in text.splitlines() if "--kv-transfer-config" in ln)
        args = vars(vllm_loaders.parse_serve_args(shlex.split(line[line.index("--kv-transfer-config") :])))
    kv = args.pop("kv_transfer_config")
    fields = {k: v for k, v in vars(kv).items() if k != "engine_id"}
    return fields, args


def assert_only_async_changed(before: Path | str, after: Path, value: bool) -> None:
    """vLLM reads the new file exactly as the old one, except kv_connector_extra_config.async_loading == value."""
    copy = after.with_name("original" + after.suffix)  # vLLM reads --config only from .yaml files, not .bak
    copy.write_text(Path(before).read_text())
    kv_before, rest_before = vllm_view(copy)
    kv_after, rest_after = vllm_view(after)
    assert rest_after == rest_before
    assert kv_after["kv_connector_extra_config"].pop("async_loading") is value
    kv_before["kv_connector_extra_config"].pop("async_loading", None)
    assert kv_after == kv_before


def fresh_diagnosis(tmp_path: Path, rho: float) -> Path:
    p = tmp_path / "diag.json"
    p.write_text(json.dumps({"rho": rho, "saved_at": dt.datetime.now(dt.timezone.utc).isoformat(), "findings": []}))
    return p


def test_json_string_yaml_flips_one_value(tmp_path):
    p = sample(tmp_path, "vllm-config-sync.yaml")
    p.chmod(0o640)
    original = p.read_text()
    res = run(["loading", "async", "--vllm", str(p)])
    assert "vLLM --config YAML found" in res.stdout
    assert p.read_text() == original.replace('"async_loading":false', '"async_loading":true')
    (bak,) = backups(p)
    assert bak.read_text() == original
    assert stat.S_IMODE(p.stat().st_mode) == 0o640
    assert not [f for f in tmp_path.iterdir() if "kvctl-tmp" in f.name]
    assert_only_async_changed(bak, p, True)


def test_mapping_yaml_flips_one_line_keeping_comment(tmp_path):
    p = sample(tmp_path, "vllm-config-async.yaml")
    original = p.read_text()
    run(["loading", "sync", "--vllm", str(p), "--force"])
    old_lines, new_lines = original.splitlines(), p.read_text().splitlines()
    assert [(a, b) for a, b in zip(old_lines, new_lines) if a != b] == [
        ("    async_loading: true               # flipped by `kvctl loading sync|async --vllm THIS_FILE`",
         "    async_loading: false               # flipped by `kvctl loading sync|async --vllm THIS_FILE`"),
    ]  # fmt: skip
    assert len(old_lines) == len(new_lines)
    assert_only_async_changed(backups(p)[0], p, False)


def test_block_mapping_without_the_key_gets_one_line_inserted(tmp_path):
    p = write(tmp_path, "serve.yaml", BLOCK_NO_ASYNC)
    run(["loading", "async", "--vllm", str(p)])
    new_lines = p.read_text().splitlines()
    # the new member goes after the extra config's last one, at its indentation, before the comment that follows
    assert new_lines[:11] == BLOCK_NO_ASYNC.splitlines()[:11]
    assert new_lines[11] == "    async_loading: true"
    assert new_lines[12:] == BLOCK_NO_ASYNC.splitlines()[11:]
    assert_only_async_changed(backups(p)[0], p, True)


def test_flow_mapping_and_json_string_without_the_key(tmp_path):
    flow = write(tmp_path, "flow.yaml", FLOW_NO_ASYNC)
    run(["loading", "async", "--vllm", str(flow)])
    assert flow.read_text() == FLOW_NO_ASYNC.replace('"resp://valkey-{rank}:6379"}', '"resp://valkey-{rank}:6379", "async_loading": true}')
    assert_only_async_changed(backups(flow)[0], flow, True)

    text = f"model: /models/m\nkv-transfer-config: '{JSON_NO_ASYNC}'\n"
    compact = write(tmp_path, "compact.yaml", text)
    run(["loading", "sync", "--vllm", str(compact), "--force"])
    assert compact.read_text() == text.replace('"chunk_tokens":128}', '"chunk_tokens":128,"async_loading":false}')
    assert_only_async_changed(backups(compact)[0], compact, False)


def test_systemd_unit_and_env_file(tmp_path):
    unit = sample(tmp_path, "vllm-prefill.service")
    original = unit.read_text()
    run(["loading", "async", "--vllm", str(unit), "--restart-cmd", f"touch {tmp_path / 'restarted'}"])
    assert unit.read_text() == original.replace('"async_loading":false', '"async_loading":true')
    assert (tmp_path / "restarted").exists()
    assert_only_async_changed(backups(unit)[0], unit, True)

    env = sample(tmp_path, "vllm-prefill.env")
    original = env.read_text()
    res = run(["loading", "sync", "--vllm", str(env), "--force", "--json"])
    out = json.loads(res.stdout)
    (change,) = out["changes"]
    assert (change["kind"], change["before"], change["after"], change["changed"]) == ("vllm-args", True, False, True)
    assert env.read_text() == original.replace('"async_loading":true', '"async_loading":false')
    assert_only_async_changed(backups(env)[0], env, False)


def test_crlf_unit_keeps_every_other_byte(tmp_path):
    unit = write(tmp_path, "vllm.service", UNIT_CRLF)
    run(["loading", "sync", "--vllm", str(unit), "--force"])
    assert unit.read_bytes() == UNIT_CRLF.replace('"async_loading": true', '"async_loading": false').encode()
    assert_only_async_changed(backups(unit)[0], unit, False)


def test_show_dry_run_and_already_set(tmp_path):
    y = sample(tmp_path, "vllm-config-async.yaml")
    u = sample(tmp_path, "vllm-prefill.service")
    res = run(["loading", "show", "--vllm", str(y), "--vllm", str(u), "--json"])
    (sy, su) = json.loads(res.stdout)["sources"]
    assert (sy["kind"], sy["async_loading"], sy["line"]) == ("vllm-yaml", True, 19)
    assert sy["found"] == "vLLM --config YAML (YAML mapping, line 11)"
    assert (su["kind"], su["async_loading"], su["line"]) == ("vllm-args", False, 17)
    assert "warning: the files disagree" in run(["loading", "show", "--vllm", str(y), "--vllm", str(u)]).stderr

    before = u.read_text()
    res = run(["loading", "async", "--vllm", str(u), "--dry-run"])
    assert '+    --kv-transfer-config' in res.stdout and "dry run, not written" in res.stdout
    assert u.read_text() == before and not backups(u)
    res = run(["loading", "async", "--vllm", str(y), "--restart-cmd", "false"])
    assert "already asynchronous; nothing to change" in res.stdout and not backups(y)


def test_config_option_detects_a_vllm_yaml(tmp_path):
    """A vLLM --config YAML passed as --config is edited as one (LMCache's enable_async_loading would break vLLM's parse)."""
    p = sample(tmp_path, "vllm-config-sync.yaml")
    original = p.read_text()
    res = run(["loading", "async", "--config", str(p)])
    assert "vLLM --config YAML found" in res.stdout and "enable_async_loading" not in p.read_text()
    assert p.read_text() == original.replace('"async_loading":false', '"async_loading":true')


def test_sync_keeps_the_rho_check(tmp_path):
    p = sample(tmp_path, "vllm-config-async.yaml")
    original = p.read_text()
    res = run(["loading", "sync", "--vllm", str(p), "--diagnosis", str(fresh_diagnosis(tmp_path, 0.93))], code=1)
    assert "ρ = 0.93" in res.output
    assert p.read_text() == original and not backups(p)


REFUSED = [
    ("both.yaml", f"kv-transfer-config: '{JSON_NO_ASYNC}'\nkv_transfer_config: '{JSON_NO_ASYNC}'\n", "ambiguous: the kv-transfer-config key is set more than once (lines 1, 2)"),
    ("keyflag.yaml", f"kv-transfer-config: '{JSON_NO_ASYNC}'\nargs: --kv-transfer-config x\n", "ambiguous: a kv-transfer-config key (line 1) and a --kv-transfer-config argument (line 2)"),
    ("two.service", f"[Service]\nExecStartPre=/bin/check --kv-transfer-config '{JSON_NO_ASYNC}'\nExecStart=/bin/vllm --kv-transfer-config '{JSON_NO_ASYNC}'\n", "appears more than once (lines 2, 3)"),
    ("bad.service", "[Service]\n# a comment --kv-transfer-config '{}'\nExecStart=/bin/vllm \\\n  --kv-transfer-config '{\"kv_role\": \"kv_both\" \"kv_connector\": \"K\"}'\n", "malformed JSON in the kv-transfer-config at line 4"),
    ("bad.yaml", "model: m\nkv-transfer-config: '{\"kv_role\": \"kv_both\",\n  \"kv_connector_extra_config\": {\"urls\": [}}'\n", "malformed JSON in the kv-transfer-config at line 3"),
    ("broken.yaml", "model: m\nkv-transfer-config: {\"a\": 1\nport: [8000\n", "malformed YAML at line"),
    ("dup.env", 'VLLM_ARGS=--kv-transfer-config \'{"kv_connector_extra_config": {"async_loading": true, "async_loading": false}}\'\n', "ambiguous: async_loading is set more than once (lines 1, 1)"),
    ("word.env", 'VLLM_ARGS=--kv-transfer-config \'{"kv_connector_extra_config": {"async_loading": "yes"}}\'\n', 'async_loading on line 1 is "yes", not true or false'),
    ("quoted.yaml", 'kv_transfer_config:\n  kv_connector: K\n  kv_connector_extra_config:\n    async_loading: "true"\n', "async_loading on line 4 is not true or false"),
    ("escaped.yaml", 'kv-transfer-config: "{\\"kv_connector\\": \\"K\\", \\"kv_role\\": \\"kv_both\\"}"\n', "uses YAML escapes"),
    ("nothing.service", "[Service]\nExecStart=/bin/vllm --model m\n", "no kv-transfer-config key and no --kv-transfer-config argument found"),
    ("vllm.conf", f"kv-transfer-config: '{JSON_NO_ASYNC}'\n", "vLLM reads --config only from .yaml/.yml files"),
]


@pytest.mark.parametrize("name, text, needle", REFUSED, ids=[r[0] for r in REFUSED])
def test_refused_with_one_line_and_file_untouched(tmp_path, name, text, needle):
    p = write(tmp_path, name, text)
    for args in (["loading", "show", "--vllm", str(p)], ["loading", "async", "--vllm", str(p)]):
        res = run(args, code=2)
        (error,) = [ln for ln in res.output.splitlines() if ln.strip()]
        assert needle in error and error.endswith("the file was not changed"), error
    assert p.read_text() == text and not backups(p)


def test_lmcache_and_vllm_settings_in_one_file_are_ambiguous(tmp_path):
    y = write(tmp_path, "mixed.yaml", f"enable_async_loading: false\nkv-transfer-config: '{JSON_NO_ASYNC}'\n")
    res = run(["loading", "async", "--config", str(y)], code=2)
    assert "ambiguous: it sets the LMCache setting enable_async_loading" in res.output
    e = write(tmp_path, "mixed.env", f"LMCACHE_ENABLE_ASYNC_LOADING=False\nVLLM_ARGS=--kv-transfer-config '{JSON_NO_ASYNC}'\n")
    res = run(["loading", "async", "--env-file", str(e)], code=2)
    assert "LMCACHE_ENABLE_ASYNC_LOADING" in res.output
    assert not backups(y) and not backups(e)


def test_missing_extra_config_is_added(tmp_path):
    """No kv_connector_extra_config at all: one member with only async_loading is appended to the object."""
    text = 'VLLM_ARGS=--kv-transfer-config \'{"kv_connector":"KvctlConnector","kv_role":"kv_both"}\' --port 8000\n'
    new = loading_vllm.flip(text, loading_vllm.VLLM_ARGS, True, "x.env")[1]
    assert new == text.replace('"kv_both"}', '"kv_both","kv_connector_extra_config":{"async_loading":true}}')


INSERTS = [
    # (file text, expected text after `async`), worked out by hand
    ("kv_transfer_config:\n  kv_connector: K\n  kv_role: kv_both\n  kv_connector_extra_config: {}\n",
     'kv_transfer_config:\n  kv_connector: K\n  kv_role: kv_both\n  kv_connector_extra_config: {"async_loading": true}\n'),
    ("kv_transfer_config:\n  kv_connector: K\n  kv_role: kv_both\n  kv_connector_extra_config:\n    chunk_tokens: 256",
     "kv_transfer_config:\n  kv_connector: K\n  kv_role: kv_both\n  kv_connector_extra_config:\n    chunk_tokens: 256\n    async_loading: true\n"),
    ("kv_transfer_config:\n  kv_connector: K   # ours\n  kv_role: kv_both\nport: 8000\n",
     'kv_transfer_config:\n  kv_connector: K   # ours\n  kv_role: kv_both\n  kv_connector_extra_config: {"async_loading": true}\nport: 8000\n'),
    ("kv-transfer-config: '{\"kv_connector\": \"K\", \"kv_role\": \"kv_both\", \"kv_connector_extra_config\": {}}'\n",
     "kv-transfer-config: '{\"kv_connector\": \"K\", \"kv_role\": \"kv_both\", \"kv_connector_extra_config\": {\"async_loading\": true}}'\n"),
]  # fmt: skip


@pytest.mark.parametrize("text, expected", INSERTS)
def test_insert_forms(tmp_path, text, expected):
    p = write(tmp_path, "serve.yaml", text)
    run(["loading", "async", "--vllm", str(p)])
    assert p.read_text() == expected
    assert_only_async_changed(backups(p)[0], p, True)


@pytest.mark.parametrize("name", ["vllm-config-sync.yaml", "vllm-config-async.yaml", "vllm-prefill.service", "vllm-prefill.env"])
def test_flip_and_flip_back_restores_every_byte(tmp_path, name):
    p = sample(tmp_path, name)
    original = p.read_bytes()
    was_async = json.loads(run(["loading", "show", "--vllm", str(p), "--json"]).stdout)["sources"][0]["async_loading"]
    run(["loading", "sync" if was_async else "async", "--vllm", str(p), "--force"] if was_async else ["loading", "async", "--vllm", str(p)])
    assert p.read_bytes() != original
    run(["loading", "async", "--vllm", str(p)] if was_async else ["loading", "sync", "--vllm", str(p), "--force"])
    assert p.read_bytes() == original


def test_json_in_a_yaml_block_literal(tmp_path):
    text = 'model: /models/m\nkv-transfer-config: |\n  {"kv_connector": "KvctlConnector", "kv_role": "kv_both",\n   "kv_connector_extra_config": {"url": "resp://v-{rank}:6379", "async_loading": false}}\nport: 8000\n'
    p = write(tmp_path, "literal.yaml", text)
    state = json.loads(run(["loading", "show", "--vllm", str(p), "--json"]).stdout)["sources"][0]
    assert (state["async_loading"], state["line"], state["found"]) == (False, 4, "vLLM --config YAML (JSON string, line 2)")
    run(["loading", "async", "--vllm", str(p)])
    assert p.read_text() == text.replace('"async_loading": false', '"async_loading": true')
    assert_only_async_changed(backups(p)[0], p, True)
