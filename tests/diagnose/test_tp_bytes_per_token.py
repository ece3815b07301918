"""`kvctl diagnose --model-config --tp`: B* and ρ use the whole model's bytes per token (issue 13).

The capture is authored from the documented vLLM / kvctl-connector text formats
(tests/diagnose/engine_text.py) and Valkey INFO fields; expectations are worked
out by hand in the docstring.
"""

from __future__ import annotations

import pytest

from tests.diagnose.captures import from_dir, info, write_capture
from tests.diagnose.engine_text import EngineState

LLAMA = "configs/models/llama-3.1-8b.json"


def test_llama_tp8_on_8_instances_of_1_gbps_is_below_breakeven(tmp_path):
    """Llama-3.1-8B bf16, tp 8, one Valkey instance per rank, each delivering 1 GB/s; R = 100k tok/s, T0 = 0.

    s (whole model) = 2 × 32 layers × 8 KV heads × 128 × 2 B = 131072 B/token; per rank 16384.
    100 s window, 100 requests of 1000 tokens, all loaded from L2: 1000 × 131072 = 131.072e6 B per request,
    13.1072e9 B in all. Each rank reads its 16.384e6 B per request at 1 GB/s: 16.384 ms; summed over the
    8 ranks 0.131072 s per request, 13.1072 s in all. B = W × Σbytes / Σseconds = 8 × 13.1072e9 / 13.1072 = 8 GB/s.
    B* = s·R = 131072 × 1e5 = 13.1072 GB/s > 8 GB/s: every hit is slower than recomputing (a warning, exit 3).
    ρ = λ·bytes/B = 1 × 131.072e6 / 8e9 = 0.016384. L2-served tokens/s = 13.1072e9 / 100 / 131072 = 1000.
    With the per-rank 16384 taken for s, B* would read 1.6384 GB/s (no finding) and 8000 tokens/s.
    """
    per_req = 1000 * 131072
    before = EngineState(running=1, kvctl_get_bytes=0, lmcache=False)
    after = before.advance(requests=100, prompt_lengths=[1000] * 100, external_hits=100 * 1000, external_queries=100 * 1000,
                           kvctl_get_bytes=100 * per_req, kvctl_get_s=100 * 8 * (per_req / 8 / 1e9), running=1)
    insts = [(info(0, 0, 0), info(100, 100 * 16384, 100 * per_req / 8)) for _ in range(8)]
    cap = write_capture(tmp_path / "tp8", [(before.text(), after.text())], insts, 100.0)
    d = from_dir(cap, "--model-config", LLAMA, "--tp", "8", "--prefill-rate", "100000", "--t0", "0", code=3)
    assert d["bytes_per_token"] == 131072
    assert d["bytes_per_token_per_rank"] == 16384  # s / W, W = 8 instances (one per rank)
    assert d["bandwidth_gbps"] == pytest.approx(8.0)
    assert d["breakeven_gbps"] == pytest.approx(13.1072)
    assert d["rho"] == pytest.approx(0.016384)
    assert d["l2_tokens_per_s"] == pytest.approx(1000.0)
    assert "bandwidth_below_breakeven" in {f["id"] for f in d["findings"]}
