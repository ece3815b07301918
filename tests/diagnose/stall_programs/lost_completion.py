"""Paper §5.4 bug 1: a lookup future registered after its request was submitted.

A native-style client submits a request to its event-loop thread and only
then registers the future that should receive the completion. The loop
drains the completion in between, finds no future, drops it, and the lookup
thread blocks in ``fut.result()`` forever while nothing is outstanding.
The race window is widened (the submitter waits for the drain) so the loss
happens every time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import parse_args, ready  # noqa: E402


class NativeStyleClient:
    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="resp-event-loop", daemon=True)
        self._loop_thread.start()
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._next_id = 0
        self._drained = threading.Event()
        self._keys = {b"chunk-0"}

    def _drain(self, req_id: int, found: bool) -> None:
        """Runs on the event-loop thread: hand a completion to its future."""
        fut = self._pending.pop(req_id, None)
        self._drained.set()
        if fut is None:
            return  # nobody registered yet: the completion is dropped (the bug)
        fut.set_result(found)

    def exists(self, key: bytes) -> bool:
        req_id = self._next_id
        self._next_id += 1
        self._drained.clear()
        self._loop.call_soon_threadsafe(self._drain, req_id, key in self._keys)  # submit ...
        self._drained.wait(5)  # (race window, widened so the loss is certain)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._pending[req_id] = fut  # ... then register: too late
        return fut.result()


def lookup_worker(client: NativeStyleClient) -> None:
    client.exists(b"chunk-0")


def main() -> None:
    parse_args()
    client = NativeStyleClient()
    t = threading.Thread(target=lookup_worker, args=(client,), name="lmcache-lookup-0", daemon=True)
    t.start()
    time.sleep(0.3)
    ready("lookup blocked")
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
