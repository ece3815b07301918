"""Settings of the vLLM connector, read from ``kv_connector_extra_config`` (pure, no vLLM import).

    {"urls": ["resp://127.0.0.1:P0", "resp://127.0.0.1:P1"], "chunk_tokens": 128}
    {"url": "resp://valkey-{rank}:6379", "chunk_tokens": 256, "timeout_s": 2,
     "password_file": "/run/secrets/valkey", "host_budget_bytes": 0,
     "async_loading": true, "load_policy": {...}, "pinned_pool_bytes": 268435456}
    {"url": "resp://valkey-{rank}-{instance}:6379", "instances_per_rank": 4, ...}
    {"urls": [["resp://h:7000", "resp://h:7001"], ["resp://h:7002", "resp://h:7003"]], ...}

Exactly one of ``urls`` (per rank of the shard group: one URL, or a list of
K URLs) or ``url`` (a template with ``{rank}`` and, for K > 1 instances per
rank, ``{instance}``; or one URL for every rank) names the tier. Every key
has a range (:data:`RANGES`). Every problem is one
:class:`ConnectorConfigError` whose message names the key, so a bad setting
fails the engine start with one clear line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from kvctl.connector.urls import (INSTANCE_PLACEHOLDER, MAX_INSTANCES_PER_RANK, InvalidUrl, check_distinct_servers,
                                  expand_rank_urls, instances_in, parse_resp_url, read_password_file, redact_url_text,
                                  redact_urls_in, redacted_repr, with_credentials)
from kvctl.core.errors import InvalidInput
from kvctl.core.known_keys import nearest

from .config_keys import POLICY_KEYS, VLLM_KEYS
from .policy import CREDIT_CAP
from kvctl.core.thresholds import CONNECTOR_TIMEOUT_S

__all__ = ["SYNC_LOAD_PATHS", "ConnectorConfigError", "ConnectorSettings", "LoadPolicySettings", "parse_settings"]

#: the keys and the range each takes (checked at engine start; docs/connector.md lists them)
RANGES: dict[str, tuple[float, float]] = {
    "chunk_tokens": (1, 1 << 20),
    "timeout_s": (0.01, 3600.0),
    "host_budget_bytes": (0, 1 << 44),  # 16 TiB of host memory
    "pinned_pool_bytes": (1, 1 << 40),  # 1 TiB page-locked: far above any host, below an overflow
    "instances_per_rank": (1, MAX_INSTANCES_PER_RANK),
    "connections_per_instance": (1, 16),
    "save_drain_s": (0.0, 3600.0),
    "save_queue_bytes": (1, 1 << 44),
    "layer_groups": (1, 64),
    "layered_switch_ms": (0.01, 100.0),
    "async_switch_ms": (0.01, 100.0),
    "load_policy.prefill_tokens_per_s": (1e-3, 1e9),
    "load_policy.t0_s": (0.0, 3600.0),
    "load_policy.bandwidth_gbps": (1e-6, 1e5),
    "load_policy.reprobe_after_s": (1e-3, 86400.0 * 30),
    "load_policy.line_credit_cap": (0.0, 10.0),
}
KNOWN_KEYS = VLLM_KEYS  # the one list (connector/config_keys.py), which the writer in kvctl.tier uses too
#: page-locked host memory for chunk copies on CUDA engines (one pool a worker, reused across requests):
#: two batches of the store's 4 chunks of the paper's 12.4 MB fit with room to spare
DEFAULT_PINNED_POOL_BYTES = 256 * 2**20
#: GETs a device load keeps in flight on each instance (one lane a connection: fetch.py)
DEFAULT_CONNECTIONS = 2
#: how long a worker's shutdown waits for saves still queued or running before it abandons them; inside
#: a vLLM ``--shutdown-timeout 5`` (vLLM's default 0 kills the workers at once on SIGTERM: docs/gpu.md)
DEFAULT_SAVE_DRAIN_S = 4.0
#: the most bytes of extracted chunks a worker's saves may hold while they wait for the tier (queued and running;
#: on CUDA they are GPU memory that vLLM's KV-cache sizing does not know of). A save that would pass it is dropped
#: and counted (kvctl:saves_dropped): its chunks are future misses, where an unbounded queue behind a slow tier
#: ends the engine in a CUDA out-of-memory. One save is always taken when none waits, however large.
DEFAULT_SAVE_QUEUE_BYTES = 2 * 2**30
#: how a sync load reaches vLLM: "step" -- in the step that computes the request's tail (vLLM's sync path; a
#: short load is re-scheduled from the failed blocks); "receive" -- the request waits one step in vLLM's
#: remote-KV state while the worker loads it in that step, blocking it as a sync load does, and a short load is
#: settled before the request is scheduled (vLLM's async path); "auto" -- "receive" where vLLM's async scheduling
#: is on or its workers run Model Runner V2 (CUDA's default): there a short load on the "step" path ended vLLM
#: 0.32's engine core (H200 2026-12-01, H100 2026-12-05): V2 rewinds the request on the host only (vllm#49250)
SYNC_LOAD_PATHS = ("auto", "step", "receive")
#: a chunk is stored as one value per group of layers (kvctl.connector.layer_groups), so a sync hit on vLLM's
#: "step" path loads group by group while the forward computes the groups before (kvctl.connector.pipeline);
#: 1 keeps one value per chunk, the format of earlier releases. Part of the keys: engines sharing a tier agree.
DEFAULT_LAYER_GROUPS = 1


class ConnectorConfigError(ValueError):
    """A bad or missing ``kv_connector_extra_config`` setting; the message names the key."""


@dataclass(frozen=True)
class LoadPolicySettings:
    """The load-or-recompute decision (connector/policy.py; on unless ``load_policy`` is false).

    Each value given overrides what the engine measures: ``prefill_tokens_per_s`` R, ``t0_s`` T0,
    ``bandwidth_gbps`` the whole tier's bandwidth (split evenly over the ranks). A veto is re-probed (one
    load let through) after ``reprobe_after_s`` without a new bandwidth measurement. ``line_credit_cap``: with
    requests waiting in vLLM's line, an async load wins at up to 1 + this × its recompute time
    (:class:`~kvctl.connector.policy.Line`).
    """

    prefill_tokens_per_s: float | None = None
    t0_s: float | None = None
    bandwidth_gbps: float | None = None
    reprobe_after_s: float = 30.0
    line_credit_cap: float = CREDIT_CAP


@dataclass(frozen=True)
class ConnectorSettings:
    """The connector's settings once checked. ``rank_urls[r]``: rank r's K instance URLs (credentials in).

    Its repr (and so str and every log line) shows the URLs with their passwords masked.
    """

    __repr__ = redacted_repr

    rank_urls: tuple[tuple[str, ...], ...]
    chunk_tokens: int
    timeout_s: float = CONNECTOR_TIMEOUT_S
    host_budget_bytes: int = 0
    async_loading: bool = False
    #: the load-or-recompute decision; None: off (``"load_policy": false``)
    load_policy: LoadPolicySettings | None = LoadPolicySettings()
    password_file: str | None = field(default=None, repr=False)
    pinned_pool_bytes: int = DEFAULT_PINNED_POOL_BYTES
    connections_per_instance: int = DEFAULT_CONNECTIONS
    save_drain_s: float = DEFAULT_SAVE_DRAIN_S
    save_queue_bytes: int = DEFAULT_SAVE_QUEUE_BYTES
    #: how vLLM is told about a sync load (:data:`SYNC_LOAD_PATHS`)
    sync_load_path: str = "auto"
    #: values per chunk, one per group of layers (:data:`DEFAULT_LAYER_GROUPS`)
    layer_groups: int = DEFAULT_LAYER_GROUPS
    #: Python's thread switch interval (ms) while a layered load's lanes run beside the forward; None: unchanged
    #: (an experiment for the GPU host: benchmarks/lanes_gil.py, docs/engine.md)
    layered_switch_ms: float | None = None
    #: the same while an async load runs (its lanes beside the engine's steps: kvctl.connector.switch); None: unchanged
    async_switch_ms: float | None = None

    @property
    def instances_per_rank(self) -> int:
        return len(self.rank_urls[0])

    @property
    def urls(self) -> tuple[str, ...]:
        """Every instance, rank-major (instance i of rank r at ``r*K + i``); one a rank when K = 1."""
        return tuple(u for rank in self.rank_urls for u in rank)


def _err(key: str, why: str) -> ConnectorConfigError:
    return ConnectorConfigError(f"kv_connector_extra_config.{key}: {why}")


def _number(cfg: Mapping[str, Any], key: str, default, *, integer: bool = False, name: str | None = None):
    """``cfg[key]`` checked against its documented range (:data:`RANGES`, by ``name`` or ``key``).

    The lower bound is exclusive for seconds and rates whose 0 means nothing (``timeout_s``, rates) only
    where RANGES says so by a positive minimum; integers are compared as integers (no float overflow).
    """
    name = name or key
    if key not in cfg or cfg[key] is None:
        return default
    v = cfg[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise _err(name, f"expected {'an integer' if integer else 'a number'}, got {v!r}")
    lo, hi = RANGES[name]
    if isinstance(v, float) and not math.isfinite(v):
        raise _err(name, f"must be a finite number in [{lo:g}, {hi:g}], got {v!r}")
    if not lo <= v <= hi:  # int vs float compares exactly, whatever the int's size
        shown = v if not isinstance(v, int) or abs(v) < 10**30 else f"an integer of {len(str(abs(v)))} digits"
        raise _err(name, f"must be in [{lo:g}, {hi:g}], got {shown}")
    return v


def _policy(raw: Any) -> LoadPolicySettings | None:
    """``load_policy``: absent, null or true -- on, everything measured; false or ``{"enabled": false}`` -- off;
    an object -- on, with its values instead of the measured ones."""
    if raw is None or raw is True:
        return LoadPolicySettings()
    if raw is False:
        return None
    if not isinstance(raw, Mapping):
        raise _err("load_policy", f"expected true, false or an object of {', '.join(sorted(POLICY_KEYS))}, got {raw!r}")
    unknown = set(raw) - POLICY_KEYS
    if unknown:
        key = sorted(unknown)[0]
        raise _err(f"load_policy.{key}", f"unknown key{_guess(key, POLICY_KEYS)} (known: {', '.join(sorted(POLICY_KEYS))})")
    enabled = raw.get("enabled", True)
    if not isinstance(enabled, bool):
        raise _err("load_policy.enabled", f"expected true or false, got {enabled!r}")
    values = {k: _number(raw, k, None, name=f"load_policy.{k}") for k in sorted(POLICY_KEYS - {"enabled"})}
    if not enabled:
        return None
    return LoadPolicySettings(**{k: float(v) for k, v in values.items() if v is not None})


def _guess(key: str, known: frozenset[str]) -> str:
    """`` (did you mean K?)`` for the known key ``key`` is a typo of (kvctl.core.known_keys), else ""."""
    guess = nearest(key, known)
    return f" (did you mean {guess}?)" if guess else ""


def parse_settings(cfg: Mapping[str, Any] | None, world_size: int) -> ConnectorSettings:
    """Validate ``kv_connector_extra_config`` for a shard group of ``world_size`` ranks."""
    cfg = dict(cfg or {})
    unknown = set(cfg) - KNOWN_KEYS
    if unknown:
        key = sorted(unknown)[0]
        raise _err(key, f"unknown key{_guess(key, KNOWN_KEYS)} (known: {', '.join(sorted(KNOWN_KEYS))})")
    if ("urls" in cfg) == ("url" in cfg):
        raise _err("urls", "give exactly one of 'urls' (one URL, or a list of K URLs, per rank) or 'url' "
                           "(a template with {rank}, and {instance} for several instances per rank)")
    k = _number(cfg, "instances_per_rank", None, integer=True)
    if "urls" in cfg:
        raw = cfg["urls"]
        if not isinstance(raw, (list, tuple)) or not all(
                (isinstance(u, str) and u) or (isinstance(u, (list, tuple)) and u and all(isinstance(x, str) and x for x in u))
                for u in raw):
            raise _err("urls", "expected a list of URL strings (or of lists of URL strings, one per instance), "
                               f"got {redact_urls_in(raw)!r}")
        if len(raw) != world_size:
            raise _err("urls", f"{len(raw)} entries for {world_size} rank(s): give one entry per rank")
        try:
            listed = instances_in(raw)
        except InvalidUrl as exc:
            raise _err("urls", str(exc)) from None
        if k is not None and k != listed:
            raise _err("instances_per_rank", f"{k}, but every entry of urls lists {listed} URL(s)")
        key, template, k = "urls", list(raw), listed
    else:
        raw = cfg["url"]
        if not isinstance(raw, str) or not raw:
            raise _err("url", f"expected a URL string such as resp://valkey-{{rank}}:6379, got {redact_urls_in(raw)!r}")
        key, template = "url", raw
        if k is None:
            k = 1
            if INSTANCE_PLACEHOLDER in raw:
                raise _err("instances_per_rank", f"missing: url {redact_url_text(raw)} has {INSTANCE_PLACEHOLDER}, so say how many "
                                                 "instances each rank has")
    if "chunk_tokens" not in cfg:
        raise _err("chunk_tokens", "missing (tokens per stored chunk, a multiple of vLLM's block size)")
    chunk_tokens = _number(cfg, "chunk_tokens", None, integer=True)
    password = None
    pw_file = cfg.get("password_file")
    if pw_file is not None:
        if not isinstance(pw_file, str) or not pw_file:
            raise _err("password_file", f"expected a file path, got {pw_file!r}")
        try:
            password = read_password_file(pw_file)  # the one reader: regular, bounded, not open to every user
        except InvalidInput as exc:
            raise _err("password_file", str(exc)) from None
    rank_urls = []
    for rank in range(world_size):
        try:
            urls = expand_rank_urls(template, rank, k)
            if password is not None:
                urls = [with_credentials(u, password=password) for u in urls]
            for u in urls:
                parse_resp_url(u)
        except InvalidUrl as exc:
            raise _err(key, str(exc)) from None
        rank_urls.append(tuple(urls))
    if k > 1:  # one server under two spellings would halve the bandwidth K instances are for
        try:
            check_distinct_servers(rank_urls)
        except InvalidUrl as exc:
            raise _err(key, str(exc)) from None
    async_loading = cfg.get("async_loading", False)
    if not isinstance(async_loading, bool):
        raise _err("async_loading", f"expected true or false, got {async_loading!r}")
    sync_path = cfg.get("sync_load_path", "auto")
    if sync_path not in SYNC_LOAD_PATHS:
        raise _err("sync_load_path", f"expected one of {', '.join(SYNC_LOAD_PATHS)}, got {sync_path!r}")
    budget = _number(cfg, "host_budget_bytes", 0, integer=True)
    pinned = _number(cfg, "pinned_pool_bytes", DEFAULT_PINNED_POOL_BYTES, integer=True)
    return ConnectorSettings(
        rank_urls=tuple(rank_urls),
        chunk_tokens=chunk_tokens,
        timeout_s=float(_number(cfg, "timeout_s", CONNECTOR_TIMEOUT_S)),
        host_budget_bytes=budget,
        async_loading=async_loading,
        load_policy=_policy(cfg.get("load_policy")),
        password_file=pw_file,
        pinned_pool_bytes=pinned,
        connections_per_instance=_number(cfg, "connections_per_instance", DEFAULT_CONNECTIONS, integer=True),
        save_drain_s=float(_number(cfg, "save_drain_s", DEFAULT_SAVE_DRAIN_S)),
        save_queue_bytes=_number(cfg, "save_queue_bytes", DEFAULT_SAVE_QUEUE_BYTES, integer=True),
        sync_load_path=sync_path,
        layer_groups=_number(cfg, "layer_groups", DEFAULT_LAYER_GROUPS, integer=True),
        layered_switch_ms=_number(cfg, "layered_switch_ms", None),
        async_switch_ms=_number(cfg, "async_switch_ms", None),
    )
