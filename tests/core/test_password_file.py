"""The one password-file reader on kvctl's side (issue 32 item 5): kvctl.core.files.read_password_file, files.read_regular
with the mode checked on the same open file. Every module of kvctl/ reads password files through it; it answers as
the engine plugins' reader in kvctl.connector.urls does (same files read, same refusals, never the password quoted)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

from kvctl.core import files
from kvctl.connector import urls
from kvctl.core.errors import InvalidInput
from kvctl.core.thresholds import PASSWORD_FILE_MAX_BYTES

ROOT = Path(__file__).resolve().parents[2]


def _cases(tmp_path: Path) -> list[tuple[str, Path]]:
    """(what, path) of each kind of password file: read, or refused."""
    out = []

    def file(name: str, text: str, mode: int) -> Path:
        p = tmp_path / name
        p.write_text(text)
        p.chmod(mode)
        return p

    for mode in (0o600, 0o400, 0o640, 0o440):
        out.append((f"mode {mode:o}", file(f"pw{mode:o}", "s3cret\n", mode)))
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "pw600")  # how Kubernetes mounts a secret
    out.append(("a link", link))
    for mode in (0o644, 0o604, 0o606):
        out.append((f"open mode {mode:o}", file(f"open{mode:o}", "s3cret\n", mode)))
    out.append(("oversized", file("big", "x" * (PASSWORD_FILE_MAX_BYTES + 1), 0o600)))
    out.append(("blank", file("blank", "  \n", 0o600)))
    out.append(("not UTF-8", file("latin", "", 0o600)))
    (tmp_path / "latin").write_bytes(b"caf\xe9\n")
    out.append(("a directory", tmp_path))
    out.append(("missing", tmp_path / "missing"))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)  # no writer: a blocking open would never return
    out.append(("a FIFO", fifo))
    return out


def _answer(read, path: Path) -> tuple[str, str]:
    try:
        return "read", read(path)
    except InvalidInput as e:
        return "refused", str(e)


def test_kvctls_reader_reads_and_refuses_what_the_plugins_reader_does(tmp_path):
    for what, path in _cases(tmp_path):
        mine, theirs = _answer(files.read_password_file, path), _answer(urls.read_password_file, path)
        assert mine[0] == theirs[0], (what, mine, theirs)
        if mine[0] == "read":
            assert mine[1] == theirs[1], what
        else:
            assert str(path) in mine[1] and "s3cret" not in mine[1], (what, mine)


def test_the_refusals_say_why(tmp_path):
    answers = {what: _answer(files.read_password_file, path) for what, path in _cases(tmp_path)}
    assert answers["mode 600"] == ("read", "s3cret") and answers["a link"] == ("read", "s3cret")
    assert "open to every user (mode 0644): run `chmod 600" in answers["open mode 644"][1]
    assert "over the 4,096-byte cap for a password file" in answers["oversized"][1]
    assert answers["blank"][1].endswith("is empty")
    assert answers["not UTF-8"] == ("read", "caf\ufffd")
    assert "not a regular file" in answers["a directory"][1] and "not a regular file" in answers["a FIFO"][1]
    assert answers["missing"][1].startswith("cannot read password file")


def test_kvctl_reads_password_files_through_kvctl_files_only():
    """tier/targets.py re-exported the connector's reader and tier/spec.py, tier/local.py took it from there."""
    found = []
    for path in sorted((ROOT / "kvctl").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module != "kvctl.core.files" and any(a.name == "read_password_file" for a in node.names):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} from {node.module}")
    assert not found, found
    assert "read_regular(" in Path(files.__file__).read_text().split("def read_password_file", 1)[1].split("\ndef ", 1)[0]
