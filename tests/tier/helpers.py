"""Helpers the tier tests share (and the doctor, LMCache and vLLM-config tests): ports, the CLI, processes."""

from __future__ import annotations

import psutil
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.tier.server import free_base_port, free_port, port_in_use  # noqa: F401 - free_base_port re-exported for the tests


def invoke(*args: str):
    return CliRunner().invoke(cli, ["deploy-valkey", *args])


def valkey_pids_on(ports) -> list[int]:
    """pids of valkey-server processes whose title names one of ``ports``."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "valkey-server" in cmd and any(f":{port}" in cmd for port in ports):
            found.append(p.pid)
    return found
