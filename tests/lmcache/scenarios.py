"""Scenarios that run inside the LMCache environment and report what they saw as JSON.

LMCache 0.5.6 lives in its own venv (``make lmcache-venv``, docs/engine.md, "The LMCache
path"), so the tests in the main venv run these through
:func:`tests.lmcache.lmcache_env.run_scenario`:

    python -m tests.lmcache.scenarios NAME  < args.json   # prints "RESULT {json}" last

Each scenario builds LMCache's own objects (engine config from a dict,
``LMCacheMetadata``, a CPU ``LocalCPUBackend`` and the ``RemoteBackend`` that
loads the plugin through ``remote_storage_plugins``), drives them against the
real Valkey servers the test started, and returns raw observations; the
assertions are the test's.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from typing import Any

RESULT_PREFIX = "RESULT "


def _lmcache_objects(config: dict | str, worker_id: int, world_size: int, use_mla: bool, chunk_size: int, plugin: str | None):
    import torch  # noqa: PLC0415
    from lmcache.v1.config import LMCacheEngineConfig  # noqa: PLC0415
    from lmcache.v1.storage_backend.remote_backend import RemoteBackend  # noqa: PLC0415

    if isinstance(config, str):  # a YAML file, through LMCache's own loader
        from lmcache.v1.config import load_engine_config_with_overrides  # noqa: PLC0415

        cfg = load_engine_config_with_overrides(config_file_path=config, overrides={"max_local_cpu_size": 0.01})
        chunk_size = cfg.chunk_size
    else:
        cfg = LMCacheEngineConfig.from_dict(dict({"chunk_size": chunk_size, "local_cpu": True, "max_local_cpu_size": 0.01}, **config))
    # 2 layers x chunk_size tokens x 8 values (GQA: K and V, MLA: one latent row) in bf16
    md, local = _local_backend(cfg, (2, 1 if use_mla else 2, chunk_size, 1, 8), torch.bfloat16, worker_id, world_size)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True, name="lmcache-loop").start()
    remote = RemoteBackend(cfg, md, loop, local, dst_device="cpu", plugin_name=plugin)
    return cfg, md, local, loop, remote


def _local_backend(cfg, kv_shape, dtype, worker_id: int = 0, world_size: int = 1):
    from lmcache.v1.metadata import LMCacheMetadata  # noqa: PLC0415
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend  # noqa: PLC0415

    md = LMCacheMetadata(model_name="tiny", world_size=world_size, local_world_size=world_size, worker_id=worker_id,
                         local_worker_id=worker_id, kv_dtype=dtype, kv_shape=kv_shape, use_mla=kv_shape[1] == 1,
                         chunk_size=kv_shape[2])
    return md, LocalCPUBackend(cfg, md, dst_device="cpu")


def cpu_connector_layouts(args: dict[str, Any]) -> dict[str, Any]:
    """kvctl's CpuKVConnector between hand-filled vLLM-cpu caches and LMCache memory objects.

    Caches hold value = layer*10000 + slot*100 + position (MLA), or
    layer*10000 + block*1000 + head*100 + kv*50 + offset*2 + d (GQA, d < 2):
    exact in float32, so every element says where it came from. Tokens 0..23
    of the request live in blocks [3, 1] (block size 16): slots 48..63, 16..23.
    """
    import torch  # noqa: PLC0415
    from lmcache.v1.memory_management import MemoryFormat  # noqa: PLC0415

    from lmcache.v1.config import LMCacheEngineConfig  # noqa: PLC0415

    from kvctl.plugins.lmcache_cpu import CpuKVConnector  # noqa: PLC0415

    bs, layers, n = 16, 2, 24
    slot_mapping = torch.tensor([48 + i for i in range(16)] + [16 + i for i in range(8)], dtype=torch.long)
    out: dict[str, Any] = {}
    for mla in (True, False):
        heads, hs = (1, 4) if mla else (2, 2)
        md_shape = (layers, 1 if mla else 2, n, heads, hs)
        conn = CpuKVConnector(layers, heads, hs, bs, mla)
        if mla:
            caches = [torch.tensor([[layer * 10000 + s * 100 + j for j in range(hs)] for s in range(4 * bs)],
                                   dtype=torch.float32).view(4, bs, hs) for layer in range(layers)]
        else:
            caches = [torch.tensor([[[[[layer * 10000 + b * 1000 + h * 100 + kv * 50 + o * 2 + d for d in range(hs)]
                                       for o in range(bs)] for kv in range(2)] for h in range(heads)] for b in range(4)],
                                   dtype=torch.float32) for layer in range(layers)]
        fmt = MemoryFormat.KV_MLA_FMT if mla else MemoryFormat.KV_2LTD
        cfg = LMCacheEngineConfig.from_dict({"chunk_size": n, "local_cpu": True, "max_local_cpu_size": 0.01})
        md, local = _local_backend(cfg, md_shape, torch.float32)
        obj = local.allocate(md.get_shapes(n), md.get_dtypes(), MemoryFormat.KV_2LTD)
        obj.tensor.zero_()
        conn.from_gpu(obj, 0, n, kvcaches=caches, slot_mapping=slot_mapping)
        name = "mla" if mla else "gqa"
        out[f"{name}_fmt_after_from_gpu"] = str(obj.metadata.fmt)
        out[f"{name}_shape"] = list(obj.tensor.shape)
        out[f"{name}_obj"] = obj.tensor.tolist()
        # back into zeroed caches, the first 5 tokens already in vLLM's cache (left alone)
        empty = [torch.zeros_like(c) for c in caches]
        obj.metadata.fmt = fmt
        conn.to_gpu(obj, 0, n, kvcaches=empty, slot_mapping=slot_mapping, vllm_cached_tokens=5)
        out[f"{name}_back"] = [c.tolist() for c in empty]
        out[f"{name}_lmcache_shape"] = [list(x) for x in md.get_shapes(n)]
    return out


def _key(md, chunk_hash: int):
    import torch  # noqa: PLC0415
    from lmcache.utils import CacheEngineKey  # noqa: PLC0415

    return CacheEngineKey(md.model_name, md.world_size, md.worker_id, chunk_hash, torch.bfloat16)


def _filled(local, conn, value: float):
    obj = local.allocate(conn.meta_shapes, conn.meta_dtypes, conn.meta_fmt)
    obj.tensor.fill_(value)
    return obj


def _run(loop, coro, timeout_s: float = 30.0):
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout_s)


def plugin_roundtrip(args: dict[str, Any]) -> dict[str, Any]:
    """Store three chunks through the plugin, then look up and read them back with a missing key in between."""
    cfg, md, local, loop, remote = _lmcache_objects(args["config"], args["worker_id"], args["world_size"],
                                                    args.get("use_mla", False), args.get("chunk_size", 16), "kvctl")
    out: dict[str, Any] = {"connection": repr(remote.connection)}
    if remote.connection is None:
        return out
    conn = remote.connection.getWrappedConnector()
    active = lambda: local.memory_allocator.pin_allocator.num_active_allocations  # noqa: E731
    stored = [_key(md, h) for h in (101, 102, 103)]
    missing = _key(md, 999)
    objs = [_filled(local, conn, v) for v in (1.0, 2.0, 3.0)]
    _run(loop, conn.batched_put(stored, objs))
    _run(loop, conn.put(_key(md, 104), objs[0]))
    for o in objs:
        o.ref_count_down()
    out["stored_keys"] = [k.to_string() for k in stored + [_key(md, 104)]]
    out["full_chunk_bytes"] = conn.full_chunk_size_bytes
    out["active_before"] = active()
    out["batched_contains"] = conn.batched_contains([stored[0], stored[1], missing, stored[2]])
    out["backend_batched_contains"] = remote.batched_contains([stored[0], stored[1], missing, stored[2]])
    out["async_contains"] = _run(loop, conn.batched_async_contains("l1", [stored[0], missing, stored[1]]))
    out["exists"] = [conn.exists_sync(stored[2]), conn.exists_sync(missing), _run(loop, conn.exists(stored[0]))]
    t0 = time.monotonic()
    miss = _run(loop, conn.get(missing))
    out["get_missing_s"] = time.monotonic() - t0
    out["get_missing"] = None if miss is None else "object"
    got = _run(loop, conn.batched_get([stored[0], missing, stored[2]]))
    out["batched_get"] = [None if o is None else float(o.tensor.float().mean()) for o in got]
    for o in got:
        if o is not None:
            o.ref_count_down()
    prefix = _run(loop, conn.batched_get_non_blocking("l2", [stored[1], stored[0], missing, stored[2]]))
    out["non_blocking_prefix"] = [float(o.tensor.float().mean()) for o in prefix]
    for o in prefix:
        o.ref_count_down()
    blocking = remote.get_blocking(stored[1])
    out["backend_get_blocking"] = None if blocking is None else float(blocking.tensor.float().mean())
    if blocking is not None:
        blocking.ref_count_down()
    out["active_after"] = active()
    out["remove"] = [conn.remove_sync(stored[2]), conn.remove_sync(stored[2])]
    out["ping"] = _run(loop, conn.ping())
    out["errors"] = conn.errors
    _run(loop, conn.close())
    return out


def plugin_dead_server(args: dict[str, Any]) -> dict[str, Any]:
    """Every call against a port nobody answers on is a miss (or a dropped store) within the deadline."""
    cfg, md, local, loop, remote = _lmcache_objects(args["config"], 0, 1, False, 16, "kvctl")
    conn = remote.connection.getWrappedConnector()
    key = _key(md, 7)
    obj = _filled(local, conn, 1.0)
    t0 = time.monotonic()
    _run(loop, conn.put(key, obj))
    out = {
        "contains": conn.batched_contains([key]),
        "get": None if _run(loop, conn.get(key)) is None else "object",
        "batched_get": [o for o in _run(loop, conn.batched_get([key, key]))],
        "ping": _run(loop, conn.ping()),
    }
    out["elapsed_s"] = time.monotonic() - t0
    out["errors"] = conn.errors
    obj.ref_count_down()
    return out


def plugin_decision(args: dict[str, Any]) -> dict[str, Any]:
    """Load or recompute in the plugin (issue 46 item 5): what its contains answers report, before and after its
    GETs measured the tier, through LMCache's own RemoteBackend."""
    cfg, md, local, loop, remote = _lmcache_objects(args["config"], 0, 1, False, 16, "kvctl")
    conn = remote.connection.getWrappedConnector()
    keys = [_key(md, h) for h in (201, 202, 203, 204)]
    objs = [_filled(local, conn, 1.0) for _ in keys]
    _run(loop, conn.batched_put(keys, objs))
    for o in objs:
        o.ref_count_down()
    out: dict[str, Any] = {"before": remote.batched_contains(keys),
                           "async_before": _run(loop, conn.batched_async_contains("d1", keys))}
    got = _run(loop, conn.batched_get(keys))  # LMCache's load of the hit: the plugin times it
    for o in got:
        if o is not None:
            o.ref_count_down()
    out["after"] = remote.batched_contains(keys)
    out["async_after"] = _run(loop, conn.batched_async_contains("d2", keys))
    out["decisions"] = {f"{d}/{r}": n for (d, r), n in conn.decisions.items()}
    _run(loop, conn.close())
    return out


def native_resp_get_missing(args: dict[str, Any]) -> dict[str, Any]:
    """LMCache's own ``resp://`` client: GET of a stored key, then of a missing one (prints progress as it goes)."""
    cfg, md, local, loop, remote = _lmcache_objects({"remote_url": args["url"], "remote_serde": "naive"}, 0, 1, False, 16, None)
    conn = remote.connection.getWrappedConnector()
    key, missing = _key(md, 1), _key(md, 2)
    obj = _filled(local, conn, 5.0)
    _run(loop, conn.put(key, obj))
    got = _run(loop, conn.get(key))
    _emit("progress", {"stored_get": float(got.tensor.float().mean())})
    t0 = time.monotonic()
    res = _run(loop, conn.get(missing), timeout_s=args["wait_s"] + 60)
    return {"missing_returned_after_s": time.monotonic() - t0, "missing": None if res is None else "object"}


def validate_config_file(args: dict[str, Any]) -> dict[str, Any]:
    """Load a YAML file with LMCache's own loader and report what it made of the remote settings."""
    from lmcache.v1.config import load_engine_config_with_overrides  # noqa: PLC0415

    cfg = load_engine_config_with_overrides(config_file_path=args["path"])
    return {"remote_url": cfg.remote_url, "remote_storage_plugins": cfg.remote_storage_plugins,
            "extra_config": cfg.extra_config, "chunk_size": cfg.chunk_size,
            "enable_async_loading": cfg.enable_async_loading, "save_unfull_chunk": cfg.save_unfull_chunk,
            "max_local_cpu_size": cfg.max_local_cpu_size}


def chunk_key_names(args: dict[str, Any]) -> dict[str, Any]:
    """LMCache's own key names for a prompt's chunks (its ChunkedTokenDatabase, worker 0), in chunk order.

    Run with the engine's PYTHONHASHSEED (run_scenario sets 0, as the engine tests do): LMCache hashes
    chunks with Python's hash when vLLM's hash cannot be loaded.
    """
    import torch  # noqa: PLC0415
    from lmcache.v1.cache_engine import LMCacheEngineBuilder  # noqa: PLC0415
    from lmcache.v1.config import LMCacheEngineConfig  # noqa: PLC0415
    from lmcache.v1.metadata import LMCacheMetadata  # noqa: PLC0415

    # shard mode saves from every rank: LMCache then keeps the real world size in the key (token_database.py:238-243)
    cfg = LMCacheEngineConfig.from_dict({"chunk_size": args["chunk_size"],
                                         "extra_config": {"save_only_first_rank": args.get("save_only_first_rank", False)}})
    md = LMCacheMetadata(model_name=args["model"], world_size=args["world_size"], local_world_size=args["world_size"],
                         worker_id=0, local_worker_id=0, kv_dtype=torch.bfloat16,
                         kv_shape=(2, 1, args["chunk_size"], 1, 576), use_mla=True, chunk_size=args["chunk_size"])
    db = LMCacheEngineBuilder._Create_token_database(cfg, md)
    return {"keys": [[start, end, key.to_string()] for start, end, key in db.process_tokens(tokens=args["token_ids"])]}


def shard_key_coverage(args: dict[str, Any]) -> dict[str, Any]:
    """What LMCache's stock keys and kvctl shard mode's keys cover: the same prompt with two images
    (LMCache's adapter substitutes placeholder tokens from the image hash) and with two ``lmcache.tag.*``
    request configs, through LMCache's own token database and through shard mode's wrapper of it."""
    import inspect  # noqa: PLC0415

    import torch  # noqa: PLC0415
    from lmcache.integration.vllm.utils import apply_mm_hashes_to_token_ids  # noqa: PLC0415
    from lmcache.v1.cache_engine import LMCacheEngineBuilder  # noqa: PLC0415
    from lmcache.v1.config import LMCacheEngineConfig  # noqa: PLC0415
    from lmcache.v1.metadata import LMCacheMetadata  # noqa: PLC0415
    from vllm.multimodal.inputs import PlaceholderRange  # noqa: PLC0415

    from kvctl.plugins.lmcache_shard import _OwnedChunks  # noqa: PLC0415

    ct = 16
    cfg = LMCacheEngineConfig.from_dict({"chunk_size": ct, "extra_config": {"save_only_first_rank": False}})
    md = LMCacheMetadata(model_name="m", world_size=2, local_world_size=2, worker_id=1, local_worker_id=1,
                         kv_dtype=torch.bfloat16, kv_shape=(2, 1, ct, 1, 576), use_mla=True, chunk_size=ct)
    stock = LMCacheEngineBuilder._Create_token_database(cfg, md)
    shard = _OwnedChunks(stock, 1, 2, ct)
    text = list(range(100, 164))  # 4 chunks; an image's placeholder at tokens 20..27 (chunk 1)

    def prompt(image: str | None) -> torch.Tensor:
        t = torch.tensor(text, dtype=torch.long)
        return apply_mm_hashes_to_token_ids(t, [image], [PlaceholderRange(offset=20, length=8)]) if image else t

    out: dict[str, Any] = {"process_tokens_params": sorted(inspect.signature(stock.process_tokens).parameters)}
    cases = {"plain": (None, None), "red": ("img-red", None), "blue": ("img-blue", None),
             "tag_a": (None, {"lmcache.tag.tenant": "a"}), "tag_b": (None, {"lmcache.tag.tenant": "b"})}
    for name, (image, configs) in cases.items():
        for label, db in (("stock", stock), ("shard", shard)):
            keys = db.process_tokens(tokens=prompt(image), request_configs=configs)
            out[f"{label}_{name}"] = [key.to_string() for _, _, key in keys]
    return out


def shard_prepare(args: dict[str, Any]) -> dict[str, Any]:
    """kvctl shard mode's config preparation on LMCache's own config objects: the refusals and the result."""
    from lmcache.v1.config import LMCacheEngineConfig  # noqa: PLC0415

    from kvctl.plugins.lmcache_shard import ShardModeError, prepare_config  # noqa: PLC0415

    cases = {
        "ok": ({}, (2, 1, True)),
        "async": ({"enable_async_loading": True}, (2, 1, True)),
        "layerwise": ({"use_layerwise": True}, (2, 1, True)),
        "unfull": ({"save_unfull_chunk": True}, (2, 1, True)),
        "gqa": ({}, (2, 1, False)),
        "pipeline": ({}, (4, 2, True)),
        "sparse": ({}, (2, 1, True)),  # MLA with a sparse-attention indexer (GLM-5)
    }
    out: dict[str, Any] = {}
    for name, (settings, (world, pp, mla)) in cases.items():
        cfg = LMCacheEngineConfig.from_dict(dict({"chunk_size": 64, "extra_config": {"keep": 1}}, **settings))
        try:
            prepare_config(cfg, world, pp, mla, sparse_indexer=name == "sparse")
        except ShardModeError as exc:
            out[name] = str(exc)
        else:
            out[name] = {"extra_config": cfg.extra_config, "lookup_server_worker_ids": cfg.lookup_server_worker_ids,
                         "mla_lookup_servers": cfg.get_lookup_server_worker_ids(True, world)}
    return out


def _emit(kind: str, payload: dict) -> None:
    print(f"{kind.upper()} {json.dumps(payload)}", flush=True)


SCENARIOS = {f.__name__: f for f in (plugin_roundtrip, plugin_dead_server, plugin_decision, native_resp_get_missing,
                                     validate_config_file,
                                     cpu_connector_layouts, chunk_key_names, shard_key_coverage, shard_prepare)}


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[1] not in SCENARIOS:
        print(f"usage: python -m tests.lmcache.scenarios {{{','.join(SCENARIOS)}}} < args.json", file=sys.stderr)
        return 2
    result = SCENARIOS[argv[1]](json.loads(sys.stdin.read() or "{}"))
    _emit("result", result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
