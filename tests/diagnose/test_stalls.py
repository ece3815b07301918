"""``kvctl diagnose stalls`` against real py-spy and real stalled child processes.

Each child in ``stall_programs/`` reproduces one signature of paper §5.4 and
exits by itself after ``--lifetime`` seconds; every test also kills the
children it started, by pid, in a ``finally``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvctl.diagnose import pyspy, stalls
from kvctl.core.errors import BinaryNotFound, ExitStatus
from kvctl.tier.server import free_port
from tests.diagnose.stall_helpers import INTERVAL_S, by_id, run_stalls, spawn, wait_ready

# --- the three signatures ---------------------------------------------------


def test_lost_completion_thread_is_found(pyspy_attach):
    with spawn("lost_completion.py") as proc:
        wait_ready(proc)
        report = stalls.diagnose_stalls([proc.pid], samples=3, interval_s=INTERVAL_S)
        found = by_id(report)
        assert list(found) == ["lost-completion"], report.findings
        (f,) = found["lost-completion"]
        assert f.severity is stalls.Severity.CRITICAL
        assert f.pid == proc.pid and f.thread_name == "lmcache-lookup-0"
        assert f.frames[0].startswith("Condition.wait (threading.py")
        assert any(fr.startswith("Future.result (concurrent/futures/_base.py") for fr in f.frames)
        assert any("NativeStyleClient.exists" in fr for fr in f.frames)
        assert "resp-event-loop idle in select" in f.evidence
        assert "no wakeups" in f.evidence or "wakeup" in f.evidence
        assert "not fixed in LMCache <= 0.5.6" in f.recommendation and "kvctl.connector" in f.recommendation
        assert report.worst_severity is stalls.Severity.CRITICAL
        assert report.processes[0].threads == 4


def test_lost_completion_through_the_command(pyspy_attach):
    with spawn("lost_completion.py") as proc:
        wait_ready(proc)
        res = run_stalls("--pid", str(proc.pid), "--json")
        assert res.exit_code == ExitStatus.FINDING_CRITICAL, res.output
        data = json.loads(res.stdout)
        assert data["worst_severity"] == "critical"
        assert [f["id"] for f in data["findings"]] == ["lost-completion"]
        f = data["findings"][0]
        assert {"id", "severity", "pid", "process_name", "thread_id", "thread_name", "frames", "message", "evidence", "recommendation"} <= set(f)
        assert f["pid"] == proc.pid and f["process_name"]
        assert data["processes"][0]["pid"] == proc.pid
        assert data["gpu_note"] or data["gpu_utilization_pct"]

        text = run_stalls("--pid", str(proc.pid))
        assert text.exit_code == ExitStatus.FINDING_CRITICAL, text.output
        assert "CRITICAL lost-completion" in text.output
        assert "lmcache-lookup-0" in text.output and "Future.result" in text.output
        assert "LMCache <= 0.5.6" in text.output


def test_match_finds_the_process_by_command_line(pyspy_attach):
    tag = f"kvctl-stall-test-{uuid.uuid4().hex[:12]}"
    with spawn("lost_completion.py", "--tag", tag) as proc:
        wait_ready(proc)
        found = stalls.find_processes(tag)
        assert [p.pid for p in found] == [proc.pid]
        # through the real root group: `kvctl diagnose stalls --match ...`
        from kvctl.cli import cli  # noqa: PLC0415

        args = ["diagnose", "stalls", "--match", tag, "--samples", "2", "--interval", str(INTERVAL_S), "--json"]
        res = CliRunner().invoke(cli, args)
        assert res.exit_code == ExitStatus.FINDING_CRITICAL, res.output
        data = json.loads(res.stdout)
        assert [p["pid"] for p in data["processes"]] == [proc.pid]
        assert [f["id"] for f in data["findings"]] == ["lost-completion"]


def _raw_get(port: int, key: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(key), key))
        time.sleep(0.2)
        return s.recv(64)


def test_missing_key_get_hang_is_found(pyspy_attach, valkey_server):
    # the premise: a missing key is the 5-byte null bulk, shorter than the client's 11-byte header
    assert _raw_get(valkey_server.port, b"evicted-chunk-0042") == b"$-1\r\n"
    with spawn("missing_key_get.py", "--port", str(valkey_server.port)) as proc:
        wait_ready(proc)
        report = stalls.diagnose_stalls([proc.pid], samples=3, interval_s=INTERVAL_S)
        found = by_id(report)
        # the caller waiting on the GET's future is not a lost completion: the GET is still outstanding
        assert list(found) == ["missing-key-get"], report.findings
        (f,) = found["missing-key-get"]
        assert f.severity is stalls.Severity.CRITICAL and f.thread_name == "remote-io_0"
        assert f.frames[0].startswith("FixedHeaderRespClient._read_exactly")
        assert f.frames[1].startswith("FixedHeaderRespClient.get")
        assert "`$-1`" in f.recommendation and "not fixed in LMCache <= 0.5.6" in f.recommendation
        assert "no GPU visible" in f.evidence or "GPUs" in f.evidence


def test_healthy_busy_process_has_no_finding(pyspy_attach):
    with spawn("healthy_busy.py") as proc:
        wait_ready(proc)
        time.sleep(0.3)
        res = run_stalls("--pid", str(proc.pid), "--samples", "4", "--json")
        assert res.exit_code == 0, res.output
        data = json.loads(res.stdout)
        assert data["findings"] == [] and data["worst_severity"] is None
        assert data["processes"][0]["threads"] == 6
        assert data["processes"][0]["stable_threads"] >= 2  # the idle loop and the queue consumer stay put
        text = run_stalls("--pid", str(proc.pid))
        assert text.exit_code == 0 and "no stalled lookup" in text.output


@pytest.mark.engine
def test_gloo_rank_in_a_collective_its_peer_never_enters(pyspy_attach):
    pytest.importorskip("torch")
    port = free_port()
    with spawn("gloo_lockstep.py", "--rank", "0", "--port", str(port)) as r0, spawn(
        "gloo_lockstep.py", "--rank", "1", "--port", str(port)
    ) as r1:
        wait_ready(r0, r1, timeout_s=80)
        report = stalls.diagnose_stalls([r0.pid, r1.pid], samples=3, interval_s=INTERVAL_S)
        found = by_id(report)
        assert list(found) == ["lockstep-stall"], report.findings
        (f,) = found["lockstep-stall"]
        assert f.pid == r0.pid and f.thread_name == "MainThread" and f.severity is stalls.Severity.CRITICAL
        assert f.frames[0].startswith("all_reduce (torch/distributed/distributed_c10d.py")
        assert f"peer pid {r1.pid}" in f.evidence and "skip_collective_and_poll" in f.evidence
        assert "no GPU visible" in f.evidence or "GPUs" in f.evidence

        # rank 0 alone: the wait is visible, but not whose fault it is -> a warning (exit 3)
        res = run_stalls("--pid", str(r0.pid), "--samples", "2", "--json")
        assert res.exit_code == ExitStatus.FINDING_WARNING, res.output
        assert [x["id"] for x in json.loads(res.stdout)["findings"]] == ["collective-wait"]


# --- errors and usage -------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv to run py-spy as an unprivileged user")
def test_ptrace_denied_says_what_to_do(pyspy_attach):
    """py-spy as `nobody` against a root-owned process: the real 'Permission Denied' path, through the CLI's error mapping."""
    target = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    script = (
        "import sys\n"
        "from kvctl.cli import KvctlGroup\n"
        "from kvctl.commands.diagnose_stalls import stalls_cmd\n"
        "g = KvctlGroup('kvctl'); g.add_command(stalls_cmd)\n"
        f"g(['stalls', '--pid', '{target.pid}', '--samples', '2', '--interval', '0.1'], prog_name='kvctl')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "KVCTL_RAISE_ERRORS"}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    try:
        out = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", script],
            capture_output=True, text=True, timeout=60, cwd="/", env=env,
        )
    finally:
        os.kill(target.pid, 9)
        target.wait()
    assert out.returncode == ExitStatus.ERROR, out.stderr
    err = out.stderr
    assert err.startswith("Error: py-spy may not attach to pid"), err
    assert "ptrace not permitted" in err and "Permission Denied" in err
    assert "run kvctl as root" in err and "SYS_PTRACE" in err and "kernel.yama.ptrace_scope" in err
    assert "Traceback" not in err


def test_missing_py_spy_gives_the_install_hint(monkeypatch):
    monkeypatch.setenv("KVCTL_PY_SPY", "/nonexistent/py-spy")
    with pytest.raises(BinaryNotFound, match="pip install py-spy"):
        pyspy.dump_threads(os.getpid())


def test_py_spy_found_next_to_the_interpreter(monkeypatch):
    if not (Path(sys.executable).parent / "py-spy").exists():
        pytest.skip("py-spy is not installed next to this interpreter")
    monkeypatch.delenv("KVCTL_PY_SPY", raising=False)
    monkeypatch.setenv("PATH", "")
    assert pyspy.find_py_spy() == str(Path(sys.executable).parent / "py-spy")


def test_exited_and_non_python_processes(pyspy_attach):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    with pytest.raises(pyspy.ProcessGone, match=f"no process with pid {gone.pid}"):
        pyspy.dump_threads(gone.pid)
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        time.sleep(0.2)
        with pytest.raises(pyspy.NotAPythonProcess, match="not a Python process"):
            pyspy.dump_threads(sleeper.pid)
    finally:
        os.kill(sleeper.pid, 9)
        sleeper.wait()


@pytest.mark.parametrize(
    "args, text",
    [
        ([], "give --pid PID"),
        (["--pid", "1", "--samples", "1"], "--samples"),
        (["--pid", "0"], "--pid"),
        (["--pid", "1", "--interval", "0"], "--interval"),
        (["--pid", "1", "--interval", "nan"], "--interval"),
        (["--pid", "1", "--interval", "inf"], "--interval"),
    ],
)
def test_bad_usage_exits_2(args, text):
    from kvctl.commands.diagnose_stalls import stalls_cmd  # noqa: PLC0415

    res = CliRunner().invoke(stalls_cmd, args)
    assert res.exit_code == 2, res.output
    assert text in res.output


def test_match_with_no_process_is_an_error():
    from kvctl.commands.diagnose_stalls import stalls_cmd  # noqa: PLC0415

    from kvctl.cli import KvctlGroup  # noqa: PLC0415

    g = KvctlGroup("kvctl")
    g.add_command(stalls_cmd)
    res = CliRunner().invoke(g, ["stalls", "--match", "no-such-process-name-4242x"])
    assert res.exit_code == ExitStatus.ERROR
    assert "no process matches 'no-such-process-name-4242x'" in res.output


def test_gpu_evidence_wording():
    assert stalls._gpu_text((), "no GPU visible (NVML: NVML Shared Library Not Found)") == "no GPU visible (NVML: NVML Shared Library Not Found)"
    assert stalls._gpu_text((0.0, 3.0), "") == "GPUs idle, all below 5% (0%, 3%)"
    assert stalls._gpu_text((0.0, 97.0), "") == "GPUs busy (0%, 97%)"
    utils, names, note = stalls.gpu_state()  # the real NVML reader: devices, or why there are none
    assert (len(utils) == len(names) and utils) or note.startswith("no GPU visible")


@pytest.mark.parametrize("first", ["kvctl.commands.diagnose_stalls", "kvctl.cli"])
def test_attached_as_kvctl_diagnose_stalls_whatever_is_imported_first(first):
    """No import cycle: `kvctl diagnose stalls` exists even when this module is imported before kvctl.cli."""
    code = f"import {first}\nfrom kvctl.cli import cli\nprint(sorted(cli.commands['diagnose'].commands))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "'stalls'" in out.stdout, out.stdout
