"""Fixtures: the stand-in OpenAI server (tests/replay/standin.py) in its own process on a free loopback port."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class StandinServer:
    proc: subprocess.Popen
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def arrivals(self) -> list[dict]:
        with urllib.request.urlopen(self.url + "/_arrivals", timeout=10) as r:
            return json.load(r)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def start_standin(*args: str) -> StandinServer:
    proc = subprocess.Popen([sys.executable, "-m", "tests.replay.standin", *args], cwd=str(ROOT),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()  # "PORT n" once it listens; EOF if it died
    if not line.startswith("PORT "):
        proc.kill()
        proc.wait(timeout=10)
        raise RuntimeError(f"stand-in server did not start: {line!r}")
    return StandinServer(proc, int(line.split()[1]))


@pytest.fixture
def standin_factory():
    """Start stand-in servers with the given options; all are stopped (by pid) after the test."""
    started: list[StandinServer] = []

    def make(*args: str) -> StandinServer:
        s = start_standin(*args)
        started.append(s)
        return s

    try:
        yield make
    finally:
        for s in started:
            s.stop()
