"""Agreed-prefix load over ``torch.distributed`` (paper §5.1, Algorithm 1).

Every rank of the group runs the *same* sequence of collectives whatever it
found locally, so one rank's eviction, failed GET or staging error can never
leave another rank waiting in a collective it will not enter:

1. fetch and stage the chunks this rank owns (``c mod W == rank``) through the
   caller's ``fetch_owned`` callback; anything that goes wrong here (``None``,
   an exception, a tensor of the wrong shape or dtype, a failed copy) is a
   *local failure* at that chunk; an ``Exception`` is never raised, and a
   ``BaseException`` such as ``asyncio.CancelledError`` is re-raised only
   after step 4, so this rank still enters every collective;
2. exchange one fixed-size message per rank with a single all-gather: a
   fingerprint of the chunk-key list and chunk metadata, the first chunk this
   rank failed to provide, the transfer mode;
3. compute the agreed prefix from the W messages, which are identical on every
   rank: 0 when any fingerprint (or mode, or version) differs, otherwise the
   minimum first failure over all ranks;
4. move the prefix chunks from their owners to every rank. The number and
   shape of these collectives depend only on the agreed prefix and W, never on
   local state.

Three transfer modes are implemented (``mode=``):

* ``"per_chunk"``  -- one broadcast per prefix chunk, from its owner (the paper's form);
* ``"per_owner"``  -- one broadcast per owner of that owner's prefix chunks,
  which are already contiguous in its staging buffer (no packing copy);
* ``"all_gather"`` -- one all-gather of every owner's prefix slots.

``mode="auto"`` (the default) picks the fastest form measured for the group's
backend with ``benchmarks/protocol_bcast.py`` (see ``FASTEST_BY_BACKEND``).
All data collectives move ``uint8`` bytes, so any dtype works on any backend.

Chunk offset: a load may start at absolute chunk ``first_chunk`` (the engine
already holds chunks ``0..first_chunk-1``, e.g. in its own prefix cache).
``chunk_keys[i]`` is then absolute chunk ``first_chunk + i`` and is owned by
rank ``(first_chunk + i) mod W``, the same owner that stored it; the default
``first_chunk=0`` is the plain rule.
"""

from __future__ import annotations

import hashlib
import math
from typing import Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist

from .ownership import owned_chunks

__all__ = [
    "DEFAULT_MODE",
    "MODES",
    "LoadResult",
    "Agreement",
    "StageOwned",
    "agree",
    "fingerprint",
    "load_agreed_prefix",
    "load_agreed_prefix_detailed",
    "member_group",
    "move_prefix",
    "resolve_mode",
]

MODES = ("per_chunk", "per_owner", "all_gather")
# "auto" picks the fastest measured form for the group's backend
# (benchmarks/protocol_bcast.py, see README): on 2xH200 NCCL, 64 x 12.4 MB,
# all_gather 1.58 ms ~ raw all-gather 1.56 ms < per_owner 2.32 < per_chunk
# 4.06; on gloo CPU one broadcast per owner beat both all-gathers.
DEFAULT_MODE = "auto"
FASTEST_BY_BACKEND = {"gloo": "per_owner", "nccl": "all_gather"}


def resolve_mode(group, mode: str = DEFAULT_MODE) -> str:
    """The concrete transfer form: ``mode`` itself, or for "auto" the fastest for the group's backend."""
    if mode != "auto":
        return mode
    backend = str(dist.get_backend(group)).lower()
    return FASTEST_BY_BACKEND.get(backend, "all_gather")


def member_group(ranks: Sequence[int], backend: str = "gloo"):
    """A new process group over ``ranks`` (global ranks), created by its members only.

    A plain ``new_group`` is a collective over the whole default group: every
    process must call it for every group, in one order. Under vLLM's data
    parallelism the world holds several TP groups, and each builds a group
    for its own ranks only: its name (a world-wide counter) is then the same
    in every TP group, their rendezvous keys collide in the shared store, and
    the ranks hang or join the wrong peers. ``use_local_synchronization``
    names the group by its ranks (and this process's group count, the same on
    every member when, as in vLLM, all ranks created the same groups before)
    and lets non-members stay out. Members must still call this in one order.
    """
    return dist.new_group(ranks=sorted(int(r) for r in ranks), backend=backend, use_local_synchronization=True)


PROTOCOL_VERSION = 1
# message layout (int64): version, fp_hi, fp_lo, n_chunks, first_failure,
# mode code, chunk nbytes, staged chunk count
MSG_LEN = 8
_VERSION, _FP_HI, _FP_LO, _N, _FIRST_FAIL, _MODE, _NBYTES, _STAGED = range(MSG_LEN)

FetchOwned = Callable[[list[int]], Sequence[object]]
# stage_owned(owned, slot) writes owned chunk owned[j] into slot(j) (this rank's uint8 staging bytes of
# that chunk, on the load's device) in order, and returns how many it staged before its first failure
StageOwned = Callable[[list[int], Callable[[int], torch.Tensor]], int]

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class LoadResult(NamedTuple):
    """What every rank gets back: the agreed prefix (in chunks) and its chunks.

    ``chunks[c]`` has the caller's ``chunk_shape`` and ``dtype`` and lives on
    ``device``; ``len(chunks) == prefix`` on every rank.
    """

    prefix: int
    chunks: list[torch.Tensor]


class Agreement(NamedTuple):
    """The outcome of the exchange (step 3), identical on every rank."""

    prefix: int
    mismatch: bool  # fingerprints, modes or versions differed -> prefix 0
    first_failures: tuple[int, ...]  # per rank, in group-rank order
    local_failure: int  # this rank's own first failure (n_chunks if none)


def fingerprint(
    chunk_keys: Sequence[object], chunk_shape: Sequence[int], dtype: torch.dtype, first_chunk: int = 0
) -> tuple[int, int]:
    """128-bit digest of the key list, the chunk shape, the dtype (and a non-zero chunk offset), as two int64."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"kvctl-agreed-prefix\0")
    if first_chunk:
        h.update(b"first-chunk" + int(first_chunk).to_bytes(8, "little"))
    h.update(str(tuple(int(d) for d in chunk_shape)).encode())
    h.update(str(dtype).encode() + b"\0")
    h.update(len(chunk_keys).to_bytes(8, "little"))
    for key in chunk_keys:
        raw = key if isinstance(key, (bytes, bytearray, memoryview)) else str(key).encode()
        raw = bytes(raw)
        h.update(len(raw).to_bytes(8, "little"))
        h.update(raw)
    d = h.digest()
    return int.from_bytes(d[:8], "little", signed=True), int.from_bytes(d[8:], "little", signed=True)


def agree(messages: torch.Tensor, n_chunks: int) -> tuple[int, bool]:
    """Agreed prefix from the gathered (W, MSG_LEN) messages: 0 on any mismatch, else min first failure."""
    rows = messages.tolist()
    first = rows[0]
    for row in rows:
        for field in (_VERSION, _FP_HI, _FP_LO, _N, _MODE, _NBYTES):
            if row[field] != first[field]:
                return 0, True
    if first[_VERSION] != PROTOCOL_VERSION:
        return 0, True
    prefix = min(row[_FIRST_FAIL] for row in rows)
    # defensive: a first failure is always within [0, n_chunks]
    return max(0, min(prefix, n_chunks)), False


def _group_rank_world(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _global(group, group_rank: int) -> int:
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def _fetch_and_stage(
    fetch_owned: FetchOwned,
    owned: list[int],
    staging: torch.Tensor,
    chunk_shape: tuple[int, ...],
    dtype: torch.dtype,
    nbytes: int,
    n_chunks: int,
) -> tuple[int, int, BaseException | None]:
    """Step 1: (first failed chunk index or n_chunks, staged count, deferred exception). Never raises.

    Anything ``fetch_owned`` raises, or a failed copy, is a local failure. A
    ``BaseException`` that is not an ``Exception`` (``asyncio.CancelledError``
    inside an async engine, ``KeyboardInterrupt``, ``SystemExit``) is a local
    failure too, and is handed back as the deferred exception, which
    :func:`load_agreed_prefix_detailed` re-raises after every collective:
    raised here, it would make this rank skip the exchange its peers wait in.
    """
    if not owned:
        return n_chunks, 0, None
    try:
        fetched = list(fetch_owned(list(owned)))  # a generator is consumed here, inside the guard
    except BaseException as exc:  # noqa: BLE001 - any callback failure is a local failure
        return owned[0], 0, _deferred(exc)
    staged = 0
    try:
        for slot, c in enumerate(owned):
            t = fetched[slot] if slot < len(fetched) else None
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != chunk_shape:
                return c, staged, None
            _chunk_view(staging, slot, nbytes, dtype, chunk_shape).copy_(t, non_blocking=staging.is_cuda)
            staged += 1
        if staging.is_cuda:
            torch.cuda.synchronize(staging.device)
    except BaseException as exc:  # noqa: BLE001 - a failed copy is a staging error at this chunk
        # after an async copy failure we cannot tell which slot broke: be safe
        return (owned[staged] if staged < len(owned) else owned[0]), staged, _deferred(exc)
    return n_chunks, staged, None


def _stage_direct(
    stage_owned: StageOwned, owned: list[int], staging: torch.Tensor, nbytes: int, n_chunks: int
) -> tuple[int, int, BaseException | None]:
    """Step 1 through a caller that writes straight into the staging slots (see :data:`StageOwned`). Never raises.

    Same failure rules as :func:`_fetch_and_stage`: an exception, or a count
    outside ``0..len(owned)``, is a local failure at the first owned chunk not
    staged.
    """
    if not owned:
        return n_chunks, 0, None
    try:
        staged = int(stage_owned(list(owned), lambda j: _slot(staging, j, nbytes)))
    except BaseException as exc:  # noqa: BLE001 - any stager failure is a local failure
        return owned[0], 0, _deferred(exc)
    if not 0 <= staged <= len(owned):
        return owned[0], 0, None
    return (owned[staged] if staged < len(owned) else n_chunks), staged, None


def _deferred(exc: BaseException) -> BaseException | None:
    """What step 1 keeps to re-raise after the collectives: a BaseException that is not an Exception."""
    return None if isinstance(exc, Exception) else exc


def _reraise_deferred(deferred: BaseException | None, prefix: int) -> None:
    """Re-raise step 1's deferred exception on this rank once every collective is done."""
    if deferred is not None:
        deferred.add_note(
            f"kvctl: raised by fetch_owned; re-raised after the load protocol's collectives (agreed prefix {prefix})"
        )
        raise deferred


def _chunk_nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size() * math.prod(shape)


def _slot(buf: torch.Tensor, slot: int, nbytes: int) -> torch.Tensor:
    """Bytes of slot ``slot`` of a uint8 buffer of ``nbytes``-sized chunks."""
    return buf[slot * nbytes : (slot + 1) * nbytes]


def _chunk_view(buf: torch.Tensor, slot: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return _slot(buf, slot, nbytes).view(dtype).view(shape)


def _owned_count(prefix: int, r: int, world: int) -> int:
    """How many of the chunks 0..prefix-1 rank r owns."""
    return 0 if prefix <= r else (prefix - r + world - 1) // world


def _virtual_rank(rank: int, world: int, shift: int) -> int:
    """The rank whose offset-0 ownership equals ``rank``'s ownership under chunk offset ``shift``."""
    return (rank - shift) % world


def _move_per_chunk(group, prefix, rank, world, staging, nbytes, dtype, shape, device, shift=0):
    out = []
    for c in range(prefix):
        o = (c + shift) % world
        if o == rank:
            buf = _slot(staging, c // world, nbytes)
        else:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dist.broadcast(buf, src=_global(group, o), group=group)
        out.append(buf.view(dtype).view(shape))
    return out


def _move_per_owner(group, prefix, rank, world, staging, nbytes, dtype, shape, device, shift=0):
    per_owner: list[torch.Tensor | None] = [None] * world
    for o in range(world):
        k = _owned_count(prefix, _virtual_rank(o, world, shift), world)
        if k == 0:
            continue  # same decision on every rank: it depends only on prefix and W
        if o == rank:
            buf = staging[: k * nbytes]
        else:
            buf = torch.empty(k * nbytes, dtype=torch.uint8, device=device)
        dist.broadcast(buf, src=_global(group, o), group=group)
        per_owner[o] = buf
    return [_chunk_view(per_owner[(c + shift) % world], c // world, nbytes, dtype, shape) for c in range(prefix)]


def _move_all_gather(group, prefix, rank, world, staging, nbytes, dtype, shape, device, shift=0):
    if prefix == 0:
        return []
    kmax = math.ceil(prefix / world)
    send = staging[: kmax * nbytes]
    if send.numel() < kmax * nbytes:
        # staging could not be allocated here, so this rank owns no prefix chunk
        # (its first failure capped the prefix); it still sends kmax padding slots
        send = torch.empty(kmax * nbytes, dtype=torch.uint8, device=device)
    out = torch.empty(world * kmax * nbytes, dtype=torch.uint8, device=device)
    _all_gather_single(out, send, group=group)
    return [_chunk_view(out, ((c + shift) % world) * kmax + c // world, nbytes, dtype, shape) for c in range(prefix)]


_MOVERS = {"per_chunk": _move_per_chunk, "per_owner": _move_per_owner, "all_gather": _move_all_gather}


def move_prefix(
    group,
    prefix: int,
    staging: torch.Tensor,
    chunk_shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    mode: str = DEFAULT_MODE,
    first_chunk: int = 0,
) -> list[torch.Tensor]:
    """Step 4 alone: move chunks ``0..prefix-1`` from their owners to every rank.

    ``staging`` is this rank's uint8 buffer with owned chunk ``rank + j*W`` in
    slot ``j`` (at least ``ceil(prefix/W)`` slots); with a chunk offset the
    owned chunks are ``(rank - first_chunk) mod W + j*W``. Every rank must
    call this with the same ``prefix``, ``mode`` and ``first_chunk`` --
    :func:`load_agreed_prefix` guarantees that; the benchmark calls it directly.
    """
    mode = resolve_mode(group, mode)
    if mode not in _MOVERS:
        raise ValueError(f"unknown load mode {mode!r}; expected one of {MODES}")
    shape = tuple(int(d) for d in chunk_shape)
    rank, world = _group_rank_world(group)
    nbytes = _chunk_nbytes(shape, dtype)
    if prefix <= 0:
        return []
    shift = first_chunk % world
    return _MOVERS[mode](group, prefix, rank, world, staging, nbytes, dtype, shape, torch.device(device), shift)


def load_agreed_prefix_detailed(
    group,
    chunk_keys: Sequence[object],
    fetch_owned: FetchOwned,
    chunk_shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    mode: str = DEFAULT_MODE,
    first_chunk: int = 0,
    stage_owned: StageOwned | None = None,
    meta_group=None,
    staging: torch.Tensor | None = None,
) -> tuple[LoadResult, Agreement]:
    """:func:`load_agreed_prefix` plus the :class:`Agreement` (for logs, tests, metrics)."""
    mode = resolve_mode(group, mode)
    # an unknown mode must not make this rank skip the exchange: it is sent as
    # code -1 (a mismatch for everyone else) and raised after the exchange
    mode_code = MODES.index(mode) if mode in _MOVERS else -1
    device = torch.device(device)
    shape = tuple(int(d) for d in chunk_shape)
    rank, world = _group_rank_world(group)
    n_chunks = len(chunk_keys)
    nbytes = _chunk_nbytes(shape, dtype)

    # step 1: fetch and stage owned chunks into one contiguous byte buffer;
    # slot j holds owned chunk v + j*W (v = rank, shifted by the chunk offset).
    # ceil(N/W) slots on every rank, so the all-gather can always send kmax slots.
    # a bad argument on one rank is raised only after the exchange, like an
    # unknown mode: it is sent as mode code -1, so the peers agree on 0
    bad_input = None
    if mode_code < 0:
        bad_input = ValueError(f"unknown load mode {mode!r}; expected one of {MODES}")
    if first_chunk < 0:
        bad_input = ValueError(f"first_chunk must be >= 0, got {first_chunk}")
        mode_code, first_chunk = -1, 0
    owned = [] if bad_input else list(owned_chunks(n_chunks, _virtual_rank(rank, world, first_chunk % world), world))
    n_slots = max(1, math.ceil(n_chunks / world))
    try:
        if staging is None:
            staging = torch.empty(n_slots * nbytes, dtype=torch.uint8, device=device)
        elif staging.dtype != torch.uint8 or staging.numel() < n_slots * nbytes or staging.device.type != device.type:
            raise ValueError(f"a staging buffer of {staging.numel()} {staging.dtype} bytes on {staging.device} for "
                             f"{n_slots} slots of {nbytes} on {device}")
    except Exception:  # noqa: BLE001 - out of memory (or a caller's buffer that does not fit): fail locally, keep the sequence
        staging = torch.empty(0, dtype=torch.uint8, device=device)
        first_fail, staged, deferred = (owned[0] if owned else n_chunks), 0, None
    else:
        if stage_owned is not None:
            first_fail, staged, deferred = _stage_direct(stage_owned, owned, staging, nbytes, n_chunks)
        else:
            first_fail, staged, deferred = _fetch_and_stage(fetch_owned, owned, staging, shape, dtype, nbytes, n_chunks)

    if world == 1:
        # one rank: nobody to agree with and nothing to move; the agreed prefix is what this rank staged
        # (no collective, so no device sync and no NCCL call inside the engine step)
        if bad_input is not None:
            _reraise_deferred(deferred, 0)
            raise bad_input
        prefix = max(0, min(first_fail, n_chunks))
        agreement = Agreement(prefix=prefix, mismatch=False, first_failures=(first_fail,), local_failure=first_fail)
        chunks = [_chunk_view(staging, c, nbytes, dtype, shape) for c in range(prefix)]
        _reraise_deferred(deferred, prefix)
        return LoadResult(prefix, chunks), agreement

    # step 2: one fixed-size message per rank (over meta_group when given: a CPU/gloo group, so the
    # exchange of 64 bytes needs no device copy and no wait for the device's queued work)
    fp_hi, fp_lo = fingerprint(chunk_keys, shape, dtype, first_chunk)
    meta_device = torch.device("cpu") if meta_group is not None else device
    msg = torch.tensor(
        [PROTOCOL_VERSION, fp_hi, fp_lo, n_chunks, first_fail, mode_code, nbytes, staged],
        dtype=torch.int64,
        device=meta_device,
    )
    gathered = torch.empty(world * MSG_LEN, dtype=torch.int64, device=meta_device)
    _all_gather_single(gathered, msg, group=meta_group if meta_group is not None else group)
    gathered = gathered.view(world, MSG_LEN).cpu()

    # step 3: the agreed prefix, identical on every rank
    prefix, mismatch = agree(gathered, n_chunks)
    if bad_input is not None:
        # raised only after the exchange, so the other ranks are not left waiting;
        # they saw a different mode code and agreed on 0 without more collectives
        _reraise_deferred(deferred, prefix)
        raise bad_input
    agreement = Agreement(
        prefix=prefix,
        mismatch=mismatch,
        first_failures=tuple(int(x) for x in gathered[:, _FIRST_FAIL].tolist()),
        local_failure=first_fail,
    )

    # step 4: move the prefix chunks from their owners
    chunks = move_prefix(group, prefix, staging, shape, dtype, device, mode, first_chunk)
    _reraise_deferred(deferred, prefix)  # every collective is done: peers are not left waiting
    return LoadResult(prefix, chunks), agreement


def load_agreed_prefix(
    group,
    chunk_keys: Sequence[object],
    fetch_owned: FetchOwned,
    chunk_shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    mode: str = DEFAULT_MODE,
    first_chunk: int = 0,
    stage_owned: StageOwned | None = None,
    meta_group=None,
    staging: torch.Tensor | None = None,
) -> LoadResult:
    """Load the longest prefix of ``chunk_keys`` that every owner could provide.

    ``group``: a ``torch.distributed`` process group (None = the default group).
    ``chunk_keys``: the prompt's chunk keys (same list on every rank, or the
    fingerprints differ and the agreed prefix is 0).
    ``fetch_owned(indexes)``: called once with this rank's owned chunk indexes
    in increasing order; returns one tensor of ``chunk_shape``/``dtype`` (or
    None for a chunk it could not provide) per index. Exceptions are local
    failures, never raised; a BaseException that is not an Exception
    (``asyncio.CancelledError``, ``KeyboardInterrupt``, ``SystemExit``) is a
    local failure too and is re-raised on this rank after the collectives.
    ``mode``: "auto" (default: the fastest measured form for the backend),
    "per_owner", "all_gather" or "per_chunk".
    ``first_chunk``: absolute index of ``chunk_keys[0]`` (see the module
    docstring); ``fetch_owned`` still gets indexes into ``chunk_keys``.
    ``meta_group``: a group of the same ranks for step 2's small message
    (a gloo group next to an NCCL ``group``: no device round trip); None =
    ``group``. With one rank there are no collectives at all.
    ``stage_owned``: instead of ``fetch_owned`` (pass None there), a callback
    that writes owned chunks straight into this rank's staging slots on
    ``device`` (see :data:`StageOwned`): the device path reads replies into
    pinned host buffers and copies them to the GPU without another host copy.
    ``staging``: the uint8 buffer ``stage_owned`` writes into (at least
    ``ceil(N/W)`` slots of a chunk's bytes, on ``device``), for a caller whose
    chunks are already landing there (:mod:`kvctl.connector.pipeline`); None:
    allocated here.

    Returns ``LoadResult(prefix, chunks)``; every rank gets the same prefix.
    Only errors of the process group itself (a dead peer, a collective timeout)
    propagate.
    """
    result, _ = load_agreed_prefix_detailed(group, chunk_keys, fetch_owned, chunk_shape, dtype, device, mode, first_chunk,
                                            stage_owned, meta_group, staging)
    return result
