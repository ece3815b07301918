"""layout_for() extract/insert against raw copies of the same bytes, side by side, on CPU or CUDA (torch only).

    python benchmarks/layout_copy.py --device cuda            # the paper's chunk: 42 layers x 256 tokens x 576 bf16
    python benchmarks/layout_copy.py --device cpu --layers 8 --chunks 4 --json

Caches come from kvctl.connector.kv_views (no vLLM needed). For each layout
it times, alternating in one run: extract (a new tensor on the caches' device)
against a device-to-device copy of the same bytes, and insert against the same
copy; on CUDA also extract + copy into a pinned host buffer against a raw D2H
copy, and a pinned H2D copy + insert against a raw pinned H2D copy (the
issue's >= 0.7x targets). Prints a table and, with --json, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvctl.connector.layouts import layout_for, slots_for  # noqa: E402
from kvctl.connector.kv_views import CacheSpec, build_caches  # noqa: E402

LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")


def _timed(fn, sync, reps: int) -> float:
    """Median seconds of ``reps`` calls (after one warm-up)."""
    fn()
    sync()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def run(args) -> dict:
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    mla = args.backend.endswith("MLA")
    spec = (CacheSpec(args.block_size, 1, args.row, torch.bfloat16, head_size_v=0) if mla
            else CacheSpec(args.block_size, args.heads, args.head_size, torch.bfloat16))
    tokens = args.chunk_tokens * args.chunks
    blocks = tokens // args.block_size
    num_blocks = 2 * blocks + 1
    gen = torch.Generator().manual_seed(0)
    block_ids = torch.randperm(num_blocks - 1, generator=gen)[:blocks].add(1).tolist()  # scattered, not in order
    slots = slots_for(block_ids, args.block_size, 0, tokens).to(dev)
    rows = []
    for name in args.layouts:
        _, caches = build_caches(spec, name, args.layers, num_blocks, device=dev)
        lay = layout_for(caches, spec, name, args.backend)
        chunk = lay.extract(slots)
        nbytes = chunk.numel() * chunk.element_size()
        flat = chunk.reshape(-1).clone()
        dst = torch.empty_like(flat)
        row = {"layout": name, "bytes": nbytes, "fused": lay.fused}
        t_raw = _timed(lambda: dst.copy_(flat), sync, args.reps)
        row["raw_copy_gbps"] = nbytes / t_raw / 1e9
        row["extract_gbps"] = nbytes / _timed(lambda: lay.extract(slots), sync, args.reps) / 1e9
        row["insert_gbps"] = nbytes / _timed(lambda: lay.insert(slots, chunk), sync, args.reps) / 1e9
        if dev.type == "cuda":
            host = torch.empty(chunk.shape, dtype=chunk.dtype, pin_memory=True)
            row["raw_d2h_gbps"] = nbytes / _timed(lambda: host.copy_(chunk, non_blocking=True), sync, args.reps) / 1e9
            row["extract_to_pinned_gbps"] = nbytes / _timed(
                lambda: host.copy_(lay.extract(slots), non_blocking=True), sync, args.reps) / 1e9
            row["raw_h2d_gbps"] = nbytes / _timed(lambda: chunk.copy_(host, non_blocking=True), sync, args.reps) / 1e9
            row["pinned_insert_gbps"] = nbytes / _timed(lambda: lay.insert(slots, host), sync, args.reps) / 1e9
        rows.append(row)
    return {"device": str(dev), "backend": args.backend, "layers": args.layers, "tokens": tokens,
            "torch": torch.__version__, "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", default="FLASHMLA", help="an attention backend name (MLA if it ends in MLA)")
    p.add_argument("--layers", type=int, default=42)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--chunks", type=int, default=8, help="chunks moved per call")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--row", type=int, default=576, help="MLA latent row (kv_lora_rank + rope)")
    p.add_argument("--heads", type=int, default=8, help="GQA KV heads")
    p.add_argument("--head-size", type=int, default=128, help="GQA head size")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args()
    res = run(args)
    if args.json:
        print(json.dumps(res, indent=2))
        return
    cols = [k for k in res["rows"][0] if k.endswith("gbps")]
    print(f"{res['backend']} on {res['device']}, {res['layers']} layers x {res['tokens']} tokens "
          f"({res['rows'][0]['bytes'] / 1e6:.1f} MB per call), GB/s (median of {args.reps})")
    print("layout  " + "  ".join(f"{c.removesuffix('_gbps'):>18}" for c in cols))
    for r in res["rows"]:
        print(f"{r['layout']:<7} " + "  ".join(f"{r[c]:>18.2f}" for c in cols))


if __name__ == "__main__":
    main()
