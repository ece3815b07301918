"""Shared bits of the stall programs: a bounded lifetime and a READY line.

Every program exits by itself after ``--lifetime`` seconds (``os._exit`` from
a timer thread, which works even while the main thread is blocked in C), so a
crashed test run never leaves a stuck process behind.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading


def parse_args(extra=None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--lifetime", type=float, default=60.0, help="exit after this many seconds")
    p.add_argument("--tag", default="", help="ignored: a unique word for finding this process by command line")
    for args, kwargs in extra or ():
        p.add_argument(*args, **kwargs)
    ns = p.parse_args()
    t = threading.Timer(ns.lifetime, os._exit, (0,))
    t.daemon = True
    t.name = "lifetime-watchdog"
    t.start()
    return ns


def ready(what: str = "") -> None:
    """Tell the parent the stall is in place."""
    sys.stdout.write(f"READY {what}\n".rstrip() + "\n")
    sys.stdout.flush()
