"""W real gloo ranks in fresh processes, for the connector's and the plugins' multi-rank tests."""

from __future__ import annotations

import os
import queue
import time
import traceback

import torch


def free_port() -> int:
    from kvctl.tier.server import free_port as _free_port

    return _free_port()


def init_gloo(rank: int, world: int, port: int, timeout_s: float = 20.0) -> None:
    """Join a gloo group on loopback; collectives give up after ``timeout_s``."""
    from datetime import timedelta

    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))


def _entry(target, rank, world, port, args, results):
    try:
        init_gloo(rank, world, port)
        out = target(rank, world, *args)
        results.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def spawn_ranks(target, world: int, args: tuple, timeout_s: float) -> list:
    """Run ``target(rank, world, *args)`` in ``world`` fresh processes in one gloo group.

    Returns the per-rank return values in rank order. Any rank error fails the
    test with its traceback; after ``timeout_s`` the processes this function
    started are killed (by their own handles) and the test fails: no hang.
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(target, r, world, port, args, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, object] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) + len(errors) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, status, payload = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs) and results.empty():
                    time.sleep(0.5)  # let a dying rank's report arrive
                    if results.empty():
                        break
                continue
            if status == "ok":
                got[rank] = payload
            else:
                errors.append(f"rank {rank}:\n{payload}")
    finally:
        for p in procs:
            p.join(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    assert not errors, "\n".join(errors)
    assert len(got) == world, f"only ranks {sorted(got)} of {world} finished within {timeout_s}s (hang?)"
    return [got[r] for r in range(world)]
