"""Odd input (issue 21, items 13–19): a clear line-numbered error with exit 2, or a correct answer.

Real components throughout: `kvctl diagnose` against a real HTTP /metrics server
(tests/diagnose/metrics_server.py), the real `kvctl exporter` process against a real passworded
valkey-server, `kvctl replay` against the stand-in OpenAI server process (tests/replay/standin.py:
it sends the hostile SSE lines itself) with real signals to a real `kvctl replay` process, `kvctl
report` on run files that a real replay wrote, and the real `kvctl simulate` and `kvctl loading`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvctl.core import render
from kvctl.cli import cli
from kvctl.records import prometheus as M
from kvctl.records.runfile import read_run
from kvctl.records.trace import read_trace
from kvctl.tier.server import free_port
from tests.diagnose.engine_text import EngineState
from tests.diagnose.metrics_server import MetricsServer
from tests.replay.conftest import start_standin

ROOT = Path(__file__).resolve().parents[2]
BASE = EngineState()
HEALTHY = BASE.advance(requests=10, prompt_lengths=[16000] * 10, external_hits=100000, remote_read_bytes=1e9, remote_get_ms=[1] * 10)
MODEL = ["--bytes-per-token", "48437.5", "--prefill-rate", "52200", "--t0", "0.1"]
ENV = {**os.environ, "KVCTL_TESTING": "1"}


def invoke(args: list[str]) -> tuple[int, str]:
    r = CliRunner().invoke(cli, args)
    return r.exit_code, r.output


def strict_json(text: str):
    """json.loads that refuses NaN and ±Infinity, as jq and JavaScript do."""
    def refuse(name: str):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def write_lines(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


@pytest.fixture
def standin():
    started = []

    def make(*args: str):
        s = start_standin(*args)
        started.append(s)
        return s

    try:
        yield make
    finally:
        for s in started:
            s.stop()


# --- 13. diagnose --json: the outcome is the exit code's word -----------------------------------


def test_diagnose_json_does_not_say_ok_when_every_engine_is_unreachable():
    code, out = invoke(["diagnose", "--engine-url", f"http://127.0.0.1:{free_port()}", "--window", "0.1", "--timeout", "1", "--json"])
    assert code == 5, out
    d = strict_json(out)
    assert d["outcome"] == "unreachable" and d["exit_code"] == 5 and d["unreachable"]


# --- 14. a repeated series is counted once, and said -------------------------------------------


def test_duplicate_series_are_not_summed():
    """The same /metrics text served twice over (every series duplicated): λ and the request count are
    those of one copy (10 requests, not 20), and the output says the exposition repeats series."""
    with MetricsServer([BASE.text() * 2, HEALTHY.text() * 2]) as srv:
        code, out = invoke(["diagnose", "--engine-url", srv.url, "--window", "0.3", *MODEL, "--json"])
    d = strict_json(out)
    assert d["requests"] == 10, d["requests"]
    assert any("repeats a series" in n and "vllm:request_success_total" in n for n in d["notes"]), d["notes"]
    assert M.parse(HEALTHY.text() * 2).values == M.parse(HEALTHY.text()).values


# --- 15. the exporter says "auth" on a wrong password -----------------------------------------


def test_exporter_says_auth_on_a_wrong_password(valkey_factory, tmp_path):
    v = valkey_factory(password="right-pw")
    pw = tmp_path / "pw"
    pw.write_text("wrong-pw\n")
    pw.chmod(0o600)
    with MetricsServer([BASE.text(), HEALTHY.text()]) as srv:
        r = subprocess.run([sys.executable, "-m", "kvctl.cli", "exporter", "--listen", "127.0.0.1:0", "--engine-url", srv.url,
                            "--valkey", f"resp://127.0.0.1:{v.port}", "--password-file", str(pw), "--interval", "0.2",
                            "--duration", "1.2", "--json"], capture_output=True, text=True, env=ENV, timeout=60, cwd=str(ROOT))
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "refused the login" in ln]
    assert len(lines) == 1, r.stderr  # said once, not every round
    assert "auth" in lines[0] and "--password-file" in lines[0] and "rank 0" in lines[0]
    assert "wrong-pw" not in r.stderr and "right-pw" not in r.stderr


def test_diagnose_says_auth_on_a_wrong_password(valkey_factory, tmp_path):
    v = valkey_factory(password="right-pw")
    pw = tmp_path / "pw"
    pw.write_text("wrong-pw\n")
    pw.chmod(0o600)
    with MetricsServer([BASE.text(), HEALTHY.text()]) as srv:
        code, out = invoke(["diagnose", "--engine-url", srv.url, "--valkey", f"resp://127.0.0.1:{v.port}", "--password-file", str(pw),
                            "--window", "0.2", *MODEL, "--json"])
    d = strict_json(out)
    assert code == 5 and d["outcome"] == "unreachable"
    (said,) = d["unreachable"]
    assert "auth: refused the login" in said and "--password-file" in said and "wrong-pw" not in out


# --- 16. replay ---------------------------------------------------------------------------------


def test_non_object_answers_fail_that_request_and_the_run_goes_on(standin, tmp_path):
    """`data: [1,2]`, `data: null` and `"usage": [1]` from a real HTTP server: each fails its own request."""
    server = standin()
    prompts = ["first ok", "ODD_LIST", "ODD_NULL", "ODD_USAGE", "last ok"]
    trace = write_lines(tmp_path / "t.jsonl", [{"offset_s": i * 0.02, "prompt": p} for i, p in enumerate(prompts)])
    out = tmp_path / "run.jsonl"
    code, output = invoke(["replay", str(trace), "--engine-url", server.url, "--out", str(out)])
    assert code == 0, output
    rows = {r["index"]: r for r in read_run(out).rows}
    assert [rows[i]["status"] for i in (0, 4)] == ["ok", "ok"]
    for i in (1, 2, 3):
        assert rows[i]["status"].startswith("error: bad answer"), rows[i]
    summary = read_run(out).summary
    assert summary["finished"] == 5 and summary["errors"] == 3


def test_a_list_body_without_streaming_fails_that_request(standin, tmp_path):
    server = standin()
    trace = write_lines(tmp_path / "t.jsonl", [{"offset_s": 0, "prompt": "fine"}, {"offset_s": 0.01, "prompt": "ODD_LIST"}])
    out = tmp_path / "run.jsonl"
    code, output = invoke(["replay", str(trace), "--engine-url", server.url, "--out", str(out), "--no-stream"])
    assert code == 0, output
    statuses = sorted(r["status"] for r in read_run(out).rows)
    assert statuses[1] == "ok" and "not an object" in statuses[0]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_stop_replay_like_ctrl_c(standin, tmp_path, sig):
    """The real `kvctl replay` process: 3 requests answered, 3 hung; the signal gives exit 128 + its number,
    a summary naming it, and a row for each of the 3 still open."""
    server = standin("--slow-after", "3", "--slow-delay-s", "120")
    trace = write_lines(tmp_path / "t.jsonl", [{"offset_s": i * 0.05, "prompt": f"r {i}"} for i in range(6)])
    out = tmp_path / "run.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "kvctl.cli", "replay", str(trace), "--engine-url", server.url, "--out", str(out)],
                            cwd=str(ROOT), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if len(server.arrivals()) == 6 and out.exists() and out.read_text().count('"status":"ok"') == 3:
                break
            time.sleep(0.1)
        else:
            pytest.fail("the replay never reached 3 answered and 3 open requests")
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 128 + int(sig), stderr
    assert "Traceback" not in stderr
    run = read_run(out)
    assert run.summary is not None and run.summary["interrupted"] is True and run.summary["signal"] == sig.name
    assert run.summary["finished"] == 3 and run.summary["unfinished"] == 3
    by_index = {r["index"]: r["status"] for r in run.rows}
    assert sorted(by_index) == list(range(6))
    assert [by_index[i] for i in range(3)] == ["ok"] * 3
    assert all(by_index[i] == f"interrupted by {sig.name} before the answer" for i in range(3, 6))
    code, output = invoke(["report", str(out), "--json"])
    summary = strict_json(output)["runs"][0]
    assert code == 0 and summary["errors"] == 0 and summary["unfinished"] == 3 and summary["interrupted"] is True


def test_sigterm_while_replay_reads_the_metrics_after_the_run_still_writes_the_summary(standin, tmp_path):
    """Every request answered; the engine's /metrics then hangs (30 s) when the replay reads it for the summary.
    SIGTERM there: exit 143 with the summary written (it used to kill the process, no summary)."""
    server = standin("--metrics-delay-s", "30")
    trace = write_lines(tmp_path / "t.jsonl", [{"offset_s": i * 0.01, "prompt": f"r {i}"} for i in range(3)])
    out = tmp_path / "run.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "kvctl.cli", "replay", str(trace), "--engine-url", server.url, "--out", str(out)],
                            cwd=str(ROOT), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (out.exists() and out.read_text().count('"status":"ok"') == 3):
            time.sleep(0.1)
        time.sleep(1.0)  # now in the scrape after the run
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 143, stderr
    run = read_run(out)
    assert run.summary is not None and run.summary["signal"] == "SIGTERM" and run.summary["finished"] == 3
    assert run.summary["metrics_after"] is None and run.summary["unfinished"] == 0


@pytest.mark.parametrize("line, says", [
    ({"timestamp": 1e300, "input_length": 10, "hash_ids": [1]}, "timestamp must be a non-negative number of ms up to"),
    ({"offset_s": 1e300, "prompt": "x"}, "offset_s must be a non-negative number of s up to"),
    ({"timestamp": 40 * 86400 * 1000, "input_length": 10, "hash_ids": [1]}, "past the cap of"),
    ({"timestamp": int("9" * 400), "input_length": 10, "hash_ids": [1]}, "a 400-digit integer"),
    ({"timestamp": 5, "input_length": 20_000_000, "hash_ids": [1]}, "input_length must be an integer in [1, 10,000,000]"),
    ({"timestamp": 5, "input_length": 10**30, "hash_ids": [1]}, "input_length must be an integer in [1, 10,000,000]"),
    ({"offset_s": 1, "prompt_tokens": 20_000_000}, "prompt_tokens must be an integer in [1, 10,000,000]"),
    ({"timestamp": 5, "input_length": 10, "hash_ids": [1 << 70]}, "hash_ids must be a list of 64-bit integers"),
    ('{"timestamp": 5, "input_length": 10, "hash_ids": [' + "7" * 5000 + "]}", "not usable JSON"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
])
def test_trace_lines_past_the_bounds_are_line_numbered_errors(tmp_path, line, says):
    trace = write_lines(tmp_path / "t.jsonl", [{"timestamp": 0, "input_length": 10, "hash_ids": [1]}, line])
    code, output = invoke(["replay", str(trace), "--dry-run"])
    assert code == 2, output
    assert "line 2" in output and says in output, output
    assert "line 1" not in output


def test_prompts_longer_than_the_engines_max_model_len_are_refused_before_sending(standin, tmp_path):
    server = standin("--max-model-len", "100")
    trace = write_lines(tmp_path / "t.jsonl", [{"offset_s": 0, "prompt_tokens": 50}, {"offset_s": 0.1, "prompt_tokens": 5000}])
    out = tmp_path / "run.jsonl"
    code, output = invoke(["replay", str(trace), "--engine-url", server.url, "--out", str(out)])
    assert code == 2, output
    assert "line 2" in output and "max_model_len 100" in output and "line 1" not in output
    assert not out.exists() and server.arrivals() == []


# --- 17. report ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_text(tmp_path_factory) -> str:
    """A run file a real replay wrote against the stand-in server (3 requests)."""
    tmp = tmp_path_factory.mktemp("run")
    server = start_standin()
    try:
        trace = write_lines(tmp / "t.jsonl", [{"offset_s": i * 0.01, "prompt": f"req {i}"} for i in range(3)])
        r = CliRunner().invoke(cli, ["replay", str(trace), "--engine-url", server.url, "--out", str(tmp / "run.jsonl")])
        assert r.exit_code == 0, r.output
    finally:
        server.stop()
    return (tmp / "run.jsonl").read_text()


def test_report_skips_a_torn_last_line_with_a_warning(run_text, tmp_path):
    lines = run_text.splitlines()
    torn = "\n".join(lines[:-2] + [lines[-2][: len(lines[-2]) // 2]])  # stopped while writing the last row: no summary
    p = tmp_path / "run.jsonl"
    p.write_text(torn)
    r = CliRunner().invoke(cli, ["report", str(p), "--json"])
    assert r.exit_code == 0, r.output
    s = strict_json(r.stdout)["runs"][0]
    assert s["requests"] == 2 and s["interrupted"] is True
    assert s["warnings"] == [f"line {len(lines) - 1} is torn (the run stopped while writing it): skipped"]
    r = CliRunner().invoke(cli, ["report", str(p)])
    assert r.exit_code == 0 and "torn" in r.output


def _edit(run_text: str, line: int, change) -> str:
    lines = run_text.splitlines()
    obj = json.loads(lines[line - 1])
    change(obj)
    lines[line - 1] = json.dumps(obj)
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("line, change, says", [
    (2, lambda r: r.update(scheduled_s=None), "scheduled_s must be a non-negative number"),
    (2, lambda r: r.update(scheduled_s="soon"), "scheduled_s must be a non-negative number"),
    (3, lambda r: r.update(prompt_tokens="12"), "prompt_tokens must be a non-negative integer"),
    (3, lambda r: r.update(cached_tokens=float("nan")), "cached_tokens must be a non-negative integer"),
    (2, lambda r: r.update(cached_tokens=[1]), "cached_tokens must be a non-negative integer"),
    (4, lambda r: r.update(in_flight="3"), "in_flight must be a non-negative integer"),
    (2, lambda r: r.update(latency_s=float("inf")), "latency_s must be a non-negative number"),
    (1, lambda m: m["metadata"].update(metrics_before={"vllm:prompt_tokens_total": "many"}), "metadata.metrics_before.vllm:prompt_tokens_total"),
    (1, lambda m: m["metadata"].update(metrics_before=[1, 2]), "metadata.metrics_before must be an object"),
    (5, lambda s: s["summary"].update(metrics_after={"kvctl:remote_hit_tokens_total": None}), "summary.metrics_after.kvctl:remote_hit_tokens_total"),
    (5, lambda s: s["summary"].update(max_in_flight="2"), "summary.max_in_flight"),
])
def test_report_names_the_line_of_a_wrong_type(run_text, tmp_path, line, change, says):
    p = tmp_path / "run.jsonl"
    p.write_text(_edit(run_text, line, change))
    code, output = invoke(["report", str(p)])
    assert code == 2, output
    assert f"line {line}: " in output and says in output, output
    assert "unexpected" not in output


# --- 18. simulate ------------------------------------------------------------------------------

SIM = ["simulate", "--arrival-rate", "1", "--prompt-tokens", "1000", "--bytes-per-token", "1000", "--prefill-rate", "1000", "--requests", "50"]


def test_json_never_holds_nan_or_infinity(capsys):
    render.emit_json({"a": float("nan"), "b": [float("inf"), -float("inf"), 1.5], "c": {"d": float("nan")}})
    assert strict_json(capsys.readouterr().out) == {"a": None, "b": [None, None, 1.5], "c": {"d": None}}
    render.emit_json_line({"a": float("nan")})
    assert strict_json(capsys.readouterr().out) == {"a": None}


def test_simulate_refuses_what_overflows_instead_of_printing_nan(tmp_path):
    """A bench file whose bandwidth is tiny but positive: the transfer time is past a float's range.
    Today's code printed NaN and Infinity in --json, exit 0."""
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"runs": [{"op": "get", "instances": 1, "aggregate_gbps": 1e-300}]}))
    code, out = invoke([*SIM, "--prompt-tokens", "1e9", "--bytes-per-token", "1e9", "--bench", str(bench), "--json"])
    assert code == 2, out
    assert "leave a float's range" in out and "NaN" not in out and "Infinity" not in out


@pytest.mark.parametrize("args", [["--instance-gbps", "1e-300"], ["--instance-gbps", "1", "--arrival-rate", "1e-300"]])
def test_simulate_options_bound_what_would_overflow(args):
    code, out = invoke([*SIM, *args, "--json"])
    assert code == 2 and "is not in the range" in out, out


@pytest.mark.parametrize("sweep, option", [
    ("async_timeout_s=3,-1", "-1.0 is not in the range"),
    ("instances=1,100000", "100000 is not in the range"),
    ("rate=1,1e-300", "1e-300 is not in the range"),
    ("hit_fraction=0.5,2", "2.0 is not in the range"),
    ("instance_gbps=nan", "is not a finite number"),
])
def test_sweep_values_obey_the_options_bounds(sweep, option):
    code, out = invoke([*SIM, "--instance-gbps", "1", "--sweep", sweep, "--json"])
    assert code == 2, out
    assert "--sweep" in out and option in out, out


# --- 19. --vllm with a !!python tag ----------------------------------------------------------


@pytest.mark.parametrize("cmd", [["loading", "show"], ["loading", "async"]])
def test_vllm_file_with_a_python_tag_is_refused_naming_the_line(tmp_path, cmd):
    p = tmp_path / "vllm.yaml"
    text = ("model: m\nkv-transfer-config:\n  kv_connector: LMCacheConnectorV1\n  kv_role: kv_both\n"
            "evil: !!python/object/apply:os.system [\"touch pwned\"]\n")
    p.write_text(text)
    code, out = invoke([*cmd, "--vllm", str(p)])
    assert code == 2, out
    assert "line 5" in out and "python/object/apply" in out and "unexpected" not in out
    assert p.read_text() == text and not (tmp_path / "pwned").exists()


def test_trace_reader_survives_every_odd_line_at_once(tmp_path):
    """All the hostile lines in one file: one InvalidInput listing them, no crash."""
    trace = write_lines(tmp_path / "t.jsonl", [
        {"timestamp": int("9" * 400), "input_length": 10, "hash_ids": [1]},
        '{"timestamp": 1, "input_length": 10, "hash_ids": [' + "1" * 5000 + "]}",
        "[" * 100_000 + "]" * 100_000,
    ])
    with pytest.raises(Exception) as e:
        read_trace(trace)
    assert type(e.value).__name__ == "InvalidInput"
    assert all(f"line {n}" in str(e.value) for n in (1, 2, 3))
