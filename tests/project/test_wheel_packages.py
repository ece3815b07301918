"""Issue 48 item 13: building kvctl prints no setuptools "Package would be ignored" warning.

`make demo` printed ~60 lines of them: kvctl/samples/ (and kvctl/samples/models/) are directories Python can import
as packages, installed as package data but absent from setup.cfg's `packages`. The wheel is built from a copy of
the sources (the shared tree stays untouched), without build isolation (no download), verbosely so setuptools'
warnings reach the output; every data directory that ships must be a listed package, whatever it is named.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("setup.cfg", "pyproject.toml", "README.md", "kvctl", "connector", "plugins")


def test_wheel_builds_without_package_would_be_ignored(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        p = ROOT / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(p, src / name)
    out = tmp_path / "wheel"
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-v", "-w", str(out), "."],
                       cwd=src, capture_output=True, text=True, timeout=120)
    text = p.stdout + p.stderr
    assert p.returncode == 0, text[-3000:]
    ignored = [ln.strip() for ln in text.splitlines() if "would be ignored" in ln or "as an importable package" in ln]
    assert not ignored, ignored
    (wheel,) = out.glob("kvctl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "kvctl/samples/calib-trace.jsonl" in names and "kvctl/samples/models/deepseek-v3.json" in names
