"""Issue 48 item 15: λ from the states an engine publishes, read by the real ``kvctl diagnose`` between its samples.

The engine is a real HTTP server on 127.0.0.1 that publishes as vLLM 0.32 does: at the end of each step, the state as
of the step's start (what arrived during a step waits outside waiting and running). It idles until diagnose's first
read, then requests arrive at 10/s and, past a short first step, each step lasts 2 s (a synchronous load): at the end
of the window 20 to 40 requests are in no gauge, and finished + queue growth reads λ about half of what arrived.
"""

from __future__ import annotations

import json
import math
import threading
import time

import pytest
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.diagnose.arrivals import BASIS_QUEUE, BASIS_STATES, State, states_rate
from tests.diagnose.metrics_server import MetricsServer

RATE, FIRST_STEP_S, STEP_S, IDLE_S = 10.0, 0.2, 2.0, 0.3


class SteppingEngine:
    """vLLM's publishing, in time since its first /metrics read (T0 = that read + IDLE_S)."""

    def __init__(self) -> None:
        self.t0: float | None = None
        self.lock = threading.Lock()

    def arrived(self, t: float) -> int:
        return max(0, math.floor(RATE * t))

    def text(self) -> str:
        with self.lock:
            now = time.monotonic()
            if self.t0 is None:
                self.t0 = now + IDLE_S
            t = now - self.t0
        ends = [FIRST_STEP_S + STEP_S * k for k in range(1000)]  # step j covers [ends[j-1], ends[j]], step 0 [0, ends[0]]
        done = [e for e in ends if e <= t]
        k = len(done) - 1  # the last step that ended
        if k < 0:
            finished = queue = steps = 0
        else:
            start = ends[k - 1] if k else 0.0  # that step began here: the state counts what had arrived by then
            before = (ends[k - 2] if k >= 2 else 0.0) if k else 0.0
            finished = self.arrived(before) if k else 0  # a request finishes the step after the one that admitted it
            queue = self.arrived(start) - finished
            steps = k + 1
        return "\n".join([
            "# TYPE vllm:request_success counter", f'vllm:request_success_total{{finished_reason="stop"}} {finished}',
            "# TYPE vllm:num_requests_waiting gauge", f"vllm:num_requests_waiting {queue}",
            "# TYPE vllm:num_requests_running gauge", "vllm:num_requests_running 0",
            "# TYPE vllm:iteration_tokens_total histogram", f"vllm:iteration_tokens_total_count {steps}",
            f"vllm:iteration_tokens_total_sum {steps}", f'vllm:iteration_tokens_total_bucket{{le="+Inf"}} {steps}',
        ]) + "\n"


def test_lambda_counts_what_waits_outside_the_gauges():
    eng = SteppingEngine()
    window = 8.0
    with MetricsServer(eng.text) as srv:
        res = CliRunner().invoke(cli, ["diagnose", "--engine-url", srv.url, "--window", str(window), "--json"])
        hits = srv.hits
    d = json.loads(res.stdout)
    truth = RATE * (window - IDLE_S) / window  # arrivals in the window over the window
    assert d["arrival_rate_basis"] == BASIS_STATES and d["engine_states"] >= 3, d
    assert d["arrival_rate_per_s"] == pytest.approx(truth, rel=0.15), d
    lo, hi = d["arrival_rate_range_per_s"]
    assert lo < 0.7 * truth and hi == d["arrival_rate_per_s"], d  # finished + queue growth: the old number, low
    assert 2 + window - 1 <= hits <= 2 + window + 1, hits  # one read a second between the two samples


def test_an_idle_engine_and_a_short_window_keep_finished_plus_queue_growth():
    """One state, or two samples: no pair of states with a known time, λ as before."""
    assert states_rate([State(0, 10, 5, False)], 10) is None
    assert states_rate([State(0, 1, 5, True), State(2, 3, 9, True)], 3) is None
    eng = SteppingEngine()
    with MetricsServer(eng.text) as srv:
        d = json.loads(CliRunner().invoke(cli, ["diagnose", "--engine-url", srv.url, "--window", "1", "--json"]).stdout)
        assert srv.hits == 2  # no read between: a window under two DIAGNOSIS_POLL_S
    assert d["arrival_rate_basis"] == BASIS_QUEUE


def test_states_rate_reads_each_state_as_of_its_step_start():
    """R2's end: the state first seen at 30.5 s counts what had arrived by the publish before it (first seen 27 s)."""
    seq = [State(1.8, 1.8, 0, False), State(2.8, 3.8, 4, True), State(4.8, 26.8, 22, True), State(27.0, 30.0, 50, True),
           State(30.5, 33.5, 67, True)]
    r = states_rate(seq, 31.75)
    assert (r.start_s, r.end_s, r.arrivals, r.states) == (1.8, 27.0, 67, 5)
    assert r.rate_per_s == pytest.approx(67 / 25.2)
    # an idle state at the end holds until its last sighting: traffic that stopped is not read as faster
    quiet = [State(0, 0, 0, False), State(1, 1, 10, True), State(2, 2, 20, True), State(3, 10, 30, False)]
    assert states_rate(quiet, 10).rate_per_s == pytest.approx(3.0)


def test_the_exporter_reads_the_states_from_its_window():
    """The exporter's window holds a sample every --interval: its λ comes from the engine's states too."""
    from kvctl.ops.exporter import Exporter, ExporterConfig  # noqa: PLC0415

    eng = SteppingEngine()
    with MetricsServer(eng.text) as srv:
        exp = Exporter(ExporterConfig((srv.url,), interval_s=0.5, window_s=7.0, timeout_s=1.0))
        try:
            t0 = time.monotonic()
            rnd = exp.step()
            while time.monotonic() - t0 < 7.0:
                time.sleep(max(0.0, 0.5 - (time.monotonic() - t0) % 0.5))
                rnd = exp.step()
        finally:
            exp.close()
    d = rnd.diagnosis
    truth = RATE * (d.window_s - IDLE_S) / d.window_s
    assert d.arrival_rate_basis == BASIS_STATES and d.arrival_rate_per_s == pytest.approx(truth, rel=0.15), (d.arrival_rate_per_s, truth)
    assert min(d.arrival_rate_range_per_s) < 0.8 * truth  # finished + queue growth over the same window
