"""`kvctl loading ... --restart-cmd` under SIGTERM, SIGHUP and Ctrl-C: a real kvctl process, real signals.

The config is written before the restart runs; a signal that stops kvctl during the restart must also stop
what the restart command started (it runs in a process group of its own, so it would not get the signal),
say so, and exit 128 + the signal's number.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

KVCTL = str(Path(sys.executable).with_name("kvctl"))
CONFIG = "chunk_size: 256\nremote_url: resp://127.0.0.1:6379\nenable_async_loading: false\n"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _wait(predicate, limit_s: float) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_signal_during_restart_stops_the_restart_and_says_so(tmp_path, sig):
    cfg = tmp_path / "lmcache.yaml"
    cfg.write_text(CONFIG)
    pidfile = tmp_path / "restart-child.pid"
    env = {k: v for k, v in os.environ.items() if k not in ("KVCTL_TESTING", "LMCACHE_CONFIG_FILE")}
    proc = subprocess.Popen(
        [KVCTL, "loading", "async", "--config", str(cfg), "--restart-cmd", f"sleep 60 & echo $! > {pidfile}; wait",
         "--restart-timeout", "120"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    child = None
    try:
        assert _wait(lambda: pidfile.exists() and pidfile.read_text().strip(), 30), "the restart command never started"
        child = int(pidfile.read_text())
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 128 + int(sig), (proc.returncode, out, err)
        assert _wait(lambda: not _alive(child), 5), "the restart command's child outlived kvctl"
        assert "enable_async_loading: true" in cfg.read_text()  # written before the restart began
        assert sig.name in err and "restart" in err and "stopped" in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if child is not None and _alive(child):  # the test's own grandchild: never leave it behind
            os.kill(child, signal.SIGKILL)
