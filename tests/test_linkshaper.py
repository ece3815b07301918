"""benchmarks/linkshaper.py, the slow link simulate_vs_replay.py puts in front of each Valkey instance.

A real valkey-server behind a real shaper process: replies arrive whole and correct, no faster than the
configured rate (a lower bound only: a busy machine can only make it slower), SETs pass unlimited, and
a small reply is not held behind a large one of another connection for longer than a few slices.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
import redis

SHAPER = Path(__file__).resolve().parents[1] / "benchmarks" / "linkshaper.py"
sys.path.insert(0, str(SHAPER.parents[1]))
from benchmarks import linkshaper  # noqa: E402
MB = 1e6


@pytest.fixture
def shaped(valkey_server):
    """(client through a 1 MB/s link, direct client, shaper process), started and stopped by the benchmarks' helpers."""
    p, port = linkshaper.spawn(valkey_server.host, valkey_server.port, 1)
    try:
        through = redis.Redis(host="127.0.0.1", port=port, socket_timeout=20)
        direct = redis.Redis(host=valkey_server.host, port=valkey_server.port, socket_timeout=20)
        yield through, direct, p
    finally:
        linkshaper.stop([p])
        assert p.returncode is not None  # SIGTERM ends it (or the kill after the grace)


def test_replies_are_whole_and_no_faster_than_the_link(shaped):
    through, direct, _ = shaped
    value = bytes(range(256)) * 4096  # 1 MiB
    t0 = time.monotonic()
    assert through.set("k", value)  # SETs are not limited
    set_s = time.monotonic() - t0
    t0 = time.monotonic()
    got = through.get("k")
    get_s = time.monotonic() - t0
    assert got == value == direct.get("k")
    # 1 MiB at 1 MB/s: at least ~1.05 s less the bucket's burst of 4 × 16 KiB
    assert get_s >= (len(value) - 4 * 16384) / MB * 0.98, get_s
    assert set_s < get_s


def test_a_small_reply_is_not_held_behind_a_large_one(shaped, valkey_server):
    through, direct, p = shaped
    direct.set("big", b"x" * 2_000_000)  # 2 s on the 1 MB/s link
    other = redis.Redis(host="127.0.0.1", port=through.connection_pool.connection_kwargs["port"], socket_timeout=20)
    other.ping()
    done = threading.Event()
    worker = threading.Thread(target=lambda: (through.get("big"), done.set()), daemon=True)
    worker.start()
    time.sleep(0.3)  # the big reply is flowing
    t0 = time.monotonic()
    assert other.exists("big") == 1
    small_s = time.monotonic() - t0
    worker.join(timeout=20)
    assert done.is_set()
    assert small_s < 1.0, small_s  # a slice or two of the big reply (16 KiB each, 16 ms at 1 MB/s), not the 1.7 s it has left
    assert p.poll() is None
