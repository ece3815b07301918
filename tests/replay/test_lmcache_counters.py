"""`kvctl replay`'s scrape after the run waits for LMCache's counters (issue 47 item 2).

LMCache 0.5.6 publishes its counters every 10 s (its stats logger), vLLM its own every engine step: read right after
the last answer, `kvctl report`'s L2 share (from lmcache:num_remote_read_bytes) read 0.0625 where it was 0.5 on a
real engine. The stand-in server (tests/replay/standin.py, its own process) publishes LMCache's counters the way
LMCache's logger does: the counts as of its last publish, every --lmcache-publish-s seconds.
"""

from __future__ import annotations

import json
import time

from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.core.thresholds import LMCACHE_PUBLISH_S, REPLAY_LMCACHE_SETTLE_S
from kvctl.records.runfile import read_run
from tests.progress_helpers import progress_lines, run_piped
from tests.replay.standin import LMCACHE_BYTES_PER_TOKEN

#: four requests 0.2 s apart, 16-token blocks: the second shares two blocks with the first, the third repeats it
TRACE = [
    {"timestamp": 0, "input_length": 48, "output_length": 1, "hash_ids": [1, 2, 3]},
    {"timestamp": 200, "input_length": 48, "output_length": 1, "hash_ids": [1, 2, 4]},
    {"timestamp": 400, "input_length": 48, "output_length": 1, "hash_ids": [1, 2, 3]},
    {"timestamp": 600, "input_length": 48, "output_length": 1, "hash_ids": [5, 6, 7]},
]


def test_the_scrape_after_the_run_waits_for_lmcache_to_publish(standin_factory, tmp_path):
    server = standin_factory("--lmcache-publish-s", f"{LMCACHE_PUBLISH_S:g}")  # published 0 at its start, next in 10 s
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(x) + "\n" for x in TRACE))
    out = tmp_path / "run.jsonl"
    t0 = time.monotonic()
    res = run_piped(["replay", str(trace), "--engine-url", server.url, "--out", str(out), "--block-tokens", "16"], tmp_path)
    took = time.monotonic() - t0
    assert res.returncode == 0, res.stderr
    run = read_run(out)
    cached = sum(r["cached_tokens"] for r in run.rows)
    assert cached == 32 + 48 and run.metadata["metrics_before"]["lmcache:num_hit_tokens_total"] == 0
    # read at the last answer this was 0 (the stand-in published last at its start): now every hit of the run
    assert run.summary["metrics_after"]["lmcache:num_hit_tokens_total"] == cached
    assert run.summary["metrics_after"]["lmcache:num_remote_read_bytes_total"] == cached * LMCACHE_BYTES_PER_TOKEN
    assert "metrics_after_error" not in run.summary and "metrics_after_note" not in run.summary
    waits = [ln for ln in progress_lines(res.stderr) if "waiting" in ln and "LMCache" in ln]
    assert len(waits) == 1, res.stderr
    # bounded: the run (0.6 s of offsets), one settle after its last answer, and the process's own start
    assert REPLAY_LMCACHE_SETTLE_S <= took - run.summary["duration_s"] < REPLAY_LMCACHE_SETTLE_S + 10, took
    assert REPLAY_LMCACHE_SETTLE_S <= 12.5
    # the report's L2 share is the engine's: LMCache's bytes ÷ s over vLLM's prompt tokens, = cached over prompt tokens
    rep = CliRunner().invoke(cli, ["report", str(out), "--bytes-per-token", str(LMCACHE_BYTES_PER_TOKEN), "--json"])
    assert rep.exit_code == 0, rep.output
    (r,) = json.loads(rep.stdout)["runs"]
    assert r["l2_token_share"] == cached / (4 * 48) and "lmcache" in r["l2_token_share_source"]


def test_an_engine_without_lmcache_series_is_read_at_once(standin_factory, tmp_path):
    """No lmcache: series (vLLM alone, or kvctl's connector, whose counters move every step): no wait."""
    server = standin_factory()
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(x) + "\n" for x in TRACE))
    out = tmp_path / "run.jsonl"
    t0 = time.monotonic()
    res = CliRunner().invoke(cli, ["replay", str(trace), "--engine-url", server.url, "--out", str(out), "--block-tokens", "16"])
    assert res.exit_code == 0, res.output
    assert time.monotonic() - t0 < LMCACHE_PUBLISH_S / 2 and "waiting" not in res.output
    assert read_run(out).summary["metrics_after"]["vllm:prefix_cache_hits_total"] == 32 + 48
