"""The agreed-prefix load protocol over NCCL on real GPUs, and NVML readings.

Runs only where CUDA devices are visible (skipped on CI's CPU machines); run
it on a host with 2 or more GPUs with ``python -m pytest -m gpu tests/gpu``: the
world size is the number of visible CUDA devices (``KVCTL_GPU_WORLD`` caps it),
so the same test runs at W=2, 4 and 8. Every rank
derives the same trial plan from one seed, applies only its own injected
failures, and the parent checks that all ranks agree on the prefix, that it
is the expected one, and that the loaded bytes equal the owners' bytes.
"""

from __future__ import annotations

import os
import queue
import random
import threading
import time
import traceback

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.engine]

CHUNK_SHAPE = (64, 576)  # one small MLA-like latent chunk, bf16
MODES = ("per_chunk", "per_owner", "all_gather")
TRIALS = 60


def _need_gpus(n: int) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA device(s)")


def chunk_tensor(prompt: int, chunk: int) -> "torch.Tensor":
    g = torch.Generator().manual_seed(prompt * 100_003 + chunk)
    return torch.randn(CHUNK_SHAPE, generator=g).to(torch.bfloat16)


def plan(seed: int, trial: int, world: int) -> dict:
    rnd = random.Random(seed * 1_000_003 + trial)
    n = rnd.randint(1, 24)
    inj = {}
    if rnd.random() < 0.6:
        inj = {"rank": rnd.randrange(world), "chunk": rnd.randrange(n), "kind": rnd.choice(["none", "raise", "mismatch"])}
    return {"n": n, "mode": MODES[trial % len(MODES)], "inj": inj}


def expected_prefix(p: dict, world: int) -> int:
    inj = p["inj"]
    if not inj:
        return p["n"]
    if inj["kind"] == "mismatch":
        return 0
    rank, c, n = inj["rank"], inj["chunk"], p["n"]
    if inj["kind"] == "raise":
        # the callback raises only when asked for chunk c; then every owned chunk failed
        return rank if c % world == rank else n
    # a None at chunk c on its owner cuts the prefix at c; on a non-owner it does nothing
    return c if c % world == rank else n


def worker(rank: int, world: int, port: int, seed: int, results) -> None:
    try:
        from datetime import timedelta

        import torch.distributed as dist

        from kvctl.connector.protocol import load_agreed_prefix

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timedelta(seconds=60), device_id=dev)
        out = []
        for trial in range(TRIALS):
            p = plan(seed, trial, world)
            inj = p["inj"] if p["inj"].get("rank") == rank else {}
            keys = [f"p{trial}-c{c}" for c in range(p["n"])]
            if inj.get("kind") == "mismatch":
                keys[-1] = keys[-1] + "-other"

            def fetch(owned, trial=trial, inj=inj):
                res = []
                for c in owned:
                    if inj.get("kind") == "raise" and c == inj["chunk"]:
                        raise RuntimeError("injected staging failure")
                    res.append(None if (inj.get("kind") == "none" and c == inj["chunk"]) else chunk_tensor(trial, c).pin_memory())
                return res

            r = load_agreed_prefix(None, keys, fetch, CHUNK_SHAPE, torch.bfloat16, dev, mode=p["mode"])
            ok = all(torch.equal(r.chunks[c].cpu(), chunk_tensor(trial, c)) for c in range(r.prefix))
            out.append((r.prefix, ok))
        torch.cuda.synchronize()
        # the group still works after all those failures
        t = torch.ones(1, device=dev) * (rank + 1)
        dist.all_reduce(t)
        results.put((rank, "ok", (out, float(t.item()))))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        results.put((rank, "error", traceback.format_exc()))


def gpu_world() -> int:
    """Ranks for the NCCL test: every visible GPU, or ``$KVCTL_GPU_WORLD`` of them (at least 2)."""
    _need_gpus(2)
    visible = torch.cuda.device_count()
    cap = int(os.environ.get("KVCTL_GPU_WORLD", visible))
    if not 2 <= cap <= visible:
        pytest.skip(f"KVCTL_GPU_WORLD={cap} needs 2..{visible}")
    return cap


def test_protocol_over_nccl_agrees_and_moves_exact_bytes():
    world = gpu_world()
    import torch.multiprocessing as mp

    from kvctl.tier.server import free_port

    seed = 1234
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, seed, results)) for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    deadline = time.monotonic() + 240
    try:
        while len(got) < world and time.monotonic() < deadline:
            try:
                rank, status, payload = results.get(timeout=1)
            except queue.Empty:
                continue
            assert status == "ok", payload
            got[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert len(got) == world, "a rank hung"
    for rank in range(world):
        assert got[rank][1] == sum(range(1, world + 1))
    for trial in range(TRIALS):
        prefixes = {got[r][0][trial][0] for r in range(world)}
        assert len(prefixes) == 1, f"trial {trial}: ranks disagree {prefixes}"
        assert prefixes.pop() == expected_prefix(plan(seed, trial, world), world), f"trial {trial}"
        assert all(got[r][0][trial][1] for r in range(world)), f"trial {trial}: bytes differ"


def test_nvml_sees_gpus_and_busy_utilisation():
    _need_gpus(1)
    from kvctl.diagnose.sources import gpu_sample

    idle = gpu_sample()
    assert idle.visible and "no GPU" not in idle.note, idle
    assert len(idle.utilization_pct) == torch.cuda.device_count()
    assert all(idle.names), idle
    stop = threading.Event()

    def burn():
        a = torch.randn(8192, 8192, device="cuda:0", dtype=torch.bfloat16)
        while not stop.is_set():
            for _ in range(20):
                a = (a @ a).clamp_(-1, 1)
            torch.cuda.synchronize()

    t = threading.Thread(target=burn, daemon=True)
    t.start()
    try:
        busy = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            time.sleep(0.5)
            busy.append(gpu_sample().utilization_pct[0])
            if busy[-1] >= 50:
                break
    finally:
        stop.set()
        t.join(timeout=30)
    assert max(busy) >= 50, busy
