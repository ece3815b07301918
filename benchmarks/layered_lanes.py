#!/usr/bin/env python3
"""A layered load's lanes, one unit per round trip against a chunk's worth, beside a forward that holds the GIL.

On an H200 (2026-12-05, ``results/engine_gpu_layered-h200-2026-12-05.json``) a hit loaded in 4 layer groups took
2.4x the serial load's GET time for the same bytes. The serial load GETs one whole chunk per round trip; the
layered one (``connector/pipeline.py``) one unit, a quarter of it, so it paid four times the round trips, lock
rounds, slot refills and copies per byte, each a point where a lane gives up the GIL and must take it back from
the forward's thread. Its lanes now take a chunk's worth of consecutive units of one group per round trip
(:meth:`PipelinedLoad._batch_units`); this measures both on CPU with the real pipeline and a real Valkey.

One rank (gloo), a DeepSeek-V2-Lite-shaped MLA chunk (``--layers`` x ``--chunk-tokens`` x 576 bf16), ``--chunks``
chunks stored in ``--groups`` groups on one local valkey-server; ``--lanes`` connections. Round by round, for
``--seconds``, alternating: units per round trip 1 or a chunk's worth, and the main thread either waiting for every
group at once (``idle``) or running ``--busy-ms`` of pure Python before each group's ``ensure`` (``busy``: the
forward's host side between layers). Prints the medians of the load's GET time (start to the last GET) and its
total, per mode, and the ratios of one unit to a chunk's worth.

    .venv/bin/python benchmarks/layered_lanes.py [--seconds 20] [--chunks 16] [--layers 27] [--groups 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BS, ROW = 16, 576
MODES = [(batch, main) for main in ("idle", "busy") for batch in ("unit", "chunk")]


def _busy(seconds: float) -> int:
    """Pure-Python work for ``seconds``: what the GIL sees of a forward's host side."""
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        for i in range(500):
            n += i * i % 7
    return n


def run(seconds: float, chunks: int, layers: int, chunk_tokens: int, groups: int, lanes: int, busy_ms: float) -> dict:
    import torch
    import torch.distributed as dist

    from kvctl.connector.datapath import KVDataPath, slots_for
    from kvctl.connector.kv_views import CacheSpec, build_caches
    from kvctl.connector.layer_groups import Plane, grouped
    from kvctl.connector.layouts import layout_for
    from kvctl.connector.pipeline import PipelinedLoad, begin
    from kvctl.connector.store import ShardedStore
    from kvctl.tier.server import start_valkey

    spec = CacheSpec(block_size=BS, num_kv_heads=1, head_size=ROW, dtype=torch.bfloat16, head_size_v=0)
    n_blocks = chunks * chunk_tokens // BS + 1

    def layout():
        _, views = build_caches(spec, "LBHNC", layers, n_blocks)
        return layout_for(views, spec, "LBHNC", "FLASHMLA", cache_dtype="auto")

    chunk_bytes = layers * chunk_tokens * ROW * 2
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
        maxmem = int(chunks * chunk_bytes * 1.5 / 1e6) + 64
        server = start_valkey(Path(tmp) / "valkey", settings={"maxmemory": f"{maxmem}mb", "io-threads": 2},
                              die_with_parent=True)
        try:
            src, dst = layout(), layout()
            g = grouped([Plane("", layers, chunk_bytes // (layers * chunk_tokens))], chunk_tokens, groups)

            def path(lay):
                store = ShardedStore(0, 1, [server.url], 0, lay.chunk_shape(chunk_tokens, 1), lay.dtype,
                                     chunk_tokens=chunk_tokens, model_name="bench", fmt=lay.fmt(1), timeout_s=30.0,
                                     connections=lanes, pool_size=lanes, parts=g.parts)
                return KVDataPath(store, lay, chunk_tokens=chunk_tokens, block_size=BS, group=None, device="cpu",
                                  grouping=g)

            tokens = list(range(1000, 1000 + chunks * chunk_tokens + 1))
            blocks = list(range(n_blocks))
            kv = torch.randn(src.chunk_shape(chunks * chunk_tokens, 1)).to(src.dtype)
            src.insert(slots_for(blocks, BS, 0, chunks * chunk_tokens), kv)
            save, load = path(src), path(dst)
            assert save.store_batch(save.extract(tokens, blocks, 0)).l2_chunks == chunks

            def one(batch: str, main: str) -> tuple[float, float]:
                PipelinedLoad.max_batch_units = 1 if batch == "unit" else None
                t0 = time.perf_counter()
                pipe = begin(load, tokens, blocks, 0, chunks)
                for grp in range(len(g.units)):
                    if main == "busy":
                        _busy(busy_ms / 1e3)
                    pipe.ensure(grp)
                out = pipe.finish()
                total = time.perf_counter() - t0
                if (out.agreed, out.written) != (chunks, chunks):
                    raise RuntimeError(f"{batch}/{main}: agreed {out.agreed}, written {out.written} of {chunks}")
                return out.timing.get_s, total

            one("chunk", "idle")  # warm-up: connections, staging
            got: dict[tuple[str, str], list[tuple[float, float]]] = {m: [] for m in MODES}
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                for m in MODES:
                    got[m].append(one(*m))
            moved = dst.extract(slots_for(blocks, BS, 0, chunks * chunk_tokens))
            if not torch.equal(moved, kv):
                raise RuntimeError("the loaded KV differs from the stored KV")
            save.store.close()
            load.store.close()
            load.close()
        finally:
            PipelinedLoad.max_batch_units = None
            server.stop()
            dist.destroy_process_group()
    med = {f"{b}/{m}": {"get_s": statistics.median(x[0] for x in v), "total_s": statistics.median(x[1] for x in v)}
           for (b, m), v in got.items()}
    mb = chunks * chunk_bytes / 1e6
    return {"chunks": chunks, "chunk_mb": chunk_bytes / 1e6, "groups": len(g.units), "lanes": lanes,
            "busy_ms": busy_ms, "rounds": len(got[MODES[0]]), "load_mb": mb, "medians": med,
            "unit_over_chunk_get": {m: med[f"unit/{m}"]["get_s"] / med[f"chunk/{m}"]["get_s"] for m in ("idle", "busy")}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--layers", type=int, default=27, help="DeepSeek-V2-Lite's 27: a 256-token chunk is 7.96 MB")
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--lanes", type=int, default=2, help="connections to the instance, one lane each")
    ap.add_argument("--busy-ms", type=float, default=5.0, help="Python work before each group's ensure (busy mode)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    out = run(a.seconds, a.chunks, a.layers, a.chunk_tokens, a.groups, a.lanes, a.busy_ms)
    if a.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"{out['chunks']} chunks of {out['chunk_mb']:.2f} MB in {out['groups']} groups, {out['lanes']} lanes, "
          f"{out['rounds']} rounds per mode, medians:")
    for key, v in out["medians"].items():
        print(f"  {key:<11} GETs {v['get_s'] * 1e3:7.1f} ms ({out['load_mb'] / v['get_s'] / 1e3:5.2f} GB/s)  "
              f"load {v['total_s'] * 1e3:7.1f} ms")
    for m, r in out["unit_over_chunk_get"].items():
        print(f"  one unit a round trip / a chunk's worth, GET time, main thread {m}: {r:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
