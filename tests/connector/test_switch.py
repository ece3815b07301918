"""kvctl.connector.switch: the process's switch interval lowered while loads run, counted across overlapping holders."""

from __future__ import annotations

import sys
import threading

import pytest

from kvctl.connector import switch


@pytest.fixture(autouse=True)
def _own_interval():
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(before)


def test_a_lowered_block_sets_the_interval_and_gives_the_processs_own_back():
    with switch.lowered(0.5):
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    assert sys.getswitchinterval() == pytest.approx(0.005)
    with switch.lowered(None):  # unset: left alone
        assert sys.getswitchinterval() == pytest.approx(0.005)


def test_overlapping_holders_keep_the_shortest_until_the_last_one_ends():
    """A layered load (0.5 ms) and an async one (0.2 ms) overlap on two threads, and end in either order."""
    inside, release = threading.Event(), threading.Event()
    seen = {}

    def async_load():
        with switch.lowered(0.2):
            inside.set()
            release.wait(10)

    t = threading.Thread(target=async_load)
    h = switch.lower(0.0005)
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    t.start()
    assert inside.wait(10)
    seen["both"] = sys.getswitchinterval()
    switch.restore(h)  # the layered load ends first: the async one's shorter interval stays
    seen["async only"] = sys.getswitchinterval()
    release.set()
    t.join(10)
    assert seen == {"both": pytest.approx(0.0002), "async only": pytest.approx(0.0002)}
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_a_longer_interval_is_never_set_and_a_block_that_raises_still_restores():
    with switch.lowered(50):  # 50 ms asked for, 5 ms already: never raised
        assert sys.getswitchinterval() == pytest.approx(0.005)
    with pytest.raises(RuntimeError):
        with switch.lowered(0.1):
            raise RuntimeError("a load failed")
    assert sys.getswitchinterval() == pytest.approx(0.005)
    with pytest.raises(ValueError, match="positive"):
        switch.lower(0)
