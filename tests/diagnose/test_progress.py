"""Issue 31, item 6: `kvctl diagnose --window` piped into a file says what it is doing on stderr, a line every few
seconds, and never writes progress to stdout (with --json, stdout is the JSON alone)."""

from __future__ import annotations

import json

from tests.diagnose.engine_text import EngineState
from tests.diagnose.metrics_server import MetricsServer
from tests.progress_helpers import progress_lines, run_piped


def test_diagnose_window_prints_progress_lines_on_stderr_without_a_tty(tmp_path):
    a = EngineState(engines=1)
    b = a.advance(requests=5, prompt_lengths=[4160] * 5)
    with MetricsServer([a.text(), b.text()]) as srv:
        res = run_piped(["diagnose", "--engine-url", srv.url, "--window", "6", "--bytes-per-token", "274.5",
                         "--prefill-rate", "40960"], tmp_path)
        lines = progress_lines(res.stderr)
        # a line when sampling starts, at least one while it waits (every 5 s), one when it is done
        assert len(lines) >= 3, res.stderr
        assert lines[0].startswith("kvctl diagnose: sampling for 6 s") and "done" in lines[-1], lines
        assert not progress_lines(res.stdout) and "Diagnosis over" in res.stdout
        res = run_piped(["diagnose", "--engine-url", srv.url, "--window", "1", "--json"], tmp_path)
        json.loads(res.stdout)  # the JSON and nothing else
        assert not progress_lines(res.stdout)
