"""What a Valkey (or anything on its port) answers is bounded in time and typed before use (issue 44, defects 3
and 13).

* A server that drips its reply one byte every 0.3 s: a socket timeout per read never fires, so `doctor
  --timeout 1` ran 128 s and `deploy-valkey status`, `diagnose --timeout 2` and `bench --timeout 2` ran until the
  server quit. Each now ends within its timeout (plus start-up), says "timed out" for that instance and exits
  as it does for an unreachable one. Real kvctl processes.
* INFO or CONFIG GET answered by a null, an array, an integer, a number no float holds, a key count that is not
  a number, or an INFO of more than 1 MiB: a traceback ("unexpected ...", exit 1) before; now a per-instance
  failure naming what the instance answered.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from http.server import BaseHTTPRequestHandler

import pytest
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.tier.targets import InstanceState, TierState
from tests.diagnose.engine_text import EngineState
from tests.exporter.helpers import ExporterProcess
from tests.hostile.fake_resp import CONFIG, FakeResp, bulk, info_with
from tests.hostile.helpers import HostileHTTP, kvctl, kvctl_env, send_head

DRIP_S = 0.3
METRICS = EngineState(requests=3, prompt_lengths=(100.0, 100.0, 100.0)).text()


def healthy(server: HostileHTTP, h: BaseHTTPRequestHandler) -> None:
    send_head(h, len(METRICS))
    h.wfile.write(METRICS.encode())


def tier_dir(tmp_path, port: int):
    """A tier directory whose one instance is the fake server's port, written by the state file's own writer. Its pid
    is this test's (alive, not a valkey-server: not the tier's process, and status never signals)."""
    d = tmp_path / "tier"
    d.mkdir()
    inst = InstanceState(0, "127.0.0.1", port, os.getpid(), f"resp://127.0.0.1:{port}", *(str(d / f"valkey-0.{x}") for x in ("conf", "log", "pid")))
    TierState(str(d), [inst], maxmemory_total=1 << 26, maxmemory_per_instance=1 << 26, io_threads=1).write()
    return d


def timed(args: list[str], home, limit_s: float = 40.0):
    t0 = time.monotonic()
    res = kvctl(args, home, timeout_s=limit_s)
    return res, time.monotonic() - t0


# --- a dripping server: one deadline for the whole call --------------------------------------------------------


@pytest.mark.parametrize("case", ["doctor", "status", "status-dir", "bench"])
def test_a_dripping_server_costs_one_timeout(tmp_path, case):
    with FakeResp(drip_s=DRIP_S) as srv:
        args, code = {  # doctor --timeout 1; status's own 3 s; bench --timeout 2 (its chunk probe, then INFO)
            "doctor": (["doctor", "--valkey", srv.url, "--timeout", "1", "--no-host-checks"], 5),  # 5: the one source given timed out (issue 48)
            "status": (["deploy-valkey", "status", "--valkey", srv.url], 5),
            "status-dir": (["deploy-valkey", "status", "--dir", str(tier_dir(tmp_path, srv.port))], 5),
            "bench": (["bench", "--valkey", srv.url, "--timeout", "2", "--duration", "1", "--chunk-bytes", "1mb"], 5),
        }[case]
        res, took = timed(args, tmp_path / "home")
    assert res.returncode == code, (res.returncode, took, res.output[-1500:])  # None: still running at 40 s
    assert "timed out" in res.output, res.output[-1500:]
    assert took < 20, took  # a few seconds; a loaded machine starts python slowly (it dripped for 40 s and more before)


def test_diagnose_a_dripping_instance_costs_one_timeout(tmp_path):
    with FakeResp(drip_s=DRIP_S) as srv, HostileHTTP(healthy) as eng:
        res, took = timed(["diagnose", "--engine-url", eng.url, "--valkey", srv.url, "--timeout", "2", "--window", "1", "--json"], tmp_path / "home")
    assert res.returncode == 5, (res.returncode, took, res.output[-1500:])  # unreachable; None: still running at 40 s
    assert "timed out" in res.output, res.output[-1500:]
    assert took < 20, took  # two samples of at most 2 s each, 1 s apart, and the start


def test_exporter_publishes_a_dripping_instance_as_down(tmp_path):
    with FakeResp(drip_s=DRIP_S) as srv, HostileHTTP(healthy) as eng, \
            ExporterProcess(["--engine-url", eng.url, "--valkey", srv.url, "--interval", "1", "--window", "2", "--timeout", "1"],
                            env=kvctl_env(tmp_path / "home")) as ex:
        up = None
        deadline = time.monotonic() + 20
        while up is None and time.monotonic() < deadline:
            time.sleep(0.3)
            with urllib.request.urlopen(ex.start["metrics_url"], timeout=5) as r:
                body = r.read().decode()
            up = next((float(ln.rsplit(" ", 1)[1]) for ln in body.splitlines() if ln.startswith("kvctl_valkey_up{")), None)
    assert up == 0.0, (up, ex.err[-2000:])
    assert "timed out" in ex.err, ex.err[-2000:]


# --- hostile INFO / CONFIG GET replies: typed before use ----------------------------------------------------------

HOSTILE = {
    "config-null": ({"CONFIG": b"$-1\r\n"}, "CONFIG GET"),
    "used-memory-1e400": ({"INFO": info_with("used_memory:1e400")}, "INFO"),
    "keys-abc": ({"INFO": info_with("db0:keys=abc,expires=0,avg_ttl=0")}, "INFO"),
    "info-array": ({"INFO": b"*2\r\n$1\r\na\r\n$1\r\nb\r\n"}, "INFO"),
    "info-integer": ({"INFO": b":7\r\n"}, "INFO"),
    "info-null": ({"INFO": b"$-1\r\n"}, "INFO"),
    "info-2mib": ({"INFO": bulk("# Server\r\n" + "x:" + "y" * (2 << 20) + "\r\n")}, "INFO"),
    "info-nan-calls": ({"INFO": info_with("cmdstat_get:calls=nan,usec=1,usec_per_call=1.0")}, "INFO"),
    "config-odd": ({"CONFIG": b"*3\r\n$9\r\nmaxmemory\r\n$1\r\n0\r\n$4\r\nsave\r\n"}, "CONFIG GET"),
    "config-nested": ({"CONFIG": b"*2\r\n$9\r\nmaxmemory\r\n*1\r\n:1\r\n"}, "CONFIG GET"),
}
#: each reader and the exit code it uses for an instance it cannot read
READERS = {
    "doctor": (lambda url: ["doctor", "--valkey", url, "--timeout", "2", "--no-host-checks", "--json"], 4),
    "status": (lambda url: ["deploy-valkey", "status", "--valkey", url, "--json"], 5),
    "bench": (lambda url: ["bench", "--valkey", url, "--timeout", "2", "--duration", "1", "--chunk-bytes", "1mb", "--json"], 5),
}


#: status and bench send no CONFIG GET * (bench's CONFIG GET io-threads is tried below)
PAIRS = [(c, r) for c in sorted(HOSTILE) for r in sorted(READERS) if r == "doctor" or HOSTILE[c][1] == "INFO"]


@pytest.mark.parametrize("case, reader", PAIRS)
def test_a_hostile_reply_is_a_per_instance_failure(case, reader):
    replies, command = HOSTILE[case]
    args, code = READERS[reader]
    with FakeResp(replies) as srv:
        res = CliRunner().invoke(cli, args(srv.url))
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert res.exit_code == code, (res.exit_code, res.output[-1500:])
    assert f"answered {command}" in res.output, res.output[-1500:]


@pytest.mark.parametrize("case", ["info-array", "info-integer", "used-memory-1e400", "keys-abc", "info-2mib"])
def test_diagnose_reports_a_hostile_info(case):
    replies, _ = HOSTILE[case]
    with FakeResp(replies) as srv, HostileHTTP(healthy) as eng:
        res = CliRunner().invoke(cli, ["diagnose", "--engine-url", eng.url, "--valkey", srv.url, "--timeout", "2", "--window", "1", "--json"])
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert res.exit_code == 5, res.output[-1500:]
    errors = json.dumps(json.loads(res.stdout))
    assert "answered INFO" in errors, errors[-1500:]


def test_bench_reads_a_hostile_io_threads_as_unknown():
    """CONFIG GET io-threads answered with a null: bench goes on without the number, as for an ACL user."""
    from kvctl.bench.info import server_info

    with FakeResp({"CONFIG": b"$-1\r\n"}) as srv:
        info = server_info(srv.url, 2.0)
    assert info.io_threads is None and info.maxmemory_bytes == int(CONFIG["maxmemory"])


# --- the pieces: the parser with bytes alone, the connector's bounded reader, one deadline, the abort ----------------


@pytest.mark.parametrize("reply, says", [
    (None, "a null reply"), ([b"a"], "an array of 1"), (7, "the integer 7"), ("OK", "the simple string 'OK'"),
    (b"used_memory:1e400\r\n", "used_memory '1e400'"), (b"used_memory:nan\r\n", "used_memory 'nan'"),
    (b"maxmemory:-5\r\n", "maxmemory '-5'"), (b"db0:keys=abc,expires=0\r\n", "db0 keys 'abc'"), (b"db0:12\r\n", "db0 '12'"),
    (b"cmdstat_get:calls=1,usec=inf\r\n", "cmdstat_get usec 'inf'"), (b"connected_clients:" + b"9" * 30 + b"\r\n", "connected_clients '999"),
])
def test_parse_info_refuses_what_it_cannot_type(reply, says):
    from kvctl.tier.replies import BadReply, parse_info

    with pytest.raises(BadReply, match="answered INFO with") as e:
        parse_info(reply)
    assert says in str(e.value)


def test_parse_info_types_a_valkey_reply():
    from kvctl.tier.replies import parse_info

    info = parse_info(info_with("db0:keys=3,expires=1,avg_ttl=0\nmem_fragmentation_ratio:1.25\nos:Linux 6.1 x86_64").split(b"\r\n", 1)[1])
    assert info["used_memory"] == 1048576 and info["db0"] == {"keys": 3, "expires": 1, "avg_ttl": 0}
    assert info["mem_fragmentation_ratio"] == 1.25 and info["os"] == "Linux 6.1 x86_64" and info["cmdstat_get"]["usec_per_call"] == 0.0


@pytest.mark.parametrize("reply, says", [
    (None, "a null reply"), (b"x", "a bulk string"), ([b"a"], "odd number"), ([b"a", [b"b"]], "an array of 1"), ([b"a", None], "a null reply"),
])
def test_parse_config_refuses_what_is_not_name_value_pairs(reply, says):
    from kvctl.tier.replies import BadReply, parse_config

    with pytest.raises(BadReply, match="answered CONFIG GET with") as e:
        parse_config(reply)
    assert says in str(e.value)


@pytest.mark.parametrize("reply, says", [
    (b"*1000000000\r\n", "array elements"), (b"$99999999999\r\n", "bytes"), (b"*1\r\n*1\r\n*1\r\n:1\r\n", "nested deeper"),
    (b"%1\r\n", "not RESP2"), (b":12x\r\n", "malformed"), (b"$-7\r\n", "negative length"),
])
def test_the_reader_refuses_a_reply_past_its_bounds_at_its_header(reply, says):
    """Refused before any of it is read (or allocated): the connection is dropped, the failure is the instance's."""
    from kvctl.tier.admin import Admin
    from kvctl.tier.replies import BadReply

    with FakeResp({"INFO": reply}) as srv, Admin(srv.url, 5.0) as a:
        t0 = time.monotonic()
        with pytest.raises(BadReply, match="answered INFO with an unreadable reply") as e:
            a.info()
        assert time.monotonic() - t0 < 2.0
    assert says in str(e.value)


def test_one_deadline_covers_every_command_of_a_read():
    """INFO answered at once, CONFIG GET dripped: the read ends at the one deadline set when it began, not a timeout
    after CONFIG GET was sent; :meth:`Admin.restart` starts the next read's."""
    from kvctl.tier.admin import Admin, TimedOut

    with FakeResp(drip_s=DRIP_S, drip=("CONFIG",)) as srv, Admin(srv.url, 2.0) as a:
        t0 = time.monotonic()
        assert a.info()["used_memory"] == 1048576
        time.sleep(1.5)
        with pytest.raises(TimedOut, match="timed out: no whole reply to CONFIG GET within 2 s"):
            a.config_get("maxmemory")
        took = time.monotonic() - t0
        assert 1.9 < took < 3.2, took  # 2 s in all, not 1.5 + 2
        a.restart()
        assert a.ping()


def test_abort_cuts_a_read_in_flight():
    import threading

    from kvctl.tier.admin import Admin, InstanceFailure

    with FakeResp(drip_s=DRIP_S) as srv:
        a = Admin(srv.url, 30.0)
        failed: list[BaseException] = []

        def read() -> None:
            try:
                a.info()
            except InstanceFailure as e:
                failed.append(e)

        t = threading.Thread(target=read, daemon=True)
        t.start()
        time.sleep(1.0)
        t0 = time.monotonic()
        a.abort()
        t.join(timeout=5)
        assert not t.is_alive() and time.monotonic() - t0 < 2.0
    assert failed and "unreachable" in str(failed[0])

