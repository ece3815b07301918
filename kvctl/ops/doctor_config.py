"""``kvctl doctor``'s reads of a deployment's own records: the saved diagnosis of the tier it checks, and the keys of
its configs that their readers do not know.

Library code: no click, nothing printed.
"""

from __future__ import annotations

from typing import Any, Sequence

from kvctl.connector import unknown_keys as engine_keys
from kvctl.core.errors import KvctlError
from kvctl.diagnose import saved
from kvctl.loading import edit as loading
from kvctl.loading import tier_of
from kvctl.tier.checks import FAIL, WARNING, Check
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
