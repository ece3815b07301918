"""Flip LMCache between synchronous and asynchronous loading, safely.

The edit is line-based so every other line and comment of the config stays
byte-for-byte; PyYAML only validates (the original must parse, and the result
must parse to the same mapping with just ``enable_async_loading`` changed).
Writes are atomic (``kvctl.core.files``: a 0600 temp file in the same directory + ``os.replace``) after a
backup (0600, unguessable name). Deployments that set ``LMCACHE_ENABLE_ASYNC_LOADING`` in
an env file (``KEY=value`` lines, optionally ``export``) are edited the same way.
kvctl's vLLM connector keeps the switch in vLLM's ``--kv-transfer-config``: those files
(a ``--config`` YAML, an env/unit file with the argument) are detected, read and edited in
``kvctl.loading.vllm``, then backed up and written here like the others.

Whether switching to synchronous loading is allowed is decided in
``kvctl.loading.safety`` (ρ from the saved diagnosis); the restart command runs
in ``kvctl.loading.restart``; ``kvctl.loading.flip`` puts the three together.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
import re
import signal
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from kvctl.connector import unknown_keys as engine_keys
from kvctl.core import files, safeyaml
from kvctl.core.errors import InvalidInput, KvctlError
from kvctl.core.known_keys import UnknownKey
from kvctl.loading.near_miss import NearMiss, refuse_near_miss  # noqa: F401 - NearMiss re-exported
from kvctl.loading.types import SourceState  # re-exported: part of this module's API

log = logging.getLogger(__name__)

KEY = "enable_async_loading"
ENV_VAR = "LMCACHE_ENABLE_ASYNC_LOADING"
#: words LMCache reads as true (its _to_bool: ``str(value).strip().lower() in ["true", "1"]``, for env values
#: and YAML strings alike); the others below it reads as false, "yes" and "on" included
TRUTHY = ("true", "1")
FALSY = ("false", "0", "no", "off", "yes", "on")

_YAML_LINE = re.compile(rf"^(?P<head>{KEY}[ \t]*:[ \t]*)(?P<val>[^#\r\n]*?)(?P<rest>[ \t]*(?:#.*)?)$")
_ENV_LINE = re.compile(rf"^(?P<head>[ \t]*(?:export[ \t]+)?{ENV_VAR}[ \t]*=[ \t]*)(?P<q>[\"']?)(?P<val>[^\"'#\s]*)(?P=q)(?P<rest>.*)$")


class Refused(KvctlError):
    """A flip that the safety check does not allow (use --force to override)."""


#: top-level sections of LMCache-style files that are kvctl's own, not LMCache's: the drill engine's (kvctl.drill.config)
OWN_SECTIONS = frozenset({"drill"})
_ENV_NAME = re.compile(r"^[ \t]*(?:export[ \t]+)?(?P<name>[A-Za-z_][A-Za-z0-9_.]*)[ \t]*=")


@dataclass(frozen=True)
class Change:
    """A planned (or applied) edit of one file."""

    path: str
    kind: str
    before: bool | None
    after: bool
    changed: bool
    diff: str
    new_text: str
    backup: str | None = None
    unknown_keys: tuple[UnknownKey, ...] = ()  # keys of the file its engine does not know (said; the flip goes on)


def read_text(path: Path | str) -> str:
    """The file's text with its line endings as they are (CRLF stays CRLF); regular files up to the size cap only."""
    return files.read_regular(path, "config")


_read = read_text


def parse_yaml(text: str, path: str = "<config>") -> dict[str, Any]:
    """The config as a mapping; InvalidInput with the line number when it is malformed (alias bombs refused)."""
    data = safeyaml.load(text, path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise InvalidInput(f"{path}: an LMCache config must be a YAML mapping, got {type(data).__name__}; the file was not changed")
    return data


def _as_bool(value: Any) -> bool | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return value
    return str(value).strip().strip("\"'").lower() in TRUTHY


def _top_nodes(text: str, path: str) -> list[tuple[Any, Any]]:
    """(key node, value node) of every top-level key, in file order."""
    import yaml  # noqa: PLC0415

    parse_yaml(text, path)  # a malformed file is refused with its line
    root = safeyaml.compose(text, path)
    if not isinstance(root, yaml.MappingNode):
        return []
    return [(k, v) for k, v in root.value if isinstance(k, yaml.ScalarNode)]


def _key_nodes(text: str, path: str) -> list[tuple[Any, Any]]:
    """(key node, value node) of every top-level ``enable_async_loading``, in file order (YAML keeps the last)."""
    return [(k, v) for k, v in _top_nodes(text, path) if k.value == KEY]


def _top_lines(text: str, path: str) -> dict[str, int]:
    return {k.value: k.start_mark.line + 1 for k, _ in reversed(_top_nodes(text, path))}


def yaml_unknown(data: dict[str, Any], text: str, path: str) -> tuple[UnknownKey, ...]:
    """Keys of an LMCache YAML that LMCache 0.5.6 (or kvctl's plugin in its extra_config) does not know."""
    own = {k: v for k, v in data.items() if k not in OWN_SECTIONS}
    return tuple(engine_keys.in_lmcache(own, path, _top_lines(text, path)))


def env_names(text: str) -> dict[str, int]:
    """The variables an env file sets, each with its (last) line."""
    return {m.group("name"): i for i, ln in enumerate(text.splitlines(), 1) if (m := _ENV_NAME.match(ln))}


def _checked_value(value: Any, line: int | None, path: str) -> bool | None:
    """The setting as a bool; InvalidInput naming the line when it is a list, a mapping or another word."""
    if value is None or isinstance(value, bool):
        return value
    what = {list: "a list", dict: "a mapping"}.get(type(value))
    if what is None and isinstance(value, (str, int)) and not isinstance(value, bool) and str(value).strip().strip("\"'").lower() in TRUTHY + FALSY:
        return _as_bool(value)
    where = f" on line {line}" if line else ""
    raise InvalidInput(f"{path}: {KEY}{where} is {what or type(value).__name__} ({value!r}), not true or false; the file was not changed")


def yaml_state(path: Path | str) -> SourceState:
    text = _read(path)
    data = parse_yaml(text, str(path))
    nodes = _key_nodes(text, str(path))
    line = nodes[-1][0].start_mark.line + 1 if nodes else None  # the effective (last) one
    return SourceState(str(path), "yaml", _checked_value(data.get(KEY), line, str(path)), line, unknown_keys=yaml_unknown(data, text, str(path)))


_ENV_OK = re.compile(r"^[ \t]*(?:#.*|(?:export[ \t]+)?[A-Za-z_][A-Za-z0-9_.]*(?:[ \t]*=.*)?)?$")


def check_env_file(text: str, path: str) -> None:
    """InvalidInput unless every line is ``KEY=value`` (optionally ``export``), a bare ``KEY``, a comment or blank."""
    continued = False
    for i, ln in enumerate(text.splitlines(), 1):
        if not continued and not _ENV_OK.match(ln):
            raise InvalidInput(  # the line itself is never quoted: an env file may hold secrets
                f"{path} is not an env file: line {i} is not KEY=value; "
                "give an LMCache YAML with --config, a vLLM config or unit file with --vllm; the file was not changed"
            )
        continued = ln.endswith("\\")


def env_state(path: Path | str) -> SourceState:
    text = _read(path)
    check_env_file(text, str(path))
    value, line = None, None
    for i, ln in enumerate(text.splitlines()):
        m = _ENV_LINE.match(ln)
        if m:
            value, line = _as_bool(m.group("val")), i + 1
    return SourceState(str(path), "env", value, line, unknown_keys=tuple(engine_keys.in_lmcache_env(env_names(text), str(path))))


def detect_kind(path: Path | str, given: str) -> str:
    """The kind of one file named by option ``given`` ("yaml", "env" or "vllm"); vLLM files are recognised by content."""
    from kvctl.loading import vllm as loading_vllm  # noqa: PLC0415

    return loading_vllm.detect(path, _read(path), given)


def state(path: Path | str, kind: str) -> SourceState:
    """What one file of a detected kind says about async loading."""
    if kind == "yaml":
        return yaml_state(path)
    if kind == "env":
        return env_state(path)
    from kvctl.loading import vllm as loading_vllm  # noqa: PLC0415

    return loading_vllm.state(path, _read(path), kind)


def set_yaml(text: str, value: bool, path: str = "<config>") -> str:
    """``text`` with ``enable_async_loading`` set to ``value``; every other line unchanged."""
    before = parse_yaml(text, path)
    nodes = _key_nodes(text, path)
    if nodes:
        key, val = nodes[-1]
        _checked_value(before.get(KEY), key.start_mark.line + 1, path)
        if val.start_mark.line != key.start_mark.line:
            raise KvctlError(f"{path}: {KEY} on line {key.start_mark.line + 1} has its value on another line; kvctl edits `{KEY}: true|false` on one line; change it by hand")
    word = "true" if value else "false"
    new = _rewrite(text, _YAML_LINE, lambda m: f"{m.group('head')}{word}{m.group('rest')}")
    if new is None:
        if KEY in before:
            raise KvctlError(f"{path}: {KEY} is set in a form kvctl does not edit (quoted or nested key); change it by hand")
        new = _append(text, f"{KEY}: {word}")
    try:
        after = parse_yaml(new, path)
    except InvalidInput as e:
        raise KvctlError(f"{path}: the line edit did not give valid YAML ({e}); change {KEY} by hand") from e
    if after.get(KEY) is not value or {k: v for k, v in after.items() if k != KEY} != {k: v for k, v in before.items() if k != KEY}:
        raise KvctlError(f"{path}: the line edit did not give the expected config; change {KEY} by hand")
    return new


def set_env(text: str, value: bool) -> str:
    """Env-file ``text`` with ``LMCACHE_ENABLE_ASYNC_LOADING`` set; other lines unchanged."""
    word = "True" if value else "False"
    new = _rewrite(text, _ENV_LINE, lambda m: f"{m.group('head')}{m.group('q')}{word}{m.group('q')}{m.group('rest')}")
    return _append(text, f"{ENV_VAR}={word}") if new is None else new


def _rewrite(text: str, pattern: re.Pattern[str], replace: Callable[[re.Match[str]], str]) -> str | None:
    """``text`` with every line matching ``pattern`` replaced (its line ending kept); None when none matches."""
    lines = text.splitlines(keepends=True)
    found = False
    for i, raw in enumerate(lines):
        body = raw.rstrip("\r\n")
        m = pattern.match(body)
        if m:
            lines[i] = replace(m) + raw[len(body):]
            found = True
    return "".join(lines) if found else None


def _append(text: str, line: str) -> str:
    """``text`` with ``line`` added as a last line, ended like the file's lines (CRLF or LF)."""
    eol = "\r\n" if "\r\n" in text else "\n"
    return text + (eol if text and not text.endswith("\n") else "") + line + eol


def env_form(value: bool) -> str:
    return f"{ENV_VAR}={'True' if value else 'False'}"


def plan(path: Path | str, kind: str, value: bool, force: bool = False) -> Change:
    """The edit that sets async loading to ``value`` in one file (nothing is written). NearMiss, unless ``force``, when
    the setting is absent and a near miss of it is there (kvctl would add the setting beside the typo)."""
    text = _read(path)
    st = state(path, kind)
    if kind == "yaml":
        if st.line is None:
            refuse_near_miss(str(path), KEY, st.unknown_keys, force)
        new = set_yaml(text, value, str(path))
    elif kind == "env":
        if st.line is None:
            refuse_near_miss(str(path), ENV_VAR, st.unknown_keys, force)
        new = set_env(text, value)
    else:
        from kvctl.loading import vllm as loading_vllm  # noqa: PLC0415

        loading_vllm.check_near_miss(text, kind, str(path), st.unknown_keys, force)
        _, new = loading_vllm.flip(text, kind, value, str(path))
    diff = "".join(difflib.unified_diff(text.splitlines(keepends=True), new.splitlines(keepends=True), f"{path} (before)", f"{path} (after)"))
    return Change(str(path), kind, st.async_loading, value, new != text, diff, new, unknown_keys=st.unknown_keys)


TMP_MARK = files.TMP_MARK


def real_path(path: Path | str) -> Path:
    """The file a path names, every symlink resolved: kvctl edits a symlink's target and keeps the link."""
    return Path(os.path.realpath(path))


def read_only(st: os.stat_result, path: Path) -> bool:
    """No write bit at all in the mode (root could write anyway), or not writable by this user."""
    return not (st.st_mode & 0o222) or (os.geteuid() != 0 and not os.access(path, os.W_OK))


def check_writable(path: Path | str, force: bool = False) -> None:
    """Refuse (before anything is written) a file kvctl should not or cannot replace in place.

    A read-only file is refused unless ``force`` (its mode is kept when forced); a file owned by
    another user is refused when this user cannot give the new file that owner (only root can).
    """
    real = real_path(path)
    shown = f"{path}" if str(real) == str(path) else f"{path} (-> {real})"
    try:
        st = os.stat(real)
    except OSError as e:
        raise InvalidInput(f"cannot read {shown}: {e.strerror or e}") from e
    if not stat.S_ISREG(st.st_mode):
        raise InvalidInput(f"{shown} is not a regular file; the file was not changed")
    if st.st_nlink > 1 and not force:
        raise Refused(
            f"{shown} has {st.st_nlink} hard links: kvctl writes a new file and renames it, so the other names would keep "
            "the old text; edit the file the engine reads, or pass --force to write this name anyway; no file was changed"
        )
    if read_only(st, real) and not force:
        raise Refused(f"{shown} is read-only (mode {stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}); pass --force to write it anyway (its mode and owner are kept); no file was changed")
    if os.geteuid() != 0 and (st.st_uid != os.geteuid() or st.st_gid not in (os.getegid(), *os.getgroups())):
        raise KvctlError(
            f"{shown} is owned by uid {st.st_uid} gid {st.st_gid}: kvctl (uid {os.geteuid()}) cannot give the rewritten file that owner, "
            "so the engine might no longer read it; run as that user or as root; no file was changed"
        )
    if not os.access(real.parent, os.W_OK | os.X_OK):
        raise KvctlError(f"cannot write {shown}: its directory {real.parent} is not writable (kvctl writes a temp file next to it); no file was changed")


# the staged write lives in kvctl.core.files (one implementation of every atomic write); these names stay importable
TempFile, open_temp = files.TempFile, files.open_temp


def _backup(real: Path) -> Path:
    """A copy next to the file, created 0600 under an unpredictable name, then given its owner, group and mode."""
    return files.write_backup(real)


HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


@contextlib.contextmanager
def _signals_held():
    """Hold Ctrl-C, SIGTERM, SIGHUP and SIGQUIT for the few renames, so a signal cannot leave some files changed
    and others not; a signal that came meanwhile takes effect right after."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def apply(change: Change, backup: bool = True, force: bool = False) -> Change:
    """Write one planned change (backup first); a no-op for an unchanged file."""
    return apply_all([change], backup=backup, force=force)[0]


def apply_all(changes: list[Change], backup: bool = True, force: bool = False) -> list[Change]:
    """Write planned changes all or nothing.

    Every file is checked (read-only, owner, directory) and its new text staged in a temp file
    before any backup is made or any file replaced; a failure on the way removes what this run
    made and leaves every file as it was. Only the renames themselves come last.
    """
    todo = [c for c in changes if c.changed]
    seen: dict[Path, str] = {}
    for c in todo:
        check_writable(c.path, force)
        real = real_path(c.path)
        if real in seen:
            raise InvalidInput(f"{c.path} and {seen[real]} are the same file ({real}); name it once; no file was changed")
        seen[real] = c.path
    staged: dict[str, TempFile] = {}
    baks: dict[str, Path] = {}
    done: list[str] = []
    try:
        for c in todo:
            try:
                staged[c.path] = files.stage(real_path(c.path), c.new_text)
            except OSError as e:
                raise KvctlError(f"cannot write {c.path}: {e.strerror or e}; no file was changed") from e
        if backup:
            for c in todo:
                try:
                    baks[c.path] = _backup(real_path(c.path))
                except OSError as e:
                    raise KvctlError(f"cannot back up {c.path}: {e.strerror or e}; no file was changed") from e
        with _signals_held():
            for c in todo:
                try:
                    staged[c.path].commit()
                except OSError as e:
                    left = f"; already written: {', '.join(done)} (backups kept)" if done else "; no file was changed"
                    raise KvctlError(f"cannot replace {c.path}: {e.strerror or e}{left}") from e
                done.append(c.path)
    except BaseException:
        for t in staged.values():
            t.discard()
        if not done:  # nothing replaced: the backups are not needed
            for b in baks.values():
                with contextlib.suppress(OSError):
                    b.unlink()
        raise
    return [
        Change(c.path, c.kind, c.before, c.after, True, c.diff, c.new_text, str(baks[c.path]) if c.path in baks else None, c.unknown_keys)
        if c.changed else c
        for c in changes
    ]
