"""Trace readers and prompt building (no server needed)."""

from __future__ import annotations

import hashlib
import json

import pytest
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.core.errors import InvalidInput
from kvctl.replay.prompts import PromptBuilder, TokenPool
from kvctl.records.trace import read_trace


def write_lines(path, lines):
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return path


def test_mooncake_offsets_are_ms_from_the_first_request(tmp_path):
    p = write_lines(tmp_path / "t.jsonl", [
        {"timestamp": 5000, "input_length": 700, "output_length": 10, "hash_ids": [1, 2]},
        {"timestamp": 5250, "input_length": 300, "output_length": 0, "hash_ids": [1]},
    ])
    tr = read_trace(p)
    assert tr.format == "mooncake"
    assert [r.offset_s for r in tr.requests] == [0.0, 0.25]  # (5250 - 5000) ms
    assert [r.token_count for r in tr.requests] == [700, 300]
    assert tr.requests[0].hash_ids == (1, 2) and tr.requests[0].max_tokens == 10
    assert tr.sha256 == hashlib.sha256(p.read_bytes()).hexdigest()


def test_offset_formats_and_sorting(tmp_path):
    p = write_lines(tmp_path / "t.jsonl", [
        {"offset_s": 2.0, "prompt": "hello there"},
        "",
        {"offset_s": 0.5, "prompt_tokens": 12, "max_tokens": 3},
        {"offset_s": 1.0, "prompt_tokens": [5, 6, 7]},
    ])
    tr = read_trace(p)
    assert tr.format == "offsets"
    assert [r.line for r in tr.requests] == [3, 4, 1]
    assert [r.offset_s for r in tr.requests] == [0.0, 0.5, 1.5]
    assert [r.token_count for r in tr.requests] == [12, 3, None]
    assert tr.requests[1].prompt_token_ids == (5, 6, 7)


def test_malformed_lines_are_rejected_with_their_line_numbers(tmp_path):
    p = write_lines(tmp_path / "bad.jsonl", [
        {"timestamp": 0, "input_length": 10, "hash_ids": [1]},
        "{not json",
        {"timestamp": 10, "input_length": -3, "hash_ids": [1]},
        {"offset_s": 1.0},
        {"timestamp": 20, "input_length": 5, "hash_ids": ["a"]},
        [1, 2],
    ])
    with pytest.raises(InvalidInput) as e:
        read_trace(p)
    msg = str(e.value)
    assert "5 malformed line(s)" in msg
    for expected in ("line 2: not JSON", "line 3: input_length", "line 4: an offset_s line needs prompt",
                     "line 5: hash_ids", "line 6: not a JSON object"):
        assert expected in msg
    assert "line 1" not in msg


def test_malformed_trace_is_a_usage_error_on_the_cli(tmp_path):
    p = write_lines(tmp_path / "bad.jsonl", [{"offset_s": 0, "prompt": "a"}, {"offset_s": "soon", "prompt": "b"}])
    r = CliRunner().invoke(cli, ["replay", str(p), "--dry-run"])
    assert r.exit_code == 2, r.output
    assert "line 2: offset_s must be a non-negative number" in r.output


def test_dry_run_prints_the_schedule_scaled_by_speed(tmp_path):
    p = write_lines(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 1024, "hash_ids": [1, 2]},
        {"timestamp": 3000, "input_length": 512, "hash_ids": [1]},
    ])
    r = CliRunner().invoke(cli, ["replay", str(p), "--dry-run", "--speed", "2", "--json"])
    assert r.exit_code == 0, r.output
    sched = json.loads(r.output)["schedule"]
    assert [s["scheduled_s"] for s in sched] == [0.0, 1.5]  # 3 s ÷ --speed 2
    assert [s["prompt_tokens"] for s in sched] == [1024, 512]
    assert [s["max_tokens"] for s in sched] == [1, 1]


def test_shared_hash_ids_share_exactly_their_block_tokens():
    pool = TokenPool(tuple(range(100, 200)), "test")
    b = PromptBuilder(pool, block_tokens=4, seed=7)
    from kvctl.records.trace import TraceRequest

    r1 = TraceRequest(index=0, offset_s=0, line=1, input_length=10, hash_ids=(11, 12, 13))
    r2 = TraceRequest(index=1, offset_s=0, line=2, input_length=12, hash_ids=(11, 12, 99))
    r3 = TraceRequest(index=2, offset_s=0, line=3, input_length=6)
    p1, p2, p3 = b.build(r1), b.build(r2), b.build(r3)
    assert (len(p1), len(p2), len(p3)) == (10, 12, 6)  # exact token counts
    assert p1[:8] == p2[:8]  # blocks 11 and 12: 2 × 4 tokens in common
    assert p1[8:10] != p2[8:10]
    assert all(100 <= t < 200 for t in p1 + p2 + p3)
    assert PromptBuilder(pool, 4, seed=7).build(r1) == p1  # deterministic


def test_length_prompts_without_a_tokenizer_are_refused():
    from kvctl.records.trace import TraceRequest

    with pytest.raises(InvalidInput, match="--tokenizer"):
        PromptBuilder(None, 16).build(TraceRequest(index=0, offset_s=0, line=1, input_length=5))
    assert PromptBuilder(None, 16).build(TraceRequest(index=0, offset_s=0, line=1, prompt="hi")) == "hi"
