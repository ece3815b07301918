"""The tier's own settings, read from running instances: what multi-MB values need of Valkey.

``kvctl doctor``'s Valkey lines. Every instance is read once (``INFO all``, ``CONFIG GET *``, ``INFO
keyspace`` and a few random keys' lengths) and judged here, each line with its runbook anchor in
``kvctl runbook tier_settings``:

* ``maxmemory``, ``eviction_policy``: a limit, and a policy that evicts;
* ``policy_vs_ttl``: a ``volatile-*`` policy evicts only keys with a TTL. kvctl's connector
  (``connector/store.py`` calls ``batched_set`` without ``ttl_s``), its LMCache plugin
  (``plugins/lmcache.py``, the same) and LMCache 0.5.6's native ``resp://`` and ``redis://`` clients
  (``RESPConnector``/``RedisConnector``: plain SET) write none; only LMCache's ``valkey://`` connector
  with ``valkey_enable_ttl`` does. Their keys are never evicted: memory fills and writes are refused;
* ``persistence``: a cache has no RDB (``save ""``) and no AOF (``appendonly no``);
* ``io_threads``: the threads of the instances on this host (``io-threads`` counts the main thread)
  against its cores: not more than the cores, and (Valkey 9.x) not far fewer than ``deploy-valkey up`` gives them
  (:mod:`kvctl.tier.server_checks`); a remote host's cores are not checked;
* ``server_version``: Valkey 9.x, whose replies of large values skip a copy (else: move to 9.1 before adding
  instances; :mod:`kvctl.tier.server_checks`);
* ``proto_max_bulk_len``: at least one chunk, or every SET of a chunk is refused;
* ``output_buffer``: ``client-output-buffer-limit normal`` must not cut a batch of multi-MB replies;
* ``maxclients``: engines × ranks per instance × connections per rank, and room for kvctl's tools;
* ``fragmentation``, ``evictions_vs_hits``: RSS against the data; keys evicted against hits;
* ``transparent_huge_pages``: ``always`` (``/sys/kernel/mm/transparent_hugepage/enabled``) on the
  instance's own host, unless Valkey turns it off for itself (``disable-thp yes``); not checked remotely;
* ``value_size``: chunks above :data:`~kvctl.core.thresholds.LARGE_VALUE_BYTES`.

The chunk size is ``--chunk-bytes`` when given, else the largest of a few values sampled from the tier.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from kvctl.core.thresholds import (
    CLIENTS_NEAR_MAXCLIENTS,
    CONNECTIONS_PER_RANK,
    FRAGMENTATION_MIN_WASTE_BYTES,
    FRAGMENTATION_RATIO_HIGH,
    LARGE_VALUE_BYTES,
    MAXCLIENTS_HEADROOM,
    REPLY_BATCH_CHUNKS,
)
from kvctl.tier.admin import Admin
from kvctl.tier.check_types import FAIL, OK, RUNBOOK, SKIPPED, WARNING, Check, InstanceRead, runbook  # noqa: F401 - re-exported
from kvctl.tier.replies import is_keyspace, whole_number
from kvctl.tier.server import base_settings
from kvctl.tier.sizing import (  # noqa: F401 - doctor reads the cores through this module
    AVOID_COPY_DEFAULTS, ZERO_COPY_MAJOR, connections_for, copy_avoided, host_cores, io_threads_for, parse_version, up_command,
)
from kvctl.tier.spec import format_size, is_loopback
from kvctl.tier.server_checks import io_threads_too_few, server_version_check

THP_PATH = "/sys/kernel/mm/transparent_hugepage/enabled"
#: The eviction policy kvctl deploy-valkey writes (an evicting cache without persistence).
RECOMMENDED_POLICY = str(base_settings(0, "", Path("."))["maxmemory-policy"])
LRU_POLICIES = ("allkeys-lru", "allkeys-lfu", "volatile-lru", "volatile-lfu")
#: Random keys whose lengths are read to learn the chunk size when --chunk-bytes is not given.
SAMPLED_KEYS = 8
#: Bytes of the THP setting read (one short line).
THP_MAX_BYTES = 256


@dataclass(frozen=True)
class TierContext:
    """What the checks need besides the instances: the chunk size, how many engines and ranks use the tier."""

    chunk_bytes: int | None = None
    chunk_source: str = ""
    engines: int = 1
    engines_source: str = "default"
    world_size: int | None = None
    instances: int = 1
    cores: int = 1
    thp_path: str = THP_PATH


def read_instance(client: Admin, rank: int, host: str, port: int, instance: int = 0, instances_per_rank: int = 1) -> InstanceRead:
    """One instance's facts, all within ``client``'s one deadline, every reply typed (raises what :class:`Admin` raises)."""
    info = client.info("all")
    config = client.config_get("*")
    if (parse_version(info.get("valkey_version")) or (0,))[0] >= ZERO_COPY_MAJOR:  # hidden configs: by name only
        for name in AVOID_COPY_DEFAULTS:
            config.update(client.config_get(name))
    keys = expires = 0
    for name, value in info.items():
        if is_keyspace(name) and isinstance(value, dict):
            keys += int(value.get("keys", 0))
            expires += int(value.get("expires", 0))
    names = client.random_keys(SAMPLED_KEYS) if keys else []
    largest = _largest(client, names)
    return InstanceRead(rank, host, port, info, config, keys, expires, largest, instance, instances_per_rank,
                        tuple(n.decode("ascii", "replace") for n in names))


def largest_sampled_value(client: Admin, samples: int = SAMPLED_KEYS, skip_prefix: bytes | None = None) -> int | None:
    """Bytes of the largest string value among ``samples`` random keys (those starting ``skip_prefix`` left out):
    the tier's chunk size as its engines stored it; None when no key was sampled."""
    return _largest(client, [k for k in client.random_keys(samples) if not (skip_prefix and k.startswith(skip_prefix))])


def _largest(client: Admin, names: list[bytes]) -> int | None:
    lengths = [n for n in client.strlens(names) if n]
    return max(lengths) if lengths else None


def is_local(host: str) -> bool:
    """True when ``host`` is this machine: loopback, this host's name, or an address of one of its interfaces."""
    h = host.strip("[]")
    if is_loopback(h) or h == socket.gethostname():  # no DNS lookup: a broken resolver must not stall doctor
        return True
    try:
        import psutil  # noqa: PLC0415

        return any(a.address.split("%")[0] == h for addrs in psutil.net_if_addrs().values() for a in addrs)
    except (ImportError, OSError):
        return False


def chunk_size(reads: Sequence[InstanceRead], given: int | None) -> tuple[int | None, str]:
    """(chunk bytes, where the number comes from): --chunk-bytes, else the largest sampled value."""
    if given:
        return given, "--chunk-bytes"
    sampled = [r.largest_value for r in reads if r.largest_value]
    if sampled:
        return max(sampled), f"the largest of {SAMPLED_KEYS} random keys per instance"
    return None, ""


def _int(conf: dict[str, str], name: str) -> int | None:
    """A setting as a whole number >= 0 (int64), or None: absent, or not such a number (as the instance said it)."""
    return whole_number(conf.get(name))


# --- per instance ------------------------------------------------------------------------


def _memory(x: InstanceRead) -> list[Check]:
    ev = x.ident
    out = []
    maxmem = _int(x.config, "maxmemory") or 0
    if maxmem == 0:
        out.append(Check("valkey", "maxmemory", FAIL, f"{x.where} has no maxmemory: it grows until the host runs out of memory",
                         "set maxmemory (CONFIG SET maxmemory 64gb), as kvctl deploy-valkey up --maxmemory does", ev, runbook("maxmemory")))
    else:
        out.append(Check("valkey", "maxmemory", OK, f"{x.where} maxmemory {maxmem / 2**20:.0f} MiB", evidence={**ev, "maxmemory": maxmem}, runbook=runbook("maxmemory")))
    policy = x.config.get("maxmemory-policy", "")
    fix = f"CONFIG SET maxmemory-policy {RECOMMENDED_POLICY}"
    if policy not in LRU_POLICIES:
        out.append(Check("valkey", "eviction_policy", FAIL, f"{x.where} maxmemory-policy is {policy}: a full instance refuses writes or never frees cold chunks",
                         fix, {**ev, "policy": policy}, runbook("maxmemory")))
    elif policy != RECOMMENDED_POLICY:
        out.append(Check("valkey", "eviction_policy", WARNING, f"{x.where} maxmemory-policy {policy}: kvctl recommends {RECOMMENDED_POLICY} (chunks carry no TTL)",
                         fix, {**ev, "policy": policy}, runbook("maxmemory")))
    else:
        out.append(Check("valkey", "eviction_policy", OK, f"{x.where} maxmemory-policy {policy}", evidence=ev, runbook=runbook("maxmemory")))
    out.append(_policy_vs_ttl(x, policy))
    return out


def _policy_vs_ttl(x: InstanceRead, policy: str) -> Check:
    ev = {**x.ident, "policy": policy, "keys": x.keys, "keys_with_ttl": x.keys_with_ttl}
    fix = f"CONFIG SET maxmemory-policy {RECOMMENDED_POLICY} (evicts keys with or without a TTL)"
    if not policy.startswith("volatile-"):
        return Check("valkey", "policy_vs_ttl", OK, f"{x.where} {policy or 'no policy'} does not depend on key TTLs", evidence=ev, runbook=runbook("policy-vs-ttl"))
    writers = "kvctl's connector, its LMCache plugin and LMCache 0.5.6's resp:// and redis:// clients write chunks without a TTL"
    if x.keys > x.keys_with_ttl:
        return Check("valkey", "policy_vs_ttl", FAIL,
                     f"{x.where} {policy} evicts only keys with a TTL, and {x.keys - x.keys_with_ttl} of {x.keys} keys have none: "
                     "they are never evicted, memory fills and writes are refused (OOM)", fix, ev, runbook("policy-vs-ttl"))
    if x.keys == 0:
        return Check("valkey", "policy_vs_ttl", WARNING,
                     f"{x.where} {policy} evicts only keys with a TTL; the instance is empty, but {writers}: once written they are never evicted",
                     fix, ev, runbook("policy-vs-ttl"))
    return Check("valkey", "policy_vs_ttl", OK, f"{x.where} {policy}: every one of its {x.keys} keys carries a TTL (a writer that sets one, "
                 "e.g. LMCache's valkey:// with valkey_enable_ttl)", evidence=ev, runbook=runbook("policy-vs-ttl"))


def _persistence(x: InstanceRead) -> Check:
    conf = x.config
    persisting = ([f"save {conf['save']!r}"] if conf.get("save") else []) + (["appendonly yes"] if conf.get("appendonly") == "yes" else [])
    if persisting:
        return Check("valkey", "persistence", WARNING, f"{x.where} persists a cache ({', '.join(persisting)}): forks and disk writes stall GETs",
                     'CONFIG SET save "" and CONFIG SET appendonly no (kvctl deploy-valkey writes both)', x.ident, runbook("persistence"))
    return Check("valkey", "persistence", OK, f"{x.where} no persistence (a cache)", evidence=x.ident, runbook=runbook("persistence"))


def _bulk_len(x: InstanceRead, ctx: TierContext) -> Check:
    limit = _int(x.config, "proto-max-bulk-len")
    ev = {**x.ident, "proto_max_bulk_len": limit, "chunk_bytes": ctx.chunk_bytes}
    if limit is None:
        return Check("valkey", "proto_max_bulk_len", SKIPPED, f"{x.where} did not report proto-max-bulk-len", evidence=ev, runbook=runbook("proto-max-bulk-len"))
    if ctx.chunk_bytes is None:
        return Check("valkey", "proto_max_bulk_len", SKIPPED, f"{x.where} proto-max-bulk-len {format_size(limit)}; chunk size unknown (no key stored, no --chunk-bytes)",
                     evidence=ev, runbook=runbook("proto-max-bulk-len"))
    if ctx.chunk_bytes > limit:
        return Check("valkey", "proto_max_bulk_len", FAIL,
                     f"{x.where} proto-max-bulk-len {format_size(limit)} < one chunk ({format_size(ctx.chunk_bytes)}, {ctx.chunk_source}): every SET of a chunk is refused",
                     f"CONFIG SET proto-max-bulk-len {max(ctx.chunk_bytes * 2, 512 * 2**20)}", ev, runbook("proto-max-bulk-len"))
    return Check("valkey", "proto_max_bulk_len", OK, f"{x.where} proto-max-bulk-len {format_size(limit)} ≥ one chunk ({format_size(ctx.chunk_bytes)})",
                 evidence=ev, runbook=runbook("proto-max-bulk-len"))


def output_buffer_limit(value: str) -> tuple[int, int, int] | None:
    """(hard bytes, soft bytes, soft seconds) of the ``normal`` class in ``client-output-buffer-limit``, or None."""
    words = value.split()
    for i in range(0, len(words) - 3, 4):
        if words[i] == "normal":
            hard, soft, secs = (whole_number(w) for w in words[i + 1 : i + 4])
            return None if hard is None or soft is None or secs is None else (hard, soft, secs)
    return None


def _output_buffer(x: InstanceRead, ctx: TierContext) -> Check:
    raw = x.config.get("client-output-buffer-limit", "")
    normal = output_buffer_limit(raw)
    ev = {**x.ident, "normal": normal, "chunk_bytes": ctx.chunk_bytes, "batch_chunks": REPLY_BATCH_CHUNKS}
    anchor = runbook("client-output-buffer-limit")
    fix = "CONFIG SET client-output-buffer-limit 'normal 0 0 0' (no limit for normal clients, Valkey's default)"
    if normal is None:
        return Check("valkey", "output_buffer", SKIPPED, f"{x.where} did not report client-output-buffer-limit normal", evidence=ev, runbook=anchor)
    hard, soft, secs = normal
    limits = [b for b in (hard, soft) if b > 0]
    if not limits:
        return Check("valkey", "output_buffer", OK, f"{x.where} client-output-buffer-limit normal 0 0 0: replies are never cut", evidence=ev, runbook=anchor)
    shown = f"normal {hard} {soft} {secs}"
    version = x.info.get("valkey_version")
    if ctx.chunk_bytes is not None and copy_avoided(version, _int(x.config, "io-threads"), ctx.chunk_bytes, x.config):
        return Check("valkey", "output_buffer", OK,
                     f"{x.where} client-output-buffer-limit {shown}: Valkey {version} writes replies of {format_size(ctx.chunk_bytes)} chunks from "
                     "the values themselves (copy avoidance), so the limit counts a reference per chunk, not its bytes: batches are not cut",
                     evidence={**ev, "copy_avoided": True}, runbook=anchor)
    if ctx.chunk_bytes is None:
        return Check("valkey", "output_buffer", WARNING,
                     f"{x.where} client-output-buffer-limit {shown}: a client whose pending replies pass {format_size(min(limits))} is disconnected "
                     "(chunk size unknown: give --chunk-bytes to check it against a batch)", fix, ev, anchor)
    batch = ctx.chunk_bytes * REPLY_BATCH_CHUNKS
    if min(limits) < batch:
        return Check("valkey", "output_buffer", FAIL,
                     f"{x.where} client-output-buffer-limit {shown} < a batch of {REPLY_BATCH_CHUNKS} chunks ({format_size(batch)}): "
                     "batched GETs are cut off mid-reply and the client is disconnected", fix, ev, anchor)
    return Check("valkey", "output_buffer", OK, f"{x.where} client-output-buffer-limit {shown} ≥ a batch of {REPLY_BATCH_CHUNKS} chunks ({format_size(batch)})",
                 evidence=ev, runbook=anchor)


def connections_per_rank(io_threads: int | None = None) -> int:
    """Connections one engine rank opens to an instance: CONNECTIONS_PER_RANK, or more when the connector keeps one per
    I/O thread busy (connections_per_instance as vllm-config writes it, + 1 of the worker's pool for lookups and saves,
    + 2 for the scheduler's lookups)."""
    return max(CONNECTIONS_PER_RANK, connections_for(io_threads) + 3)


def clients_needed(ctx: TierContext, io_threads: int | None = None) -> tuple[int, int]:
    """(connections the engines open to one instance of ``io_threads``, that plus the headroom for kvctl's tools)."""
    world = ctx.world_size or ctx.instances
    ranks_per_instance = max(1, -(-world // max(1, ctx.instances)))
    engines = ctx.engines * ranks_per_instance * connections_per_rank(io_threads)
    return engines, engines + MAXCLIENTS_HEADROOM


def _maxclients(x: InstanceRead, ctx: TierContext) -> Check:
    limit = _int(x.config, "maxclients")
    connected = int(x.info.get("connected_clients", 0))
    threads = _int(x.config, "io-threads")
    engines, needed = clients_needed(ctx, threads)
    ev = {**x.ident, "maxclients": limit, "needed": needed, "connected": connected, "engines": ctx.engines}
    anchor = runbook("maxclients")
    how = (f"{ctx.engines} engine(s) ({ctx.engines_source}) × {max(1, -(-(ctx.world_size or ctx.instances) // max(1, ctx.instances)))} rank(s) per instance "
           f"× {connections_per_rank(threads)} connections = {engines}, + {MAXCLIENTS_HEADROOM} for kvctl's tools")
    if limit is None:
        return Check("valkey", "maxclients", SKIPPED, f"{x.where} did not report maxclients", evidence=ev, runbook=anchor)
    if limit < needed:
        return Check("valkey", "maxclients", FAIL, f"{x.where} maxclients {limit} < {needed} ({how}): connections past it are refused",
                     f"CONFIG SET maxclients {max(needed * 2, 10000)}", ev, anchor)
    if connected >= CLIENTS_NEAR_MAXCLIENTS * limit:
        return Check("valkey", "maxclients", WARNING, f"{x.where} {connected} of maxclients {limit} connected: new connections are refused soon",
                     f"CONFIG SET maxclients {limit * 2}; find who holds the connections (CLIENT LIST)", ev, anchor)
    return Check("valkey", "maxclients", OK, f"{x.where} maxclients {limit} ≥ {needed} ({how})", evidence=ev, runbook=anchor)


def _fragmentation(x: InstanceRead) -> Check:
    used, rss = int(x.info.get("used_memory", 0)), int(x.info.get("used_memory_rss", 0))
    ratio = rss / used if used else None
    ev = {**x.ident, "used_memory": used, "used_memory_rss": rss, "ratio": None if ratio is None else round(ratio, 2)}
    anchor = runbook("fragmentation")
    if ratio is not None and ratio >= FRAGMENTATION_RATIO_HIGH and rss - used >= FRAGMENTATION_MIN_WASTE_BYTES:
        allocator = str(x.info.get("mem_allocator") or "")
        restart = "restart the instance at a quiet hour (a cache loses only its contents)"
        fix = (f"CONFIG SET activedefrag yes, or {restart}" if allocator.startswith("jemalloc") else  # Valkey's defrag needs its jemalloc
               f"{restart}; this server's allocator ({allocator or 'unknown'}) has no active defragmentation (activedefrag needs jemalloc)")
        return Check("valkey", "fragmentation", WARNING,
                     f"{x.where} RSS {format_size(rss)} is {ratio:.1f}× its data ({format_size(used)}): fragmentation holds {format_size(rss - used)} "
                     "that maxmemory does not count", fix, {**ev, "mem_allocator": allocator or None}, anchor)
    return Check("valkey", "fragmentation", OK, f"{x.where} RSS {format_size(rss)} for {format_size(used)} of data", evidence=ev, runbook=anchor)


def _evictions(x: InstanceRead) -> Check:
    evicted, hits = int(x.info.get("evicted_keys", 0)), int(x.info.get("keyspace_hits", 0))
    ev = {**x.ident, "evicted_keys": evicted, "keyspace_hits": hits}
    anchor = runbook("evictions-vs-hits")
    if evicted > 0 and evicted > hits:
        return Check("valkey", "evictions_vs_hits", WARNING,
                     f"{x.where} evicted {evicted} keys against {hits} hits since it started: chunks leave before they are read again",
                     f"raise maxmemory or add instances ({up_command()}); kvctl diagnose shows evictions under load", ev, anchor)
    return Check("valkey", "evictions_vs_hits", OK, f"{x.where} evicted {evicted} keys, {hits} hits since it started", evidence=ev, runbook=anchor)


def read_thp(path: str) -> str | None:
    """The selected transparent-huge-pages mode (``always``, ``madvise`` or ``never``), or None when unreadable."""
    try:
        with open(path, "rb") as f:
            text = f.read(THP_MAX_BYTES).decode("ascii", "replace")
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def _thp(x: InstanceRead, ctx: TierContext, local: bool) -> Check:
    anchor = runbook("transparent-huge-pages")
    disable = x.config.get("disable-thp", "")
    if not local:
        return Check("valkey", "transparent_huge_pages", SKIPPED, f"{x.where} is on another host: transparent huge pages not checked", evidence=x.ident, runbook=anchor)
    mode = read_thp(ctx.thp_path)
    ev = {**x.ident, "thp": mode, "disable_thp": disable, "path": ctx.thp_path}
    if mode is None:
        return Check("valkey", "transparent_huge_pages", SKIPPED, f"{ctx.thp_path} unreadable: transparent huge pages not checked", evidence=ev, runbook=anchor)
    if mode == "always" and disable != "yes":
        return Check("valkey", "transparent_huge_pages", WARNING,
                     f"{x.where}: transparent huge pages are 'always' on its host and Valkey keeps them (disable-thp {disable or 'unset'}): "
                     "latency spikes and memory use grow when pages are collapsed or copied",
                     "disable-thp yes in the instance's config (Valkey's default), or echo madvise > " + ctx.thp_path, ev, anchor)
    said = " (Valkey turns them off for itself: disable-thp yes)" if mode == "always" else ""
    return Check("valkey", "transparent_huge_pages", OK, f"{x.where}: transparent huge pages '{mode}'{said}", evidence=ev, runbook=anchor)


def _value_size(x: InstanceRead, ctx: TierContext) -> Check:
    anchor = runbook("value-size")
    ev = {**x.ident, "chunk_bytes": ctx.chunk_bytes}
    if ctx.chunk_bytes is None:
        return Check("valkey", "value_size", SKIPPED, f"{x.where}: chunk size unknown (no key stored, no --chunk-bytes)", evidence=ev, runbook=anchor)
    if ctx.chunk_bytes > LARGE_VALUE_BYTES:
        return Check("valkey", "value_size", WARNING,
                     f"{x.where}: chunks of {format_size(ctx.chunk_bytes)} ({ctx.chunk_source}) are above {format_size(LARGE_VALUE_BYTES)}, "
                     "where values have been reported to read about 3× slower", "use smaller chunks (LMCache chunk_size, or the connector's chunk_tokens)", ev, anchor)
    return Check("valkey", "value_size", OK, f"{x.where}: chunks of {format_size(ctx.chunk_bytes)} ≤ {format_size(LARGE_VALUE_BYTES)}", evidence=ev, runbook=anchor)


# --- the tier ------------------------------------------------------------------------------


def _io_threads(reads: Sequence[InstanceRead], locality: dict[int, bool], ctx: TierContext) -> dict[int, Check]:
    """One io_threads line per instance; the instances on this host are judged together against its cores (too many
    threads), and each 9.x one against the threads its share of the cores gives (too few)."""
    local = [x for x in reads if locality[x.key]]
    threads = {x.key: _int(x.config, "io-threads") or 1 for x in reads}
    total = sum(threads[x.key] for x in local)  # main threads included: io-threads counts the main thread
    extra = any(threads[x.key] > 1 for x in local)
    anchor = runbook("io-threads")
    out = {}
    for x in reads:
        n = threads[x.key]
        ev = {**x.ident, "io_threads": n, "host_cores": ctx.cores if locality[x.key] else None, "local_threads": total if locality[x.key] else None}
        if not locality[x.key]:
            out[x.key] = Check("valkey", "io_threads", OK, f"{x.where} io-threads {n} (another host: its cores are not checked)", evidence=ev, runbook=anchor)
        elif extra and total > ctx.cores:
            out[x.key] = Check("valkey", "io_threads", WARNING,
                                f"{x.where} io-threads {n}: the {len(local)} instance(s) on this host run {total} threads on {ctx.cores} core(s), "
                                "so I/O threads take cores from each other and from the main threads",
                                f"io-threads {io_threads_for(ctx.cores, len(local))} per instance (kvctl deploy-valkey up divides the cores among the instances)", ev, anchor)
        else:
            out[x.key] = io_threads_too_few(x, ctx.cores, len(local)) or Check(
                "valkey", "io_threads", OK, f"{x.where} io-threads {n} ({total} thread(s) of this host's instances on {ctx.cores} core(s))",
                evidence=ev, runbook=anchor)
    return out


def tier_checks(reads: Sequence[InstanceRead], ctx: TierContext) -> dict[int, list[Check]]:
    """Every setting check of every instance read, by tier number r*K + i (the rank with one instance per rank; the order doctor prints them in)."""
    locality = {x.key: is_local(x.host) for x in reads}
    io = _io_threads(reads, locality, ctx)
    here = sum(locality.values())
    out: dict[int, list[Check]] = {}
    for x in reads:
        out[x.key] = [
            *_memory(x), _persistence(x), server_version_check(x, ctx.cores if locality[x.key] else None, here if locality[x.key] else 1),
            io[x.key], _bulk_len(x, ctx), _output_buffer(x, ctx), _maxclients(x, ctx),
            _fragmentation(x), _evictions(x), _thp(x, ctx, locality[x.key]), _value_size(x, ctx),
        ]
    return out
