"""One rank's share of the tier: its K Valkey instances, chunk ``c`` on instance ``(c // W) mod K``.

With one instance per rank (K = 1, the paper's §5.2) this is one
:class:`~kvctl.connector.resp.RespClient`, called on the caller's thread.
With K > 1 (``instances_per_rank``) a batch is split by instance and the
parts run at once, one thread per instance, so a rank's GET bandwidth adds up
over its instances; every call still ends on the caller's thread with every
part done (no future is handed out). The chunk index decides the instance
(:func:`kvctl.connector.urls.instance_of`), never the key's hash: engines of
the same W and K share keys, and one prompt's chunks spread evenly.

``connections`` is how many connections a device load keeps busy on each
instance at once (:mod:`kvctl.connector.fetch`); each client's socket pool
holds that many plus one for lookups and saves.

``parts`` (a :class:`~kvctl.connector.ownership.ChunkParts`): each chunk is
stored as one value per part, under the part's key, on the chunk's
instance; EXISTS and GET of a chunk are true only when every part's are, SET
and DEL write and remove every part. The callers keep passing the chunk's
key and one buffer of the whole chunk.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from .ownership import ChunkParts
from .resp import RespClient, RespError
from .urls import instance_of, parse_resp_url

__all__ = ["RankTier"]


class RankTier:
    """Rank ``rank``'s instances ``urls`` (index = instance) in a shard group of ``world_size`` ranks."""

    def __init__(self, urls: Sequence[str], world_size: int, *, timeout_s: float, connections: int = 2,
                 client_factory: Callable[..., Any] = RespClient, parts: ChunkParts | None = None) -> None:
        urls = list(urls)
        if not urls:
            raise ValueError("a rank needs at least one instance URL")
        if connections < 1:
            raise ValueError(f"connections must be >= 1, got {connections}")
        self.world_size = world_size
        self.urls = urls  # credentials included: never log these (use url / redacted)
        self.k = len(urls)
        self.connections = connections
        self.timeout_s = timeout_s
        self.parts = parts
        # the device load's lanes use `connections` sockets per instance; +1 for a lookup or save meanwhile
        self.clients = [client_factory(u, timeout_s=timeout_s, pool_size=connections + 1) for u in urls]
        self.redacted = [parse_resp_url(u).redacted() for u in urls]
        self._fan = ThreadPoolExecutor(max_workers=self.k, thread_name_prefix="kvctl-tier") if self.k > 1 else None

    @property
    def url(self) -> str:
        """The instances for logs and messages, passwords masked."""
        return self.redacted[0] if self.k == 1 else f"{self.redacted[0]} (+{self.k - 1} more instances of this rank)"

    def instance(self, chunk: int) -> int:
        return instance_of(chunk, self.world_size, self.k)

    def split(self, chunks: Sequence[int]) -> list[list[int]]:
        """Positions into ``chunks`` grouped by instance (instance i's in list i, in order)."""
        parts: list[list[int]] = [[] for _ in range(self.k)]
        for pos, c in enumerate(chunks):
            parts[self.instance(c)].append(pos)
        return parts

    def _each(self, chunks: Sequence[int], op: Callable[[RespClient, list[int]], list[Any] | None]) -> list[Any]:
        """``op(client, positions)`` per instance that has chunks, at once; results back in position order.

        Every part is waited for; then the first RespError (in instance order) is raised.
        """
        n = len(chunks)
        if n == 0:
            return []
        if self.k == 1:
            got = op(self.clients[0], list(range(n)))
            return list(got) if got is not None else [None] * n
        parts = self.split(chunks)
        futures = {i: self._fan.submit(op, self.clients[i], pos) for i, pos in enumerate(parts) if pos}
        out: list[Any] = [None] * n
        error: BaseException | None = None
        for i, fut in futures.items():
            try:
                got = fut.result()
            except RespError as exc:
                error = error or exc
                continue
            if got is not None:
                for p, v in zip(parts[i], got):
                    out[p] = v
        if error is not None:
            raise error
        return out

    def _expand(self, chunks: Sequence[int], keys: Sequence[str], buffers: Sequence[Any] | None = None):
        """Chunks, keys and buffers one entry per part (the chunk's own when there are no parts)."""
        if self.parts is None:
            return chunks, keys, buffers
        p = len(self.parts.names)
        xc = [c for c in chunks for _ in range(p)]
        xk = [pk for k in keys for pk in self.parts.keys(k)]
        xb = None if buffers is None else [v for b in buffers for v in self.parts.views(b)]
        return xc, xk, xb

    def _all_parts(self, found: list[bool]) -> list[bool]:
        if self.parts is None:
            return found
        p = len(self.parts.names)
        return [all(found[i : i + p]) for i in range(0, len(found), p)]

    def exists(self, chunks: Sequence[int], keys: Sequence[str]) -> list[bool]:
        """EXISTS of ``keys[j]`` (chunk ``chunks[j]``) on its instance, one pipeline per instance."""
        xc, xk, _ = self._expand(chunks, keys)
        return self._all_parts([bool(x) for x in self._each(xc, lambda cl, pos: cl.batched_exists([xk[p] for p in pos]))])

    def get(self, chunks: Sequence[int], keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        """GET ``keys[j]`` into ``buffers[j]`` from its instance; True = filled (see RespClient.batched_get)."""
        xc, xk, xb = self._expand(chunks, keys, buffers)
        return self._all_parts([bool(x) for x in self._each(
            xc, lambda cl, pos: cl.batched_get([xk[p] for p in pos], [xb[p] for p in pos]))])

    def get_one(self, client: RespClient, key: str, buffer: Any) -> bool:
        """One chunk into ``buffer`` from ``client`` (its instance's), every part, in one pipeline on one connection:
        the device load's lanes (each a connection of its own; a split would queue behind the other lanes)."""
        if self.parts is None:
            return bool(client.batched_get([key], [buffer], split=False)[0])
        return all(client.batched_get(self.parts.keys(key), self.parts.views(buffer), split=False))

    def set(self, chunks: Sequence[int], keys: Sequence[str], values: Sequence[Any], ttl_s: int | None = None) -> None:
        """SET ``keys[j]`` to ``values[j]`` on its instance (one pipeline per instance)."""
        xc, xk, xv = self._expand(chunks, keys, values)
        self._each(xc, lambda cl, pos: cl.batched_set([xk[p] for p in pos], [xv[p] for p in pos], ttl_s=ttl_s))

    def delete(self, chunks: Sequence[int], keys: Sequence[str]) -> int:
        """DEL each key on its instance (every part of it); how many keys were removed."""
        xc, xk, _ = self._expand(chunks, keys)
        removed = [0]
        lock = threading.Lock()

        def op(cl: RespClient, pos: list[int]) -> None:
            n = cl.delete([xk[p] for p in pos])
            with lock:
                removed[0] += n

        self._each(xc, op)
        return removed[0]

    def close(self) -> None:
        if self._fan is not None:
            self._fan.shutdown(wait=False, cancel_futures=True)
        for c in self.clients:
            c.close()
