"""Run kvctl as an on-call pipe does (stdout and stderr pipes, no TTY) and split its progress lines (issue 31, item 6)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: a progress line on stderr: "kvctl <what>: ..." (render.progress / render.replay_progress without a TTY)
PROGRESS_LINE = re.compile(r"^kvctl (bench|diagnose|replay): ")


def run_piped(args: list[str], tmp_path: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_", "_KVCTL"))}
    env.update(KVCTL_HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "kvctl.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, cwd=str(tmp_path))


def progress_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if PROGRESS_LINE.match(ln)]
