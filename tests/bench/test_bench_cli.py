"""`kvctl bench` against real embedded valkey-servers: schema, server-side consistency, sweep, faults.

Expected numbers are worked out here from the arguments (bytes = ops × chunk,
B* = s·R, verdicts forced by choosing R far above or below any loopback
bandwidth); the formulas themselves are unit-tested on hand-made results in
test_results.py.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import threading
import time

import pytest
from click.testing import CliRunner

from kvctl.cli import cli

SMALL = ["--chunk-bytes", "2e6", "--batch", "4", "--keys", "16"]
RUN_KEYS = {
    "op", "instances", "clients", "chunk_bytes", "batch", "duration_s", "aggregate_gbps", "per_instance_gbps",
    "p50_batch_ms", "p99_batch_ms", "server_usec_per_get", "server_busy_frac", "server_gbps", "errors", "per_instance",
    "scaling_vs_1x1",
}


def _bench(args, expect=0):
    result = CliRunner().invoke(cli, ["bench", *args, "--json"])
    assert result.exit_code == expect, result.output
    return json.loads(result.stdout), result


def test_json_schema_and_server_counters_match_client(valkey_server):
    data, _ = _bench(["--valkey", valkey_server.url, *SMALL, "--duration", "1", "--write"])
    meta = data["metadata"]
    assert meta["server_versions"][0].count(".") >= 1 and meta["host_cores"] >= 1 and meta["kvctl_version"]
    assert meta["parameters"]["chunk_bytes"] == 2_000_000 and meta["parameters"]["keys_per_instance"] == 16
    assert data["errors"] == 0 and data["verdict"] is None
    assert [r["op"] for r in data["runs"]] == ["set", "get"]
    for run in data["runs"]:
        assert RUN_KEYS <= set(run), RUN_KEYS - set(run)
        assert run["errors"] == 0 and run["instances"] == 1 and run["clients"] == 1
        inst = run["per_instance"][0]
        assert run["ops"] > 0 and run["bytes"] == run["ops"] * 2_000_000 and run["misses"] == 0
        assert run["ops"] % 4 == 0 and run["batches"] == run["ops"] // 4  # whole batches of --batch 4
        # the server counted exactly the commands the client completed (warm-up excluded) ...
        assert inst["server_calls"] == run["ops"]
        # ... and moved the same payload: out for GET (each reply "$2000000\r\n" + value + "\r\n": 12 B of
        # framing, plus one INFO reply < 64 kB), in for SET (the same 12 B around the value, plus the
        # command, key and EX ttl: under 200 B)
        lo, hi = (12, 12) if run["op"] == "get" else (12, 200)
        assert run["ops"] * (2_000_000 + lo) <= inst["server_net_bytes"] <= run["ops"] * (2_000_000 + hi) + 64_000
        assert 0.9 <= run["duration_s"] <= 3.0
        # B = ops × 2 MB over a window of 0.9 to 3 s
        assert run["ops"] * 2e6 / 3.0 / 1e9 <= run["aggregate_gbps"] <= run["ops"] * 2e6 / 0.9 / 1e9
        assert 0 < run["server_busy_frac"] <= 1 and run["server_gbps"] > 0
        assert 0 < run["p50_batch_ms"] <= run["p99_batch_ms"]
    get = data["runs"][1]
    assert get["server_usec_per_get"] > 0 and get["server_usec_per_set"] is None
    assert data["runs"][0]["server_usec_per_set"] > 0


def test_two_instance_sweep_with_verdict_plot_and_save(tmp_path):
    png, saved = tmp_path / "scaling.png", tmp_path / "bench.json"
    data, res = _bench([
        "--embedded", "2", "--embedded-maxmemory", "128mb", "--sweep", *SMALL, "--duration", "1",
        "--prefill-rate", "52200", "--bytes-per-token", "48437.5", "--plot", str(png), "--save", str(saved),
    ])
    assert f"plot: wrote {png}" in " ".join(res.stderr.split())  # issue 22: it did not say where
    grid = [(r["instances"], r["clients"]) for r in data["runs"]]
    assert grid == [(1, 1), (1, 2), (2, 1)]
    assert data["runs"][0]["scaling_vs_1x1"] == 1.0  # the 1 × 1 run against itself (the ratio: test_results.py)
    assert all(r["scaling_vs_1x1"] > 0 for r in data["runs"])
    two = data["runs"][2]
    assert len(two["per_instance_gbps"]) == 2 and all(g > 0 for g in two["per_instance_gbps"])
    assert [p["server_calls"] for p in two["per_instance"]] == [p["ops"] for p in two["per_instance"]]
    assert two["bytes"] == sum(p["ops"] for p in two["per_instance"]) * 2_000_000
    v = data["verdict"]
    assert v["ranks"] == 2  # the run with the most instances is judged
    assert v["breakeven_gbps"] == pytest.approx(2.5284375)  # s·R = 48437.5 B × 52200 tok/s = 2 528 437 500 B/s
    assert v["per_rank_needed_gbps"] == pytest.approx(1.26421875)  # 2.5284375 / 2 ranks
    assert v["bytes_per_token_per_rank"] == pytest.approx(24218.75)  # 48437.5 / 2
    assert v["recompute_us_per_token"] == pytest.approx(19.157088, rel=1e-6)  # 1e6 µs / 52200 tok/s
    assert png.stat().st_size > 5000 and png.read_bytes()[:4] == b"\x89PNG"
    assert json.loads(saved.read_text()) == data


def test_model_config_sets_chunk_and_table_output(valkey_server):
    """DeepSeek-V3 is MLA: (kv_lora_rank 512 + qk_rope_head_dim 64) = 576 elements per token per layer,
    × 61 layers × 1 B (fp8) = 35 136 B per token; a 16-token chunk is 562 176 B = 0.562176 MB.
    B* = 35 136 B × 52 200 tok/s = 1 834 099 200 B/s = 1.834 GB/s."""
    result = CliRunner().invoke(cli, [
        "bench", "--valkey", valkey_server.url, "--model-config", "configs/models/deepseek-v3.json", "--dtype", "fp8",
        "--chunk-tokens", "16", "--batch", "2", "--keys", "8", "--duration", "0.5", "--prefill-rate", "52200",
    ], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    assert "kvctl bench" in result.output and "verdict:" in result.output
    assert "0.562176 MB values" in result.output
    assert "35,136 B × 52,200 tok/s = 1.834 GB/s" in result.output


@pytest.mark.parametrize(
    "prefill_rate, wins, b_star, recompute_us",
    [
        # B* = 48437.5 B × 1 tok/s = 48 437.5 B/s = 4.84375e-5 GB/s: any working tier beats it
        ("1", True, 4.84375e-5, 1e6),
        # B* = 48437.5 B × 1e9 tok/s = 4.84375e13 B/s = 48 437.5 GB/s: no loopback reaches it
        ("1e9", False, 48437.5, 1e-3),
    ],
)
def test_verdict_follows_breakeven(valkey_server, prefill_rate, wins, b_star, recompute_us):
    data, _ = _bench(["--valkey", valkey_server.url, *SMALL, "--duration", "0.5", "--bytes-per-token", "48437.5", "--prefill-rate", prefill_rate])
    v = data["verdict"]
    assert v["breakeven_gbps"] == pytest.approx(b_star)
    assert v["recompute_us_per_token"] == pytest.approx(recompute_us)  # 1e6 µs / R
    assert v["ranks"] == 1 and v["loading_wins"] is wins
    assert ("beats recompute" in v["text"]) is wins and ("recompute wins" in v["text"]) is not wins
    assert (v["load_us_per_token"] < v["recompute_us_per_token"]) is wins  # per token: load s/B vs recompute 1/R


@pytest.mark.parametrize(
    "args, message",
    [
        (["--embedded", "1", "--valkey", "resp://127.0.0.1:1"], "--embedded"),
        ([], "--valkey"),
        (["--valkey", "resp://127.0.0.1:1", "--prefill-rate", "100"], "--bytes-per-token"),
        (["--valkey", "resp://127.0.0.1:1", "--batch", "8", "--keys", "4"], "fewer than one batch"),
        (["--valkey", "http://127.0.0.1:1"], "scheme"),
    ],
)
def test_bad_input_exits_2(args, message):
    result = CliRunner().invoke(cli, ["bench", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_unreachable_exits_5():
    from kvctl.tier.server import free_port

    result = CliRunner().invoke(cli, ["bench", "--valkey", f"resp://127.0.0.1:{free_port()}", *SMALL, "--duration", "0.5"])
    assert result.exit_code == 5, result.output
    assert "cannot reach" in result.output


def test_maxmemory_too_small_for_a_batch_exits_2(valkey_factory):
    srv = valkey_factory(settings={"maxmemory": "8mb"})
    result = CliRunner().invoke(cli, ["bench", "--valkey", srv.url, "--chunk-bytes", "4e6", "--batch", "4", "--duration", "0.5"])
    assert result.exit_code == 2, result.output
    msg = " ".join(result.output.split())
    assert "maxmemory" in msg
    # issue 22: the message says where the memory went (the reserve for replies in flight: 2 × 1 × 4 × 4 MB)
    assert "32 MB is reserved for the replies in flight (2 × 1 client(s) × 4 × 4 MB)" in msg and "may fill 80%" in msg


def _fault_run(args, act, at_s, port):
    """Run the bench; ``act`` lands ``at_s`` after the clients' GETs reached ``port`` (bounded wait), i.e. mid-run."""
    import redis

    done = threading.Event()

    def fire():
        deadline = time.monotonic() + 20
        while not done.is_set() and time.monotonic() < deadline:
            try:
                with redis.Redis(port=port, socket_timeout=1) as r:
                    if int(r.info("commandstats").get("cmdstat_get", {}).get("calls", 0)) > 8:  # past the warm-up batch
                        break
            except redis.RedisError:
                pass
            time.sleep(0.05)
        if not done.wait(at_s):
            act()

    th = threading.Thread(target=fire, daemon=True)
    t0 = time.monotonic()
    th.start()
    try:
        data, result = _bench(args, expect=5)
    finally:
        done.set()
        th.join(timeout=25)
    return data, result, time.monotonic() - t0


def test_killed_server_mid_run(valkey_factory):
    healthy, doomed = valkey_factory(), valkey_factory()
    duration, timeout = 2.0, 1.0
    data, result, wall = _fault_run(
        ["--valkey", healthy.url, "--valkey", doomed.url, *SMALL, "--duration", str(duration), "--timeout", str(timeout)],
        lambda: os.kill(doomed.pid, signal.SIGKILL),
        at_s=0.3,
        port=doomed.port,
    )
    assert wall < duration + timeout + 6, wall  # start-up, one INFO timeout, process teardown
    run = data["runs"][0]
    ok, dead = run["per_instance"]
    assert ok["errors"] == 0 and ok["ops"] > 0 and ok["server_calls"] == ok["ops"]
    # it served GETs before the kill, then its client failed (and its counters could not be read)
    assert dead["ops"] > 0 and dead["errors"] >= 2 and dead["first_error"] and dead["server_calls"] is None
    assert data["errors"] == run["errors"] == dead["errors"]
    assert "rank 1" in result.stderr


def test_stalled_server_mid_run(valkey_server):
    duration, timeout = 1.5, 1.0
    try:
        data, _, wall = _fault_run(
            ["--valkey", valkey_server.url, *SMALL, "--duration", str(duration), "--timeout", str(timeout)],
            lambda: os.kill(valkey_server.pid, signal.SIGSTOP),
            at_s=0.3,
            port=valkey_server.port,
        )
    finally:
        os.kill(valkey_server.pid, signal.SIGCONT)
    assert wall < duration + timeout + 6, wall
    inst = data["runs"][0]["per_instance"][0]
    assert inst["errors"] > 0
    assert "Timeout" in inst["first_error"] or "timed out" in inst["first_error"] or "INFO failed" in inst["first_error"]


def test_library_from_a_main_without_file(valkey_server):
    """Clients must not re-run the caller's __main__ (a script, or stdin here, which would crash them)."""
    import subprocess
    import sys

    code = (
        "from kvctl.bench.runner import run_bench\n"
        "from kvctl.bench.spec import BenchSpec\n"
        "from kvctl.tier.targets import Target\n"
        f"t = Target(0, '127.0.0.1', {valkey_server.port}, '{valkey_server.url}')\n"
        "r = run_bench([t], BenchSpec(chunk_bytes=1_000_000, batch=2, keys=4, duration_s=0.5)).runs[0]\n"
        "print(r.errors, r.ops)\n"
    )
    out = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    errors, ops = map(int, out.stdout.split())
    assert errors == 0 and ops > 0, out.stderr


def test_save_over_an_existing_file_replaces_it_in_one_rename(valkey_server, tmp_path):
    """--save FILE that exists (a dashboard may be reading it): written beside and renamed over it, so a reader
    sees the old JSON or the new, never a prefix; the file's mode is kept and nothing is left beside it."""
    saved = tmp_path / "bench.json"
    saved.write_text('{"old": true}\n')
    saved.chmod(0o640)
    ino = saved.stat().st_ino
    data, _ = _bench(["--valkey", valkey_server.url, *SMALL, "--duration", "0.5", "--save", str(saved)])
    assert saved.stat().st_ino != ino and stat.S_IMODE(saved.stat().st_mode) == 0o640
    assert json.loads(saved.read_text()) == data
    assert [p.name for p in tmp_path.iterdir() if p.name != "valkey"] == ["bench.json"]
