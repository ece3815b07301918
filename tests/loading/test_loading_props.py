"""Properties of the line edits behind `kvctl loading`: only the one setting changes, every other byte stays,
and what kvctl reads back is what it wrote. Bounded: a fixed number of generated files per property."""

from __future__ import annotations

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvctl.loading import edit as loading

NAMES = st.from_regex(r"[A-Z_][A-Z0-9_]{0,12}", fullmatch=True).filter(lambda n: n != loading.ENV_VAR)
VALUES = st.from_regex(r"[a-zA-Z0-9/:._-]{0,16}", fullmatch=True)
WORDS = st.sampled_from(["True", "False", "true", "false", "1", "0", "yes", "no"])


@st.composite
def env_lines(draw) -> str:
    kind = draw(st.sampled_from(["plain", "export", "quoted", "comment", "blank", "bare", "setting"]))
    if kind == "comment":
        return "# " + draw(VALUES)
    if kind == "blank":
        return ""
    if kind == "bare":
        return draw(NAMES)
    if kind == "setting":
        q = draw(st.sampled_from(["", '"', "'"]))
        head = draw(st.sampled_from(["", "export "]))
        tail = draw(st.sampled_from(["", "  # set by ops"]))
        return f"{head}{loading.ENV_VAR}={q}{draw(WORDS)}{q}{tail}"
    q = '"' if kind == "quoted" else ""
    return f"{'export ' if kind == 'export' else ''}{draw(NAMES)}={q}{draw(VALUES)}{q}"


@st.composite
def env_files(draw) -> str:
    lines = draw(st.lists(env_lines(), max_size=12))
    eol = draw(st.sampled_from(["\n", "\r\n"]))
    text = eol.join(lines)
    return text + (eol if lines and draw(st.booleans()) else "")


def _non_setting_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if loading.ENV_VAR not in ln]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(text=env_files(), value=st.booleans())
def test_env_edit_changes_only_the_setting(tmp_path, text, value):
    loading.check_env_file(text, "engine.env")  # every generated file is an env file
    new = loading.set_env(text, value)
    p = tmp_path / "engine.env"
    p.write_bytes(new.encode())
    got = loading.env_state(p)
    assert got.async_loading is value
    assert new.splitlines()[got.line - 1].split("=", 1)[0].replace("export ", "").strip() == loading.ENV_VAR
    assert _non_setting_lines(new) == _non_setting_lines(text)  # every other line, in order
    # a file with the setting keeps its line count; a file without one gets exactly one more line
    if loading.ENV_VAR in text:
        assert len(new.splitlines()) == len(text.splitlines())
    else:
        assert new.splitlines()[-1] == f"{loading.ENV_VAR}={'True' if value else 'False'}"
    assert loading.set_env(new, value) == new  # idempotent
    eol = "\r\n" if "\r\n" in text else "\n"
    assert all(ln.endswith(eol) for ln in new.splitlines(keepends=True)[:-1])  # line endings as the file's


YAML_KEYS = st.from_regex(r"[a-z][a-z0-9_]{0,12}", fullmatch=True).filter(lambda k: k != loading.KEY and k not in ("y", "n", "yes", "no", "on", "off", "true", "false", "null"))
YAML_SCALARS = st.one_of(st.integers(-10**6, 10**6), st.sampled_from(['"resp://valkey-{rank}:6379"', "naive", "40.0", "true", "false"]))


@st.composite
def lmcache_configs(draw) -> str:
    keys = draw(st.lists(YAML_KEYS, unique=True, max_size=8))
    lines = [f"{k}: {draw(YAML_SCALARS)}" + draw(st.sampled_from(["", "  # note"])) for k in keys]
    if draw(st.booleans()):
        at = draw(st.integers(0, len(lines)))
        lines.insert(at, f"{loading.KEY}: {draw(st.sampled_from(['true', 'false', 'True', 'no', 'yes']))}" + draw(st.sampled_from(["", "  # flipped by kvctl"])))
    if draw(st.booleans()):
        lines.insert(0, "# LMCache config (kept by ops)")
    return "\n".join(lines) + ("\n" if draw(st.booleans()) else "")


@settings(max_examples=200, deadline=None)
@given(text=lmcache_configs(), value=st.booleans())
def test_yaml_edit_changes_only_the_setting(text, value):
    new = loading.set_yaml(text, value)
    before, after = yaml.safe_load(text) or {}, yaml.safe_load(new)
    assert after[loading.KEY] is value
    assert {k: v for k, v in after.items() if k != loading.KEY} == {k: v for k, v in before.items() if k != loading.KEY}
    changed = [(a, b) for a, b in zip(text.splitlines(), new.splitlines()) if a != b]
    assert all(a.startswith(loading.KEY) and b.startswith(loading.KEY) for a, b in changed)
    assert loading.set_yaml(new, value) == new
