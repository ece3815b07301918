"""A real ``kvctl replay`` process against the stand-in engine (tests/replay/standin.py), with every outcome a row can
record, stopped by SIGINT; ``kvctl report`` then counts each outcome and they add up (issue 48, item 9)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvctl.cli import cli

ROOT = Path(__file__).resolve().parents[2]
DOC = " ".join(f"w{i}" for i in range(32))  # 32 words: two of the stand-in's 16-token blocks


def test_report_counts_every_outcome_of_a_real_replay_stopped_by_sigint(standin_factory, tmp_path):
    # the 6th request and later wait 120 s: the 5th times out (--timeout 3), the 6th is open at the SIGINT
    server = standin_factory("--slow-after", "4", "--slow-delay-s", "120")
    lines = [
        {"offset_s": 0.0, "prompt": DOC},  # a miss (first sight of the document)
        {"offset_s": 0.2, "prompt": DOC},  # a hit: its 32 tokens cached
        {"offset_s": 0.3, "prompt": "FAIL now"},  # HTTP 500
        {"offset_s": 0.4, "prompt": "ODD_LIST please"},  # an answer the OpenAI API does not allow: an error
        {"offset_s": 0.5, "prompt": "slow one"},  # no answer within --timeout 3: a timeout
        {"offset_s": 4.5, "prompt": "open at the stop"},  # sent, still open at the SIGINT: interrupted
        {"offset_s": 120.0, "prompt": "never sent"},  # due after the stop
    ]
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "run.jsonl"
    env = dict(os.environ, KVCTL_TESTING="1")
    proc = subprocess.Popen([sys.executable, "-m", "kvctl.cli", "replay", str(trace), "--engine-url", server.url, "--out", str(out),
                             "--timeout", "3"], cwd=str(ROOT), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:  # 5 rows written and the 6th request at the engine
            if out.exists() and out.read_text().count('"status"') == 5 and len(server.arrivals()) == 6:
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"the replay never reached 5 rows and 6 sends: {out.read_text() if out.exists() else 'no run file'}")
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 130, stderr
    r = CliRunner().invoke(cli, ["report", str(out), "--json"])
    assert r.exit_code == 0, r.output
    run = json.loads(r.output)["runs"][0]
    assert run["outcomes"] == {"hit": 1, "miss": 1, "ok_no_usage": 0, "http_error": 1, "timeout": 1, "error": 1, "interrupted": 1}
    assert run["requests"] == 6 == sum(run["outcomes"].values())
    assert (run["trace_requests"], run["not_sent"]) == (7, 1)
    assert run["errors"] == 3 and run["interrupted"] is True and run["signal"] == "SIGINT"
    # the stand-in keeps a prefix cache of its own (it exports vllm:prefix_cache_hits) and no L2 counter, and the stop
    # skipped the scrape after the run: from L2 is at most the cached share, and the report says why
    assert run["l2_token_share"] is None
    assert run["l2_token_share_max"] == pytest.approx(run["cached_token_share"]) and run["cached_token_share"] > 0
    assert "prefix cache" in run["l2_token_share_source"] and "SIGINT" in run["l2_token_share_source"]
    table = " ".join(CliRunner().invoke(cli, ["report", str(out)], terminal_width=200).output.split())
    assert "stopped by SIGINT" in table and "≤ " in table
