"""A hit loaded group by group of layers while the engine's forward runs the groups before (torch only, no vLLM).

The serial load (:meth:`KVDataPath.load <kvctl.connector.datapath.KVDataPath.load>`) GETs every chunk, then
the engine's step computes the request's tail: at 16k tokens on an H200 45 ms of GETs, then 40 ms of step.
With the chunk stored per group of layers (:mod:`kvctl.connector.layer_groups`), a load can be split the
same way and overlap:

* :meth:`PipelinedLoad.start` (before the forward) queues every (group, owned chunk) unit on the lanes of
  the rank's instances, group 0 first: each lane GETs the parts of up to a chunk's worth of consecutive units
  of one group in one pipeline on its own connection straight into a pinned slot (host staging on CPU) and
  copies them to the group's device staging on its own stream, as :mod:`kvctl.connector.fetch` does for whole
  chunks (a round trip per chunk's bytes, as the serial load; a batch leaves every lane a share of its group);
  then it returns.
* :meth:`PipelinedLoad.ensure` (from vLLM's ``wait_for_layer_load``, before a layer's attention) runs the
  agreed-prefix protocol (:func:`~kvctl.connector.protocol.load_agreed_prefix`) for each group not yet
  done up to the one asked for, over that group's units, and writes them into the layers of the group
  (:meth:`KVLayout.layers <kvctl.connector.layouts.KVLayout.layers>`). Its waits are the only time the
  forward waits for the tier: while group g is on the wire, the layers of groups < g compute.
* :meth:`PipelinedLoad.finish` (after the forward) runs what is left and says how far the load got.

The protocol is unchanged, run once per group: every rank stages its owned units, the W messages give the
agreed prefix, each owner's units move to every rank. Group g's protocol runs over the chunks group g-1
agreed on, so the prefix only shrinks from group to group, every rank computes the same one, and a rank
never skips a collective the others enter (every rank calls ``ensure`` at the same layers). A chunk missing
in group g (deleted between lookup and load, a stopped instance) ends the hit there: the layers of earlier
groups may hold it, but the caller reports every block from the final prefix on as failed and vLLM
recomputes them, as for a short serial load.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .datapath import KVDataPath, LoadOutcome, LoadTiming, slots_for
from .layer_groups import Unit
from .ownership import KeyExtra, owned_chunks, part_key
from .protocol import load_agreed_prefix

__all__ = ["PipelineState", "PipelinedLoad", "begin"]

log = logging.getLogger(__name__)

_WAIT_POLL_S = 0.05  # how often a wait for a group looks whether its lanes are still alive


@dataclass
class PipelineState:
    """Where one pipelined load stands (for the caller's bookkeeping, logs and traces)."""

    groups_done: int = 0  # groups agreed and written, in order
    prefix: int = 0  # the last agreed prefix (chunks from the load's first chunk)
    written: int = 0  # chunks written into every group done so far (0 after a failed write)
    wait_s: float = 0.0  # how long the forward waited in ensure() (the load's cost to the step)
    late_groups: int = 0  # groups first done by finish(), after their layers ran: their hit cannot be used


class PipelinedLoad:
    """One request's hit, chunks ``first_chunk..end_chunk-1``, loaded group by group (see the module docstring).

    ``store``: the rank's :class:`~kvctl.connector.store.ShardedStore` (its tier, pinned pool, lanes, L1);
    ``units``: the chunk's groups (:class:`~kvctl.connector.layer_groups.Unit`, from its
    :class:`~kvctl.connector.layer_groups.Grouping`); ``layouts``: one per unit, the cache's layers of that
    group (``layout.layers(lo, hi)``); ``executor``: lane threads (the store's on CUDA); ``group`` /
    ``meta_group``: the shard group's collectives, as for a serial load.
    """

    def __init__(self, store: Any, units: Sequence[Unit], layouts: Sequence[Any], *, token_ids: Sequence[int],
                 block_ids: Sequence[int], block_size: int, first_chunk: int, end_chunk: int, skip_tokens: int,
                 executor: ThreadPoolExecutor, group, meta_group=None, extra: KeyExtra | None = None) -> None:
        if len(units) != len(layouts) or not units:
            raise ValueError(f"{len(units)} units for {len(layouts)} layouts")
        self.store, self.units, self.layouts = store, list(units), list(layouts)
        self.block_ids, self.block_size = list(block_ids), block_size
        self.first_chunk, self.skip_tokens = first_chunk, skip_tokens
        self.group, self.meta_group = group, meta_group
        self._executor = executor
        self.state = PipelineState()
        W, r = store.world_size, store.rank
        self._keys = store.keys(token_ids, extra)[first_chunk:end_chunk]
        self._n = len(self._keys)
        self._owned = list(owned_chunks(self._n, (r - first_chunk) % W, W))
        self.state.prefix = self._n
        self.state.written = self._n
        self._device = store.device
        self._on_cuda = self._device.type == "cuda"
        slots = max(1, math.ceil(self._n / W))
        self._staging = [torch.empty(slots * u.nbytes, dtype=torch.uint8, device=self._device) for u in self.units]
        # unit (g, j): group g of owned chunk j; lanes set, the caller reads under _cond
        G, n_own = len(self.units), len(self._owned)
        self._fail = [n_own] * G  # first owned position not staged, per group (never larger in a later group)
        self._resolved = [0] * G  # units of a group staged, failed or skipped
        self._events: list[list] = [[] for _ in range(G)]
        self._cond = threading.Condition()
        self._futures: list[Future] = []
        self._held: list[int] = []
        self._got = 0
        self._t0 = time.perf_counter()
        self._last_get = 0.0
        self._error: BaseException | None = None
        self._started = False
        self._spread = 1  # units a round trip that still leave every lane a share of a group (set by start)

    # -- the lanes ---------------------------------------------------------------------------------------
    def start(self) -> "PipelinedLoad":
        """Queue every unit on the lanes, group 0 first, and return (nothing waits here but for pinned slots)."""
        self._started = True
        tier = self.store.tier
        if tier is None or not self._owned:
            with self._cond:
                self._fail = [0 if tier is None else len(self._owned)] * len(self.units)
                self._resolved = [len(self._owned)] * len(self.units)
            return self
        per_instance = [deque() for _ in range(tier.k)]
        for g in range(len(self.units)):
            for j, c in enumerate(self._owned):
                per_instance[tier.instance(self.first_chunk + c)].append((g, j))
        lanes = self._lanes_per_instance(tier)
        work = [(i, q) for i, q in enumerate(per_instance) if q for _ in range(lanes)]
        # a group's units spread over every lane of their instance (the forward waits for group 0 first)
        self._spread = max(1, math.ceil(len(self._owned) / (tier.k * lanes)))
        streams = self.store.lane_streams if self._on_cuda else None
        if streams is not None:
            work = work[: len(streams)]
        rings: list[list[int]] = [[] for _ in work]
        if self._on_cuda:
            try:  # as many slots as are free (a background save may hold some), at least one a lane
                self._held = self.store.pool.acquire_up_to(len(work), 4 * len(work), timeout_s=tier.timeout_s)
            except TimeoutError as exc:
                log.warning("kvctl rank %d: no pinned slot for a pipelined load (%s): it is recomputed", self.store.rank, exc)
                with self._cond:
                    self._fail = [0] * len(self.units)
                    self._resolved = [len(self._owned)] * len(self.units)
                return self
            per = len(self._held) // len(work)
            rings = [self._held[i * per : (i + 1) * per] for i in range(len(work))]
        caller = torch.cuda.current_stream(self._device) if self._on_cuda else None
        inference = torch.is_inference_mode_enabled()
        qlock = threading.Lock()
        for li, ((inst, q), ring) in enumerate(zip(work, rings)):
            stream = streams[li] if streams is not None else None
            self._futures.append(self._executor.submit(
                self._lane, inst, q, qlock, deque((s, None) for s in ring), stream, caller, inference))
        return self

    def _lanes_per_instance(self, tier) -> int:
        per = getattr(self.store, "lanes_per_instance", None) or tier.connections
        return max(1, min(per, tier.connections))

    def _skip(self, g: int, j: int) -> bool:
        """Whether unit (g, j) is not wanted any more: a unit at or after a failure of its group."""
        return j >= self._fail[g]

    def _resolve(self, g: int, fail_at: int | None = None, event=None) -> None:
        with self._cond:
            if fail_at is not None:
                for gg in range(g, len(self.units)):  # nothing past a missing chunk can be used, in any later group
                    self._fail[gg] = min(self._fail[gg], fail_at)
            if event is not None:
                self._events[g].append(event)
            self._resolved[g] += 1
            self._cond.notify_all()

    #: at most this many units a round trip (None: a chunk's worth); benchmarks/layered_lanes.py sets 1 to compare
    max_batch_units: int | None = None

    def _batch_units(self, g: int) -> int:
        """How many units of group g one round trip may carry: those of one chunk's bytes (the serial load's GET,
        one slot), so a layered load pays no more round trips, locks and copies per byte than a serial one; but no
        more than leaves every lane a share of the group (a short hit's group 0 on all lanes at once)."""
        nb = self.units[g].nbytes
        cap = self.store.pool.slot_nbytes // nb if self._on_cuda else len(self.units)
        return max(1, min(len(self.units), cap, self._spread, self.max_batch_units or cap))

    def _in_l1(self, j: int) -> bool:
        l1 = self.store.l1
        return l1 is not None and self._keys[self._owned[j]] in l1

    def _take(self, q: deque, qlock: threading.Lock) -> list[tuple[int, int]]:
        """The next units for a lane: the head of its queue and the units after it of the same group at the next
        owned positions (their staging is contiguous), up to :meth:`_batch_units`, none an async prefetch holds in
        host memory (those are copied one by one); [] when the queue is empty."""
        with qlock:
            if not q:
                return []
            batch = [q.popleft()]
            g, cap = batch[0][0], self._batch_units(batch[0][0])
            if self._in_l1(batch[0][1]):
                return batch
            while q and len(batch) < cap and q[0] == (g, batch[-1][1] + 1) and not self._in_l1(q[0][1]):
                batch.append(q.popleft())
        return batch

    def _lane(self, inst: int, q: deque, qlock: threading.Lock, ring: deque, stream, caller, inference: bool) -> None:
        with torch.inference_mode(inference):
            client = self.store.tier.clients[inst]
            if stream is not None:
                stream.wait_stream(caller)  # the staging was allocated on the caller's stream
            batch: list[tuple[int, int]] = []
            try:
                while True:
                    batch = self._take(q, qlock)
                    if not batch:
                        return
                    g = batch[0][0]
                    with self._cond:
                        wanted = [j for _, j in batch if not self._skip(g, j)]
                    if len(wanted) < len(batch):  # from a failure of its group on: nothing after it is wanted
                        for _ in range(len(batch) - len(wanted)):
                            self._resolve(g)
                        batch = batch[: len(wanted)]
                        if not batch:
                            continue
                    ok, ev = self._units(client, g, [j for _, j in batch], ring, stream)
                    for i, (_, j) in enumerate(batch):
                        if i < ok:
                            self._resolve(g, None, ev if i == ok - 1 else None)
                        else:
                            self._resolve(g, j if i == ok else None)  # the first unit missing fails its group there
                    batch = []
            except BaseException as exc:  # noqa: BLE001 - a broken lane fails its units and every unit it still had
                self._error = self._error or exc
                for g, j in batch:
                    self._resolve(g, j)
                with qlock:
                    rest, _ = list(q), q.clear()
                for g, j in rest:
                    self._resolve(g, j)
            finally:
                if stream is not None:
                    stream.synchronize()  # no slot goes back to the pool with a copy still reading it

    def _units(self, client, g: int, js: list[int], ring: deque, stream) -> tuple[int, Any]:
        """GET units (g, j) for consecutive owned positions ``js`` in one round trip (one pipelined batch of their
        parts into one slot) and copy them to group g's staging; (how many of them, from the first, were staged,
        the copy's event or None)."""
        u = self.units[g]
        j0, m = js[0], len(js)
        dst = self._staging[g][j0 * u.nbytes : (j0 + m) * u.nbytes]
        host = self.store.l1.get(self._keys[self._owned[j0]]) if self.store.l1 is not None and m == 1 else None
        if host is not None:  # an async prefetch brought the whole chunk into host memory: no GET
            flat = host.reshape(-1).view(torch.uint8)
            offsets = dict(zip(self.store.parts.names, self.store.parts.offsets))
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                at = 0
                for name, size in zip(u.names, u.sizes):
                    dst[at : at + size].copy_(flat[offsets[name] : offsets[name] + size])
                    at += size
                return 1, (stream.record_event() if stream is not None else None)
        keys = []
        for j in js:
            key = self._keys[self._owned[j]]
            keys += [part_key(key, name) for name in u.names] if u.names else [key]
        if stream is None:  # CPU: the GETs land in the staging itself
            buf = memoryview(dst.numpy())
            slot = ev = None
        else:
            slot, ev = ring.popleft()
            if ev is not None:
                ev.synchronize()  # the copy out of this slot is done: refill it
            buf = self.store.pool.view(slot)[: m * u.nbytes]
        views, at = [], 0
        for _ in js:
            for size in u.sizes:
                views.append(buf[at : at + size])
                at += size
        per = len(u.sizes)
        try:
            found = client.batched_get(keys, views, split=False)  # the lane's own connection: the others are lanes
            ok = next((i for i in range(m) if not all(found[i * per : (i + 1) * per])), m)
        except Exception:  # noqa: BLE001 - a GET error ends the hit at the batch's first unit, like a miss
            ok = 0
        finally:
            with self._cond:
                self._last_get = time.perf_counter()
        if ok:
            with self._cond:
                self._got += ok * u.nbytes
        if stream is None:
            return ok, None
        if not ok:
            ring.append((slot, None))
            return 0, None
        with torch.cuda.stream(stream):
            dst[: ok * u.nbytes].copy_(self.store.pool.tensor(slot)[: ok * u.nbytes], non_blocking=True)
            ev = stream.record_event()
        ring.append((slot, ev))
        return ok, ev

    def _wait_group(self, g: int) -> int:
        """Block until every unit of group g is resolved; the leading count of owned units it staged."""
        n_own = len(self._owned)
        with self._cond:
            while self._resolved[g] < n_own:
                if all(f.done() for f in self._futures):
                    # every lane ended and some unit was never accounted for: nothing of this group is trusted
                    for gg in range(g, len(self.units)):
                        self._fail[gg] = 0
                    break
                self._cond.wait(_WAIT_POLL_S)
            staged = min(self._fail[g], n_own)
            events = list(self._events[g])
        if self._on_cuda:
            cur = torch.cuda.current_stream(self._device)
            for ev in events:
                cur.wait_event(ev)  # the device reads the staging after its copies, the host does not wait
        return staged

    # -- the groups ----------------------------------------------------------------------------------------
    def ensure(self, g: int) -> None:
        """Agree on and write every group up to ``g`` not done yet (collective: every rank calls it alike)."""
        g = min(g, len(self.units) - 1)
        while self.state.groups_done <= g:
            t0 = time.perf_counter()
            self._group(self.state.groups_done)
            self.state.wait_s += time.perf_counter() - t0
            self.state.groups_done += 1

    def _group(self, g: int) -> None:
        u, lay, st = self.units[g], self.layouts[g], self.store
        n = self.state.prefix  # group g runs over the chunks group g-1 agreed on: the same on every rank
        keys = [part_key(k, u.names[0]) if u.names else k for k in self._keys[:n]]

        def stage(owned: list[int], _slot) -> int:
            return min(self._wait_group(g), len(owned))

        result = load_agreed_prefix(self.group, keys, None, (u.nbytes,), torch.uint8, self._device, st.load_mode,
                                    self.first_chunk, stage_owned=stage, meta_group=self.meta_group,
                                    staging=self._staging[g])
        self.state.prefix = result.prefix
        self.state.written = min(self.state.written, result.prefix)
        if not result.prefix or not self.state.written:
            return
        ct = st.chunk_tokens
        start = max(self.first_chunk * ct, self.skip_tokens)
        try:
            shape = lay.chunk_shape(ct, st.world_size)
            chunks = [c.view(lay.dtype).view(shape) for c in result.chunks]
            data = lay.join_chunks(chunks, start - self.first_chunk * ct, st.rank)
            lay.insert(slots_for(self.block_ids, self.block_size, start, (self.first_chunk + result.prefix) * ct), data)
        except Exception:  # noqa: BLE001 - a failed write is a load error: the engine recomputes the hit
            log.exception("kvctl: writing layers %d..%d of a pipelined load failed", u.lo, u.hi - 1)
            self.state.written = 0

    def finish(self) -> LoadOutcome:
        """Run the groups still to do (their layers already ran: the hit is reported failed), free the slots."""
        late = len(self.units) - self.state.groups_done
        interrupted = None
        try:
            if late:
                self.state.late_groups = late
                self.ensure(len(self.units) - 1)
                self.state.written = 0  # those layers computed without their KV: the whole hit is recomputed
        except Exception:  # noqa: BLE001 - a late group's failure only confirms the hit is lost
            log.exception("kvctl: finishing a pipelined load failed")
            self.state.written = 0
        except BaseException as exc:  # noqa: BLE001 - handed back like a serial load's
            interrupted = exc
            self.state.written = 0
        finally:
            self.close()
        t_end = time.perf_counter()
        last = self._last_get or t_end
        self.store.note_get(self._got, max(0.0, last - self._t0))  # the engine's GET bytes and seconds, as a serial load
        timing = LoadTiming(chunks=self.state.prefix, get_bytes=self._got, get_s=max(0.0, last - self._t0),
                            copy_tail_s=0.0, exchange_s=0.0, insert_s=0.0, total_s=t_end - self._t0)
        return LoadOutcome(self.state.prefix, self.state.written, interrupted, timing)

    def close(self) -> None:
        """Wait for the lanes (each GET is bounded by the tier's timeout) and give the pinned slots back."""
        for f in self._futures:
            try:
                f.result()
            except BaseException:  # noqa: BLE001 - a lane's error was recorded as its units' failure
                pass
        self._futures = []
        if self._held:
            self.store.pool.release(self._held)
            self._held = []


def begin(datapath: KVDataPath, token_ids: Sequence[int], block_ids: Sequence[int], first_chunk: int, end_chunk: int,
          skip_tokens: int = 0, *, group=None, extra: KeyExtra | None = None, meta_group=None) -> PipelinedLoad:
    """Start the load of chunks ``first_chunk..end_chunk-1`` on ``datapath`` group by group; returns at once.

    The caller drives it: ``ensure(g)`` before the layers of group g run (collective, like
    :meth:`KVDataPath.load`), ``finish()`` after the forward. Same arguments and agreed-prefix rules as
    :meth:`KVDataPath.load`; the path must be :attr:`KVDataPath.pipelined`."""
    if not datapath.pipelined:
        raise ValueError("this data path has no layer groups (or no tier): load it with KVDataPath.load")
    return PipelinedLoad(datapath.store, datapath.grouping.units, datapath.group_layouts, token_ids=token_ids,
                         block_ids=block_ids, block_size=datapath.block_size, first_chunk=first_chunk,
                         end_chunk=end_chunk, skip_tokens=skip_tokens, executor=datapath.lane_executor(),
                         group=datapath.group if group is None else group, meta_group=meta_group, extra=extra).start()
