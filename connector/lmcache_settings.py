"""Settings of kvctl's LMCache remote-storage plugin, read from LMCache's ``extra_config`` (pure, no LMCache import).

    remote_storage_plugins: [kvctl]
    extra_config:
      remote_storage_plugin.kvctl.module_path: kvctl.plugins.lmcache
      remote_storage_plugin.kvctl.class_name: KvctlConnectorAdapter
      remote_storage_plugin.kvctl.url: resp://valkey-{rank}:6379   # or kvctl_remote_urls: [per-rank list]
      remote_storage_plugin.kvctl.timeout_s: 2                     # optional, whole-call deadline
      remote_storage_plugin.kvctl.instances_per_rank: 4            # optional: url with {instance}, or lists of K URLs
      remote_storage_plugin.kvctl.prefill_tokens_per_s: 50000      # optional: R, turns the load-or-recompute decision on
      remote_storage_plugin.kvctl.t0_s: 0.05                       # optional: T0 of that decision (default 0)
      kvctl_username: kvctl-engine                                 # optional ACL user
      kvctl_password_file: /run/secrets/valkey                     # optional, never inlined

Exactly one of ``remote_storage_plugin.<name>.url`` (a ``{rank}`` template,
or one URL for every rank) or ``kvctl_remote_urls`` (one URL per rank, index =
rank) names the tier; the rank is LMCache's ``metadata.worker_id``. The last
three keys are the ones ``kvctl deploy-valkey lmcache-config`` writes. Every
problem is one :class:`PluginConfigError` naming the key.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from kvctl.connector.urls import (INSTANCE_PLACEHOLDER, MAX_INSTANCES_PER_RANK, InvalidUrl, check_distinct_servers, expand_rank_urls,
                                  instances_in, parse_resp_url, read_password_file, redact_url_text, redact_urls_in, with_credentials)
from kvctl.core.errors import InvalidInput
from kvctl.core.thresholds import CONNECTOR_TIMEOUT_S
from kvctl.core.known_keys import log_unknown
from .config_keys import PASSWORD_FILE_KEY, PLUGIN_NAME, URL_LIST_KEY, USERNAME_KEY, plugin_key
from .unknown_keys import in_plugin_extra

log = logging.getLogger(__name__)

__all__ = ["PLUGIN_TYPE", "PluginConfigError", "PluginSettings", "plugin_settings"]

PLUGIN_TYPE = PLUGIN_NAME  # remote_storage_plugins entry: "kvctl" or "kvctl.<instance>"
DEFAULT_TIMEOUT_S = CONNECTOR_TIMEOUT_S
DEFAULT_POOL_SIZE = 4


class PluginConfigError(ValueError):
    """A bad or missing setting of the kvctl LMCache plugin; the message names the key."""


@dataclass(frozen=True)
class PluginSettings:
    """What one rank's connector needs: its own instance(s) and the call bounds."""

    urls: tuple[str, ...] = field(repr=False)  # this rank's K instance URLs, credentials included
    redacted_urls: tuple[str, ...]
    rank: int
    timeout_s: float = DEFAULT_TIMEOUT_S
    pool_size: int = DEFAULT_POOL_SIZE
    #: the engine's prefill rate R: with it, a contains answer declines hits that load slower than they recompute
    #: (docs/connector.md, "Load or recompute"); LMCache shows a plugin no engine step to measure it by
    prefill_tokens_per_s: float | None = None
    t0_s: float = 0.0

    @property
    def url(self) -> str:
        """The rank's first instance (its only one when K = 1)."""
        return self.urls[0]

    @property
    def redacted_url(self) -> str:
        k = len(self.redacted_urls)
        return self.redacted_urls[0] if k == 1 else f"{self.redacted_urls[0]} (+{k - 1} more instances of this rank)"


#: each numeric setting's range, checked at engine start (the same bounds as the vLLM connector's timeout_s)
RANGES = {"timeout_s": (0.01, 3600.0), "pool_size": (1, 1024), "instances_per_rank": (1, MAX_INSTANCES_PER_RANK),
          "prefill_tokens_per_s": (1e-3, 1e9), "t0_s": (0.0, 3600.0)}


def _positive(extra: Mapping[str, Any], key: str, default, integer: bool = False, kind: str | None = None):
    v = extra.get(key, default)
    if isinstance(v, str):  # LMCache's env converter and --config strings
        try:
            v = int(v) if integer else float(v)
        except ValueError:
            raise PluginConfigError(f"extra_config.{key}: expected a number, got {v!r}") from None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise PluginConfigError(f"extra_config.{key}: expected {'an integer' if integer else 'a number'}, got {v!r}")
    lo, hi = RANGES[kind or key.rsplit(".", 1)[-1]]
    if isinstance(v, float) and not math.isfinite(v):
        raise PluginConfigError(f"extra_config.{key}: must be a finite number in [{lo:g}, {hi:g}], got {v!r}")
    if not lo <= v <= hi:  # exact for ints of any size (no float overflow)
        shown = v if not isinstance(v, int) or abs(v) < 10**30 else f"an integer of {len(str(abs(v)))} digits"
        raise PluginConfigError(f"extra_config.{key}: must be in [{lo:g}, {hi:g}], got {shown}")
    return v


def plugin_settings(
    extra_config: Mapping[str, Any] | None,
    plugin_name: str,
    rank: int,
    *,
    remote_url: str | None = None,
    save_unfull_chunk: bool = False,
) -> PluginSettings:
    """This rank's settings from LMCache's ``extra_config``.

    ``remote_url`` and ``save_unfull_chunk`` are LMCache's top-level settings
    of the same config: a ``remote_url`` next to the plugin makes LMCache build
    a second remote backend that writes every chunk again, and partial chunks
    have no fixed size to read into, so both are refused.
    """
    extra = dict(extra_config or {})
    log_unknown(in_plugin_extra(extra, "LMCache config", plugin_name), log, "kvctl's plugin ignores it and uses its default")
    url_key = plugin_key("url", plugin_name)
    if remote_url:
        raise PluginConfigError(
            f"remote_url ({redact_url_text(remote_url)}) is set next to remote_storage_plugins [{plugin_name}]: LMCache would build a "
            f"second remote backend and write every chunk twice; drop remote_url (the plugin reads extra_config.{url_key} "
            f"or extra_config.{URL_LIST_KEY})"
        )
    if save_unfull_chunk:
        raise PluginConfigError("save_unfull_chunk: must be false with the kvctl plugin (values are read into full-chunk buffers)")
    if (url_key in extra) == (URL_LIST_KEY in extra):
        raise PluginConfigError(
            f"extra_config: give exactly one of {url_key} (a template with {{rank}}) or {URL_LIST_KEY} (one URL per rank)"
        )
    key = url_key if url_key in extra else URL_LIST_KEY
    raw = extra[key]
    if key == URL_LIST_KEY:
        if not isinstance(raw, (list, tuple)) or not all(
                (isinstance(u, str) and u) or (isinstance(u, (list, tuple)) and u and all(isinstance(x, str) and x for x in u))
                for u in raw):
            raise PluginConfigError(f"extra_config.{key}: expected a list of URL strings (or of lists of URL strings, "
                                    f"one per instance of the rank), got {redact_urls_in(raw)!r}")
    elif not isinstance(raw, str) or not raw:
        raise PluginConfigError(f"extra_config.{key}: expected a URL string such as resp://valkey-{{rank}}:6379, "
                                f"got {redact_urls_in(raw)!r}")
    username = extra.get(USERNAME_KEY)
    if username is not None and (not isinstance(username, str) or not username):
        raise PluginConfigError(f"extra_config.{USERNAME_KEY}: expected a user name, got {username!r}")
    password = None
    pw_file = extra.get(PASSWORD_FILE_KEY)
    if pw_file is not None:
        if not isinstance(pw_file, str) or not pw_file:
            raise PluginConfigError(f"extra_config.{PASSWORD_FILE_KEY}: expected a file path, got {pw_file!r}")
        try:
            password = read_password_file(pw_file)  # the one reader: regular, bounded, not open to every user
        except InvalidInput as exc:
            raise PluginConfigError(f"extra_config.{PASSWORD_FILE_KEY}: {exc}") from None
    elif username is not None:
        raise PluginConfigError(f"extra_config.{USERNAME_KEY} needs extra_config.{PASSWORD_FILE_KEY} (the user's password)")
    k_key = plugin_key("instances_per_rank", plugin_name)
    try:
        if key == URL_LIST_KEY:
            listed = instances_in(raw)
            k = int(_positive(extra, k_key, listed, integer=True, kind="instances_per_rank"))
            if k != listed:
                raise PluginConfigError(f"extra_config.{k_key}: {k}, but every entry of {URL_LIST_KEY} lists {listed} URL(s)")
        else:
            if INSTANCE_PLACEHOLDER in raw and k_key not in extra:
                raise PluginConfigError(f"extra_config.{k_key}: missing: {key} {redact_url_text(raw)} has {INSTANCE_PLACEHOLDER}, so say how "
                                        "many instances each rank has")
            k = int(_positive(extra, k_key, 1, integer=True, kind="instances_per_rank"))
        urls = [with_credentials(u, username, password)
                for u in expand_rank_urls(list(raw) if key == URL_LIST_KEY else raw, rank, k)]
        parsed = [parse_resp_url(u) for u in urls]
        if k > 1:  # one server under two spellings would halve the bandwidth K instances are for
            # a list names every rank's instances: check them all (every rank refuses the same config);
            # a template names this rank's
            check_distinct_servers([expand_rank_urls(list(raw), r, k) for r in range(len(raw))]
                                   if key == URL_LIST_KEY else [urls])
    except InvalidUrl as exc:
        raise PluginConfigError(f"extra_config.{key}: {exc}") from None
    r_key = plugin_key("prefill_tokens_per_s", plugin_name)
    rate = float(_positive(extra, r_key, None)) if r_key in extra else None
    return PluginSettings(
        urls=tuple(urls),
        redacted_urls=tuple(p.redacted() for p in parsed),
        rank=rank,
        timeout_s=float(_positive(extra, plugin_key("timeout_s", plugin_name), DEFAULT_TIMEOUT_S)),
        pool_size=int(_positive(extra, plugin_key("pool_size", plugin_name), DEFAULT_POOL_SIZE, integer=True)),
        prefill_tokens_per_s=rate,
        t0_s=float(_positive(extra, plugin_key("t0_s", plugin_name), 0.0)),
    )

