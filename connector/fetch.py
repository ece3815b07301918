"""GET a rank's owned chunks over all its instances at once, through pinned slots, onto the device.

The load of a hit is bound by GET bandwidth (paper §4: ``T_load = T0 + n·s/B``),
so this keeps every connection of every instance of the rank busy for the
whole load and hides everything else behind the GETs:

* **lanes** -- ``connections`` lanes per instance (:class:`~kvctl.connector.striped.RankTier`),
  each a thread with its own socket, its own ring of pinned slots and (on CUDA)
  its own copy stream. A lane takes the next chunk of its instance, GETs it
  straight into a free slot (``recv_into``, no other host copy), queues the
  copy to the chunk's device slot on its stream and moves on; a slot is
  refilled once the copy out of it is done (its event). So GETs, host-to-device
  copies and the other lanes' GETs all overlap, and there is no batch barrier.
* **order** -- the result is the leading run of staged chunks: the first miss,
  error or deadline at position ``j`` stops every lane at the positions after
  ``j`` (nothing after a missing chunk can be used).
* **bounded** -- every GET is bounded by the client's ``timeout_s``; a lane
  starts no GET after ``deadline``; the call returns once every lane has
  ended and every copy it queued is complete.

On a CPU device (tests, CPU engines) the same lanes copy synchronously.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .pinned import PinnedPool
from .striped import RankTier

__all__ = ["FetchStats", "fetch_to_device", "lanes_for"]


@dataclass(frozen=True)
class FetchStats:
    """What one :func:`fetch_to_device` call did; seconds are wall time on the calling rank."""

    staged: int  # the leading chunks staged on the device
    got_bytes: int  # bytes GET from the tier (L1 hits not counted)
    get_s: float  # from the start to the end of the last GET
    copy_tail_s: float  # from the end of the last GET until every copy was complete
    lanes: int
    # summed over the lanes: seconds in GETs (each instance's apart, by tier position) and seconds waiting for a
    # slot's copy to the device to end before refilling it. A load slower than its GETs' usual time shows which
    # one grew (H100, 2026-12-07: loads beside 16k prefill steps took up to 1.8x, the cause unmeasured)
    recv_s_by_instance: tuple[float, ...] = ()
    slot_wait_s: float = 0.0


def lanes_for(pool: PinnedPool, instances: int, connections: int) -> int:
    """Lanes per instance that ``pool`` can feed: each lane needs two slots (one filling, one copying)."""
    return max(1, min(connections, pool.n_slots // (2 * instances)))


class _Progress:
    """The shared state of one call's lanes: which positions are staged, and the first failure."""

    def __init__(self, n: int, deadline: float) -> None:
        self.n, self.deadline = n, deadline
        self.first_fail = n
        self.ok = [False] * n
        self.got = 0
        self.last_get = 0.0
        self.recv: dict[int, float] = {}  # instance -> seconds its lanes spent in GETs
        self.slot_wait = 0.0
        self.lock = threading.Lock()

    def fail(self, j: int) -> None:
        with self.lock:
            self.first_fail = min(self.first_fail, j)

    def wanted(self, j: int) -> bool:
        return j < self.first_fail and time.monotonic() < self.deadline

    def staged(self) -> int:
        k = 0
        while k < self.n and self.ok[k]:
            k += 1
        return min(k, self.first_fail)


def fetch_to_device(tier: RankTier, pool: PinnedPool, chunks: Sequence[int], keys: Sequence[str],
                    dst: Callable[[int], torch.Tensor], executor: ThreadPoolExecutor, *,
                    streams: Sequence[Any] | None = None, l1: Any = None, deadline: float | None = None,
                    errors: tuple = (), lanes_per_instance: int | None = None) -> FetchStats:
    """GET ``keys[j]`` (chunk ``chunks[j]``) into ``dst(j)``, a uint8 tensor of ``pool.slot_nbytes`` bytes.

    ``executor`` runs the lanes (at least ``K × lanes`` workers, or lanes queue
    behind each other); ``streams``: one CUDA stream per lane (None: CPU
    copies); ``l1``: host chunks (an async prefetch's) copied from there
    instead of GET; ``errors``: exceptions of a GET that end its lane like a
    miss (anything else does too, but is re-raised after every lane ended).
    """
    n = len(keys)
    t0 = time.perf_counter()
    if n == 0:
        return FetchStats(0, 0, 0.0, 0.0, 0)
    per = lanes_per_instance or lanes_for(pool, tier.k, tier.connections)
    parts = tier.split(chunks)
    queues = [deque(p) for p in parts]
    lanes = [(i, q) for i, q in enumerate(queues) if q for _ in range(per)]
    if streams is not None and len(streams) < len(lanes):
        raise ValueError(f"{len(lanes)} lanes but {len(streams)} copy streams")
    if pool.n_slots < len(lanes):
        raise ValueError(f"a pinned pool of {pool.n_slots} slots cannot feed {len(lanes)} lanes")
    # as many slots as are free (a background save may hold some), at least one a lane
    wait_s = max(0.0, (deadline if deadline is not None else time.monotonic() + tier.timeout_s) - time.monotonic())
    held = pool.acquire_up_to(len(lanes), 4 * len(lanes), timeout_s=wait_s)
    slots_per_lane = len(held) // len(lanes)
    prog = _Progress(n, deadline if deadline is not None else float("inf"))
    caller = torch.cuda.current_stream(streams[0].device) if streams is not None else None
    # the caller's autograd mode goes with the lanes: vLLM runs a sync load inside its step's
    # torch.inference_mode(), so `dst` is an inference tensor, which a thread outside that mode may not
    # write ("Inplace update to inference tensor outside InferenceMode"): every sync load failed so on GPU
    inference = torch.is_inference_mode_enabled()
    qlock = threading.Lock()
    failures: list[BaseException] = []

    def lane(li: int, inst: int, q: deque) -> None:
        with torch.inference_mode(inference):
            _lane(li, inst, q)

    def _lane(li: int, inst: int, q: deque) -> None:
        client = tier.clients[inst]
        stream = streams[li] if streams is not None else None
        ring = deque((s, None) for s in held[li * slots_per_lane : (li + 1) * slots_per_lane])
        if stream is not None:
            stream.wait_stream(caller)  # dst was allocated (and maybe written) on the caller's stream
        recv = wait = 0.0
        try:
            while True:
                with qlock:
                    j = q.popleft() if q else None
                if j is None or not prog.wanted(j):
                    if j is not None:
                        prog.fail(j)  # past the deadline, or after a failure: nothing from here on
                    return
                host = l1.get(keys[j]) if l1 is not None else None
                if host is not None:  # brought into host memory by an async prefetch: no GET
                    if stream is not None:
                        with torch.cuda.stream(stream):
                            dst(j).copy_(host.reshape(-1).view(torch.uint8))
                    else:
                        dst(j).copy_(host.reshape(-1).view(torch.uint8))
                    prog.ok[j] = True
                    continue
                slot, ev = ring.popleft()
                t_get = time.perf_counter()
                if ev is not None:
                    ev.synchronize()  # the copy out of this slot is done: refill it
                    wait += time.perf_counter() - t_get
                    t_get = time.perf_counter()
                try:
                    hit = tier.get_one(client, keys[j], pool.view(slot))  # every part of the chunk, or a miss
                except errors:
                    hit = False
                finally:
                    t_done = time.perf_counter()
                    recv += t_done - t_get
                    with prog.lock:
                        prog.last_get = max(prog.last_get, t_done)
                if not hit:
                    ring.append((slot, None))
                    prog.fail(j)
                    return
                with prog.lock:
                    prog.got += pool.slot_nbytes
                if stream is not None:
                    with torch.cuda.stream(stream):
                        dst(j).copy_(pool.tensor(slot), non_blocking=True)
                        ev = stream.record_event()
                else:
                    dst(j).copy_(pool.tensor(slot))
                    ev = None
                ring.append((slot, ev))
                prog.ok[j] = True
        except BaseException as exc:  # noqa: BLE001 - a broken lane is a failure at its position
            prog.fail(j if j is not None else 0)
            failures.append(exc)
        finally:
            if stream is not None:
                stream.synchronize()  # no slot goes back to the pool with a copy still reading it
            with prog.lock:
                prog.recv[inst] = prog.recv.get(inst, 0.0) + recv
                prog.slot_wait += wait

    try:
        futures = [executor.submit(lane, li, inst, q) for li, (inst, q) in enumerate(lanes)]
        for f in futures:
            f.result()
    finally:
        pool.release(held)
    t_end = time.perf_counter()
    if failures:
        raise failures[0]
    last = prog.last_get or t_end
    return FetchStats(prog.staged(), prog.got, last - t0, max(0.0, t_end - last), len(lanes),
                      tuple(prog.recv.get(i, 0.0) for i in range(len(queues))), prog.slot_wait)
