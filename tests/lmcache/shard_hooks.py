"""Test hook for kvctl's LMCache shard mode: delete one chunk between the scheduler's lookup and the load.

Set in the engine's environment:
    KVCTL_LMCACHE_BEFORE_RETRIEVE_HOOK=tests.lmcache.shard_hooks:delete_marked_chunk
    KVCTL_TEST_DELETE_CHUNK_FILE=/path/marker

The marker is JSON {"chunk": c, "chunk_tokens": n, "world": W, "url": owner's instance URL}. The owner rank
of chunk c deletes it from its instance at the start of the next retrieve that includes it, then removes
the marker (one deletion). Every other call does nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvctl.connector.resp import RespClient


def delete_marked_chunk(rank: int, chunks: list) -> None:
    marker = os.environ.get("KVCTL_TEST_DELETE_CHUNK_FILE")
    if not marker or not Path(marker).exists():
        return
    spec = json.loads(Path(marker).read_text())
    if rank != spec["chunk"] % spec["world"]:
        return
    for key, start, _end in chunks:
        if start // spec["chunk_tokens"] == spec["chunk"]:
            with RespClient(spec["url"], timeout_s=5.0) as client:
                deleted = client.delete([key.to_string()])
            Path(marker).write_text(json.dumps(dict(spec, deleted=key.to_string(), count=deleted)))
            Path(marker).rename(marker + ".done")
            return
