"""How big a bench this host can run: --embedded maxmemory, client-process and buffer limits, key TTL, exit codes.

Expectations are worked out by hand from the inputs (the arithmetic is in the comments).
"""

from __future__ import annotations

import json

import signal

import pytest
from click.testing import CliRunner

from kvctl.bench.info import ServerInfo
from kvctl.bench.runner import describe_exit, key_ttl_s
from kvctl.bench.spec import BenchSpec, auto_keys, check_host, size_embedded
from kvctl.cli import cli
from kvctl.core.errors import InvalidInput

PAPER = BenchSpec(chunk_bytes=12_400_000, batch=8, clients=8, sweep=True)  # `--embedded 8 --sweep`: clients default = 8


def test_paper_grid_fits_the_old_default_only_after_sizing():
    # the old fixed 1gb: room = 0.8 × (1,073,741,824 − 1,000,000) − 2 × 8 clients × 8 × 12.4e6 (= 1,587,200,000) < 0
    with pytest.raises(InvalidInput, match="room for 0 values"):
        auto_keys(ServerInfo("8.1", 1 << 30, 1_000_000, 0), PAPER)
    s = size_embedded(8, PAPER, available_bytes=23_000_000_000)
    # budget 0.5 × 23e9 = 11.5e9; busiest run (1×8 or 8×1): server buffers 2×8×8×12.4e6 = 1,587,200,000
    #   + client buffers 8×8×12.4e6 = 793,600,000 → 2,380,800,000; bases 8 × 16 MiB = 134,217,728
    # keys = floor((11.5e9 − 2,380,800,000 − 134,217,728) / (8 × 12,400,064)) = floor(90.57) = 90 (< 256 wanted)
    assert s.keys == 90
    # maxmemory = ceil((90 × 12,400,064 + 1,587,200,000) / 0.8) + 16 MiB = 3,379,007,200 + 16,777,216
    assert s.maxmemory_bytes == 3_395_784_416
    # footprint = 8 × (90 × 12,400,064 + 16,777,216) + 2,380,800,000
    assert s.footprint_bytes == 11_443_063_808 <= 11_500_000_000
    # and the runner's own key rule then fits the 90 keys: 0.8 × (3,395,784,416 − 1e6) − 1,587,200,000 = 1,128,627,532.8
    # → floor(/12,400,064) = 91
    assert auto_keys(ServerInfo("8.1", s.maxmemory_bytes, 1_000_000, 0), PAPER) == 91


def test_embedded_too_big_for_the_host_is_refused_with_the_numbers():
    # 2 GB available → budget 1e9 < the busiest run's 2,380,800,000 bytes of buffers alone
    with pytest.raises(InvalidInput, match=r"--embedded 8 .* needs .* GB, more than half of the 2.0 GB"):
        size_embedded(8, PAPER, available_bytes=2_000_000_000)


def test_client_processes_and_buffers_against_the_host():
    one = BenchSpec(chunk_bytes=1_000_000, batch=8, clients=500)
    with pytest.raises(InvalidInput, match="500 client processes on 2 core"):
        check_host(1, one, cores=2, available_bytes=10**12)  # cap max(64, 16 × 2) = 64
    assert check_host(1, BenchSpec(chunk_bytes=1_000_000, clients=64), cores=2, available_bytes=10**12)  # 64: warned
    assert check_host(1, BenchSpec(chunk_bytes=1_000_000, clients=2), cores=2, available_bytes=10**12) == []
    # 40 clients × 8 × 12.4e6 = 3.968e9 of buffers > 0.5 × 4e9
    with pytest.raises(InvalidInput, match="need 4.0 GB"):
        check_host(1, BenchSpec(chunk_bytes=12_400_000, clients=40), cores=64, available_bytes=4_000_000_000)


def test_key_ttl_covers_the_whole_bench():
    # per run: 30 + 5 (start wait) + 10 (duration) + 5 (timeout) + 1 (grace) + 2 × 2 (INFO) = 55 s; 7 runs + 60 s margin
    assert key_ttl_s(BenchSpec(chunk_bytes=1, duration_s=10, timeout_s=5), 7) == 60 + 7 * 55


def test_describe_exit():
    assert describe_exit(1) == "exited with code 1"
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL (out of memory?)"
    assert describe_exit(-signal.SIGSEGV) == "killed by SIGSEGV"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--chunk-bytes", "nan"], "cannot parse size 'nan'"),  # a size (issue 31: one parser for every byte-sized option)
        (["--chunk-bytes", "inf"], "cannot parse size 'inf'"),
        (["--duration", "-inf"], "'-inf' is not a finite number"),
        (["--clients", "500"], "500 client processes on"),
        (["--embedded-maxmemory", "nan"], "cannot parse size"),
    ],
)
def test_bad_numbers_exit_2_before_anything_runs(args, message, monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    result = CliRunner().invoke(cli, ["bench", "--valkey", "resp://127.0.0.1:1", "--chunk-bytes", "1e6", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_bench_sizes_from_a_model_or_the_paper():
    """kvctl.bench.sizing (moved out of the bench command): one chunk of the model, else the paper's 12.4 MB."""
    from pathlib import Path

    from kvctl.bench.sizing import bench_sizes
    from kvctl.core.errors import InvalidInput

    model = str(Path(__file__).resolve().parents[2] / "configs" / "models" / "deepseek-v3.json")
    s = bench_sizes(None, model, "fp8", 256, 8, None, 52200.0)
    assert s.chunk_bytes == 61 * 576 * 256 and s.bytes_per_token == 61 * 576  # MLA: a chunk is the whole latent
    assert s.parameters["bytes_per_token_per_rank"] == 61 * 576 / 8 and s.parameters["chunk_tokens"] == 256
    assert bench_sizes(None, None, None, 256, 1, None, None).chunk_bytes == 12_400_000
    assert bench_sizes(4e6, model, "fp8", 256, 1, 1000.0, None).chunk_bytes == 4_000_000  # given sizes win
    with pytest.raises(InvalidInput, match="--prefill-rate needs"):
        bench_sizes(None, None, None, 256, 1, None, 52200.0)


def test_bench_dir_sizes_itself_to_the_readmes_two_rank_400mb_tier(tmp_path):
    """Issue 31: `kvctl bench --dir` with its defaults failed on the README's own tier (2 ranks, 400mb: 210 MB each)
    with "leaves room for 0 values of 12.4 MB". The sweep's 2 clients × 2 replies in flight × 8 values of 12.4 MB
    are 397 MB: it now runs batches that fit, (0.8 × 210 MB) / (12.4 MB × 5) = 2 values, and says so; a tier that
    holds chunks is benched at their size."""
    import redis

    from kvctl.tier.targets import resolve_targets
    from tests.tier.helpers import free_base_port

    tier = tmp_path / "kv-tier"
    up = CliRunner().invoke(cli, ["deploy-valkey", "up", "--ranks", "2", "--base-port", str(free_base_port(2)), "--maxmemory", "400mb",
                                  "--dir", str(tier), "--json"])
    assert up.exit_code == 0, up.output
    try:
        res = CliRunner().invoke(cli, ["bench", "--dir", str(tier), "--sweep", "--duration", "0.3", "--json"])
        assert res.exit_code == 0, res.output
        p = json.loads(res.stdout)["metadata"]["parameters"]
        assert p["chunk_bytes"] == 12_400_000 and p["batch"] == 2 and "--batch 2 instead of 8" in p["sizing_note"]
        # an explicit --batch is what the user asked for: refused as before, with the figures
        res = CliRunner().invoke(cli, ["bench", "--dir", str(tier), "--sweep", "--duration", "0.3", "--batch", "8"])
        assert res.exit_code == 2 and "leaves room for 0 values" in res.output
        # the engines stored 70 272-byte chunks: the bench measures values of that size
        for t in resolve_targets(tier_dir=tier):
            with redis.Redis(host=t.host, port=t.port) as r:
                r.mset({f"chunk-{i}": b"x" * 70_272 for i in range(4)})
        res = CliRunner().invoke(cli, ["bench", "--dir", str(tier), "--duration", "0.3", "--json"])
        assert res.exit_code == 0, res.output
        p = json.loads(res.stdout)["metadata"]["parameters"]
        assert p["chunk_bytes"] == 70_272 and p["batch"] == 8 and "random keys" in p["chunk_source"]
    finally:
        CliRunner().invoke(cli, ["deploy-valkey", "down", "--dir", str(tier)])
