""""GPU idle" is two facts with two thresholds (kvctl.core.thresholds), and the output says which one.

* ``diagnose stalls``: the GPUs are IDLE when even the busiest is below GPU_IDLE_PCT (5 %) at the
  moment of the dump: a stalled lookup holds the engine step, nothing runs.
* ``diagnose``'s queue_growing_gpu_idle: the queue grows while the GPUs' MEAN utilisation over the
  window is below GPU_NOT_COMPUTE_BOUND_PCT (30 %): not compute-bound, though not necessarily idle.

GPU utilisation is given as NVML would report it (no GPU here: the numbers are the test's).
"""

from __future__ import annotations

from kvctl.diagnose import stalls
from kvctl.diagnose.analysis import Params, analyse
from kvctl.diagnose.capture import Capture, Sample
from kvctl.diagnose.sources import GpuSample
from kvctl.core.thresholds import GPU_NOT_COMPUTE_BOUND_PCT
from tests.diagnose.engine_text import EngineState

BASE = EngineState(engines=1)


def queue_finding(utils: list[float]):
    """Waiting requests 1 → 9 over a 1 s window, with the GPUs at ``utils`` in both samples."""
    g = GpuSample(utils, ["H200"] * len(utils))
    a, b = BASE.advance(waiting=1), BASE.advance(requests=2, prompt_lengths=[1000, 1000], waiting=9)
    d = analyse(Capture(["http://engine:8000"], [], [Sample(100.0, [a.text()], [], g), Sample(101.0, [b.text()], [], g)], {}), Params())
    (f,) = [f for f in d.findings if f.id.startswith("queue")]
    return f


def test_the_two_thresholds_are_the_two_facts():
    assert Params().gpu_idle_pct == GPU_NOT_COMPUTE_BOUND_PCT  # diagnose's Params: the mean-utilisation threshold


def test_stalls_calls_gpus_idle_only_below_5_percent_on_the_busiest():
    assert stalls._gpu_text((0.0, 4.9), "") == "GPUs idle, all below 5% (0%, 4.9%)"
    # 4 % and 6 %: one GPU runs kernels, so not idle for stalls (though the 5 % mean is "not compute-bound" for diagnose)
    assert stalls._gpu_text((4.0, 6.0), "") == "GPUs busy (4%, 6%)"


def test_diagnose_says_not_compute_bound_with_its_threshold_not_idle():
    """Two GPUs at 20 % and 24 %: mean (20 + 24) / 2 = 22 % < 30 % → critical, worded as not compute-bound."""
    f = queue_finding([20.0, 24.0])
    assert (f.id, f.severity) == ("queue_growing_gpu_idle", "critical")
    assert "GPUs averaged 22% busy, below the 30%" in f.message and "not compute-bound" in f.message
    assert "idle" not in f.message
    # mean (30 + 34) / 2 = 32 % ≥ 30 %: a compute-bound queue, a warning
    f = queue_finding([30.0, 34.0])
    assert (f.id, f.severity) == ("queue_growing", "warning") and "GPUs averaged 32% busy" in f.message
