"""Fault injection for kvctl.connector: reliability figures per fault kind (issue 11).

Four families, each bounded in count and time:

* RESP client against fake servers on loopback (tests/connector/resp_fakes.py;
  NOT Valkey) playing misbehaviours a real Valkey cannot produce: unsolicited
  replies, dripped replies, an announced 10 GB bulk, garbage, silence...
* RESP client against a real valkey-server: SIGSTOP with callers queued on
  the pool, SIGKILL + restart on the same port, SIGKILL in the middle of a
  batch.
* batched_get calls (single and split over the GET threads) racing close()
  against a real Valkey.
* The agreed-prefix protocol (tests/connector/test_protocol.py's randomized
  worker): W = 2, 3, 4 gloo ranks on CPU, one real Valkey per rank, every
  injection kind including BaseExceptions.

Per kind it prints trials, calls, wrong bytes (a hit whose bytes are not the
ones the server sent for that key), overruns (a call longer than its deadline
+ 10 %), unresolved calls (a thread still in a call 3 deadlines after close()), other failures (an outcome other than the one
expected: e.g. an error where the retry should have succeeded) and the worst
call time against the deadline. Targets: 0 wrong bytes, 0 overruns, 0
unresolved, 0 failures, 0 protocol desyncs in >= 10 000 trials; exit 1 if one
is missed.

    .venv/bin/python benchmarks/connector_faults.py [--quick] [--close-race-calls 50000] \
        [--protocol-trials 10000] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.connector.* (fakes, protocol worker)

from kvctl.connector.resp import RespClient, RespClosedError, RespError  # noqa: E402
from kvctl.tier.server import start_valkey  # noqa: E402
from tests.connector.resp_fakes import ScriptedServer  # noqa: E402

OVERRUN = 1.10  # a call may take at most deadline + 10 %


@dataclass
class Tally:
    """One fault kind's figures."""

    kind: str
    server: str  # "fake", "valkey", or "valkey x W" for the protocol
    deadline_s: float
    trials: int = 0
    calls: int = 0
    wrong_bytes: int = 0
    overruns: int = 0
    unresolved: int = 0
    failures: int = 0
    worst_s: float = 0.0

    def timed(self, fn: Callable[[], object], expect: str, want: object = None) -> object:
        """Run one call; ``expect`` is "ok" (returns ``want`` if given), "miss" (returns [False]), "error" or "any"."""
        self.calls += 1
        t0 = time.monotonic()
        try:
            out = fn()
            got = "ok"
        except RespError as exc:
            out, got = exc, "error"
        took = time.monotonic() - t0
        self.worst_s = max(self.worst_s, took)
        if took > self.deadline_s * OVERRUN:
            self.overruns += 1
        if expect == "miss":
            got = "miss" if out == [False] else got
        if expect != "any" and (got != expect or (want is not None and got == "ok" and out != want)):
            self.failures += 1
        return out

    def check_bytes(self, hit: bool, buf: bytes | bytearray, want: bytes) -> None:
        if hit and bytes(buf) != want:
            self.wrong_bytes += 1

    def row(self) -> dict:
        return asdict(self) | {"worst_over_deadline": self.worst_s / self.deadline_s if self.deadline_s else 0.0}


# ---------------------------------------------------------------------------------------------
# fake servers (not Valkey)
# ---------------------------------------------------------------------------------------------
def _key(request: bytes) -> bytes:
    """The key of a one-key request (its last bulk string)."""
    parts = request.split(b"\r\n")
    return parts[-2] if len(parts) >= 2 else b""


VALUES = {b"a": b"AAAA", b"b": b"BBBB"}


def _bulk(v: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(v), v)


Kind = tuple[str, Callable, Callable[[Tally, RespClient, str], None], dict]


def _get_expecting(expect: str) -> Callable[[Tally, RespClient, str], None]:
    """A trial of one ``GET a`` into a 4-byte buffer, expecting "ok" (AAAA), "miss" or "error"."""

    def trial(t: Tally, client: RespClient, url: str) -> None:
        buf = bytearray(4)
        out = t.timed(lambda: client.batched_get([b"a"], [buf]), expect, [True] if expect == "ok" else None)
        t.check_bytes(out == [True], buf, VALUES[b"a"])

    return trial


def _reply(reply: bytes, close: bool = False, *, drip_s: float = 0.0, stream_s: float = 0.0, every_s: float = 0.0):
    """A script factory: send ``reply`` (``drip_s``: one byte at a time), then optionally stream filler."""

    def factory(box):
        def script(conn: socket.socket, n: int) -> bool:
            if drip_s:
                for i in range(len(reply)):
                    conn.sendall(reply[i : i + 1])
                    time.sleep(drip_s)
            else:
                conn.sendall(reply)
            end = time.monotonic() + stream_s
            while time.monotonic() < end:  # bounded: stream_s seconds at most
                conn.sendall(b"x" * 65536)
                time.sleep(every_s)
            return not close

        return script

    return factory


def _fake_kinds(d: float) -> list[Kind]:
    """(kind, script factory taking the [server, state] box, one trial, ScriptedServer options)."""

    def extra_reply(late_s: float):
        def factory(box):
            def script(conn: socket.socket, n: int) -> bool:
                key = _key(box[0].last_request)
                reply = _bulk(VALUES.get(key, b"????"))
                if key != b"a":
                    conn.sendall(reply)
                elif not late_s:  # GET a gets an unsolicited second reply, in the same packet ...
                    conn.sendall(reply + _bulk(b"EVIL"))
                else:  # ... or late_s later, while the connection is idle in the pool
                    conn.sendall(reply)
                    time.sleep(late_s)
                    conn.sendall(_bulk(b"EVIL"))
                return True

            return script

        def trial(t: Tally, client: RespClient, url: str) -> None:
            for key in (b"a", b"b"):
                buf = bytearray(4)
                out = t.timed(lambda: client.batched_get([key], [buf]), "ok", [True])
                t.check_bytes(out == [True], buf, VALUES[key])
                time.sleep(5 * late_s)  # the late reply reaches the idle socket before the next request

        return factory, trial

    def silent_auth(t: Tally, client: RespClient, url: str) -> None:
        with RespClient(url.replace("resp://", "resp://:pw@"), timeout_s=d) as c:
            t.timed(c.ping, "error")

    def never_reads(t: Tally, client: RespClient, url: str) -> None:
        t.timed(lambda: client.batched_set([b"big"], [bytes(64 << 20)]), "error")

    def closes_pooled(box):
        def script(conn: socket.socket, n: int) -> bool:
            if id(conn) in box[1]:
                return False  # the next request on a pooled connection: closed, no reply
            box[1][id(conn)] = conn  # kept alive, so no later connection gets its id
            conn.sendall(b"+PONG\r\n" if b"PING" in box[0].last_request else _bulk(VALUES[b"a"]))
            return True

        return script

    def ping_then_get(t: Tally, client: RespClient, url: str) -> None:
        t.timed(client.ping, "ok", True)
        _get_expecting("ok")(t, client, url)  # its pooled socket is closed on it: retried on a fresh one

    def short_value(box):
        def script(conn: socket.socket, n: int) -> bool:
            conn.sendall(_bulk(b"abc") if _key(box[0].last_request) == b"short" else _bulk(VALUES[b"b"]))
            return True

        return script

    def short_then_right(t: Tally, client: RespClient, url: str) -> None:
        t.timed(lambda: client.batched_get([b"short"], [bytearray(4)]), "miss")
        buf = bytearray(4)
        out = t.timed(lambda: client.batched_get([b"b"], [buf]), "ok", [True])
        t.check_bytes(out == [True], buf, VALUES[b"b"])

    more = {"serve_more": True}
    error = _get_expecting("error")
    return [
        ("unsolicited extra reply", *extra_reply(0.0), more),
        ("unsolicited reply 20 ms late", *extra_reply(0.02), more),
        ("reply dripped 1 B / 50 ms", _reply(b"$4\r\nAAAA\r\n", drip_s=0.05), error, {}),
        ("announced 10 GB bulk", _reply(b"$10000000000\r\n", stream_s=2 * d, every_s=0.005), error, {}),
        ("100 MB bulk at ~6 MB/s", _reply(b"$100000000\r\n", stream_s=2 * d, every_s=0.01), error, {}),
        ("silence", _reply(b""), error, {}),
        ("close mid-payload", _reply(b"$1000\r\n" + b"x" * 300, close=True), error, {}),
        ("stall mid-payload", _reply(b"$1000\r\n" + b"x" * 300), error, {}),
        ("garbage type byte", _reply(b"!garbage\r\n"), error, {}),
        ("payload without CRLF", _reply(b"$4\r\nAAAAXX"), error, {}),
        ("header without CRLF (70 KB)", _reply(b"$" + b"9" * 70000), error, {}),
        ("null bulk in 4 packets", _reply(b"$-1\r\n", drip_s=0.005), _get_expecting("miss"), {}),
        ("value shorter than buffer, then GET", short_value, short_then_right, more),
        ("silent during AUTH", _reply(b""), silent_auth, {}),
        ("server never reads a 64 MB SET", _reply(b""), never_reads, {}),
        ("pooled socket closed on next request", closes_pooled, ping_then_get, more),
    ]


def run_fakes(d: float, trials: int) -> list[Tally]:
    out = []
    for kind, factory, trial, opts in _fake_kinds(d):
        t = Tally(kind, "fake", d)
        box: list = [None, {}]
        srv = ScriptedServer(factory(box), max_conns=10 * trials + 10, read_timeout_s=3 * d + 1, **opts)
        box[0] = srv
        try:
            for _ in range(trials):
                with RespClient(srv.url, timeout_s=d, pool_size=1) as client:
                    trial(t, client, srv.url)
                t.trials += 1
        finally:
            srv.stop()
        out.append(t)
    return out


# ---------------------------------------------------------------------------------------------
# real Valkey
# ---------------------------------------------------------------------------------------------
def run_sigstop(tmp: Path, d: float, trials: int) -> Tally:
    """SIGSTOP: a fresh client per trial (connect to a stopped server), 3 callers on a pool of 1."""
    t = Tally("SIGSTOP, 3 callers on a pool of 1", "valkey", d)
    proc = start_valkey(tmp / "stop", die_with_parent=True)
    try:
        with RespClient(proc.url) as c:
            c.batched_set(["k"], [b"v"])
        for _ in range(trials):
            client = RespClient(proc.url, timeout_s=d, pool_size=1)
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                threads = [threading.Thread(target=t.timed, args=(lambda: client.batched_get(["k"], [bytearray(1)]), "error")) for _ in range(3)]
                for th in threads:
                    th.start()
                for th in threads:
                    th.join(timeout=10 * d)
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            client.close()
            t.trials += 1
    finally:
        proc.stop()
    return t


def run_restart(tmp: Path, d: float, trials: int, mid_batch: bool) -> Tally:
    """SIGKILL + restart on the same port; ``mid_batch``: the kill lands during a 8 x 2 MB batched_get."""
    kind = "SIGKILL mid-batch + restart" if mid_batch else "SIGKILL + restart, pool of 4"
    t = Tally(kind, "valkey", d)
    rng = random.Random(7)
    proc = start_valkey(tmp / f"kill-{mid_batch}-0", die_with_parent=True)
    client = RespClient(proc.url, timeout_s=d, pool_size=4)
    size = 2 << 20
    try:
        for i in range(trials):
            keys = [f"v{i}-{j}" for j in range(8)]
            vals = [bytes([(i * 8 + j) % 251]) * size for j in range(8)]
            t.timed(lambda: client.batched_set(keys, vals), "ok")
            threads = [threading.Thread(target=client.batched_get, args=(keys[:2], [bytearray(size) for _ in range(2)])) for _ in range(4)]
            for th in threads:  # fills the pool
                th.start()
            for th in threads:
                th.join(timeout=10)
            if mid_batch:
                bufs = [bytearray(size) for _ in keys]
                result: list = []
                # any outcome is fine, an error or a full batch ...
                th = threading.Thread(target=lambda: result.append(t.timed(lambda: client.batched_get(keys, bufs), "any")))
                th.start()
                time.sleep(rng.uniform(0.0, 0.01))
            os.kill(proc.pid, signal.SIGKILL)
            proc._popen.wait(timeout=10)
            if mid_batch:
                th.join(timeout=10)
                if result and isinstance(result[0], list):
                    for hit, buf, want in zip(result[0], bufs, vals):
                        t.check_bytes(hit, buf, want)  # ... but never a hit with wrong bytes
            port = proc.port
            proc.stop()
            proc = start_valkey(tmp / f"kill-{mid_batch}-{i + 1}", port=port, die_with_parent=True)
            for j in range(8):  # twice the pool: each pooled socket is dead
                key, val = f"after-{i}-{j}", bytes([j]) * 1000
                t.timed(lambda: client.batched_set([key], [val]), "ok")
                buf = bytearray(1000)
                out = t.timed(lambda: client.batched_get([key], [buf]), "ok", [True])
                t.check_bytes(out == [True], buf, val)
            t.trials += 1
    finally:
        client.close()
        proc.stop()
    return t


def run_close_race(tmp: Path, d: float, total: int) -> Tally:
    """Rounds of 4 threads calling batched_get (one value, or 2 x 3 MiB split over the GET threads) while the client closes.

    Each call must return the right bytes or raise RespClosedError, within its
    deadline; "unresolved" counts threads still inside a call 3 deadlines after
    close(). Worst call time = call to return.
    """
    t = Tally("batched_get racing close() (split too)", "valkey", d)
    rng = random.Random(11)
    proc = start_valkey(tmp / "close-race", die_with_parent=True)
    small = ([b"c0"], [bytes([1]) * 512])
    split = ([b"c1", b"c2"], [bytes([2]) * (3 << 20), bytes([3]) * (3 << 20)])
    try:
        with RespClient(proc.url) as c:
            for keys, vals in (small, split):
                c.batched_set(keys, vals)
        while t.calls < total:
            client = RespClient(proc.url, timeout_s=d, pool_size=4, parallel_gets=2)
            lock = threading.Lock()

            def caller(seed: int) -> None:
                r = random.Random(seed)
                for _ in range(5000):  # bounded; ends at the first refusal
                    keys, vals = small if r.random() < 0.5 else split
                    bufs = [bytearray(len(v)) for v in vals]
                    t0 = time.monotonic()
                    try:
                        got = client.batched_get(keys, bufs)
                        closed, failed = False, got != [True] * len(keys)
                    except RespClosedError:
                        got, closed, failed = None, True, False
                    except RespError:
                        got, closed, failed = None, False, True
                    took = time.monotonic() - t0
                    with lock:
                        t.calls += 1
                        t.worst_s = max(t.worst_s, took)
                        t.overruns += took > d * OVERRUN
                        t.failures += failed
                        if got:
                            for ok, buf, want in zip(got, bufs, vals):
                                t.check_bytes(ok, buf, want)
                    if closed:
                        return

            threads = [threading.Thread(target=caller, args=(rng.random(),)) for _ in range(4)]
            for th in threads:
                th.start()
            time.sleep(rng.uniform(0.0, 0.2))
            client.close()
            for th in threads:
                th.join(timeout=3 * d)
            t.unresolved += sum(th.is_alive() for th in threads)
            for th in threads:
                th.join(timeout=30)
            t.trials += 1
    finally:
        proc.stop()
    return t


# ---------------------------------------------------------------------------------------------
# the load protocol
# ---------------------------------------------------------------------------------------------
def run_protocol(tmp: Path, total: int) -> list[Tally]:
    from tests.connector.ranks import spawn_ranks  # noqa: PLC0415
    from tests.connector.test_protocol import INJECTIONS, protocol_worker  # noqa: PLC0415

    out = []
    per_world = math.ceil(total / 3)
    for world in (2, 3, 4):
        servers = [start_valkey(tmp / f"proto-{world}-{r}", die_with_parent=True) for r in range(world)]
        t = Tally(f"protocol W={world}, {len(INJECTIONS)} injection kinds", f"valkey x {world}", 0.0)
        t0 = time.monotonic()
        try:
            res = spawn_ranks(protocol_worker, world, ([s.url for s in servers], 5000 + world, 3600.0, per_world), timeout_s=3600)
        except AssertionError as exc:  # a rank raised or hung: the group desynced
            print(f"protocol W={world}: {exc}"[:2000], file=sys.stderr)
            t.failures = 1
            out.append(t)
            continue
        finally:
            for s in servers:
                s.stop()
        t.trials = res[0]["trials"]
        t.calls = sum(sum(o["kinds"].values()) for o in res)  # injections made
        desync = sum(len(o["errors"]) for o in res)
        for o in res[1:]:
            desync += sum(a != b for a, b in zip(o["prefixes"], res[0]["prefixes"]))
        t.failures = desync
        t.worst_s = max(o["max_trial_s"] for o in res)
        kinds = set().union(*(o["kinds"] for o in res))
        t.kind = f"protocol W={world}: {len(kinds)}/{len(INJECTIONS)} injection kinds"
        print(f"protocol W={world}: {t.trials} trials in {time.monotonic() - t0:.0f} s", file=sys.stderr)
        out.append(t)
    return out


# ---------------------------------------------------------------------------------------------
def render(rows: list[Tally]) -> str:
    head = f"{'fault kind':<44} {'server':<10} {'trials':>6} {'calls':>7} {'wrong B':>7} {'overrun':>7} {'unres.':>6} {'fail':>5} {'worst s':>8} {'deadl. s':>8} {'worst/d':>7}"
    lines = [head, "-" * len(head)]
    for t in rows:
        ratio = f"{t.worst_s / t.deadline_s:.2f}" if t.deadline_s else "-"
        dl = f"{t.deadline_s:.2f}" if t.deadline_s else "-"
        lines.append(
            f"{t.kind[:44]:<44} {t.server:<10} {t.trials:>6} {t.calls:>7} {t.wrong_bytes:>7} {t.overruns:>7} "
            f"{t.unresolved:>6} {t.failures:>5} {t.worst_s:>8.3f} {dl:>8} {ratio:>7}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deadline", type=float, default=0.3, help="timeout_s of the RESP calls (fake servers, SIGSTOP)")
    ap.add_argument("--trials", type=int, default=10, help="trials per RESP fault kind")
    ap.add_argument("--restarts", type=int, default=5, help="SIGKILL + restart trials (each kind)")
    ap.add_argument("--close-race-calls", type=int, default=50_000, help="batched_get calls raced against close()")
    ap.add_argument("--protocol-trials", type=int, default=10_000, help="protocol trials over W = 2, 3, 4")
    ap.add_argument("--quick", action="store_true", help="a short smoke run (3 trials, 2 restarts, 5000 close-race calls, 300 protocol trials)")
    ap.add_argument("--skip-protocol", action="store_true", help="leave out the protocol trials")
    ap.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = ap.parse_args(argv)
    if args.quick:
        args.trials, args.restarts, args.close_race_calls, args.protocol_trials = 3, 2, 5000, 300
    d = args.deadline
    rows: list[Tally] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvctl-faults-") as tmp_s:
        tmp = Path(tmp_s)
        rows += run_fakes(d, args.trials)
        rows.append(run_sigstop(tmp, d, args.trials))
        rows.append(run_restart(tmp, 1.0, args.restarts, mid_batch=False))
        rows.append(run_restart(tmp, 1.0, args.restarts, mid_batch=True))
        rows.append(run_close_race(tmp, 1.0, args.close_race_calls))
        if not args.skip_protocol:
            rows += run_protocol(tmp, args.protocol_trials)
    print(render(rows))
    bad = [t.kind for t in rows if t.wrong_bytes or t.overruns or t.unresolved or t.failures]
    proto_trials = sum(t.trials for t in rows if t.kind.startswith("protocol"))
    print(
        f"\ntotal: {sum(t.calls for t in rows if not t.kind.startswith('protocol'))} RESP calls, "
        f"{proto_trials} protocol trials, {time.monotonic() - started:.0f} s; "
        f"targets (0 wrong bytes, 0 overruns, 0 unresolved, 0 failures/desyncs, worst <= deadline + 10 %): "
        + ("MET" if not bad else "MISSED by " + ", ".join(bad))
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "params": vars(args), "rows": [t.row() for t in rows]}, indent=2))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
