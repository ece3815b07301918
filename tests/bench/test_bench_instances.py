"""`kvctl bench` over a tier of K instances per rank: per instance (rank r instance i), per rank (the sum over
its K instances) and the verdict per rank, on hand-made results and on a real `deploy-valkey up` tier."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvctl.bench.info import ServerDelta
from kvctl.bench.results import summarize_run, summarize_verdict
from kvctl.bench.worker import WorkerResult
from kvctl.cli import cli
from tests.tier.helpers import free_base_port


def _w(wid, inst, nbytes, elapsed=1.0):
    return WorkerResult(wid, inst, True, True, 1, 2, 0, nbytes, 0, None, elapsed, [0.1])


def test_a_ranks_bandwidth_is_the_sum_over_its_instances():
    """W = 2 ranks × K = 2 instances, 1 GB/s each: 2 GB/s per rank, 4 for the tier; B* = 3 GB/s is beaten by the
    tier, and per rank (s/W)·R = 1.5 GB/s < 2 GB/s (judged per instance, 1 GB/s < 1.5, it would look lost)."""
    workers = [_w(n, n, 1_000_000_000) for n in range(4)]
    run = summarize_run("get", [0, 0, 1, 1], list("abcd"), 1, 10, 1, workers, [ServerDelta(1, 1, 1, 1)] * 4,
                        instances=[0, 1, 0, 1], instances_per_rank=2)
    assert run.ranks == 2 and run.per_rank_gbps == pytest.approx((2.0, 2.0))
    assert [(p.rank, p.instance, p.name) for p in run.per_instance] == [
        (0, 0, "rank 0 instance 0"), (0, 1, "rank 0 instance 1"), (1, 0, "rank 1 instance 0"), (1, 1, "rank 1 instance 1")]
    v = summarize_verdict([run], 60_000, 50_000)  # B* = 3 GB/s
    assert v.ranks == 2 and v.instances == 4
    assert v.per_rank_gbps == pytest.approx(2.0) and v.per_rank_needed_gbps == pytest.approx(1.5)
    assert v.bytes_per_token_per_rank == 30_000 and v.loading_wins
    assert v.text.startswith("2 rank(s) × 2 instances deliver 4.000 GB/s per prompt (2.000 GB/s per rank)")
    one = summarize_run("get", [0, 1], list("ab"), 1, 10, 1, workers[:2], [ServerDelta(1, 1, 1, 1)] * 2)
    assert one.ranks == 2 and [p.name for p in one.per_instance] == ["rank 0", "rank 1"]  # K = 1: as before
    assert summarize_verdict([one], 60_000, 50_000).text.startswith("2 instance(s) deliver")


def test_bench_of_a_dir_tier_with_two_instances_per_rank(tmp_path):
    """A real tier of 1 rank × 2 instances: every instance served the GETs of its own client, and the rank's
    bandwidth is what its two instances delivered together."""
    d = tmp_path / "tier"
    runner = CliRunner()
    up = runner.invoke(cli, ["deploy-valkey", "up", "--ranks", "1", "--instances-per-rank", "2", "--base-port", str(free_base_port(2)),
                             "--maxmemory", "128mb", "--dir", str(d)])
    assert up.exit_code == 0, up.output
    try:
        res = runner.invoke(cli, ["bench", "--dir", str(d), "--chunk-bytes", "1e6", "--batch", "4", "--keys", "8", "--duration", "0.5",
                                  "--prefill-rate", "1e9", "--bytes-per-token", "1000", "--json"])
        assert res.exit_code == 0, res.output
        data = json.loads(res.stdout)
        assert data["metadata"]["parameters"]["instances_per_rank"] == 2
        (run,) = data["runs"]
        assert run["instances"] == 2 and run["ranks"] == 1 and run["errors"] == 0
        per = run["per_instance"]
        assert [(p["rank"], p["instance"]) for p in per] == [(0, 0), (0, 1)]
        assert all(p["server_calls"] == p["ops"] > 0 for p in per)  # each instance counted its own client's GETs
        assert run["per_rank_gbps"] == pytest.approx([sum(p["client_gbps"] for p in per)])
        assert data["verdict"]["ranks"] == 1 and data["verdict"]["instances"] == 2
        table = runner.invoke(cli, ["bench", "--dir", str(d), "--chunk-bytes", "1e6", "--batch", "4", "--keys", "8", "--duration", "0.3"])
        assert table.exit_code == 0, table.output
        assert "r0 " in table.output and "2 instances per rank" in table.output
    finally:
        runner.invoke(cli, ["deploy-valkey", "down", "--dir", str(d), "--purge"])
