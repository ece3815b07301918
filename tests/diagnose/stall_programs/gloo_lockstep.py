"""A lockstep stall: rank 0 enters a gloo all_reduce that rank 1 never enters.

Rank 1 "found nothing to load" and skipped the collective (the bug the load
protocol forbids: nothing may let one rank skip a collective the others
enter); it carries on elsewhere, so rank 0 waits in the collective.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import parse_args, ready  # noqa: E402


def load_step(dist, torch) -> None:
    t = torch.ones(4)
    ready("rank 0 in all_reduce")
    dist.all_reduce(t)  # the peer never gets here


def skip_collective_and_poll() -> None:
    ready("rank 1 elsewhere")
    while True:
        time.sleep(0.05)


def main() -> None:
    ns = parse_args([(("--rank",), {"type": int, "required": True}), (("--port",), {"type": int, "required": True})])
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{ns.port}",
        rank=ns.rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=ns.lifetime),
    )
    if ns.rank == 0:
        load_step(dist, torch)
    else:
        skip_collective_and_poll()


if __name__ == "__main__":
    main()
