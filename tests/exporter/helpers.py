"""Helpers the exporter tests share: the authored engine states and parameters, scraping, a real
`kvctl exporter` process, and the alert rules file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvctl.diagnose.analysis import Params
from tests.diagnose.engine_text import EngineState

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "configs" / "prometheus" / "kvctl-alerts.yaml"

S_BPT, R, T0 = 48437.5, 52200.0, 0.1
PARAMS = Params(bytes_per_token=S_BPT, prefill_rate=R, t0_s=T0)
BASE = EngineState()
# 10 requests of 16 000 tokens, 40 000 of their 160 000 prompt tokens from L2; LMCache read 2e9 B in 4 GETs of 500 ms
AFTER = BASE.advance(requests=10, prompt_lengths=[16000] * 10, external_hits=40000, remote_read_bytes=2e9, remote_get_ms=[500] * 4)


def scrape(url: str, timeout_s: float = 5.0) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        text = resp.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def one(values, name, **labels):
    return values[(name, tuple(sorted((k, str(v)) for k, v in labels.items())))]


def names(values):
    return {k[0] for k in values}


def load_rules() -> list[dict]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def rules_by_name() -> dict[str, dict]:
    return {r["alert"]: r for r in load_rules()}


class ExporterProcess:
    """The real `kvctl exporter` (``args`` after the subcommand), started with ``--listen 127.0.0.1:0 --json``.

    Inside the ``with``: ``start`` is its "listening" line. On leaving it gets SIGTERM (killed if it has not exited
    within 15 s, or if the body raised); ``returncode``, ``out`` and ``err`` are then set."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.args, self.env = args, env if env is not None else {**os.environ, "KVCTL_TESTING": "1"}

    def __enter__(self) -> "ExporterProcess":
        self.proc = subprocess.Popen([sys.executable, "-m", "kvctl.cli", "exporter", "--listen", "127.0.0.1:0", *self.args, "--json"],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env)
        try:
            self.start = json.loads(self.proc.stdout.readline() or "{}")
            assert self.start.get("event") == "listening", self.proc.stderr.read() if self.proc.poll() is not None else self.start
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, exc_type, *_) -> None:
        try:
            if exc_type is None:
                self.proc.send_signal(signal.SIGTERM)
                self.out, self.err = self.proc.communicate(timeout=15)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.out, self.err = self.proc.communicate()
        self.returncode = self.proc.returncode
