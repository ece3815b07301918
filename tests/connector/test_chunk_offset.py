"""The chunk-offset owner rule: a load that starts at chunk f keeps chunk c on rank c mod W."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


pytestmark = pytest.mark.engine

SHAPE = (2, 3)


def offset_worker(rank, world, first, n_abs, fail_abs, mode):
    from kvctl.connector.protocol import load_agreed_prefix

    keys = [f"k{c}" for c in range(first, n_abs)]  # local index i = absolute chunk first + i
    asked = []

    def fetch(indexes):
        asked.extend(indexes)
        out = []
        for i in indexes:
            c = first + i
            out.append(None if c == fail_abs else torch.full(SHAPE, float(c)))
        return out

    res = load_agreed_prefix(None, keys, fetch, SHAPE, torch.float32, mode=mode, first_chunk=first)
    return {"asked_abs": [first + i for i in asked], "prefix": res.prefix,
            "values": [float(t[0, 0]) for t in res.chunks]}


@pytest.mark.parametrize("world,first,mode", [(2, 1, "per_owner"), (3, 2, "all_gather"), (3, 4, "per_chunk"),
                                              (2, 3, "all_gather")])
def test_offset_keeps_owner_and_order(world, first, mode, rank_pool):
    n_abs = first + 7
    out = rank_pool(world).run(offset_worker, (first, n_abs, -1, mode), timeout_s=60)
    for r, res in enumerate(out):
        # every rank fetches exactly the absolute chunks it owns (c % W == r), as stored
        assert res["asked_abs"] == [c for c in range(first, n_abs) if c % world == r]
        assert res["prefix"] == 7
        assert res["values"] == [float(c) for c in range(first, n_abs)]


def test_offset_failure_at_an_absolute_chunk(rank_pool):
    # W=3, load chunks 2..9; chunk 6 (owner 0) missing -> chunks 2..5 agreed: prefix 4
    out = rank_pool(3).run(offset_worker, (2, 10, 6, "per_owner"), timeout_s=60)
    for res in out:
        assert res["prefix"] == 4
        assert res["values"] == [2.0, 3.0, 4.0, 5.0]
