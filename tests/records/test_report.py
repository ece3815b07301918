"""``kvctl report`` on synthetic run files whose latencies are known."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.records.runfile import read_run
from kvctl.records.summary import summarize_run, thirds

LATENCIES = [0.5, 0.1, 0.9, 0.3, 0.7, 2.0, 0.2, 0.4, 0.6, 0.8]  # in scheduled order, one per second
CACHED = [0, 16, 0, 512, 600, 0, 1024, 3, 0, 700]
PROMPT = 1000


def write_run(path, latencies, cached=None, prompt=PROMPT, errors=0, before=None, after=None, in_flight=None):
    lines = [{"metadata": {"engine_url": "http://x", "metrics_before": before}}]
    for i, lat in enumerate(latencies):
        lines.append({
            "index": i, "scheduled_s": float(i), "sent_s": float(i), "first_token_s": i + lat, "finished_s": i + lat,
            "latency_s": lat, "prompt_tokens": prompt, "cached_tokens": None if cached is None else cached[i],
            "status": "ok", "in_flight": 1 if in_flight is None else in_flight[i], "capped": False,
        })
    for j in range(errors):
        k = len(latencies) + j
        lines.append({"index": k, "scheduled_s": float(k), "sent_s": float(k), "first_token_s": None, "finished_s": k + 0.01,
                      "latency_s": 0.01, "prompt_tokens": None, "cached_tokens": None, "status": "http 500: boom", "in_flight": 1})
    lines.append({"summary": {"metrics_after": after, "interrupted": False, "max_in_flight": None if in_flight else 1}})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_percentiles_thirds_and_hit_rate_worked_by_hand(tmp_path):
    run = read_run(write_run(tmp_path / "a.jsonl", LATENCIES, CACHED, errors=2))
    s = summarize_run(run, hit_tokens=512)
    # sorted: 0.1 0.2 0.3 0.4 0.5 0.6 0.7 0.8 0.9 2.0 (n = 10; rank h = 9·q/100)
    assert s.p50_s == pytest.approx(0.55)  # h = 4.5: 0.5 + 0.5·(0.6 − 0.5)
    assert s.p90_s == pytest.approx(1.01)  # h = 8.1: 0.9 + 0.1·(2.0 − 0.9)
    assert s.p99_s == pytest.approx(1.901)  # h = 8.91: 0.9 + 0.91·1.1
    assert s.max_s == 2.0
    assert s.mean_s == pytest.approx(6.5 / 10)
    # thirds in scheduled order, sizes 4, 3, 3: [0.5 0.1 0.9 0.3] [0.7 2.0 0.2] [0.4 0.6 0.8]
    assert s.thirds_p50_s == pytest.approx([0.4, 0.7, 0.6])
    # cached ≥ 512: 512, 600, 1024, 700 → 4 of the 10 ok requests; the 2 errors are not in the latencies
    assert s.hit_rate == pytest.approx(0.4)
    assert s.cached_token_share == pytest.approx((16 + 512 + 600 + 1024 + 3 + 700) / 10000)
    assert (s.requests, s.errors) == (12, 2)


def test_hits_and_misses_apart_worked_by_hand(tmp_path):
    run = read_run(write_run(tmp_path / "a.jsonl", LATENCIES, CACHED))
    by = summarize_run(run, hit_tokens=512).by_class
    # hits (cached ≥ 512): 0.3, 0.7, 0.2, 0.8 → sorted 0.2 0.3 0.7 0.8, h = 3·q/100
    assert by["hit"]["requests"] == 4
    assert by["hit"]["p50_s"] == pytest.approx(0.5) and by["hit"]["p90_s"] == pytest.approx(0.77)
    # misses: 0.5 0.1 0.9 2.0 0.4 0.6 (cached 0, 16, 3 are below 512) → sorted 0.1 0.4 0.5 0.6 0.9 2.0, h = 5·q/100
    assert by["miss"]["requests"] == 6
    assert by["miss"]["p50_s"] == pytest.approx(0.55) and by["miss"]["p99_s"] == pytest.approx(0.9 + 0.95 * 1.1)
    # rows that report no usage say nothing about hits: no classes at all
    assert summarize_run(read_run(write_run(tmp_path / "n.jsonl", LATENCIES))).by_class is None


def test_report_prints_and_emits_the_classes(tmp_path):
    path = write_run(tmp_path / "a.jsonl", LATENCIES, CACHED)
    res = CliRunner().invoke(cli, ["report", str(path), "--hit-tokens", "512", "--json"])
    assert res.exit_code == 0, res.output
    by = json.loads(res.output)["runs"][0]["by_class"]
    assert (by["hit"]["requests"], by["miss"]["requests"]) == (4, 6)
    res = CliRunner().invoke(cli, ["report", str(path), "--hit-tokens", "512"], terminal_width=200)
    assert res.exit_code == 0, res.output
    assert "a: hits p50/p90/p99 0.5/0.77/" in res.output and "s (4) · misses p50/p90/p99 0.55/" in res.output


def test_every_percentile_matches_numpy_linear(tmp_path):
    rng = np.random.default_rng(5)
    lat = [round(float(x), 6) for x in rng.lognormal(-1, 1.2, size=1001)]
    s = summarize_run(read_run(write_run(tmp_path / "r.jsonl", lat)))
    for q, got in ((50, s.p50_s), (90, s.p90_s), (99, s.p99_s)):
        assert got == pytest.approx(float(np.percentile(lat, q, method="linear")), rel=1e-12, abs=0)
    parts = np.array_split(np.array(lat), 3)  # 334, 334, 333 consecutive requests
    assert s.thirds_p50_s == pytest.approx([float(np.percentile(p, 50, method="linear")) for p in parts], rel=1e-12)
    assert s.max_s == max(lat) and s.mean_s == pytest.approx(float(np.mean(lat)), rel=1e-12)


def test_thirds_sizes():
    assert [len(t) for t in thirds(list(range(10)))] == [4, 3, 3]
    assert [len(t) for t in thirds(list(range(2)))] == [1, 1, 0]


def test_l2_share_from_connector_counter_or_lmcache_bytes(tmp_path):
    lat = [0.1] * 4  # 4 ok requests of 1000 prompt tokens = 4000 tokens
    run = read_run(write_run(tmp_path / "c.jsonl", lat, before={"kvctl:remote_hit_tokens_total": 100.0},
                             after={"kvctl:remote_hit_tokens_total": 3100.0}))
    assert summarize_run(run).l2_token_share == pytest.approx(3000 / 4000)
    run = read_run(write_run(tmp_path / "l.jsonl", lat, before={"lmcache:num_remote_read_bytes_total": 0.0},
                             after={"lmcache:num_remote_read_bytes_total": 2048.0 * 1000}))
    assert summarize_run(run).l2_token_share is None  # bytes need --bytes-per-token
    # 2 048 000 bytes ÷ 1024 B/token = 2000 tokens of 4000
    assert summarize_run(run, bytes_per_token=1024).l2_token_share == pytest.approx(0.5)


def test_cli_json_keys_side_by_side_and_plots(tmp_path):
    a = write_run(tmp_path / "h1.jsonl", LATENCIES, CACHED, in_flight=[1, 2, 3, 7, 2, 1, 1, 1, 1, 1])
    b = write_run(tmp_path / "h3.jsonl", [x / 10 for x in LATENCIES], CACHED)
    r = CliRunner().invoke(cli, ["report", str(a), str(b), "--json", "--plot", str(tmp_path / "plots")])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)  # stderr says where each plot went
    runs = data["runs"]
    assert [x["name"] for x in runs] == ["h1", "h3"]
    assert set(runs[0]) >= {"name", "requests", "p50_s", "p90_s", "p99_s", "max_s", "mean_s", "thirds_p50_s", "hit_rate",
                            "l2_token_share", "max_in_flight"}
    assert runs[0]["max_in_flight"] == 7 and runs[1]["max_in_flight"] == 1
    assert runs[0]["capped"] == 0
    assert runs[1]["p50_s"] == pytest.approx(0.055)
    for name in ("latency_over_time.png", "latency_cdf.png", "cache_token_share.png"):
        png = tmp_path / "plots" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = CliRunner().invoke(cli, ["report", str(a), str(b)])
    assert r.exit_code == 0 and "h1" in r.output and "h3" in r.output


def test_malformed_run_file_names_the_line(tmp_path):
    p = write_run(tmp_path / "a.jsonl", LATENCIES)
    lines = p.read_text().splitlines()
    lines[3] = lines[3].replace('"latency_s": 0.9', '"latency_s": "slow"')
    p.write_text("\n".join(lines) + "\n")
    r = CliRunner().invoke(cli, ["report", str(p)])
    assert r.exit_code == 2
    assert "line 4: latency_s" in r.output
    q = tmp_path / "trace.jsonl"
    q.write_text('{"offset_s": 0, "prompt": "x"}\n')
    r = CliRunner().invoke(cli, ["report", str(q)])
    assert r.exit_code == 2 and "not a kvctl run file" in r.output


def test_hit_rate_and_cached_share_count_only_rows_that_report_cached_tokens(tmp_path):
    """Rows without usage (cached_tokens null) say nothing about hits: they leave both ratios' denominators."""
    cached = [0, 16, None, None]
    run = read_run(write_run(tmp_path / "u.jsonl", [0.1, 0.2, 0.3, 0.4], cached))
    s = summarize_run(run, hit_tokens=16)
    assert s.hit_rate == pytest.approx(1 / 2)  # 16 ≥ 16 in 1 of the 2 rows that report cached tokens (not 1 of 4)
    assert s.cached_token_share == pytest.approx(16 / 2000)  # over those 2 rows' 2 × 1000 prompt tokens (not 4000)
