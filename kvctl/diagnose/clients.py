"""Which KV client a stalled thread is in, from its py-spy frames.

Frame names as py-spy prints them (``Class.method``, short file names under
site-packages), read from the sources of redis-py 8.1 and LMCache 0.5.6:

* redis-py sync, pure-Python parser: ``SocketBuffer._read_from_socket``
  (``redis/_parsers/socket.py``) under ``_RESP2Parser``/``_RESP3Parser``;
* redis-py sync, hiredis parser (what ``redis[hiredis]`` installs):
  ``_HiredisParser.read_from_socket`` (``redis/_parsers/hiredis.py``);
* redis-py asyncio (``redis/asyncio/``): its coroutines are invisible while
  suspended; a sync caller waits in ``Future.result`` on the loop's thread;
* LMCache's native RESP client (``resp://``): ``RESPConnector`` in
  ``lmcache/v1/storage_backend/connector/redis_connector.py`` over
  ``ConnectorClientBase.batch_get_sync``/``batch_exists_sync``/... in
  ``lmcache/v1/storage_backend/native_clients/connector_client_base.py``,
  whose C++ worker threads py-spy does not show (submit-then-register: bug 1;
  a fixed-size read of ``$-1``: bug 2);
* LMCache's ``redis://`` connector: ``RedisConnector``/``RedisClusterConnector``
  (same file) over redis-py asyncio, ``exists_sync`` via
  ``asyncio.run_coroutine_threadsafe(...).result()``;
* kvctl's own client: ``kvctl/connector/resp.py`` (``connector/resp.py`` in a checkout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from kvctl.diagnose.pyspy import Frame


@dataclass(frozen=True)
class Client:
    name: str
    reads_to_crlf: bool  # parses reply headers up to CRLF: a missing key cannot hang it (no bug 2)
    completion_safe: bool  # registers before it submits: no lost completion (no bug 1)
    lmcache: bool = False


REDIS_PY = Client("redis-py (pure-Python parser)", True, True)
REDIS_HIREDIS = Client("redis-py (hiredis parser)", True, True)
REDIS_ASYNC = Client("redis-py asyncio", True, True)
LMCACHE_NATIVE = Client("LMCache native RESP client (resp://, RESPConnector → ConnectorClientBase)", False, False, True)
LMCACHE_REDIS = Client("LMCache redis:// connector (RedisConnector over redis-py asyncio)", True, True, True)
KVCTL = Client("kvctl.connector RESP client", True, True)

_LMCACHE_CONNECTOR_FILE = "storage_backend/connector/redis_connector.py"


def identify(frames: Iterable[Frame]) -> Client | None:
    """The KV client of a stack (innermost frame first), or None when none is recognised."""
    for f in frames:
        fn, name = f.filename, f.name
        if "redis/_parsers/hiredis.py" in fn or name.startswith("_HiredisParser."):
            return REDIS_HIREDIS
        if "redis/_parsers/" in fn or name.startswith(("_RESP2Parser.", "_RESP3Parser.", "SocketBuffer.")):
            return REDIS_ASYNC if "_Async" in name or "redis/asyncio/" in fn else REDIS_PY
        if "redis/asyncio/" in fn:
            return REDIS_ASYNC
        if "native_clients/" in fn or name.startswith("ConnectorClientBase."):
            return LMCACHE_NATIVE
        if _LMCACHE_CONNECTOR_FILE in fn or fn.endswith("redis_connector.py"):
            if name.startswith("RESPConnector."):
                return LMCACHE_NATIVE
            if name.startswith(("RedisConnector.", "RedisClusterConnector.", "RedisSentinelConnector.")):
                return LMCACHE_REDIS
        if fn.endswith(("kvctl/connector/resp.py", "connector/resp.py")):
            return KVCTL
        if "redis/client.py" in fn or "redis/connection.py" in fn:
            return REDIS_PY
    return None
