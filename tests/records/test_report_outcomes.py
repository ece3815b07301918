"""``kvctl report`` counts every outcome a run file holds (issue 48, item 9): the categories add up to the rows, and
the rows with the requests never sent to the trace's total; "from L2" is computed from what the file holds, or says why not.

Run files here: the committed drill sample (kvctl/samples/overload-run.jsonl), the issue's case (a drill run stopped
by SIGINT with 24 requests open), and hand-made ones whose counts are known. A real replay of every outcome against
the stand-in engine is in tests/replay/test_report_of_a_stopped_run.py.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.drill.samples import sample_paths
from kvctl.records.summary import summarize_run
from kvctl.records.runfile import read_run

#: The drill engine's counters before a run (kvctl's connector's, vLLM's, and no vllm:prefix_cache_hits: no cache of its own).
DRILL_BEFORE = {"kvctl:remote_hit_tokens_total": 0.0, "vllm:external_prefix_cache_hits_total": 0.0, "vllm:prompt_tokens_total": 0.0}
#: A vLLM engine's: its own prefix cache (vllm:prefix_cache_hits) beside the connector's counter.
VLLM_BEFORE = {**DRILL_BEFORE, "vllm:prefix_cache_hits_total": 0.0}


def report(*args: str, width: int = 200):
    return CliRunner().invoke(cli, ["report", *args], terminal_width=width)


def row(i: int, status: str = "ok", cached: int | None = 4096, prompt: int = 4160, latency: float = 1.0) -> dict:
    return {"index": i, "scheduled_s": float(i) / 4, "sent_s": float(i) / 4, "first_token_s": None, "finished_s": float(i) / 4 + latency,
            "latency_s": latency, "prompt_tokens": prompt, "cached_tokens": cached if status == "ok" else None,
            "status": status, "in_flight": 1, "capped": False}


def write(path, rows, *, planned=None, before=None, summary=None):
    meta = {"engine_url": "http://127.0.0.1:1", "metrics_before": before}
    if planned is not None:
        meta["requests"] = planned
    lines = [{"metadata": meta}, *rows] + ([{"summary": summary}] if summary is not None else [])
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def issue_case(tmp_path):
    """The issue's run: 106 requests in the trace; 57 answered (53 hits, 4 misses), 24 open at the drill's SIGINT, 25 never sent."""
    rows = [row(i, cached=0 if i < 4 else 4096) for i in range(57)]
    rows += [row(57 + i, status="interrupted by SIGINT before the answer") for i in range(24)]
    summary = {"requests": 106, "finished": 57, "ok": 57, "errors": 0, "max_in_flight": 26, "interrupted": True, "signal": "SIGINT",
               "unfinished": 24, "duration_s": 19.4, "metrics_after": None}
    return write(tmp_path / "run.jsonl", rows, planned=106, before=DRILL_BEFORE, summary=summary)


def test_the_issue_case_counts_interrupted_and_unsent_requests_and_they_add_up(tmp_path):
    r = report(str(issue_case(tmp_path)), "--json")
    assert r.exit_code == 0, r.output
    run = json.loads(r.output)["runs"][0]
    assert run["outcomes"] == {"hit": 53, "miss": 4, "ok_no_usage": 0, "http_error": 0, "timeout": 0, "error": 0, "interrupted": 24}
    assert run["requests"] == 81 == sum(run["outcomes"].values())
    assert (run["trace_requests"], run["not_sent"]) == (106, 25)
    assert run["requests"] + run["not_sent"] == run["trace_requests"]
    assert run["errors"] == 0 and run["unfinished"] == 24 and run["signal"] == "SIGINT"
    table = report(str(issue_case(tmp_path))).output
    assert "interrupted" in table and "not sent" in table, table
    cells = [c.strip() for c in next(ln for ln in table.splitlines() if ln.startswith("│ run")).split("│")[2:-1]]
    # trace, not sent, sent, hits, misses, ok without usage, HTTP errors, timeouts, other errors, interrupted
    assert cells == ["106", "25", "81", "53", "4", "0", "0", "0", "0", "24"], table
    assert "stopped by SIGINT" in " ".join(table.split())


def test_the_issue_case_gives_its_l2_share_from_cached_tokens_on_an_engine_without_a_cache_of_its_own(tmp_path):
    """No counters after the run (the SIGINT skipped that scrape), but the engine keeps no prefix cache of its own: every
    cached token came from L2. 53 hits of 4096 of 57 × 4160 prompt tokens."""
    s = summarize_run(read_run(issue_case(tmp_path)))
    assert s.l2_token_share == pytest.approx(53 * 4096 / (57 * 4160)) == s.cached_token_share
    assert "vllm:prefix_cache_hits" in s.l2_token_share_source and "SIGINT ends the run" in s.l2_token_share_source
    table = " ".join(report(str(issue_case(tmp_path))).output.split())
    assert "│ 0.916 │" in table  # the from-L2 cell (hit rate 0.93, cached 0.916, from L2 0.916)
    assert "run: from L2 0.916: cached_tokens / prompt_tokens of the 57 ok requests" in table


def test_the_committed_drill_sample_adds_up_and_has_its_l2_share():
    path = str(sample_paths()["run"])
    r = report(path, "--json")
    assert r.exit_code == 0, r.output
    run = json.loads(r.output)["runs"][0]
    assert run["outcomes"]["hit"] == 50 and run["outcomes"]["miss"] == 4
    assert sum(run["outcomes"].values()) == run["requests"] == 54
    assert (run["trace_requests"], run["not_sent"]) == (106, 52)
    assert run["l2_token_share"] == pytest.approx(50 * 4096 / (54 * 4160))
    assert run["l2_token_share_source"]


def test_a_vllm_engine_with_its_own_prefix_cache_gets_an_upper_bound_and_the_reason(tmp_path):
    rows = [row(i, cached=0 if i < 2 else 2048) for i in range(10)]
    path = write(tmp_path / "v.jsonl", rows, planned=10, before=VLLM_BEFORE, summary={"interrupted": True, "signal": "SIGTERM", "metrics_after": None})
    s = summarize_run(read_run(path))
    assert s.l2_token_share is None
    assert s.l2_token_share_max == pytest.approx(8 * 2048 / (10 * 4160))
    assert "prefix cache" in s.l2_token_share_source
    table = " ".join(report(str(path)).output.split())
    assert "≤ 0.394" in table and "from L2" in table


def test_every_status_replay_writes_has_its_outcome(tmp_path):
    statuses = ["ok", "http 500: boom", "timeout after 5 s", "error: bad answer: usage is a JSON list, not an object",
                "error: ClientConnectorError: refused", "error: the stream ended before [DONE]", "interrupted by SIGHUP before the answer"]
    rows = [row(i, status=st) for i, st in enumerate(statuses)] + [row(len(statuses), cached=None)]
    s = summarize_run(read_run(write(tmp_path / "o.jsonl", rows, summary={"interrupted": False})))
    assert s.outcomes == {"hit": 1, "miss": 0, "ok_no_usage": 1, "http_error": 1, "timeout": 1, "error": 3, "interrupted": 1}
    from kvctl.records.summary import OUTCOMES

    assert tuple(s.outcomes) == OUTCOMES and sum(s.outcomes.values()) == s.requests == 8
    assert s.errors == 5 and s.unfinished == 1
    assert (s.trace_requests, s.not_sent) == (None, 0)  # a file that does not say the trace's size


def test_l2_share_from_counters_over_the_engines_prompt_tokens_and_why_not(tmp_path):
    rows = [row(i) for i in range(4)]
    after = {"kvctl:remote_hit_tokens_total": 12000.0, "vllm:prompt_tokens_total": 16640.0}
    s = summarize_run(read_run(write(tmp_path / "c.jsonl", rows, before=DRILL_BEFORE, summary={"interrupted": False, "metrics_after": after})))
    assert s.l2_token_share == pytest.approx(12000 / 16640) and "kvctl:remote_hit_tokens" in s.l2_token_share_source
    lm_before, lm_after = {"lmcache:num_remote_read_bytes_total": 0.0}, {"lmcache:num_remote_read_bytes_total": 1e6}
    lm = read_run(write(tmp_path / "l.jsonl", [row(i, cached=None) for i in range(4)], before=lm_before,
                        summary={"interrupted": False, "metrics_after": lm_after}))
    s = summarize_run(lm)
    assert s.l2_token_share is None and s.l2_token_share_max is None and "--bytes-per-token" in s.l2_token_share_source
    bare = read_run(write(tmp_path / "b.jsonl", [row(i, cached=None) for i in range(4)], summary={"interrupted": False, "metrics_after": None}))
    s = summarize_run(bare)
    assert s.l2_token_share is None and "cached_tokens" in s.l2_token_share_source and "counters" in s.l2_token_share_source
    table = " ".join(report(str(tmp_path / "b.jsonl")).output.split())
    assert "b: from L2 —:" in table
