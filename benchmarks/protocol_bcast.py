#!/usr/bin/env python3
"""Load-step transfer forms of the agreed-prefix protocol, side by side (paper §5.1).

Compares, for the same prompt (``--chunks`` chunks of ``--chunk-bytes`` bytes
spread over W ranks by ``c mod W``):

* ``per_chunk``  -- one broadcast per chunk from its owner (the paper's form);
* ``per_owner``  -- one broadcast per owner;
* ``all_gather`` -- one all-gather of every owner's slots;
* ``raw``        -- a bare ``all_gather_single`` of the same bytes (the floor);

both for the transfer step alone and for the whole protocol (fetch+stage,
exchange, transfer). Prints a table and one JSON line (``--json FILE`` also
writes it), including the ratio default form / raw all-gather.

CPU (gloo, here):      python benchmarks/protocol_bcast.py
GPU (NCCL, 2 GPUs):    python benchmarks/protocol_bcast.py --backend nccl --chunks 64 --chunk-bytes 12400000
  or: torchrun --nproc-per-node 2 benchmarks/protocol_bcast.py --backend nccl --chunks 64 --chunk-bytes 12400000

Self-contained: needs only torch and connector/protocol.py (imported as
``kvctl.connector.protocol`` when kvctl is installed, else by file path).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def _load_protocol():
    try:
        from kvctl.connector import protocol  # noqa: PLC0415

        return protocol
    except ImportError:
        path = Path(__file__).resolve().parent.parent / "connector" / "protocol.py"
        spec = importlib.util.spec_from_file_location("kvctl_protocol_standalone", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        return mod


protocol = _load_protocol()
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    p.add_argument("--world", type=int, default=2, help="ranks to self-spawn (ignored under torchrun)")
    p.add_argument("--chunks", type=int, default=16, help="chunks in the prompt (the agreed prefix)")
    p.add_argument("--chunk-bytes", type=int, default=1_000_000, help="bytes per chunk (12.4 MB for GLM-5.3 FP8 MLA)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", dest="json_path", default=None, help="also write the JSON result here")
    return p.parse_args(argv)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device, iters, warmup):
    """Median and min over iterations of the slowest rank's wall time, in ms."""
    samples = []
    for i in range(warmup + iters):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if i >= warmup:
            samples.append(dt.item() * 1e3)
    return {"median_ms": statistics.median(samples), "min_ms": min(samples)}


def run(rank: int, world: int, args) -> dict | None:
    device = torch.device(f"cuda:{rank % max(1, torch.cuda.device_count())}") if args.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    n, nbytes = args.chunks, args.chunk_bytes
    shape, dtype = (nbytes,), torch.uint8
    owned = list(range(rank, n, world))
    slots = max(1, -(-n // world))
    # the rank's owned chunks, as the fetch callback would hand them over (host
    # memory, pinned on GPU machines: the real path copies L1 -> device)
    pin = device.type == "cuda"
    host = [torch.full(shape, (c * 7 + 1) % 251, dtype=dtype).pin_memory() if pin else torch.full(shape, (c * 7 + 1) % 251, dtype=dtype) for c in owned]
    staging = torch.empty(slots * nbytes, dtype=torch.uint8, device=device)
    for j, t in enumerate(host):
        staging[j * nbytes : (j + 1) * nbytes].copy_(t)
    keys = [f"bench-chunk-{c}" for c in range(n)]
    kmax = -(-n // world)
    raw_in = torch.empty(kmax * nbytes, dtype=torch.uint8, device=device)
    raw_out = torch.empty(world * kmax * nbytes, dtype=torch.uint8, device=device)

    # correctness once per mode: every chunk arrives intact on every rank
    for mode in protocol.MODES:
        res = protocol.load_agreed_prefix(None, keys, lambda idx: host, shape, dtype, device, mode)
        assert res.prefix == n, (mode, res.prefix)
        for c in (0, n - 1):
            assert int(res.chunks[c][0]) == (c * 7 + 1) % 251 and int(res.chunks[c][-1]) == (c * 7 + 1) % 251, (mode, c)
        del res

    out = {"transfer": {}, "protocol": {}}
    for mode in protocol.MODES:
        out["transfer"][mode] = _time(lambda: protocol.move_prefix(None, n, staging, shape, dtype, device, mode), device, args.iters, args.warmup)
    out["transfer"]["raw_all_gather"] = _time(lambda: _all_gather_single(raw_out, raw_in), device, args.iters, args.warmup)
    for mode in protocol.MODES:
        out["protocol"][mode] = _time(lambda: protocol.load_agreed_prefix(None, keys, lambda idx: host, shape, dtype, device, mode), device, args.iters, args.warmup)
    if rank != 0:
        return None
    raw = out["transfer"]["raw_all_gather"]["median_ms"]
    default = protocol.resolve_mode(None)
    total_bytes = n * nbytes
    result = {
        "benchmark": "protocol_bcast",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "torch": torch.__version__,
        "backend": args.backend,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "world": world,
        "chunks": n,
        "chunk_bytes": nbytes,
        "prompt_bytes": total_bytes,
        "iters": args.iters,
        "default_mode": default,
        "transfer_ms": {k: round(v["median_ms"], 4) for k, v in out["transfer"].items()},
        "transfer_min_ms": {k: round(v["min_ms"], 4) for k, v in out["transfer"].items()},
        "protocol_ms": {k: round(v["median_ms"], 4) for k, v in out["protocol"].items()},
        "transfer_gbps": {k: round(total_bytes / (v["median_ms"] / 1e3) / 1e9, 3) for k, v in out["transfer"].items()},
        "ratio_default_to_raw": round(out["transfer"][default]["median_ms"] / raw, 3),
        "ratio_per_chunk_to_raw": round(out["transfer"]["per_chunk"]["median_ms"] / raw, 3),
        "ratio_per_owner_to_raw": round(out["transfer"]["per_owner"]["median_ms"] / raw, 3),
        "fastest_transfer_mode": min(protocol.MODES, key=lambda m: out["transfer"][m]["median_ms"]),
    }
    return result


def render(result: dict) -> str:
    lines = [
        f"agreed-prefix load, {result['backend']} on {result['device']}, W={result['world']}, "
        f"{result['chunks']} chunks x {result['chunk_bytes'] / 1e6:.2f} MB = {result['prompt_bytes'] / 1e6:.1f} MB "
        f"(median of {result['iters']})",
        f"{'form':<16}{'transfer ms':>14}{'GB/s':>10}{'whole protocol ms':>20}",
    ]
    for k in ("per_chunk", "per_owner", "all_gather", "raw_all_gather"):
        proto = result["protocol_ms"].get(k)
        lines.append(
            f"{k:<16}{result['transfer_ms'][k]:>14.3f}{result['transfer_gbps'][k]:>10.2f}"
            f"{(f'{proto:.3f}' if proto is not None else '-'):>20}"
        )
    lines.append(
        f"default ({result['default_mode']}) / raw all_gather = {result['ratio_default_to_raw']:.2f}x  "
        f"(per_chunk {result['ratio_per_chunk_to_raw']:.2f}x, per_owner {result['ratio_per_owner_to_raw']:.2f}x); "
        f"fastest: {result['fastest_transfer_mode']}"
    )
    return "\n".join(lines)


def _worker(rank: int, world: int, port: int, args) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    if args.backend == "gloo":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(args.backend, rank=rank, world_size=world, timeout=_dt.timedelta(seconds=120))
    try:
        result = run(rank, world, args)
        if result is not None:
            print(render(result), flush=True)
            print(json.dumps(result), flush=True)
            if args.json_path:
                Path(args.json_path).write_text(json.dumps(result, indent=2) + "\n")
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if args.backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        _worker(rank, world, int(os.environ.get("MASTER_PORT", "29500")), args)
        return 0
    if args.backend == "nccl" and torch.cuda.device_count() < args.world:
        print(f"--backend nccl needs {args.world} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import torch.multiprocessing as mp  # noqa: PLC0415

    mp.spawn(_spawned, args=(args.world, port, args), nprocs=args.world, join=True)
    return 0


def _spawned(rank, world, port, args):
    import multiprocessing

    from kvctl.core.procs import die_with

    die_with(multiprocessing.parent_process().pid)  # a killed benchmark leaves no rank behind
    _worker(rank, world, port, args)


if __name__ == "__main__":
    sys.exit(main())
