"""``kvctl bench --engines``: E engines, each one client per instance in lockstep, on real embedded Valkeys.

Whole-prompt times are worked by hand on made-up spans (prompt_times_s); the run against real servers checks
what must hold whatever the host's speed: every engine's ranks loaded the same prompts, the servers sent
exactly the bytes the clients received, and a prompt takes at least as long as its slowest rank's batch.
"""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from kvctl.bench.engines import prompt_times_s, summarize_engines
from kvctl.bench.worker import WorkerResult
from kvctl.cli import cli

SMALL = ["--chunk-bytes", "1e6", "--batch", "2", "--keys", "16"]


def test_prompt_time_is_first_start_to_last_end_by_hand():
    # engine of two ranks, three prompts; rank 1 failed the second (nan), so it is left out
    r0 = WorkerResult(0, 0, engine=0, spans=[(10.0, 10.2), (11.0, 11.1), (12.0, 12.3)])
    r1 = WorkerResult(1, 1, engine=0, spans=[(10.01, 10.5), (11.0, math.nan), (12.0, 12.1)])
    assert prompt_times_s([r0, r1]) == pytest.approx([0.5, 0.3])
    # bytes 2 × 3 MB over a 2 s window: 3 GB/s... per engine: (1e9 + 2e9) B / 2 s = 1.5 GB/s
    r0.bytes, r1.bytes, r0.elapsed_s, r1.elapsed_s = 1_000_000_000, 2_000_000_000, 2.0, 1.5
    (e,) = summarize_engines([r0, r1], engines=1, instances=2)
    assert e.prompts == 2 and e.gbps == pytest.approx(1.5)
    assert e.p50_prompt_ms == pytest.approx(400.0) and e.p99_prompt_ms == pytest.approx(498.0)  # 300 + 0.99 × 200


def test_an_engine_missing_a_rank_has_no_prompts():
    r0 = WorkerResult(0, 0, engine=0, spans=[(0.0, 1.0)])
    (e,) = summarize_engines([r0], engines=1, instances=2)
    assert e.prompts == 0 and e.errors == 1 and e.p99_prompt_ms is None


def test_two_engines_share_two_instances(tmp_path):
    png, saved = tmp_path / "contention.png", tmp_path / "engines.json"
    r = CliRunner().invoke(cli, ["bench", "--embedded", "2", "--embedded-maxmemory", "64mb", "--engines", "2", *SMALL,
                                 "--duration", "1", "--plot", str(png), "--save", str(saved), "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert [(x["instances"], x["clients"], x["engines"]) for x in data["runs"]] == [(2, 1, 1), (2, 2, 2)]
    for run in data["runs"]:
        assert run["errors"] == 0 and len(run["per_engine"]) == run["engines"]
        for e in run["per_engine"]:
            assert e["prompts"] > 0 and e["errors"] == 0
            # a prompt is a batch on each instance, begun together: never shorter than the fastest batch
            assert e["p50_prompt_ms"] >= run["p50_batch_ms"] * 0.5 and e["p99_prompt_ms"] >= e["p50_prompt_ms"]
        # lockstep: each engine's ranks fetched the same number of batches, but for the one the end may cut,
        # so the instances' key counts differ by at most one batch (2 keys) per engine
        ops = [p["ops"] for p in run["per_instance"]]
        assert max(ops) - min(ops) <= 2 * run["engines"]
        # the servers sent what the clients received (12 B of framing a value, plus INFO replies)
        sent = sum(p["server_net_bytes"] for p in run["per_instance"])
        assert run["bytes"] <= sent <= run["bytes"] + run["ops"] * 12 + 2 * 64_000
        assert sum(e["bytes"] for e in run["per_engine"]) == run["bytes"]
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert json.loads(saved.read_text()) == data


def test_engines_with_sweep_is_a_usage_error():
    r = CliRunner().invoke(cli, ["bench", "--embedded", "1", "--engines", "2", "--sweep"])
    assert r.exit_code == 2 and "--engines" in r.output
