"""Test hook for kvctl's LMCache RESP plugin: delete one chunk between LMCache's lookup and its GET.

Set in the engine's environment:
    KVCTL_LMCACHE_BEFORE_GET_HOOK=tests.lmcache.plugin_hooks:delete_planned
    KVCTL_TEST_LMCACHE_FAULT_PLAN=/path/plan.json

The plan is JSON {"delete_index": i}: the i-th key the plugin GETs from the moment the plan is written (counted
over its GET calls, in order: LMCache may fetch a prompt's chunks in one call or several) is deleted from its
instance (a real DEL) just before that GET goes out. The plan then becomes ``plan.json.done`` with the deleted
key and DEL's count; one deletion per plan. Without a plan file the hook does nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvctl.connector.resp import RespClient


def delete_planned(rank: int, names: list[str], urls: list[str]) -> None:
    plan_path = os.environ.get("KVCTL_TEST_LMCACHE_FAULT_PLAN")
    if not plan_path or not Path(plan_path).exists():
        return
    plan = json.loads(Path(plan_path).read_text())
    seen, index = plan.get("seen", 0), plan["delete_index"]
    if seen + len(names) <= index:  # the key to delete is in a later call
        Path(plan_path).write_text(json.dumps(dict(plan, seen=seen + len(names))))
        return
    name, url = names[index - seen], urls[index - seen]
    with RespClient(url, timeout_s=5.0) as client:
        count = client.delete([name])
    Path(plan_path).write_text(json.dumps(dict(plan, deleted=name, count=count, rank=rank)))
    Path(plan_path).rename(plan_path + ".done")
