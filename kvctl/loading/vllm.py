"""Flip ``async_loading`` of kvctl's vLLM connector where a deployment keeps its ``--kv-transfer-config``.

Two kinds of file carry it:

* ``vllm-yaml``: a vLLM ``--config`` YAML (vLLM reads only ``.yaml``/``.yml``) whose
  ``kv-transfer-config`` (or ``kv_transfer_config``) key holds the JSON as a string
  (``'{"kv_connector": ...}'``) or as a YAML mapping (vLLM dumps a mapping to JSON);
* ``vllm-args``: any other text file carrying the argument ``--kv-transfer-config '{...}'``
  (a systemd ExecStart line, an env file's ``VLLM_ARGS=...``, a launch script).

The edit touches only the value of ``kv_connector_extra_config.async_loading`` (or inserts
that one member when it is absent): the JSON is located with its byte offsets in the file
(``json``'s own scanner for JSON text, PyYAML's node marks for a YAML mapping), the value is
replaced in place, and the result is re-read and must equal the original with only
``async_loading`` changed. A file whose kind is ambiguous, or whose JSON is malformed or
written in a form that cannot be edited in place, is refused with the line number.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvctl.connector.unknown_keys import in_kv_transfer
from kvctl.core import safeyaml
from kvctl.core.errors import InvalidInput, KvctlError
from kvctl.core.known_keys import nearest
from kvctl.loading.near_miss import refuse_near_miss
from kvctl.loading.types import SourceState
from kvctl.tier.vllm_config import ASYNC_KEY, EXTRA

VLLM_YAML = "vllm-yaml"
VLLM_ARGS = "vllm-args"
KINDS = (VLLM_YAML, VLLM_ARGS)
DESCRIPTIONS = {
    "yaml": "LMCache YAML config",
    "env": "LMCache env file",
    VLLM_YAML: "vLLM --config YAML",
    VLLM_ARGS: "env/unit file with --kv-transfer-config",
}
SETTING = f"{EXTRA}.{ASYNC_KEY}"
YAML_KEYS = ("kv-transfer-config", "kv_transfer_config")
YAML_SUFFIXES = (".yaml", ".yml")
LMCACHE_MARKERS = ("enable_async_loading", "chunk_size", "remote_url", "local_cpu", "LMCACHE_ENABLE_ASYNC_LOADING")

# vLLM accepts --kv-transfer-config and --kv_transfer_config; a dotted --kv-transfer-config.x is another form
_FLAG = re.compile(r"--kv[-_]transfer[-_]config(?![\w.-])")
_AFTER_FLAG = re.compile(r"(?:=|[ \t]+)(?P<q>['\"]?)(?=\{)")
_WS = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


class Unsupported(InvalidInput):
    """A file kvctl will not edit: ambiguous kind, malformed JSON, or a form it cannot edit in place."""


@dataclass(frozen=True)
class Found:
    """Where the connector's JSON lives in one file."""

    kind: str
    form: str  # "JSON string", "YAML mapping" or "argument"
    line: int  # 1-based line of the key or flag


def _line(text: str, index: int) -> int:
    return text.count("\n", 0, index) + 1


def _refuse(path: str, msg: str) -> Unsupported:
    return Unsupported(f"{path}: {msg}; the file was not changed")


def _set_twice(path: str, what: str, lines: list[int], tail: str = "") -> Unsupported:
    return _refuse(path, f"ambiguous: {what} more than once (lines {', '.join(map(str, lines))}){tail}")


# ----------------------------------------------------------------------------- detection


def _flags(text: str) -> list[re.Match[str]]:
    """``--kv-transfer-config`` occurrences outside comment lines (``#``, and ``;`` as systemd allows)."""
    out = []
    for m in _FLAG.finditer(text):
        start = text.rfind("\n", 0, m.start()) + 1
        if not text[start : m.start()].lstrip().startswith(("#", ";")):
            out.append(m)
    return out


def _compose(text: str, path: str, fatal: bool):
    """The YAML node tree, or None (``fatal``: malformed YAML or an alias bomb is refused with its line)."""
    try:
        return safeyaml.compose(text, path)
    except InvalidInput as e:
        if not fatal:
            return None
        raise Unsupported(str(e)) from e


def _kv_pairs(root) -> list[tuple[Any, Any]]:
    import yaml  # noqa: PLC0415

    if not isinstance(root, yaml.MappingNode):
        return []
    return [(k, v) for k, v in root.value if isinstance(k, yaml.ScalarNode) and k.value in YAML_KEYS]


def _typo_of_key(root) -> str:
    """`` (did you mean ...?)`` naming a top-level key of a YAML that is a near miss of ``kv-transfer-config``, else ""."""
    import yaml  # noqa: PLC0415

    if not isinstance(root, yaml.MappingNode):
        return ""
    for k, _ in root.value:
        if isinstance(k, yaml.ScalarNode) and nearest(k.value, YAML_KEYS):
            return f"; {k.value} on line {k.start_mark.line + 1} is a near miss of {nearest(k.value, YAML_KEYS)}"
    return ""


def detect(path: Path | str, text: str, given: str) -> str:
    """The kind of ``path``: ``given`` ("yaml", "env" or "vllm") is the option it came from.

    An LMCache file stays an LMCache file; a file that carries the connector's
    config becomes ``vllm-yaml``/``vllm-args``; anything that could be read two
    ways is refused (Unsupported, exit 2).
    """
    path = str(path)
    is_yaml_name = Path(path).suffix.lower() in YAML_SUFFIXES
    flags = _flags(text)
    root = _compose(text, path, fatal=is_yaml_name)
    keys = _kv_pairs(root)
    if keys and flags:
        raise _refuse(path, f"ambiguous: a {keys[0][0].value} key (line {keys[0][0].start_mark.line + 1}) and a --kv-transfer-config argument (line {_line(text, flags[0].start())})")
    if len(keys) > 1:
        raise _set_twice(path, "the kv-transfer-config key is set", [k.start_mark.line + 1 for k, _ in keys])
    if len(flags) > 1:
        raise _set_twice(path, "--kv-transfer-config appears", [_line(text, m.start()) for m in flags], "; kvctl edits exactly one")
    if keys and not is_yaml_name:
        raise _refuse(path, f"ambiguous: a {keys[0][0].value} key on line {keys[0][0].start_mark.line + 1}, but vLLM reads --config only from .yaml/.yml files")
    kind = VLLM_YAML if keys else VLLM_ARGS if flags else None
    if kind is None:
        if given == "vllm":
            raise _refuse(path, "no kv-transfer-config key and no --kv-transfer-config argument found" + _typo_of_key(root))
        return given
    if given != "vllm":
        lmcache = [m for m in LMCACHE_MARKERS if re.search(rf"^[ \t]*(?:export[ \t]+)?{m}[ \t]*[:=]", text, re.M)]
        if lmcache:
            raise _refuse(path, f"ambiguous: it sets the LMCache setting {lmcache[0]} and carries vLLM's kv-transfer-config")
    return kind


def locate(path: str, text: str, kind: str) -> Found:
    """Where the connector config is (the file's kind already detected)."""
    if kind == VLLM_ARGS:
        (m,) = _flags(text)
        return Found(kind, "argument", _line(text, m.start()))
    ((key, value),) = _kv_pairs(_compose(text, path, fatal=True))
    import yaml  # noqa: PLC0415

    return Found(kind, "YAML mapping" if isinstance(value, yaml.MappingNode) else "JSON string", key.start_mark.line + 1)


# ----------------------------------------------------------------------------- JSON in place


def _members(text: str, i: int) -> tuple[list[tuple[str, int, int]], int]:
    """(key, value start, value end) of the JSON object whose ``{`` is at ``text[i]``, and the index after its ``}``."""
    i = _WS.match(text, i + 1).end()
    members: list[tuple[str, int, int]] = []
    if text.startswith("}", i):
        return members, i + 1
    while True:
        if not text.startswith('"', i):
            raise json.JSONDecodeError("expected a quoted key", text, i)
        key, i = json.decoder.scanstring(text, i + 1)
        i = _WS.match(text, i).end()
        if not text.startswith(":", i):
            raise json.JSONDecodeError("expected ':'", text, i)
        start = _WS.match(text, i + 1).end()
        _, end = _DECODER.raw_decode(text, start)
        members.append((key, start, end))
        i = _WS.match(text, end).end()
        if text.startswith(",", i):
            i = _WS.match(text, i + 1).end()
        elif text.startswith("}", i):
            return members, i + 1
        else:
            raise json.JSONDecodeError("expected ',' or '}'", text, i)


def _one(members: list[tuple[str, int, int]], key: str, text: str, path: str) -> tuple[str, int, int] | None:
    found = [m for m in members if m[0] == key]
    if len(found) > 1:
        raise _set_twice(path, f"{key} is set", [_line(text, m[1]) for m in found])
    return found[0] if found else None


def _json_flip(text: str, start: int, value: bool, path: str) -> tuple[str, bool | None, int]:
    """``text`` with async_loading set in the JSON object at ``start``; (new text, old value, line of the value).

    A missing member is added after the object's last member (or inside an
    empty object), written in the object's own style (``"k": v`` or ``"k":v``).
    """
    word = "true" if value else "false"
    try:
        members, end = _members(text, start)
        sp = " " if '": ' in text[start:end] else ""
        extra = _one(members, EXTRA, text, path)
        if extra is None:  # no extra config at all: add one with only async_loading
            owner, add = members, f'"{EXTRA}":{sp}{{"{ASYNC_KEY}":{sp}{word}}}'
        elif not text.startswith("{", extra[1]):
            raise _refuse(path, f"{EXTRA} on line {_line(text, extra[1])} is not a JSON object")
        else:
            owner, add = _members(text, extra[1])[0], f'"{ASYNC_KEY}":{sp}{word}'
    except json.JSONDecodeError as e:
        raise _refuse(path, f"malformed JSON in the kv-transfer-config at line {_line(text, e.pos)}: {e.msg}") from e
    current = _one(owner, ASYNC_KEY, text, path) if extra is not None else None
    if current is not None:
        old = json.loads(text[current[1] : current[2]])
        if not isinstance(old, bool):
            raise _refuse(path, f"{ASYNC_KEY} on line {_line(text, current[1])} is {text[current[1]:current[2]]}, not true or false")
        return text[: current[1]] + word + text[current[2] :], old, _line(text, current[1])
    if owner:
        at, add = owner[-1][2], f",{sp}{add}"
    else:
        at = (start if extra is None else extra[1]) + 1
    return text[:at] + add + text[at:], None, _line(text, at)


def _json_start(text: str, kind: str, path: str, root=None) -> int:
    """Offset of the ``{`` that opens the connector JSON in an args file or a YAML JSON string."""
    if kind == VLLM_ARGS:
        (m,) = _flags(text)
        after = _AFTER_FLAG.match(text, m.end())
        if not after:
            raise _refuse(path, f"after --kv-transfer-config on line {_line(text, m.start())} kvctl expects the JSON object, '{{...}}' (quoted or not)")
        eol = text.find("\n", after.end())
        if after.group("q") == '"' and '\\"' in text[after.end() : eol if eol >= 0 else None]:
            raise _refuse(path, f"the JSON on line {_line(text, m.start())} is double-quoted with escaped quotes; write it single-quoted ('{{...}}') for kvctl to edit it")
        return after.end()
    ((_, node),) = _kv_pairs(root)
    raw = text[node.start_mark.index : node.end_mark.index]
    brace = raw.find("{")
    if brace < 0:
        raise _refuse(path, f"the kv-transfer-config on line {node.start_mark.line + 1} is not a JSON object")
    return node.start_mark.index + brace


# ----------------------------------------------------------------------------- YAML mapping in place


def _yaml_insert(text: str, mapping, key: str, value_text: str) -> str:
    """``text`` with ``key: value_text`` added as the last member of a YAML mapping node (block or flow)."""
    eol = "\r\n" if "\r\n" in text else "\n"
    if mapping.flow_style:
        if mapping.value:
            at, member = mapping.value[-1][1].end_mark.index, f', "{key}": {value_text}'
        else:
            at, member = mapping.end_mark.index - 1, f'"{key}": {value_text}'
        return text[:at] + member + text[at:]
    indent = " " * mapping.value[0][0].start_mark.column
    end = mapping.value[-1][1].end_mark
    line_start = end.index - end.column
    if text[line_start : end.index].strip() == "":  # a block value ends where the next line's token starts
        at = line_start
    else:  # a scalar ends mid-line: add after that line
        nl = text.find("\n", end.index)
        if nl < 0:
            text, at = text + eol, len(text) + len(eol)
        else:
            at = nl + 1
    return text[:at] + f"{indent}{key}: {value_text}{eol}" + text[at:]


def _mapping_flip(text: str, node, value: bool, path: str) -> tuple[str, bool | None, int]:
    import yaml  # noqa: PLC0415

    word = "true" if value else "false"
    extras = [(k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == EXTRA]
    if len(extras) > 1:
        raise _set_twice(path, f"{EXTRA} is set", [k.start_mark.line + 1 for k, _ in extras])
    if not extras:
        return _yaml_insert(text, node, EXTRA, f'{{"{ASYNC_KEY}": {word}}}'), None, node.end_mark.line + 1
    extra = extras[0][1]
    if not isinstance(extra, yaml.MappingNode):
        raise _refuse(path, f"{EXTRA} on line {extra.start_mark.line + 1} is not a mapping")
    current = [(k, v) for k, v in extra.value if isinstance(k, yaml.ScalarNode) and k.value == ASYNC_KEY]
    if len(current) > 1:
        raise _set_twice(path, f"{ASYNC_KEY} is set", [k.start_mark.line + 1 for k, _ in current])
    if not current:
        return _yaml_insert(text, extra, ASYNC_KEY, word), None, extra.end_mark.line + 1
    v = current[0][1]
    old = yaml.safe_load(text[v.start_mark.index : v.end_mark.index]) if isinstance(v, yaml.ScalarNode) and not v.style else None
    if not isinstance(old, bool):  # a quoted "true" is a string to vLLM too
        raise _refuse(path, f"{ASYNC_KEY} on line {v.start_mark.line + 1} is not true or false")
    return text[: v.start_mark.index] + word + text[v.end_mark.index :], old, v.start_mark.line + 1


# ----------------------------------------------------------------------------- read, flip, check


def read_config(text: str, kind: str, path: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the kv-transfer-config as vLLM gets it, the rest of a YAML file or None)."""
    if kind == VLLM_ARGS:
        start = _json_start(text, kind, path)
        try:
            cfg, _ = _DECODER.raw_decode(text, start)
        except json.JSONDecodeError as e:
            raise _refuse(path, f"malformed JSON in the kv-transfer-config at line {_line(text, e.pos)}: {e.msg}") from e
        return cfg, None
    try:
        data = safeyaml.load(text, path)
    except InvalidInput as e:
        raise Unsupported(str(e)) from e
    key = next(k for k in YAML_KEYS if k in data)
    value = data.pop(key)
    if isinstance(value, str):
        root = _compose(text, path, fatal=True)
        start = _json_start(text, kind, path, root)
        try:
            cfg = json.loads(value)
        except json.JSONDecodeError:
            try:  # the position in the file, where the string is written as plain JSON
                _DECODER.raw_decode(text, start)
            except json.JSONDecodeError as in_file:
                e = in_file
            raise _refuse(path, f"malformed JSON in the kv-transfer-config at line {_line(text, e.pos) if e.doc is text else _line(text, start)}: {e.msg}") from e
        try:
            in_file, _ = _DECODER.raw_decode(text, start)
        except json.JSONDecodeError:
            in_file = None
        if in_file != cfg:
            raise _refuse(path, f"the JSON string on line {_line(text, start)} uses YAML escapes kvctl does not edit in place; write it single-quoted ('{{...}}')")
        value = cfg
    if not isinstance(value, dict):
        raise _refuse(path, f"the kv-transfer-config is a {type(value).__name__}, not a JSON object")
    return value, data


def _async_value(cfg: dict[str, Any]) -> bool | None:
    extra = cfg.get(EXTRA)
    value = extra.get(ASYNC_KEY) if isinstance(extra, dict) else None
    return value if isinstance(value, bool) else None


def state(path: Path | str, text: str, kind: str):
    """What one vLLM file says about async loading (a :class:`~kvctl.loading.types.SourceState`)."""
    path = str(path)
    found = locate(path, text, kind)
    cfg, _ = read_config(text, kind, path)
    extra = cfg.get(EXTRA, {})
    if not isinstance(extra, dict):
        raise _refuse(path, f"{EXTRA} is not a JSON object")
    line = _flip_text(text, kind, True, path)[2] if ASYNC_KEY in extra else found.line  # the value's line (checked: true or false)
    form = f"{found.form}, " if kind == VLLM_YAML else ""
    return SourceState(path, kind, _async_value(cfg), line, f"{DESCRIPTIONS[kind]} ({form}line {found.line})",
                       unknown_keys=tuple(in_kv_transfer(cfg, path)))


def check_near_miss(text: str, kind: str, path: str, found: tuple, force: bool) -> None:
    """NearMiss (kvctl.loading.edit), unless ``force``, when the flip would add ``async_loading`` (or the extra config
    holding it) beside a near miss of it among the keys no reader knows (``found``): the connector refuses the typo'd
    key, vLLM the typo'd config key."""
    cfg, _ = read_config(text, kind, path)
    extra = cfg.get(EXTRA)
    if isinstance(extra, dict):
        if ASYNC_KEY not in extra:
            refuse_near_miss(path, ASYNC_KEY, found, force, parent=f"{EXTRA}.")
    elif extra is None:
        refuse_near_miss(path, EXTRA, found, force)


def _flip_text(text: str, kind: str, value: bool, path: str) -> tuple[str, bool | None, int]:
    if kind == VLLM_ARGS:
        return _json_flip(text, _json_start(text, kind, path), value, path)
    import yaml  # noqa: PLC0415

    root = _compose(text, path, fatal=True)
    ((_, node),) = _kv_pairs(root)
    if isinstance(node, yaml.MappingNode):
        return _mapping_flip(text, node, value, path)
    if not isinstance(node, yaml.ScalarNode):
        raise _refuse(path, f"the kv-transfer-config on line {node.start_mark.line + 1} is neither a JSON string nor a mapping")
    read_config(text, kind, path)  # the string must be plain JSON in the file
    return _json_flip(text, _json_start(text, kind, path, root), value, path)


def flip(text: str, kind: str, value: bool, path: str) -> tuple[bool | None, str]:
    """(the old async_loading, the new text): only that value changes (or is inserted).

    The new text is read back as vLLM would read it and must equal the
    original with ``async_loading`` = ``value``; a YAML file's other keys must
    be unchanged, an args file's text outside the JSON byte-identical.
    """
    before_cfg, before_rest = read_config(text, kind, path)
    new, old, _ = _flip_text(text, kind, value, path)
    after_cfg, after_rest = read_config(new, kind, path)
    expected = json.loads(json.dumps(before_cfg))
    expected.setdefault(EXTRA, {})[ASYNC_KEY] = value
    if after_cfg != expected or after_rest != before_rest:
        raise KvctlError(f"{path}: the in-place edit did not give the expected config; change {SETTING} by hand")
    return old, new
