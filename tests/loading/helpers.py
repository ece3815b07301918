"""Helpers the `kvctl loading` tests share (test_loading, test_loading_files, test_loading_vllm)."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from kvctl.cli import cli

CONFIG = """\
# LMCache config for the prefill engines (kept by ops; do not reformat)
chunk_size: 256
local_cpu: true   # L1 in host memory
max_local_cpu_size: 40.0

# L2: one Valkey per rank
remote_url: "resp://valkey-{rank}:6379"
remote_serde: "naive"
enable_async_loading: false  # flipped by kvctl loading
extra_config:
  lookup_timeout_ms: 3000
"""


def run(args, code=0):
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == code, (result.output, result.exception)
    return result


def backups(p: Path) -> list[Path]:
    return sorted(p.parent.glob(p.name + ".*.bak"))
