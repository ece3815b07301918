"""benchmarks/linkshaper.py, the slow link simulate_vs_replay.py puts in front of each Valkey instance.

A real valkey-server behind a real shaper process: replies arrive whole and correct, no faster than the
configured rate (a lower bound only: a busy machine can only make it slower), SETs pass unlimited, and
a small reply is not held behind a large one of another connection for longer than a few slices. A stop
signal ends it promptly with clients connected, under every Python this machine has of 3.11-3.13 (3.12's
``Server.wait_closed`` waits for every connection); it binds and forwards to loopback only unless told.
"""

from __future__ import annotations

import glob
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis

SHAPER = Path(__file__).resolve().parents[2] / "benchmarks" / "linkshaper.py"
sys.path.insert(0, str(SHAPER.parents[1]))
from benchmarks import linkshaper  # noqa: E402
MB = 1e6


@pytest.fixture
def shaped(valkey_server):
    """(client through a 1 MB/s link, direct client, shaper process), started and stopped by the benchmarks' helpers."""
    p, port = linkshaper.spawn(valkey_server.host, valkey_server.port, 1)
    try:
        through = redis.Redis(host="127.0.0.1", port=port, socket_timeout=20)
        direct = redis.Redis(host=valkey_server.host, port=valkey_server.port, socket_timeout=20)
        yield through, direct, p
    finally:
        linkshaper.stop([p])
        assert p.returncode is not None  # SIGTERM ends it (or the kill after the grace)


def test_replies_are_whole_and_no_faster_than_the_link(shaped):
    through, direct, _ = shaped
    value = bytes(range(256)) * 4096  # 1 MiB
    t0 = time.monotonic()
    assert through.set("k", value)  # SETs are not limited
    set_s = time.monotonic() - t0
    t0 = time.monotonic()
    got = through.get("k")
    get_s = time.monotonic() - t0
    assert got == value == direct.get("k")
    # 1 MiB at 1 MB/s: at least ~1.05 s less the bucket's burst of 4 × 16 KiB
    assert get_s >= (len(value) - 4 * 16384) / MB * 0.98, get_s
    assert set_s < get_s


def test_a_small_reply_is_not_held_behind_a_large_one(shaped, valkey_server):
    through, direct, p = shaped
    direct.set("big", b"x" * 2_000_000)  # 2 s on the 1 MB/s link
    other = redis.Redis(host="127.0.0.1", port=through.connection_pool.connection_kwargs["port"], socket_timeout=20)
    other.ping()
    done = threading.Event()
    worker = threading.Thread(target=lambda: (through.get("big"), done.set()), daemon=True)
    worker.start()
    time.sleep(0.3)  # the big reply is flowing
    t0 = time.monotonic()
    assert other.exists("big") == 1
    small_s = time.monotonic() - t0
    worker.join(timeout=20)
    assert done.is_set()
    assert small_s < 1.0, small_s  # a slice or two of the big reply (16 KiB each, 16 ms at 1 MB/s), not the 1.7 s it has left
    assert p.poll() is None


def _python(minor: int) -> str | None:
    """An interpreter of Python 3.MINOR on this machine (this one, on PATH, or pyenv's), checked by running it."""
    if sys.version_info[:2] == (3, minor):
        return sys.executable
    root = os.environ.get("PYENV_ROOT") or str(Path.home() / ".pyenv")
    for cand in (shutil.which(f"python3.{minor}"), *sorted(glob.glob(f"{root}/versions/3.{minor}.*/bin/python3")),
                 f"/usr/bin/python3.{minor}"):
        if not cand or not os.access(cand, os.X_OK):
            continue
        try:  # a pyenv shim of a version not selected exits 127
            r = subprocess.run([cand, "-c", "import sys; print(sys.version_info[1])"], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0 and r.stdout.strip() == str(minor):
            return cand
    return None


def _start(*args: str, python: str = sys.executable) -> tuple[subprocess.Popen, int]:
    """A shaper process (stdout and stderr piped) and its port, once it printed ``ready``."""
    p = subprocess.Popen([python, str(SHAPER), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    ready, _, _ = select.select([p.stdout], [], [], 20)
    line = p.stdout.readline().split() if ready else []
    if line[:1] != ["ready"]:
        linkshaper.stop([p])
        pytest.fail(f"the shaper did not start in 20 s: {p.stderr.read()}")
    return p, int(line[1])


def _stopped(p: subprocess.Popen) -> str:
    """Stop ``p`` (SIGTERM, then kill) and give what it wrote to stderr."""
    linkshaper.stop([p])
    err = p.stderr.read()
    p.stderr.close()
    return err


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("minor", [11, 12, 13], ids=["py3.11", "py3.12", "py3.13"])
def test_a_stop_signal_ends_it_with_clients_connected(valkey_server, minor, signum):
    """One idle client and one whose 2 MB reply is flowing at 1 MB/s (and not read) hold their connections open;
    SIGTERM or SIGINT ends the shaper, exit 0, within 5 s, and closes both (3.12 and 3.13 waited for the clients
    to leave)."""
    python = _python(minor)
    if python is None:
        pytest.skip(f"no Python 3.{minor} on this machine (this interpreter, PATH, pyenv's versions)")
    redis.Redis(host=valkey_server.host, port=valkey_server.port, socket_timeout=10).set("big", b"x" * 2_000_000)
    p, port = _start("--listen", "127.0.0.1:0", "--upstream", f"{valkey_server.host}:{valkey_server.port}",
                     "--down-mbps", "1", python=python)
    idle = socket.create_connection(("127.0.0.1", port), timeout=10)
    busy = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        idle.sendall(b"*1\r\n$4\r\nPING\r\n")
        assert idle.recv(64) == b"+PONG\r\n"  # through the shaper to the server, and held open
        busy.sendall(b"*2\r\n$3\r\nGET\r\n$3\r\nbig\r\n")
        assert busy.recv(64)  # the reply has begun; the rest waits in the bucket and in the unread socket
        p.send_signal(signum)
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pytest.fail(f"Python 3.{minor}: the shaper was still running 5 s after {signum.name} with two clients connected")
        assert p.returncode == 0
        try:  # its connections went with it: EOF or a reset, not a wait
            assert idle.recv(64) == b""
        except ConnectionResetError:
            pass
    finally:
        busy.close()
        idle.close()
        err = _stopped(p)
    assert "Traceback" not in err and "Exception" not in err, err


def _shaper(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SHAPER), *args, "--down-mbps", "1"], capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("flag, value", [
    ("--listen", "0.0.0.0:0"), ("--listen", ":0"), ("--listen", "[::]:0"), ("--listen", "192.0.2.10:0"),
    ("--upstream", "192.0.2.10:6379"), ("--upstream", "example.com:6379"), ("--upstream", "[2001:db8::1]:6379"),
])
def test_a_non_loopback_address_is_refused(flag, value):
    """A relay reachable from the network in front of a password-less Valkey, or one forwarding anywhere: refused,
    one line naming the option and the flag that allows it, exit 2."""
    args = {"--listen": "127.0.0.1:0", "--upstream": "127.0.0.1:6379", flag: value}
    r = _shaper(*[x for kv in args.items() for x in kv])
    assert r.returncode == 2, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0] and "loopback" in lines[0] and "--allow-non-loopback" in lines[0], r.stderr
    assert "Traceback" not in r.stderr and not r.stdout


@pytest.mark.parametrize("value", ["127.0.0.1", "127.0.0.1:", "127.0.0.1:abc", "127.0.0.1:70000", "[::1:6379"])
def test_a_malformed_address_is_refused(value):
    r = _shaper("--listen", "127.0.0.1:0", "--upstream", value)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--upstream" in r.stderr, r
    assert "Traceback" not in r.stderr


def test_allow_non_loopback_warns_and_starts():
    """With the flag, a non-loopback upstream is taken, with a warning (nothing connects to it: no client comes)."""
    p, _ = _start("--listen", "127.0.0.1:0", "--upstream", "192.0.2.10:6379", "--down-mbps", "1", "--allow-non-loopback")
    err = _stopped(p)
    assert "warning" in err and "192.0.2.10" in err and "loopback" in err, err
    assert p.returncode == 0


@pytest.mark.parametrize("listen", ["127.0.0.2:0", "localhost:0"])
def test_loopback_spellings_are_accepted(valkey_server, listen):
    p, port = _start("--listen", listen, "--upstream", f"localhost:{valkey_server.port}", "--down-mbps", "0")
    try:
        host = listen.rsplit(":", 1)[0].replace("localhost", "127.0.0.1")
        assert redis.Redis(host=host, port=port, socket_timeout=10).ping()
    finally:
        err = _stopped(p)
    assert not err, err
