"""README's on-call quick start, the rehearsal block, run word for word (each line as a shell command)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.held_ports import held_ports

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def quick_start_block() -> list[str]:
    section = README.split("## On call: a quick start", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [ln for ln in block.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def test_the_block_is_the_rehearsal():
    lines = quick_start_block()
    assert lines[0].startswith("kvctl drill overload") and "--keep ./drill" in lines[0]
    assert any(ln.startswith("kvctl diagnose --from ./drill/capture") for ln in lines)


@pytest.mark.long
def test_readme_quick_start_runs_word_for_word(tmp_path):
    """Word for word on a busy host (issue 48 item 7): another tier holds 17400.. (real listening sockets)."""
    env = {k: v for k, v in os.environ.items() if k != "KVCTL_BASE_PORT"}
    env.update({"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "KVCTL_HOME": str(tmp_path / "home")})
    outputs = []
    for line in quick_start_block():
        with held_ports():
            p = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
        outputs.append((line, p.returncode, p.stdout[-2000:] + p.stderr[-2000:]))
        if line.startswith("kvctl diagnose"):
            assert p.returncode == 4 and "rho_unstable" in p.stdout, outputs[-1]  # the critical finding it shows
        else:
            assert p.returncode == 0, outputs[-1]
    assert (tmp_path / "drill" / "capture" / "capture.json").is_file()
