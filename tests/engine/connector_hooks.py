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


def delete_marked_chunk(rank: int, keys: list[str], first_chunk: int, url: str, world_size: int = 2) -> None:
    marker = os.environ.get("KVCTL_TEST_DELETE_CHUNK_FILE")
    if not marker or not Path(marker).exists():
        return
    chunk = int(Path(marker).read_text().strip())
    if chunk % world_size != rank or chunk >= len(keys) or chunk < first_chunk:
        return
    with RespClient(url, timeout_s=2.0) as client:
        client.delete([keys[chunk]])
    Path(marker).unlink()
