"""Authored captures for `kvctl diagnose --from`: Valkey INFO dicts, a capture directory, the command's JSON.

Engine text comes from :mod:`tests.diagnose.engine_text`; INFO carries the fields kvctl reads as redis-py
parses them. Shared by the tests of the paper's captures and of --tp bytes per token.
"""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.diagnose.capture import Capture, Sample, save_capture
from kvctl.diagnose.sources import GpuSample


def info(get_calls: float, get_usec: float, bytes_out: float) -> dict:
    """An INFO dict with the fields kvctl reads, as redis-py parses them."""
    return {
        "cmdstat_get": {"calls": get_calls, "usec": get_usec, "usec_per_call": (get_usec / get_calls) if get_calls else 0.0},
        "total_net_output_bytes": bytes_out,
        "evicted_keys": 0,
    }


def write_capture(path: Path, engines: list[tuple[str, str]], valkey: list[tuple[dict, dict]], window_s: float, params: dict | None = None) -> Path:
    """A format-2 capture directory: engines as (before, after) text, instances as (before, after) INFO."""
    t0 = 1_790_000_000.0
    g = GpuSample(note="no GPU visible (authored capture)")
    a = Sample(t0, [e[0] for e in engines], [v[0] for v in valkey], g,
               engine_t_s=[t0] * len(engines), valkey_t_s=[t0] * len(valkey))
    b = Sample(t0 + window_s, [e[1] for e in engines], [v[1] for v in valkey], g,
               engine_t_s=[t0 + window_s] * len(engines), valkey_t_s=[t0 + window_s] * len(valkey))
    cap = Capture([f"http://prefill-{i}:8000" for i in range(len(engines))], [f"resp://valkey-{r}:6379" for r in range(len(valkey))],
                  [a, b], params or {}, "2026-11-29T00:00:00+00:00")
    return save_capture(cap, path)


def from_dir(path: Path, *extra: str, code: int) -> dict:
    res = CliRunner().invoke(cli, ["diagnose", "--from", str(path), "--json", "--explain", *extra])
    assert res.exit_code == code, (res.output, res.exception)
    return json.loads(res.stdout)
