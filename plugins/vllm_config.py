"""Settings of the vLLM connector, read from ``kv_connector_extra_config`` (pure, no vLLM import).

    {"urls": ["resp://127.0.0.1:P0", "resp://127.0.0.1:P1"], "chunk_tokens": 128}
    {"url": "resp://valkey-{rank}:6379", "chunk_tokens": 256, "timeout_s": 2,
     "password_file": "/run/secrets/valkey", "host_budget_bytes": 0,
     "async_loading": true, "load_policy": {...}, "pinned_pool_bytes": 268435456}

Exactly one of ``urls`` (one URL per rank of the shard group) or ``url`` (a
template with ``{rank}``, or one URL for every rank) names the tier. Every
problem is one :class:`ConnectorConfigError` whose message names the key, so
a bad setting fails the engine start with one clear line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from kvctl.connector.urls import InvalidUrl, expand_url, parse_resp_url, read_password_file, with_credentials
from kvctl.errors import InvalidInput
from kvctl.thresholds import CONNECTOR_TIMEOUT_S

__all__ = ["ConnectorConfigError", "ConnectorSettings", "LoadPolicySettings", "parse_settings"]

KNOWN_KEYS = frozenset({
    "urls", "url", "chunk_tokens", "password_file", "timeout_s", "host_budget_bytes",
    "async_loading", "load_policy", "pinned_pool_bytes",
})
#: page-locked host memory for chunk copies on CUDA engines (one pool a worker, reused across requests):
#: two batches of the store's 4 chunks of the paper's 12.4 MB fit with room to spare
DEFAULT_PINNED_POOL_BYTES = 256 * 2**20
POLICY_KEYS = frozenset({"prefill_tokens_per_s", "t0_s", "bandwidth_gbps", "reprobe_after_s"})


class ConnectorConfigError(ValueError):
    """A bad or missing ``kv_connector_extra_config`` setting; the message names the key."""


@dataclass(frozen=True)
class LoadPolicySettings:
    """Load-or-recompute (paper §4): load only when ``T0 + n*s/B <= n/R``.

    ``bandwidth_gbps`` None = the bandwidth the engine's workers measure; a
    low estimate is re-probed (one load let through) after ``reprobe_after_s``.
    """

    prefill_tokens_per_s: float
    t0_s: float = 0.0
    bandwidth_gbps: float | None = None
    reprobe_after_s: float = 30.0


@dataclass(frozen=True)
class ConnectorSettings:
    urls: tuple[str, ...]  # one per rank of the shard group, after expansion
    chunk_tokens: int
    timeout_s: float = CONNECTOR_TIMEOUT_S
    host_budget_bytes: int = 0
    async_loading: bool = False
    load_policy: LoadPolicySettings | None = None
    password_file: str | None = field(default=None, repr=False)
    pinned_pool_bytes: int = DEFAULT_PINNED_POOL_BYTES


def _err(key: str, why: str) -> ConnectorConfigError:
    return ConnectorConfigError(f"kv_connector_extra_config.{key}: {why}")


def _number(cfg: Mapping[str, Any], key: str, default, *, integer: bool = False, positive: bool = True):
    if key not in cfg or cfg[key] is None:
        return default
    v = cfg[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise _err(key, f"expected {'an integer' if integer else 'a number'}, got {v!r}")
    if not math.isfinite(v) or (v <= 0 if positive else v < 0):
        raise _err(key, f"must be {'> 0' if positive else '>= 0'}, got {v!r}")
    return v




def _policy(raw: Any) -> LoadPolicySettings | None:
    if raw in (None, False):
        return None
    if not isinstance(raw, Mapping):
        raise _err("load_policy", f"expected an object with prefill_tokens_per_s (or null), got {raw!r}")
    unknown = set(raw) - POLICY_KEYS
    if unknown:
        raise _err(f"load_policy.{sorted(unknown)[0]}", f"unknown key (known: {', '.join(sorted(POLICY_KEYS))})")
    if "prefill_tokens_per_s" not in raw:
        raise _err("load_policy.prefill_tokens_per_s", "missing (the engine's prefill rate R, tokens/s)")
    return LoadPolicySettings(
        prefill_tokens_per_s=float(_number(raw, "prefill_tokens_per_s", None)),
        t0_s=float(_number(raw, "t0_s", 0.0, positive=False)),
        bandwidth_gbps=_number(raw, "bandwidth_gbps", None),
        reprobe_after_s=float(_number(raw, "reprobe_after_s", 30.0)),
    )


def parse_settings(cfg: Mapping[str, Any] | None, world_size: int) -> ConnectorSettings:
    """Validate ``kv_connector_extra_config`` for a shard group of ``world_size`` ranks."""
    cfg = dict(cfg or {})
    unknown = set(cfg) - KNOWN_KEYS
    if unknown:
        raise _err(sorted(unknown)[0], f"unknown key (known: {', '.join(sorted(KNOWN_KEYS))})")
    if ("urls" in cfg) == ("url" in cfg):
        raise _err("urls", "give exactly one of 'urls' (one URL per rank) or 'url' (a template with {rank})")
    if "urls" in cfg:
        raw = cfg["urls"]
        if not isinstance(raw, (list, tuple)) or not all(isinstance(u, str) and u for u in raw):
            raise _err("urls", f"expected a list of URL strings, got {raw!r}")
        if len(raw) != world_size:
            raise _err("urls", f"{len(raw)} URL(s) for {world_size} rank(s): give one URL per rank")
        key, template = "urls", list(raw)
    else:
        raw = cfg["url"]
        if not isinstance(raw, str) or not raw:
            raise _err("url", f"expected a URL string such as resp://valkey-{{rank}}:6379, got {raw!r}")
        key, template = "url", raw
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
    urls = []
    for rank in range(world_size):
        try:
            url = expand_url(template, rank)
            if password is not None:
                url = with_credentials(url, password=password)
            parse_resp_url(url)
        except InvalidUrl as exc:
            raise _err(key, str(exc)) from None
        urls.append(url)
    async_loading = cfg.get("async_loading", False)
    if not isinstance(async_loading, bool):
        raise _err("async_loading", f"expected true or false, got {async_loading!r}")
    budget = _number(cfg, "host_budget_bytes", 0, integer=True, positive=False)
    pinned = _number(cfg, "pinned_pool_bytes", DEFAULT_PINNED_POOL_BYTES, integer=True)
    return ConnectorSettings(
        urls=tuple(urls),
        chunk_tokens=chunk_tokens,
        timeout_s=float(_number(cfg, "timeout_s", CONNECTOR_TIMEOUT_S)),
        host_budget_bytes=budget,
        async_loading=async_loading,
        load_policy=_policy(cfg.get("load_policy")),
        password_file=pw_file,
        pinned_pool_bytes=pinned,
    )
