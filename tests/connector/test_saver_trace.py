"""The worker's bounded background saver (connector/saver.py) and the opt-in trace (connector/trace.py)."""

from __future__ import annotations

import json
import os
import threading
import time


from kvctl.connector.saver import Saver
from kvctl.connector.trace import Trace


def test_saves_run_in_order_and_a_drain_waits_for_them():
    done = []
    s = Saver(lambda item: (time.sleep(0.01), done.append(item)))
    for i in range(5):
        assert s.submit(i) == "queued"
    res = s.drain(5.0)
    assert done == [0, 1, 2, 3, 4] and res.written == 5 and res.abandoned == 0
    assert s.submit(9) == "closed"  # drained: no more saves


def test_a_stuck_save_is_abandoned_after_the_bound_with_the_queue_behind_it():
    release = threading.Event()
    s = Saver(lambda item: release.wait(10))
    for i in range(4):
        s.submit(i)
    time.sleep(0.05)  # the first is running
    t0 = time.monotonic()
    res = s.drain(0.3)
    assert 0.25 < time.monotonic() - t0 < 2.0
    assert res.abandoned == 4 and res.written == 0  # 1 running + 3 queued
    release.set()


def test_the_pending_saves_bytes_are_bounded_and_a_save_past_the_bound_is_refused_at_once():
    """A tier slower than the saves: what waits is bounded in bytes, the refusal is immediate (the engine's step
    never waits), a save is always taken when none is pending, and the bytes come free as saves finish."""
    release = threading.Event()
    ran = []
    s = Saver(lambda item: (release.wait(10), ran.append(item)), max_bytes=100)
    assert s.submit("big", 500) == "queued"  # nothing pending: taken, however large
    t0 = time.monotonic()
    assert s.submit("a", 1) == "full"  # 500 pending already pass the bound
    assert time.monotonic() - t0 < 0.05
    release.set()
    assert s.wait_idle(5.0) and s.pending_bytes == 0 and ran == ["big"]
    release.clear()
    assert [s.submit(x, 40) for x in "bcd"] == ["queued", "queued", "full"]  # 40 + 40 + 40 > 100
    assert s.pending_bytes == 80
    release.set()
    assert s.wait_idle(5.0) and ran == ["big", "b", "c"] and s.pending_bytes == 0
    assert s.submit("e", 100) == "queued"
    assert s.drain(5.0).abandoned == 0 and s.pending_bytes == 0


def test_a_failing_save_does_not_stop_the_saver():
    out = []

    def fn(item):
        if item == 1:
            raise RuntimeError("tier down")
        out.append(item)

    s = Saver(fn)
    for i in range(3):
        s.submit(i)
    assert s.wait_idle(5.0) and out == [0, 2]
    assert s.drain(1.0).abandoned == 0


def test_trace_writes_one_json_line_per_event(tmp_path):
    path = tmp_path / "t.jsonl"
    tr = Trace(str(path))
    assert tr.on
    tr.event("load", req="r1", get_s=0.5)
    tr.event("save", chunks=3)
    tr.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["ev"] for x in lines] == ["load", "save"] and lines[0]["req"] == "r1" and lines[0]["pid"] == os.getpid()
    assert lines[0]["t"] <= lines[1]["t"]
    assert oct(path.stat().st_mode & 0o777) == "0o600"


def test_trace_refuses_a_planted_symlink_and_stays_off(tmp_path, caplog):
    target = tmp_path / "victim"
    target.write_text("keep me\n")
    link = tmp_path / "t.jsonl"
    link.symlink_to(target)
    tr = Trace(str(link))
    assert not tr.on
    tr.event("load")  # a no-op
    assert target.read_text() == "keep me\n"
    assert "cannot be opened" in caplog.text


def test_trace_is_off_without_the_variable(monkeypatch):
    monkeypatch.delenv("KVCTL_CONNECTOR_TRACE", raising=False)
    assert not Trace().on
