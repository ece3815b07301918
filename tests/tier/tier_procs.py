"""The tier tests' real processes: `kvctl` as a child process, and the valkey-servers of a tier directory.

A tier's servers are found the way ``kvctl deploy-valkey down`` finds them: live ``valkey-server`` processes
whose working directory is the tier's directory (they are started in it, and Valkey's ``dir`` is it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import psutil

from tests.hostile.helpers import Ran, kvctl, kvctl_env, limits


def servers_in(d: Path) -> list[int]:
    """pids of the live valkey-server processes whose working directory is ``d``."""
    return sorted(p.pid for p in _valkey_servers() if _cwd(p) == os.path.realpath(d))


def servers_under(root: Path) -> list[int]:
    """pids of the live valkey-server processes working anywhere under ``root``."""
    real = os.path.realpath(root)
    return sorted(p.pid for p in _valkey_servers() if (_cwd(p) or "").startswith(real + os.sep))


def _valkey_servers() -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["name"]):
        try:
            if "valkey-server" in (p.info["name"] or "") and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            pass
    return found


def _cwd(p: psutil.Process) -> str | None:
    try:
        return p.cwd()
    except psutil.Error:
        return None


def deploy(args: list[str], home: Path, timeout_s: float = 60.0, **env: str) -> Ran:
    """``kvctl deploy-valkey ARGS`` as a real child process (no address-space cap: the servers it starts inherit it)."""
    return kvctl(["deploy-valkey", *args], home, timeout_s=timeout_s, preexec=limits(as_bytes=None), env=kvctl_env(home, **env))


def results(ran: Ran) -> dict[str, str]:
    """``down --json``: instance name -> result."""
    return {r["name"]: r["result"] for r in json.loads(ran.stdout)["instances"]}
