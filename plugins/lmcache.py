"""kvctl's RESP client as an LMCache 0.5.6 remote-storage plugin (paper §5.2, §5.4).

    remote_storage_plugins: [kvctl]
    extra_config:
      remote_storage_plugin.kvctl.module_path: kvctl.plugins.lmcache
      remote_storage_plugin.kvctl.class_name: KvctlConnectorAdapter
      remote_storage_plugin.kvctl.url: resp://valkey-{rank}:6379     # or kvctl_remote_urls: [per-rank list]

LMCache builds one ``RemoteBackend`` per plugin with the URL ``plugin://kvctl``
and asks every adapter whether it parses that URL
(lmcache/v1/storage_backend/connector/__init__.py, ``ConnectorManager``). This
adapter answers for ``plugin://kvctl`` and ``plugin://kvctl.<instance>`` and
builds a :class:`KvctlRemoteConnector` for the worker's rank
(``metadata.worker_id``), talking to that rank's own Valkey instance through
:class:`kvctl.connector.resp.RespClient`:

* a missing key is a miss (its buffer released, ``None``), never a hang: the
  client parses the null bulk of a missing key and every call has one deadline
  (``remote_storage_plugin.<name>.timeout_s``, 2 s by default);
* exists / batched contains / get / batched get / put / batched put are each
  one pipelined round trip; values are read straight into LMCache's buffers;
* a server that fails or times out is a miss (lookups, gets) or a dropped
  store (puts), logged, never an exception into LMCache's event loop.

Several instances per rank (``remote_storage_plugin.<name>.instances_per_rank``
K, with ``{instance}`` in the URL or per-rank lists of K URLs): LMCache's
remote connector sees keys, never chunk indexes, so a key goes to instance
``blake2b(key) mod K`` of the rank -- deterministic, the same in every engine
(they share keys), near-even over one prompt's chunks (the vLLM connector,
which knows chunk indexes, stripes exactly: ``(c // W) mod K``).

Values are whole chunks (LMCache's ``save_unfull_chunk: false``, its default)
of LMCache's own layout, the same bytes its native ``resp://`` connector
writes. Settings: :mod:`kvctl.connector.lmcache_settings`.

Load or recompute (``remote_storage_plugin.<name>.prefill_tokens_per_s`` R,
optionally ``.t0_s``): LMCache asks a remote backend how many leading chunks
it holds (``batched_contains``, ``batched_async_contains``) and loads only that
many, so the plugin declines a hit by answering fewer: it answers the longest
prefix of what it holds whose load, at the bandwidth its own GETs measured and
behind the GETs it has in flight, is predicted no slower than recomputing it
(:func:`kvctl.connector.policy.decide`; nothing measured yet: all of it; a
veto re-probed after 30 s). What it cannot do there: docs/connector.md.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, List, Optional, Sequence

from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from kvctl.connector.calibration import Calibration
from kvctl.connector.policy import LOAD, RECOMPUTE, TIER_QUEUE, HitShape, TierQueue, as_probe, decide
from kvctl.connector.resp import RespClient, RespError
from kvctl.connector.striped import RankTier
from kvctl.connector.lmcache_settings import PLUGIN_TYPE, PluginConfigError, PluginSettings, plugin_settings

from .hooks import hook_from_env

__all__ = ["KvctlConnectorAdapter", "KvctlRemoteConnector", "PluginConfigError"]

log = logging.getLogger("kvctl.plugins.lmcache")
#: a test hook, "module:function", called with (rank, key names, each name's instance URL) just before a GET
#: (tests/lmcache/plugin_hooks.py: a chunk deleted between LMCache's lookup and its load)
BEFORE_GET_HOOK_ENV = "KVCTL_LMCACHE_BEFORE_GET_HOOK"
_WARN_EVERY_S = 10.0  # at most one warning per operation kind this often: a dead tier must not flood the log


class KvctlRemoteConnector(RemoteConnector):
    """LMCache ``RemoteConnector`` over one rank's Valkey instance.

    Async methods run the blocking client on a small thread pool (one thread
    per pooled connection) so LMCache's event loop never blocks on the
    network; the ``*_sync`` and ``batched_contains`` calls run on the caller's
    thread, bounded by the same deadline.
    """

    def __init__(self, settings: PluginSettings, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any, config: Any, metadata: Any) -> None:
        super().__init__(config, metadata)  # full_chunk_size_bytes, meta_shapes/dtypes/fmt
        self.settings = settings
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        # the rank's K instances; keys are routed by a stable hash of the key (see the module docstring)
        self.tier = RankTier(settings.urls, 1, timeout_s=settings.timeout_s, connections=max(1, settings.pool_size - 1))
        self._pool = ThreadPoolExecutor(max_workers=settings.pool_size, thread_name_prefix=f"kvctl-lmcache-r{settings.rank}")
        self._warned_at: dict[str, float] = {}
        self.errors = 0  # calls that failed on the network/server side (each counted once)
        # load or recompute: on with an R in the settings (a remote backend sees no engine step to measure it by)
        self.policy = (Calibration(1, prefill_tokens_per_s=settings.prefill_tokens_per_s, t0_s=settings.t0_s)
                       if settings.prefill_tokens_per_s is not None else None)
        self.decisions: dict[tuple[str, str], int] = {}  # (decision, reason) -> hits judged
        self._inflight = [0, 0]  # bytes and GET calls running now: the queue a new load waits behind
        self._flight_lock = threading.Lock()
        self._hook = hook_from_env(BEFORE_GET_HOOK_ENV)
        log.info("kvctl LMCache plugin: rank %d -> %s (timeout %.3g s)", settings.rank, settings.redacted_url, settings.timeout_s)

    def __repr__(self) -> str:
        return f"<KvctlRemoteConnector rank={self.settings.rank} {self.settings.redacted_url}>"

    # -- helpers -------------------------------------------------------------
    def _failed(self, what: str, exc: BaseException) -> None:
        self.errors += 1
        now = time.monotonic()
        if now - self._warned_at.get(what, -_WARN_EVERY_S) >= _WARN_EVERY_S:
            self._warned_at[what] = now
            log.warning("kvctl LMCache plugin: %s on %s failed (%s: %s); treated as a miss", what, self.settings.redacted_url, type(exc).__name__, exc)

    async def _off_loop(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    @property
    def client(self) -> RespClient:
        """The first instance's client (the only one when K = 1)."""
        return self.tier.clients[0]

    def _exists_many(self, keys: Sequence[Any]) -> list[bool]:
        try:
            names = [k.to_string() for k in keys]
            return self.tier.exists(_routes(names), names)
        except RespError as exc:
            self._failed("EXISTS", exc)
            return [False] * len(keys)

    @staticmethod
    def _prefix(flags: Sequence[bool]) -> int:
        n = 0
        for hit in flags:
            if not hit:
                break
            n += 1
        return n

    def _allocate(self) -> Optional[MemoryObj]:
        return self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt)

    def _get_many(self, keys: Sequence[Any]) -> list[Optional[MemoryObj]]:
        """One pipelined GET into freshly allocated chunk buffers; a miss releases its buffer."""
        objs: list[Optional[MemoryObj]] = []
        for _ in keys:
            obj = self._allocate()
            if obj is None:  # L1 full: read only as many as fit, the rest are misses
                break
            objs.append(obj)
        n = len(objs)
        hits = [False] * n
        if n:
            views = [_view(o) for o in objs]
            size = sum(len(v) for v in views)
            with self._flight_lock:
                self._inflight[0] += size
                self._inflight[1] += 1
            t0 = time.perf_counter()
            try:
                names = [k.to_string() for k in keys[:n]]
                routes = _routes(names)
                if self._hook is not None:
                    self._before_get(names, routes)
                hits = self.tier.get(routes, names, views)
            except RespError as exc:
                self._failed("GET", exc)
            finally:
                with self._flight_lock:
                    self._inflight[0] -= size
                    self._inflight[1] -= 1
            if self.policy is not None:
                self.policy.observe_gets(0, sum(len(v) for v, hit in zip(views, hits) if hit), time.perf_counter() - t0)
        out: list[Optional[MemoryObj]] = []
        for obj, hit in zip(objs, hits):
            if hit:
                out.append(obj)
            else:
                obj.ref_count_down()
                out.append(None)
        return out + [None] * (len(keys) - n)

    def _before_get(self, names: list[str], routes: list[int]) -> None:
        try:
            self._hook(self.settings.rank, names, [self.settings.urls[self.tier.instance(r)] for r in routes])
        except Exception:  # noqa: BLE001 - a test hook must not break the load
            log.exception("kvctl LMCache plugin: before-GET hook failed")

    def _set_many(self, keys: Sequence[Any], objs: Sequence[MemoryObj]) -> None:
        # LMCache's InstrumentedRemoteConnector drops the reference after put (instrumented_connector.py): not here
        try:
            names = [k.to_string() for k in keys]
            self.tier.set(_routes(names), names, [_view(o) for o in objs])
        except RespError as exc:
            self._failed("SET", exc)

    # -- RemoteConnector -----------------------------------------------------
    async def exists(self, key: Any) -> bool:
        return (await self._off_loop(self._exists_many, [key]))[0]

    def exists_sync(self, key: Any) -> bool:
        return self._exists_many([key])[0]

    async def get(self, key: Any) -> Optional[MemoryObj]:
        return (await self._off_loop(self._get_many, [key]))[0]

    async def put(self, key: Any, memory_obj: MemoryObj) -> None:
        await self._off_loop(self._set_many, [key], [memory_obj])

    async def list(self) -> List[str]:
        raise NotImplementedError("the kvctl plugin does not list keys (use `kvctl deploy-valkey status`)")

    async def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.tier.close()

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        try:
            return 0 if await self._off_loop(lambda: all(c.ping() for c in self.tier.clients)) else 1
        except RespError as exc:
            self._failed("PING", exc)
            return 1

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: List[Any]) -> List[Optional[MemoryObj]]:
        return await self._off_loop(self._get_many, list(keys))

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: List[Any], memory_objs: List[MemoryObj]) -> None:
        await self._off_loop(self._set_many, list(keys), list(memory_objs))

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: List[Any]) -> int:
        return self._judge(self._prefix(self._exists_many(keys)))

    def _judge(self, held: int) -> int:
        """How many of the ``held`` leading chunks to report: those whose load wins (all without an R)."""
        if self.policy is None or held <= 0:
            return held
        ct = self.full_chunk_size_bytes // self.single_token_size
        with self._flight_lock:
            queue = TierQueue((self._inflight[0],), self._inflight[1])
        shape, est = HitShape(0, held, 0, ct, self.full_chunk_size_bytes, 1), self.policy.estimates()
        d = decide(shape, est, queue)
        if d.decision == RECOMPUTE and d.reason != TIER_QUEUE and self.policy.probe_due():
            d = as_probe(d, shape, est, queue)
        self.decisions[(d.decision, d.reason)] = self.decisions.get((d.decision, d.reason), 0) + 1
        if d.decision != LOAD:
            log.debug("kvctl LMCache plugin: %d of %d chunk(s) held reported (%s: %s)", d.tokens // ct, held,
                      d.decision, d.reason)
        return d.tokens // ct

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: List[Any], pin: bool = False) -> int:
        return self._judge(self._prefix(await self._off_loop(self._exists_many, list(keys))))

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: List[Any]) -> List[MemoryObj]:
        """The loaded prefix: objects up to the first miss; the ones after it are released."""
        objs = await self._off_loop(self._get_many, list(keys))
        n = self._prefix([o is not None for o in objs])
        for obj in objs[n:]:
            if obj is not None:
                obj.ref_count_down()
        return objs[:n]

    def remove_sync(self, key: Any) -> bool:
        try:
            name = key.to_string()
            return self.tier.delete(_routes([name]), [name]) == 1
        except RespError as exc:
            self._failed("DEL", exc)
            return False


def _routes(names: Sequence[str]) -> list[int]:
    """A stable routing number per key: RankTier (W = 1) sends key j to instance ``routes[j] mod K``."""
    return [int.from_bytes(hashlib.blake2b(n.encode(), digest_size=8).digest(), "little") for n in names]


def _view(obj: MemoryObj) -> memoryview:
    buf = obj.byte_array
    return buf if isinstance(buf, memoryview) else memoryview(buf)


class KvctlConnectorAdapter(ConnectorAdapter):
    """LMCache ``ConnectorAdapter`` for ``plugin://kvctl`` (built by LMCache with no arguments)."""

    def __init__(self) -> None:
        super().__init__(f"plugin://{PLUGIN_TYPE}")

    def can_parse(self, url: str) -> bool:
        return url == self.schema or url.startswith(self.schema + ".")

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        config, metadata = context.config, context.metadata
        if metadata is None:  # a bare RemoteConnector gets none; the CPU backend always has it
            metadata = context.local_cpu_backend.metadata
        if config is None:
            raise PluginConfigError("the kvctl LMCache plugin needs LMCache's engine config")
        plugin_name = context.plugin_name or context.url[len("plugin://"):]
        settings = plugin_settings(
            config.extra_config,
            plugin_name,
            int(metadata.worker_id),
            remote_url=config.remote_url,
            save_unfull_chunk=bool(config.save_unfull_chunk),
        )
        return KvctlRemoteConnector(settings, context.loop, context.local_cpu_backend, config, metadata)
