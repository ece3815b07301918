"""A real redis-py client whose GET never gets a reply: the test SIGSTOPs the Valkey it talks to.

Modes: ``sync-python`` (redis-py's pure-Python RESP parser), ``sync-hiredis``
(the hiredis parser ``redis[hiredis]`` installs), ``asyncio-run`` (redis.asyncio
under ``asyncio.run``), ``asyncio-thread`` (redis.asyncio on an event-loop
thread, called from sync code with ``run_coroutine_threadsafe(...).result()``,
the way LMCache's ``redis://`` connector does). The client connects and
PINGs, prints CONNECTED, waits for a line on stdin (the server is stopped
meanwhile), prints READY and sends the GET.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import parse_args, ready  # noqa: E402

import redis  # noqa: E402
import redis.asyncio as aredis  # noqa: E402
from redis._parsers import _HiredisParser, _RESP3Parser  # noqa: E402


def go_on() -> None:
    sys.stdout.write("CONNECTED\n")
    sys.stdout.flush()
    sys.stdin.readline()
    ready("GET sent to a stopped server")


def sync_client(port: int, parser: type) -> None:
    r = redis.Redis(connection_pool=redis.ConnectionPool(port=port, parser_class=parser))
    r.ping()
    go_on()
    r.get("chunk-0042")


async def async_main(port: int) -> None:
    r = aredis.Redis(port=port)
    await r.ping()
    go_on()
    await r.get("chunk-0042")


def threaded(port: int) -> None:
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="remote-loop", daemon=True).start()

    async def connect() -> aredis.Redis:
        r = aredis.Redis(port=port)
        await r.ping()
        return r

    r = asyncio.run_coroutine_threadsafe(connect(), loop).result()
    go_on()
    asyncio.run_coroutine_threadsafe(r.get("chunk-0042"), loop).result()


def main() -> None:
    ns = parse_args([(("--port",), {"type": int, "required": True}), (("--mode",), {"required": True})])
    if ns.mode == "sync-python":
        sync_client(ns.port, _RESP3Parser)
    elif ns.mode == "sync-hiredis":
        sync_client(ns.port, _HiredisParser)
    elif ns.mode == "asyncio-run":
        asyncio.run(async_main(ns.port))
    elif ns.mode == "asyncio-thread":
        threaded(ns.port)
    else:
        raise SystemExit(f"unknown mode {ns.mode}")


if __name__ == "__main__":
    main()
