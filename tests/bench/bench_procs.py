"""A real `kvctl bench` process (the console script) for the signal and orphan tests, and a server's GET count."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import redis

KVCTL = str(Path(sys.executable).with_name("kvctl"))


def start_bench(args: list[str], cwd: Path) -> subprocess.Popen:
    """The bench in its own session, so that a test can Ctrl-C its whole process group like a terminal."""
    env = {k: v for k, v in os.environ.items() if k != "KVCTL_TESTING"}
    return subprocess.Popen(
        [KVCTL, "bench", *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def get_calls(port: int) -> int:
    try:
        with redis.Redis(port=port, socket_timeout=1) as r:
            return int(r.info("commandstats").get("cmdstat_get", {}).get("calls", 0))
    except redis.RedisError:
        return 0


def name_of(p: psutil.Process) -> str:
    """The process' name, "" once it is gone (psutil may say so with NoSuchProcess or, racing the exit, a bare
    FileNotFoundError from /proc/PID/stat: seen once on the 2-core machine under load)."""
    try:
        return p.name()
    except (psutil.Error, OSError):
        return ""
