"""The load group the engine connector creates, in a world of several TP groups (DP > 1).

With data parallelism vLLM puts every DP replica's ranks into one
``torch.distributed`` world, so each TP group is a strict subset of it. The
connector builds a group of its own for background loads on the members of
its TP group only; a plain ``new_group`` is a collective over the whole world
and, called by each TP group for its own ranks, hangs or mixes the groups up.
These tests run a real gloo world of 4 processes (DP=2 x TP=2) on loopback.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


pytestmark = pytest.mark.engine

TP = 2


def dp_tp_worker(rank: int, world: int) -> dict:
    import time

    import torch.distributed as dist

    from kvctl.connector.protocol import member_group

    tp_groups = [list(range(s, s + TP)) for s in range(0, world, TP)]  # [[0, 1], [2, 3]]
    mine = tp_groups[rank // TP]
    # vLLM first builds every TP group on every rank, in one order (its own cpu groups)
    engine_groups = [dist.new_group(ranks=g, backend="gloo") for g in tp_groups]
    engine_group = engine_groups[rank // TP]
    # then each rank's connector builds its load group, for its own TP group only. Nothing in vLLM
    # lines the ranks up here; in this run the replicas' first ranks arrive together, their second
    # ranks a moment later
    dist.barrier()
    time.sleep(1.5 * (rank % TP))
    load_group = member_group(mine)
    second = member_group(mine)  # a second connector in the same process gets a group of its own
    out = {"ranks": dist.get_process_group_ranks(load_group), "size": dist.get_world_size(load_group),
           "group_rank": dist.get_rank(load_group)}
    for name, g in (("load", load_group), ("second", second), ("engine", engine_group), ("world", None)):
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=g)
        out[name] = t.item()
    return out


def test_load_groups_of_two_tp_groups_in_one_world_stay_apart(rank_pool):
    out = rank_pool(4).run(dp_tp_worker, (), timeout_s=45)
    # all_reduce sums rank + 1 over the group: TP group [0, 1] -> 1 + 2 = 3, [2, 3] -> 3 + 4 = 7,
    # the whole world -> 1 + 2 + 3 + 4 = 10
    for rank, o in enumerate(out):
        expected = 3.0 if rank < 2 else 7.0
        assert o["ranks"] == ([0, 1] if rank < 2 else [2, 3]), (rank, o)
        assert o["size"] == 2 and o["group_rank"] == rank % 2, (rank, o)
        assert (o["load"], o["second"], o["engine"], o["world"]) == (expected, expected, expected, 10.0), (rank, o)
