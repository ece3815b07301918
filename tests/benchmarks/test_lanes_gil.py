"""benchmarks/lanes_gil.py, the GET lanes beside a busy main thread (issue 45), in a short real run.

A real local Valkey: every mode moves the bytes it should (each round GETs every lane's keys whole), the run
reports which reader its connections used, and the lane processes of ``busy-procs`` are gone when it returns.
"""

from __future__ import annotations

import sys
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import lanes_gil  # noqa: E402
from kvctl.connector import resp_conn  # noqa: E402


def test_every_mode_moves_bytes_and_the_lane_processes_end():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    flag = resp_conn.WAITALL_OK
    out = lanes_gil.run(seconds=1.0, value_mb=0.6, lanes=2, keys_per_lane=2, switch_ms=0.5)
    assert set(out["gbps"]) == set(lanes_gil.MODES)
    assert all(v > 0 for v in out["gbps"].values()), out["gbps"]
    assert out["rounds"] >= 1 and out["waitall"] == flag
    assert resp_conn.WAITALL_OK == flag  # the old reader's connections put the flag back
    left = [psutil.Process(p) for p in {p.pid for p in psutil.Process().children(recursive=True)} - before
            if psutil.pid_exists(p)]
    # multiprocessing's resource tracker (shared memory's bookkeeping) lives as long as this process; nothing else may
    lanes_left = [p.cmdline() for p in left
                  if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline())]
    assert not lanes_left
