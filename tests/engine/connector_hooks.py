"""Test hooks loaded INSIDE the engine's worker processes (KVCTL_CONNECTOR_BEFORE_LOAD_HOOK).

``delete_marked_chunk`` runs on every rank just before a load fetches its
chunks, i.e. after the scheduler's lookup found them. When the file named by
``KVCTL_TEST_DELETE_CHUNK_FILE`` exists and holds an absolute chunk index c,
the rank that owns c deletes c's key from its own Valkey instance with a real
DEL, then removes the file (so it fires once). The load then misses c.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvctl.connector.resp import RespClient


def _delete_chunk(url: str, key: str) -> None:
    """DEL chunk ``key`` on ``url`` with every part it is stored as (a sparse chunk's, layer groups'): a part's key
    is ``{model}@{fmt}/{part}@w0@{digest}`` with the chunk's digest (kvctl.connector.ownership.part_key)."""
    import redis

    from kvctl.connector.urls import parse_resp_url

    model, fmt, worker, digest = key.split("@")
    u = parse_resp_url(url)
    r = redis.Redis(host=u.host, port=u.port, db=u.db, username=u.username, password=u.password, socket_timeout=2.0)
    try:
        parts = list(r.scan_iter(match=f"{model}@{fmt}/*@{worker}@{digest}", count=1000))
        r.delete(key, *parts)
    finally:
        r.close()


def delete_marked_chunk(rank: int, keys: list[str], first_chunk: int, url: str, world_size: int = 2) -> None:
    marker = os.environ.get("KVCTL_TEST_DELETE_CHUNK_FILE")
    if not marker or not Path(marker).exists():
        return
    chunk = int(Path(marker).read_text().strip())
    if chunk % world_size != rank or chunk >= len(keys) or chunk < first_chunk:
        return
    _delete_chunk(url, keys[chunk])
    Path(marker).unlink()


def fault_plan(rank: int, keys: list[str], first_chunk: int, url: str, world_size: int = 1) -> None:
    """Faults for the lab's engine tests (tests/engine/lab_chains.py), keyed by the load's first chunk key.

    ``KVCTL_TEST_FAULT_PLAN`` names a JSON file ``{"delete": {key0: chunk}, "kill": {key0: pid},
    "delete_part": {key0: [chunk, part]}}``: a load whose prompt's chunk-0 key is in ``delete`` loses
    that chunk's key on its owner (a real DEL) just before it fetches; one in ``delete_part`` loses one
    part of a two-part chunk (``part_key``: a sparse-MLA chunk's indexer part, "idx"); one in ``kill``
    SIGKILLs the Valkey process ``pid`` (one the test started) just before it fetches. Each entry fires
    once (it is removed from the file).
    """
    import json
    import signal

    plan_path = os.environ.get("KVCTL_TEST_FAULT_PLAN")
    if not plan_path or not Path(plan_path).exists() or not keys:
        return
    plan = json.loads(Path(plan_path).read_text())
    key0 = keys[0]
    chunk = plan.get("delete", {}).pop(key0, None)
    pid = plan.get("kill", {}).pop(key0, None)
    half = plan.get("delete_part", {}).pop(key0, None)
    if chunk is None and pid is None and half is None:
        return
    Path(plan_path).write_text(json.dumps(plan))
    if chunk is not None and chunk % world_size == rank and chunk < len(keys):
        _delete_chunk(url, keys[chunk])
    if half is not None and half[0] % world_size == rank and half[0] < len(keys):
        from kvctl.connector.ownership import part_key

        with RespClient(url, timeout_s=2.0) as client:
            client.delete([part_key(keys[half[0]], half[1])])
    if pid is not None:
        os.kill(int(pid), signal.SIGKILL)
