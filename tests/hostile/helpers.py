"""Shared pieces of the hostile-input corpus: a kvctl subprocess with bounded time and memory, and a
real HTTP server on 127.0.0.1 that serves hostile /metrics bodies (endless, huge, one huge line, hung).

Every kvctl run here is a real process: the memory it reaches is read from the kernel
(``ru_maxrss`` of the reaped child), and an address-space limit keeps a regression from taking the
machine down with it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
KVCTL = "from kvctl.cli import main; main()"


def kvctl_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_", "KVCTL_"))}
    env.update(KVCTL_HOME=str(home), PYTHONPATH=str(ROOT), COLUMNS="200", **extra)
    return env


@dataclass(frozen=True)
class Limits:
    """What the child sets on itself before importing kvctl: an address-space cap (a runaway read fails
    with MemoryError instead of eating the host), optionally a file-size cap (writes past it fail with
    EFBIG, SIGXFSZ ignored) and a umask. Set in the child, not in a preexec_fn: without one the child
    is spawned with vfork, so its peak RSS (wait4's ru_maxrss) is its own, not the forked test
    process's."""

    as_bytes: int | None = 3 << 30
    fsize: int | None = None
    umask: int | None = None

    def code(self, main: str = KVCTL) -> str:
        """Python source: the limits, then ``main`` (kvctl's CLI unless another program is given)."""
        lines = ["import os, resource, signal"]
        if self.as_bytes is not None:
            lines.append(f"resource.setrlimit(resource.RLIMIT_AS, ({self.as_bytes}, {self.as_bytes}))")
        if self.fsize is not None:
            lines += ["signal.signal(signal.SIGXFSZ, signal.SIG_IGN)", f"resource.setrlimit(resource.RLIMIT_FSIZE, ({self.fsize}, {self.fsize}))"]
        if self.umask is not None:
            lines.append(f"os.umask({self.umask})")
        return "; ".join(lines) + "; " + main


def limits(as_bytes: int | None = 3 << 30, fsize: int | None = None, umask: int | None = None) -> Limits:
    return Limits(as_bytes, fsize, umask)


@dataclass
class Ran:
    returncode: int | None  # None: still running at the deadline (then killed)
    stdout: str
    stderr: str
    maxrss_mb: float  # the child's peak resident memory, from the kernel

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


TIME = "/usr/bin/time"  # GNU time: forks, execs, reports the child's own peak RSS (%M, KB)


def kvctl(args: list[str], home: Path, timeout_s: float = 20.0, preexec: Limits | None = None, env: dict[str, str] | None = None) -> Ran:
    """Run ``kvctl ARGS`` as a child; kill it at ``timeout_s`` (returncode None).

    Its peak RSS comes from GNU time, which forks it from a small process: ``wait4`` from this (large)
    test process would report this process's own high-water mark, which Linux carries across the
    fork and exec into the child's ``ru_maxrss``. Without /usr/bin/time the figure is NaN."""
    rss_file = home.parent / f".maxrss-{os.getpid()}-{time.monotonic_ns()}"
    home.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-c", (preexec or limits()).code(), *args]
    if os.path.exists(TIME):
        cmd = [TIME, "-f", "%M", "-o", str(rss_file), *cmd]
    proc = subprocess.Popen(cmd, env=env or kvctl_env(home), stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)  # the session this call started: time and kvctl under it
        out, err = proc.communicate(timeout=10)
    try:
        rss_mb = int(rss_file.read_text().split()[-1]) / 1024
        rss_file.unlink()
    except (OSError, ValueError, IndexError):
        rss_mb = float("nan")
    rc = proc.returncode
    return Ran(None if timed_out else rc, out.decode(errors="replace"), err.decode(errors="replace"), rss_mb)


class HostileHTTP:
    """A real HTTP/1.1 server on 127.0.0.1 (free port). ``body(handler)`` writes the answer; it is told to
    stop (``self.stopping``) when the server closes, so an endless body ends with the test. ``seen``
    keeps each request's path and headers (what a client sent, credentials included)."""

    def __init__(self, body: Callable[["HostileHTTP", BaseHTTPRequestHandler], None]) -> None:
        self.stopping = threading.Event()
        self.seen: list[tuple[str, dict[str, str]]] = []
        self.connected = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802
                server.seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
                server.connected.set()
                try:
                    body(server, self)
                except (BrokenPipeError, ConnectionResetError, OSError):
                    pass

            def log_message(self, *a: object) -> None:
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request: object, client_address: object) -> None:
                pass

        self._httpd = Server(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "HostileHTTP":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def send_head(h: BaseHTTPRequestHandler, length: int | None = None) -> None:
    h.send_response(200)
    h.send_header("Content-Type", "text/plain; version=0.0.4")
    if length is not None:
        h.send_header("Content-Length", str(length))
    else:
        h.send_header("Connection", "close")
    h.end_headers()


def endless(server: HostileHTTP, h: BaseHTTPRequestHandler, deadline_s: float = 30.0) -> None:
    """A /metrics body that never ends (until the test ends or ``deadline_s``): comment lines, 64 KB a write."""
    send_head(h)
    block = b"# filler\n" * 7282
    end = time.monotonic() + deadline_s
    while not server.stopping.is_set() and time.monotonic() < end:
        h.wfile.write(block)


def hang(server: HostileHTTP, h: BaseHTTPRequestHandler, deadline_s: float = 30.0) -> None:
    """Accept, send nothing, hold the connection until the test ends."""
    server.stopping.wait(deadline_s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_row(i: int, prompt_tokens: int = 16310, cached_tokens: int = 16310, latency_s: float = 0.4) -> dict:
    """One row of a ``kvctl replay --out`` run file: a request alone in flight that hit the tier."""
    return {"index": i, "scheduled_s": float(i), "sent_s": float(i), "first_token_s": i + latency_s, "finished_s": i + latency_s,
            "latency_s": latency_s, "prompt_tokens": prompt_tokens, "cached_tokens": cached_tokens, "status": "ok", "in_flight": 1}


def write_run_file(path: Path, rows: list[dict]) -> Path:
    """A run file: its metadata line, ``rows``, its summary line."""
    lines = [{"metadata": {"engine_url": "http://127.0.0.1:1"}}, *rows, {"summary": {"interrupted": False}}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path
