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


def _serve(rank: int, world: int, tasks, results) -> None:
    """A warm rank of a :class:`RankPool`: runs ``(target, port, args)`` one after another, each in a fresh gloo group."""
    torch.set_num_threads(1)
    while True:
        item = tasks.get()
        if item is None:
            return
        target, port, args = item
        _entry(target, rank, world, port, args, results)  # as a spawned rank runs its one target


class RankPool:
    """``world`` spawned processes kept warm across tests: each :meth:`run` is one :func:`spawn_ranks` call without a
    process start (and without importing torch and vLLM again, most of a spawned rank's 5-10 s on 2 cores).

    A run that errs leaves the pool usable (each rank reports and waits for the next target); one that does not
    finish in time kills the pool's processes (by their own handles) and fails, and the pool is :attr:`broken`."""

    def __init__(self, world: int) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.world = world
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.procs = [ctx.Process(target=_serve, args=(r, world, self.tasks[r], self.results), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()
        self.broken = False

    def run(self, target, args: tuple, timeout_s: float) -> list:
        """``target(rank, world, *args)`` on every rank in one gloo group; per-rank results (see :func:`spawn_ranks`)."""
        assert not self.broken, "this rank pool was killed by an earlier run that did not finish"
        port = free_port()
        for q in self.tasks:
            q.put((target, port, args))
        got: dict[int, object] = {}
        errors: list[str] = []
        deadline = time.monotonic() + timeout_s
        while len(got) + len(errors) < self.world:
            left = deadline - time.monotonic()
            if left <= 0 or any(not p.is_alive() for p in self.procs):
                self.close(kill=True)
                break
            try:
                rank, status, payload = self.results.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if status == "ok":
                got[rank] = payload
            else:
                errors.append(f"rank {rank}:\n{payload}")
        assert not errors, "\n".join(errors)
        assert len(got) == self.world, f"only ranks {sorted(got)} of {self.world} finished within {timeout_s}s (hang?)"
        return [got[r] for r in range(self.world)]

    def close(self, kill: bool = False) -> None:
        self.broken = self.broken or kill
        if not kill:
            for q in self.tasks:
                q.put(None)
        for p in self.procs:
            if not kill:
                p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
