"""Issue 14: a large batched_get spread over several pooled connections at once.

Results, misses and the deadline must be exactly those of the one-connection
path. Real valkey-server fixtures (tests/conftest.py) for data and SIGSTOP; a
sub-connection that dies or drips mid-reply comes from :class:`ScriptedServer`
(tests/connector/resp_fakes.py), a fake RESP server on loopback that is NOT
Valkey (a real Valkey cannot be made to close one connection mid-value).
Every server loop here is bounded in count and time.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import threading
import time

import pytest

from kvctl.connector.resp import RespClient, RespConnectionError, RespTimeout
from tests.connector.resp_fakes import ScriptedServer

MIB = 1024 * 1024
SLACK = 1.10  # the bound: a call ends within its deadline + 10 %


def test_parallel_gets_knob():
    """None = min(pool_size, 8); never above pool_size; 0, negatives and non-integers are refused."""
    url = "resp://127.0.0.1:1"  # nothing is connected by the constructor
    assert RespClient(url, pool_size=4).parallel_gets == 4
    assert RespClient(url, pool_size=16).parallel_gets == 8
    assert RespClient(url, pool_size=2, parallel_gets=6).parallel_gets == 2
    assert RespClient(url, pool_size=8, parallel_gets=1).parallel_gets == 1
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="parallel_gets"):
            RespClient(url, parallel_gets=bad)


def test_split_results_equal_the_serial_path_with_misses(valkey_server):
    """Random batches of 2-9 keys, 0.5-3 MiB each, about a third absent and some of the wrong size.

    Expected by hand from what was stored: a key is filled iff it was SET and
    its stored length equals its buffer's; a filled buffer holds the stored
    bytes; a missed one keeps its 0xEE filler. The split client (pool 4) and
    the serial one (parallel_gets=1) must both give exactly that.
    """
    rng = random.Random(14)
    stored: dict[str, bytes] = {}
    with RespClient(valkey_server.url, timeout_s=10.0, pool_size=4) as split, RespClient(
        valkey_server.url, timeout_s=10.0, pool_size=4, parallel_gets=1
    ) as serial:
        for batch_no in range(6):
            n = rng.randint(2, 9)
            keys = [f"b{batch_no}-k{i}" for i in range(n)]
            sizes = [rng.randint(MIB // 2, 3 * MIB) for _ in keys]
            present = [rng.random() > 0.35 for _ in keys]
            # a present key stored 7 bytes shorter than its buffer is a size-mismatch miss
            short = [p and rng.random() < 0.2 for p in present]
            to_set = {}
            for k, size, p, sh in zip(keys, sizes, present, short):
                if p:
                    to_set[k] = rng.randbytes(size - 7 if sh else size)
            if to_set:
                split.batched_set(list(to_set), list(to_set.values()))
            stored.update(to_set)
            expected = [p and not sh for p, sh in zip(present, short)]
            for client in (split, serial):
                bufs = [bytearray(b"\xee" * size) for size in sizes]
                assert client.batched_get(keys, bufs) == expected, (batch_no, client.parallel_gets)
                for k, buf, hit, size in zip(keys, bufs, expected, sizes):
                    assert bytes(buf) == (stored[k] if hit else b"\xee" * size), (batch_no, k)
        assert serial.pool_stats().created == 1  # parallel_gets=1: one connection did everything
        # the split client read at least one batch on several connections at once, and kept them all
        stats = split.pool_stats()
        assert stats.created >= 2 and stats.dropped == 0, stats


def test_split_false_keeps_a_large_batch_on_one_connection(valkey_server):
    """A lane that owns one connection (the device load's, the layered load's): 4 x 3 MiB with ``split=False`` on a
    client that would split them stays on one connection and fills every buffer (a missing key a miss)."""
    with RespClient(valkey_server.url, timeout_s=10.0, pool_size=4) as client:
        values = [bytes([i]) * (3 * MIB) for i in range(3)]
        client.batched_set(["s0", "s1", "s2"], values)
        bufs = [bytearray(3 * MIB) for _ in range(4)]
        assert client.batched_get(["s0", "s1", "gone", "s2"], bufs, split=False) == [True, True, False, True]
        assert [bytes(b) for b in (bufs[0], bufs[1], bufs[3])] == values
        assert client.pool_stats().created == 1
        client.batched_get(["s0", "s1", "s2"], bufs[:3])  # the default splits the same batch
        assert client.pool_stats().created >= 2


def test_small_batches_stay_on_one_connection(valkey_server):
    """8 x 256 KiB = 2 MiB total is under the 4 MiB threshold: one connection, as before."""
    with RespClient(valkey_server.url, pool_size=4) as client:
        keys = [f"s{i}" for i in range(8)]
        values = [bytes([i]) * (256 * 1024) for i in range(8)]
        client.batched_set(keys, values)
        for _ in range(3):
            bufs = [bytearray(len(v)) for v in values]
            assert client.batched_get(keys, bufs) == [True] * 8
            assert [bytes(b) for b in bufs] == values
        assert client.pool_stats().created == 1


def test_sigstopped_server_split_call_ends_by_its_deadline(valkey_server):
    """A SIGSTOPped Valkey: 4 x 2 MiB over 4 connections times out as one call, within 1.0 s + 10 %."""
    timeout = 1.0
    keys = [f"stop-{i}" for i in range(4)]
    with RespClient(valkey_server.url, timeout_s=timeout, pool_size=4) as client:
        client.batched_set(keys, [bytes([i]) * (2 * MIB) for i in range(4)])
        bufs = [bytearray(2 * MIB) for _ in keys]
        os.kill(valkey_server.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(RespTimeout):
                client.batched_get(keys, bufs)
            took = time.monotonic() - t0
        finally:
            os.kill(valkey_server.pid, signal.SIGCONT)
        assert took <= timeout * SLACK, f"split call took {took:.3f}s against a {timeout}s deadline"
        assert all(b == bytearray(2 * MIB) for b in bufs)  # nothing arrived from a stopped server
        # after SIGCONT the same client serves the batch (the timed-out sockets were dropped)
        assert client.batched_get(keys, bufs) == [True] * 4
        assert [b[0] for b in bufs] == [0, 1, 2, 3]


def test_dead_sub_connection_fails_the_call_and_nothing_writes_afterwards():
    """Two sub-batches of one 2 MiB value each: one connection dies mid-value, the other drips its value.

    Fake server (not Valkey), each connection served on its own thread. The
    connection that asks for ``a`` (sub-batch 0, read on the caller's thread)
    gets half a value, then a close: it fails at once. The one that asks for
    ``b`` (the client's GET thread) gets the header and 64 KiB every 20 ms:
    2 MiB would take 0.64 s, past the 0.5 s deadline, so that sub-batch is
    still writing into its buffer when the other has already failed. The
    call must fail (a connection error) only after that writer stopped: the
    buffers may not change afterwards, checked over 0.6 s while the server
    keeps sending.
    """
    timeout = 0.5
    size = 2 * MIB
    header = b"$%d\r\n" % size

    def script(conn: socket.socket, n: int) -> bool:
        if b"$1\r\na\r\n" in srv.request_on[conn]:
            conn.sendall(header + b"d" * (size // 2))
            return False  # closed mid-value
        conn.sendall(header)
        end = time.monotonic() + 1.5
        while time.monotonic() < end:  # bounded: 1.5 s
            conn.sendall(b"w" * (64 * 1024))
            time.sleep(0.02)
        return False

    srv = ScriptedServer(script, max_conns=2, concurrent=True)
    with srv, RespClient(srv.url, timeout_s=timeout, pool_size=2) as client:
        bufs = [bytearray(size), bytearray(size)]
        t0 = time.monotonic()
        with pytest.raises(RespConnectionError):
            client.batched_get(["a", "b"], bufs)
        took = time.monotonic() - t0
        after = [bytes(b) for b in bufs]
        assert srv.accepted == 2, "the batch was not split over two connections"
        # the dripped sub-batch had received some of its value by the time the call ended
        assert b"w" in after[1]
        end = time.monotonic() + 0.6
        while time.monotonic() < end:  # bounded: 0.6 s
            assert [bytes(b) for b in bufs] == after, "a sub-batch wrote into a buffer after the call returned"
            time.sleep(0.05)
        # the call waited for the dripping sub-batch: it ended at its deadline, not when "a" died
        assert timeout * 0.9 <= took <= timeout * SLACK, took
        stats = client.pool_stats()
        assert stats.idle == 0 and stats.dropped == 2, stats


def test_abort_ends_a_blocked_sub_batch_read_at_once():
    """The caller's last resort past the deadline: Fanout.abort shuts the reading socket down and waits.

    Fake server (not Valkey) that sends the header and 1 KiB of a 2 MiB value,
    then holds the socket silent. The sub-batch's own deadline is 30 s away,
    so only the abort can end its read: abort() must return within 1 s with
    the reader gone (nothing can write into the buffer after it) and the
    connection marked broken, never pooled again. A sub-batch that tries to
    start after the abort is refused.
    """
    from kvctl.connector.resp_ops import Fanout, get_op  # noqa: PLC0415 - the split call's internals

    size = 2 * MIB

    def script(conn: socket.socket, n: int) -> bool:
        conn.sendall(b"$%d\r\n" % size + b"x" * 1024)
        return True  # held open, silent

    with ScriptedServer(script, max_conns=2) as srv, RespClient(srv.url, timeout_s=30.0, pool_size=2) as client:
        fanout = Fanout()
        buf = bytearray(size)
        conn, _ = client._acquire(time.monotonic() + 30.0)
        errors: list[BaseException] = []

        def read() -> None:
            try:
                get_op(["k"], [memoryview(buf)], fanout)(conn)
            except BaseException as exc:  # noqa: BLE001 - inspected below
                errors.append(exc)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        end = time.monotonic() + 5.0
        while buf[1023] != ord("x") and time.monotonic() < end:  # bounded: 5 s
            time.sleep(0.01)
        assert buf[1023] == ord("x"), "the reader never got the first KiB"
        t0 = time.monotonic()
        aborter = threading.Thread(target=fanout.abort, daemon=True)  # a thread: a broken abort fails, not hangs
        aborter.start()
        aborter.join(timeout=5.0)
        took = time.monotonic() - t0
        assert not aborter.is_alive() and not reader.is_alive() and took < 1.0, took
        assert len(errors) == 1 and isinstance(errors[0], RespConnectionError), errors
        assert conn.broken
        client._release(conn, ok=True)  # even released as ok, a broken connection is dropped
        assert client.pool_stats().idle == 0
        conn2, _ = client._acquire(time.monotonic() + 30.0)
        try:
            with pytest.raises(RespTimeout):
                get_op(["k"], [memoryview(buf)], fanout)(conn2)
        finally:
            client._release(conn2, ok=False)
