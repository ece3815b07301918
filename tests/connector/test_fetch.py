"""The device load's lanes (connector/fetch.py) on CPU: every instance and connection at once, in order.

Real valkey-servers on loopback; the destination is CPU memory here (the lanes copy synchronously
when no CUDA streams are given). tests/gpu/ and benchmarks/engine_gpu.py run the same function with
pinned slots and copy streams on a GPU.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.engine

NB = 64 * 1024  # one chunk's bytes


def _setup(valkey_factory, k, w=1, rank=0, n=12, conns=2, slots=16, timeout_s=5.0):
    from kvctl.connector.pinned import PinnedPool
    from kvctl.connector.striped import RankTier

    procs = [valkey_factory() for _ in range(k)]
    tier = RankTier([p.url for p in procs], w, timeout_s=timeout_s, connections=conns)
    chunks = list(range(rank, rank + n * w, w))
    keys = [f"chunk-{c}" for c in chunks]
    data = [torch.randint(0, 256, (NB,), dtype=torch.uint8) for _ in chunks]
    tier.set(chunks, keys, [d.numpy() for d in data])
    pool = PinnedPool(slots * NB, NB, pin=False)
    return procs, tier, chunks, keys, data, pool


@pytest.mark.parametrize("k,conns", [(1, 1), (1, 3), (3, 2)])
def test_every_chunk_lands_in_its_slot(valkey_factory, k, conns):
    from kvctl.connector.fetch import fetch_to_device

    procs, tier, chunks, keys, data, pool = _setup(valkey_factory, k, w=2, rank=1, conns=conns)
    staging = torch.full((len(keys), NB), 7, dtype=torch.uint8)
    with ThreadPoolExecutor(8) as ex:
        stats = fetch_to_device(tier, pool, chunks, keys, lambda j: staging[j], ex)
    assert stats.staged == len(keys) and stats.got_bytes == len(keys) * NB
    assert stats.lanes == k * min(conns, pool.n_slots // (2 * k))
    # the lanes' GET seconds, an instance each (CPU copies: no slot waits for a device copy)
    assert len(stats.recv_s_by_instance) == k and all(x > 0 for x in stats.recv_s_by_instance)
    assert sum(stats.recv_s_by_instance) <= stats.lanes * stats.get_s and stats.slot_wait_s == 0.0
    for j, d in enumerate(data):
        assert torch.equal(staging[j], d), j
    assert pool.free_slots == pool.n_slots
    tier.close()


def test_the_first_miss_ends_the_load_there(valkey_factory):
    from kvctl.connector.fetch import fetch_to_device

    procs, tier, chunks, keys, data, pool = _setup(valkey_factory, 2, n=20)
    tier.delete([chunks[7]], [keys[7]])
    staging = torch.zeros((len(keys), NB), dtype=torch.uint8)
    with ThreadPoolExecutor(4) as ex:
        stats = fetch_to_device(tier, pool, chunks, keys, lambda j: staging[j], ex)
    assert stats.staged == 7
    assert all(torch.equal(staging[j], data[j]) for j in range(7))
    tier.close()


def test_l1_chunks_are_copied_from_host_memory(valkey_factory):
    from kvctl.connector.fetch import fetch_to_device

    procs, tier, chunks, keys, data, pool = _setup(valkey_factory, 1, n=4)
    l1 = {keys[2]: torch.full((NB,), 3, dtype=torch.uint8)}
    tier.delete([chunks[2]], [keys[2]])  # not in the tier: must come from l1
    staging = torch.zeros((4, NB), dtype=torch.uint8)
    with ThreadPoolExecutor(4) as ex:
        stats = fetch_to_device(tier, pool, chunks, keys, lambda j: staging[j], ex, l1=l1)
    assert stats.staged == 4 and torch.all(staging[2] == 3) and stats.got_bytes == 3 * NB
    tier.close()


def test_a_stopped_instance_ends_the_load_within_the_timeout(valkey_factory):
    """SIGSTOP one of two instances: its GET times out, the load ends short, bounded by timeout_s."""
    from kvctl.connector.fetch import fetch_to_device
    from kvctl.connector.resp import RespError

    procs, tier, chunks, keys, data, pool = _setup(valkey_factory, 2, n=10, timeout_s=1.0)
    os.kill(procs[1].pid, signal.SIGSTOP)
    try:
        staging = torch.zeros((len(keys), NB), dtype=torch.uint8)
        t0 = time.monotonic()
        with ThreadPoolExecutor(4) as ex:
            stats = fetch_to_device(tier, pool, chunks, keys, lambda j: staging[j], ex, errors=(RespError,))
        took = time.monotonic() - t0
    finally:
        os.kill(procs[1].pid, signal.SIGCONT)
    assert stats.staged == 1  # chunk 0 is on instance 0; chunk 1 on the stopped one
    assert took < 3.0, took
    # the wait is the stopped instance's: its lanes sat out the timeout in their GETs, the other's did not
    fast, stopped = stats.recv_s_by_instance
    assert stopped >= 0.9 and fast < 0.5, stats.recv_s_by_instance
    tier.close()


def test_a_past_deadline_starts_no_get(valkey_factory):
    from kvctl.connector.fetch import fetch_to_device

    procs, tier, chunks, keys, data, pool = _setup(valkey_factory, 1, n=4)
    staging = torch.zeros((4, NB), dtype=torch.uint8)
    with ThreadPoolExecutor(2) as ex:
        stats = fetch_to_device(tier, pool, chunks, keys, lambda j: staging[j], ex, deadline=time.monotonic() - 1)
    assert stats.staged == 0 and stats.got_bytes == 0
    tier.close()


def test_a_load_next_to_a_save_takes_the_free_slots(valkey_factory):
    """A background save holding part of the pool must not make a load wait for it."""
    from kvctl.connector.fetch import fetch_to_device

    procs, tier, chunks, keys, data, pool = _setup(valkey_factory, 1, n=6, slots=8)
    held = pool.acquire(6)  # a save holds 6 of 8
    try:
        staging = torch.zeros((6, NB), dtype=torch.uint8)
        with ThreadPoolExecutor(2) as ex:
            stats = fetch_to_device(tier, pool, chunks, keys, lambda j: staging[j], ex)
        assert stats.staged == 6 and all(torch.equal(staging[j], data[j]) for j in range(6))
    finally:
        pool.release(held)
    tier.close()


def test_a_broken_destination_is_raised_after_every_lane_ended(valkey_factory):
    from kvctl.connector.fetch import fetch_to_device

    procs, tier, chunks, keys, data, pool = _setup(valkey_factory, 2, n=6)

    def dst(j):
        if j == 3:
            raise RuntimeError("staging slot 3 is gone")
        return torch.zeros(NB, dtype=torch.uint8)

    with ThreadPoolExecutor(4) as ex, pytest.raises(RuntimeError, match="slot 3"):
        fetch_to_device(tier, pool, chunks, keys, dst, ex)
    assert pool.free_slots == pool.n_slots
    tier.close()


def test_lanes_write_a_staging_tensor_made_in_inference_mode(valkey_factory):
    """vLLM runs a sync load inside its step's torch.inference_mode(): the staging tensor is an inference
    tensor, and the lanes (other threads) must write it in the caller's mode. On the GPU host every sync load
    failed with "Inplace update to inference tensor outside InferenceMode" (the agreed prefix was 0)."""
    from kvctl.connector.fetch import fetch_to_device

    procs, tier, chunks, keys, data, pool = _setup(valkey_factory, 2, n=6)
    with torch.inference_mode():
        staging = torch.zeros((6, NB), dtype=torch.uint8)
        with ThreadPoolExecutor(4) as ex:
            stats = fetch_to_device(tier, pool, chunks, keys, lambda j: staging[j], ex)
    assert stats.staged == 6 and all(torch.equal(staging[j], data[j]) for j in range(6))
    tier.close()
