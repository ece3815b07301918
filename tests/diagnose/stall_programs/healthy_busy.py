"""A healthy, busy process: compute, quick futures, an idle event loop, and an
idle consumer blocked in ``multiprocessing.Queue.get`` (a socket-like receive
under a ``get`` that is not a remote GET).

Nothing here is stuck, so ``kvctl diagnose stalls`` must report no finding.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import parse_args, ready  # noqa: E402


def small_task(i: int) -> int:
    total = 0
    for j in range(2000):
        total += (i * j) % 7
    return total


def compute_forever() -> None:
    x = 0
    while True:
        for i in range(10_000):
            x = (x * 31 + i) % 1_000_003
        time.sleep(0.001)


def main() -> None:
    parse_args()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="idle-event-loop", daemon=True).start()
    threading.Thread(target=compute_forever, name="compute", daemon=True).start()
    requests: multiprocessing.Queue = multiprocessing.Queue()
    threading.Thread(target=requests.get, name="request-consumer", daemon=True).start()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="worker")
    ready("busy")
    i = 0
    while True:
        pool.submit(small_task, i).result()  # quick futures: waited on, always completed
        i += 1


if __name__ == "__main__":
    main()
