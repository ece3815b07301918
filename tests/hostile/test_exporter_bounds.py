"""The engine reads and the exporter under hostile engines (issue 21 items 6, 7, 8, 12): endless, huge
and one-huge-line /metrics bodies from a real local HTTP server, hung engines and a hung "Valkey"
(a socket that accepts and never answers), real kvctl processes measured by the kernel (peak RSS
through wait4) and stopped with real signals."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from contextlib import contextmanager

import pytest

from kvctl.diagnose.analysis import Params
from kvctl.ops.exporter import Exporter, ExporterConfig
from kvctl.core.thresholds import EXPORTER_WINDOW_SAMPLES
from tests.diagnose.engine_text import EngineState
from tests.exporter.helpers import ExporterProcess
from tests.hostile.helpers import HostileHTTP, endless, hang, kvctl, kvctl_env, send_head

METRICS = EngineState(requests=3, prompt_lengths=(100.0, 100.0, 100.0)).text()


def big_body(size: int, one_line: bool):
    """A /metrics answer of ``size`` bytes with a Content-Length: many comment lines, or one label line."""
    if one_line:
        head = b'vllm:num_requests_running{model_name="'
        tail = b'"} 1\n'
        payload = head + b"x" * (size - len(head) - len(tail)) + tail
    else:
        payload = (b"# padding line of a huge exposition\n" * (size // 36 + 1))[:size]

    def body(server, h):
        send_head(h, len(payload))
        view = memoryview(payload)
        for i in range(0, len(view), 1 << 20):
            if server.stopping.is_set():
                return
            h.wfile.write(view[i : i + (1 << 20)])

    return body


# ----------------------------------------------------------------------------- item 6: the /metrics cap


@pytest.mark.parametrize("case", ["endless", "20MB", "20MB-one-line"])
def test_an_oversized_metrics_body_is_refused_with_a_finding(tmp_path, case):
    """Past the 16 MiB default cap the read stops: the engine is reported (exit 5) with the finding
    metrics_too_large, well inside the deadline, and the process stays small (before: 743 MB RSS for
    200 MB, 3.7 GB and counting for an endless body)."""
    body = endless if case == "endless" else big_body(20 << 20, one_line=case.endswith("one-line"))
    with HostileHTTP(body) as eng:
        res = kvctl(["diagnose", "--engine-url", eng.url, "--window", "0.3", "--timeout", "30", "--json"], tmp_path / "home", timeout_s=25)
    assert res.returncode == 5, (res.returncode, res.output[-800:])
    d = json.loads(res.stdout)
    assert "size cap" in d["engines"][0]["error"]
    assert "metrics_too_large" in [f["id"] for f in d["findings"]]
    assert res.maxrss_mb < 400, res.maxrss_mb


def test_the_cap_is_an_option(tmp_path):
    with HostileHTTP(big_body(3 << 20, one_line=False)) as eng:
        small = kvctl(["diagnose", "--engine-url", eng.url, "--window", "0.2", "--max-metrics-bytes", str(1 << 20), "--json"], tmp_path / "home")
        bad = kvctl(["diagnose", "--engine-url", eng.url, "--max-metrics-bytes", "-1"], tmp_path / "home")
    assert small.returncode == 5 and "size cap" in small.stdout, small.output[-500:]
    assert bad.returncode == 2 and "--max-metrics-bytes" in bad.output


# ----------------------------------------------------------------------------- item 8: --interval bound


def test_a_tiny_interval_is_refused(tmp_path):
    with HostileHTTP(hang) as eng:
        res = kvctl(["exporter", "--listen", "127.0.0.1:0", "--engine-url", eng.url, "--interval", "0.000001", "--duration", "1"], tmp_path / "home")
    assert res.returncode == 2 and "--interval" in res.output and "0.1" in res.output, res.output


# ----------------------------------------------------------------------------- item 7: a bounded window


def at_clock(now: list[float]):
    """The real take_sample (a real read of the engine stand-in), its timestamps set to the simulated clock:
    a day of one-second rounds runs in seconds."""
    from kvctl.diagnose import capture as cap

    def take(urls, targets, timeout_s):
        s = cap.take_sample(urls, targets, timeout_s)
        s.t_s = now[0]
        s.engine_t_s = [now[0]] * len(urls)
        return s

    return take


def test_the_window_keeps_a_bounded_number_of_samples():
    """--interval 1 --window 86400 kept every sample (about 78 KB each: 6.7 GB a day). Real reads of a real
    engine stand-in, a simulated clock: after 300 rounds at most EXPORTER_WINDOW_SAMPLES + 2 are kept,
    and the analysis still spans from the first sample (the window has not slid yet)."""
    now = [1_000_000.0]
    with HostileHTTP(lambda server, h: (send_head(h, len(METRICS)), h.wfile.write(METRICS.encode()))) as eng:
        exp = Exporter(ExporterConfig((eng.url,), (), Params(bytes_per_token=1000.0), interval_s=1.0, window_s=86400.0), take_sample=at_clock(now), clock=lambda: now[0])
        try:
            kept = []
            for _ in range(300):
                rnd = exp.step()
                kept.append(rnd.samples_in_window)
                now[0] += 1.0
        finally:
            exp.close()
    assert max(kept) <= EXPORTER_WINDOW_SAMPLES + 2, max(kept)
    assert rnd.diagnosis is not None and rnd.diagnosis.window_s == 299.0  # from the first sample to the newest


def test_a_sliding_window_stays_bounded_and_spans_the_window():
    now = [0.0]
    with HostileHTTP(lambda server, h: (send_head(h, len(METRICS)), h.wfile.write(METRICS.encode()))) as eng:
        exp = Exporter(ExporterConfig((eng.url,), (), Params(bytes_per_token=1000.0), interval_s=1.0, window_s=128.0), take_sample=at_clock(now), clock=lambda: now[0])
        try:
            spans, kept = [], []
            for i in range(400):
                rnd = exp.step()
                kept.append(rnd.samples_in_window)
                if i > 200:
                    cap_ = exp.window_capture()
                    spans.append(cap_.samples[-1].t_s - cap_.samples[0].t_s)
                now[0] += 1.0
        finally:
            exp.close()
    assert max(kept) <= EXPORTER_WINDOW_SAMPLES + 2, max(kept)
    step = 128.0 / EXPORTER_WINDOW_SAMPLES
    assert all(128.0 <= s <= 128.0 + step + 1.0 for s in spans), (min(spans), max(spans))


# ----------------------------------------------------------------------------- item 12: stop within 2 s


@contextmanager
def silent_valkey():
    """A TCP listener that accepts and never answers (a SIGSTOPped Valkey); yields its port."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    conns, stop = [], threading.Event()

    def accept():
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                conns.append(srv.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield srv.getsockname()[1]
    finally:
        stop.set()
        t.join(timeout=5)
        for c in conns:
            c.close()
        srv.close()


@pytest.mark.parametrize("engine", ["hung", "endless"])
def test_exporter_stops_within_2_s_whatever_is_in_flight(tmp_path, engine):
    """SIGTERM while the engine read and the Valkey INFO are both blocked (--timeout 20): the process is
    gone within 2 s, exit 0 with its summary (before: 17.7 s at --timeout 20)."""
    with HostileHTTP(hang if engine == "hung" else endless) as eng, silent_valkey() as vport, \
            ExporterProcess(["--engine-url", eng.url, "--valkey", f"resp://127.0.0.1:{vport}", "--interval", "30", "--window", "60",
                             "--timeout", "20"], env=kvctl_env(tmp_path / "home")) as ex:
        proc = ex.proc
        assert eng.connected.wait(10), "the exporter never read the engine"
        time.sleep(0.3)  # the reads are under way
        assert proc.poll() is None
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 2 s after SIGTERM with a {engine} engine")
        took = time.monotonic() - t0
    out, err = ex.out, ex.err
    assert proc.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1])["event"] == "stopped", out
    assert took < 2.0


def test_exporter_serves_the_finding_for_an_endless_engine(tmp_path):
    """The exporter keeps going on an endless engine: engine_up 0, kvctl_finding{id="metrics_too_large"} 1,
    its memory bounded."""
    with HostileHTTP(endless) as eng, \
            ExporterProcess(["--engine-url", eng.url, "--interval", "0.5", "--window", "1"], env=kvctl_env(tmp_path / "home")) as ex:
        body, deadline = "", time.monotonic() + 10
        while 'id="metrics_too_large"' not in body and time.monotonic() < deadline:
            time.sleep(0.3)
            with urllib.request.urlopen(ex.start["metrics_url"], timeout=5) as r:
                body = r.read().decode()
        rss_mb = int(next(ln for ln in open(f"/proc/{ex.proc.pid}/status") if ln.startswith("VmHWM")).split()[1]) / 1024
    assert 'id="metrics_too_large"' in body, body[-2000:]
    assert any(ln.startswith("kvctl_engine_up{") and ln.endswith(" 0.0") for ln in body.splitlines())
    assert rss_mb < 400, rss_mb


def test_a_second_signal_cuts_the_stop_short(tmp_path):
    """SIGTERM then Ctrl-C at once: the second one exits right away (128 + its number, no orderly summary),
    as an operator who presses Ctrl-C twice expects; before, it was swallowed and the stop ran on."""
    with HostileHTTP(lambda server, h: (send_head(h, len(METRICS)), h.wfile.write(METRICS.encode()))) as eng, \
            ExporterProcess(["--engine-url", eng.url, "--interval", "0.2", "--window", "0.4"], env=kvctl_env(tmp_path / "home")) as ex:
        proc = ex.proc
        assert eng.connected.wait(10)
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pytest.fail("still running 5 s after SIGTERM and SIGINT")
    out, err = ex.out, ex.err
    assert proc.returncode in (128 + signal.SIGINT, 128 + signal.SIGTERM), (proc.returncode, err[-500:])
    assert '"stopped"' not in out
