"""What the engine chains call a wrong restart hit (tests/engine/lab_chains.chain_problems), on hand-made results.

The H200 run of 2026-12-05 (benchmarks/results/gpu_engine_tests-h200-2026-12-05.json, lmcache-FLASHMLA-eager): vLLM's
own prefix hit of a prompt took the other side of a bf16 near-tie from its cold run, the tier hit gave the cold run's
tokens, and the check compared the hit's logprobs with the prefix hit's, those of other tokens.
"""

from __future__ import annotations

from tests.engine.lab_chains import Chain, Step, chain_problems

COLD = {"tokens": [9, 9, 4, 4], "logprobs": [-1.0, -1.2, -1.3, -1.4]}
LOCAL_OTHER_SIDE = {"tokens": [9, 7, 7, 7], "logprobs": [-1.0, -1.245, -1.6, -1.7]}


def chain(hit: dict, local: dict = COLD) -> Chain:
    first = Step("eager", "sync", cold=[COLD], local=[local])
    second = Step("eager", "sync", hits=[{"cached": 512, **hit}])
    return Chain("c", [first, second], [[[1] * 600], [[2] * 600]], 256)


def test_a_hit_is_held_to_the_reference_whose_tokens_it_gave():
    assert chain_problems(chain(dict(COLD)), logprob_tol=0.01) == []
    # the prefix hit departed at token 1; the tier hit gave the cold tokens within bf16's rounding: right
    near = {"tokens": COLD["tokens"], "logprobs": [-1.0, -1.204, -1.3, -1.4]}
    assert chain_problems(chain(near, LOCAL_OTHER_SIDE), logprob_tol=0.01) == []
    # the tier hit took the prefix hit's side of the tie: held to the prefix hit
    assert chain_problems(chain(dict(LOCAL_OTHER_SIDE), LOCAL_OTHER_SIDE), logprob_tol=0.01) == []


def test_wrong_tokens_or_far_logprobs_are_still_wrong():
    wrong = {"tokens": [3, 3, 3, 3], "logprobs": [-1.0, -1.2, -1.3, -1.4]}
    (msg,) = chain_problems(chain(wrong, LOCAL_OTHER_SIDE), logprob_tol=0.01)[:1]
    assert "tokens [3, 3, 3, 3] after the restart" in msg
    far = {"tokens": COLD["tokens"], "logprobs": [-1.0, -1.3, -1.3, -1.4]}
    probs = chain_problems(chain(far, LOCAL_OTHER_SIDE), logprob_tol=0.01)
    assert probs == ["c step 1 (eager, sync) prompt 0: logprobs differ from the cold run by 0.1 (> 0.01)"]
    probs = chain_problems(chain(far), logprob_tol=0.01)
    assert probs == ["c step 1 (eager, sync) prompt 0: logprobs differ from the local prefix hit by 0.1 (> 0.01)"]


def test_an_lmcache_reader_whose_engine_died_is_a_problem_and_the_other_mode_still_counts():
    """The H100 run of 2026-12-06 (sixth): the sync reader's engine core died at the deleted chunk (vllm#49250), so
    run_lmcache_faults records its error and goes on to the async reader. The check names the dead engine, and an
    async reader that got every fault right adds nothing."""
    from tests.engine.lab_chains import lmcache_fault_problems

    prompts = [[i] * 1290 for i in range(8)]
    cold = [{"tokens": [i, i]} for i in range(8)]
    ok = {f: {"tokens": [4 + i, 4 + i], "call_s": 0.3, "cached": 1280 if f in ("clean", "after") else 512}
          for i, f in enumerate(("clean", "deleted", "stopped", "after"))}
    good = {**ok, "deleted_key": {"count": 1}, "log": ["LMCache INFO: Retrieved 512 out of 1280 required tokens"]}
    dead = {"clean": {"tokens": [0, 0], "call_s": 0.3, "cached": 1280},
            "error": "generate failed: EngineDeadError: EngineCore encountered an issue.", "log": []}
    probs = lmcache_fault_problems({"cold": cold, "sync": dead, "async": good}, prompts, chunk_tokens=256)
    assert probs[0] == "sync: the reader's engine failed (generate failed: EngineDeadError: EngineCore encountered an issue.)"
    assert probs[1:] and all(p.startswith("sync ") for p in probs[1:])
    assert lmcache_fault_problems({"cold": cold, "async": good}, prompts, chunk_tokens=256, loadings=("async",)) == []
