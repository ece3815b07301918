"""Settings of kvctl's LMCache remote-storage plugin, read from LMCache's ``extra_config`` (pure, no LMCache import).

    remote_storage_plugins: [kvctl]
    extra_config:
      remote_storage_plugin.kvctl.module_path: kvctl.plugins.lmcache
      remote_storage_plugin.kvctl.class_name: KvctlConnectorAdapter
      remote_storage_plugin.kvctl.url: resp://valkey-{rank}:6379   # or kvctl_remote_urls: [per-rank list]
      remote_storage_plugin.kvctl.timeout_s: 2                     # optional, whole-call deadline
      kvctl_username: kvctl-engine                                 # optional ACL user
      kvctl_password_file: /run/secrets/valkey                     # optional, never inlined

Exactly one of ``remote_storage_plugin.<name>.url`` (a ``{rank}`` template,
or one URL for every rank) or ``kvctl_remote_urls`` (one URL per rank, index =
rank) names the tier; the rank is LMCache's ``metadata.worker_id``. The last
three keys are the ones ``kvctl deploy-valkey lmcache-config`` writes. Every
problem is one :class:`PluginConfigError` naming the key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from kvctl.connector.urls import InvalidUrl, expand_url, parse_resp_url, read_password_file, with_credentials
from kvctl.errors import InvalidInput
from kvctl.thresholds import CONNECTOR_TIMEOUT_S
from kvctl.tier.lmcache_config import PASSWORD_FILE_KEY, PLUGIN_NAME, URL_LIST_KEY, USERNAME_KEY, plugin_key

__all__ = ["PLUGIN_TYPE", "PluginConfigError", "PluginSettings", "plugin_settings"]

PLUGIN_TYPE = PLUGIN_NAME  # remote_storage_plugins entry: "kvctl" or "kvctl.<instance>"
DEFAULT_TIMEOUT_S = CONNECTOR_TIMEOUT_S
DEFAULT_POOL_SIZE = 4


class PluginConfigError(ValueError):
    """A bad or missing setting of the kvctl LMCache plugin; the message names the key."""


@dataclass(frozen=True)
class PluginSettings:
    """What one rank's connector needs: its own instance and the call bounds."""

    url: str = field(repr=False)  # this rank's URL, credentials included
    redacted_url: str
    rank: int
    timeout_s: float = DEFAULT_TIMEOUT_S
    pool_size: int = DEFAULT_POOL_SIZE


def _positive(extra: Mapping[str, Any], key: str, default, integer: bool = False):
    v = extra.get(key, default)
    if isinstance(v, str):  # LMCache's env converter and --config strings
        try:
            v = int(v) if integer else float(v)
        except ValueError:
            raise PluginConfigError(f"extra_config.{key}: expected a number, got {v!r}") from None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise PluginConfigError(f"extra_config.{key}: expected {'an integer' if integer else 'a number'}, got {v!r}")
    if not math.isfinite(v) or v <= 0:
        raise PluginConfigError(f"extra_config.{key}: must be > 0, got {v!r}")
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
    url_key = plugin_key("url", plugin_name)
    if remote_url:
        raise PluginConfigError(
            f"remote_url ({remote_url}) is set next to remote_storage_plugins [{plugin_name}]: LMCache would build a "
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
        if not isinstance(raw, (list, tuple)) or not all(isinstance(u, str) and u for u in raw):
            raise PluginConfigError(f"extra_config.{key}: expected a list of URL strings, got {raw!r}")
    elif not isinstance(raw, str) or not raw:
        raise PluginConfigError(f"extra_config.{key}: expected a URL string such as resp://valkey-{{rank}}:6379, got {raw!r}")
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
    try:
        url = expand_url(list(raw) if key == URL_LIST_KEY else raw, rank)
        url = with_credentials(url, username, password)
        parsed = parse_resp_url(url)
    except InvalidUrl as exc:
        raise PluginConfigError(f"extra_config.{key}: {exc}") from None
    return PluginSettings(
        url=url,
        redacted_url=parsed.redacted(),
        rank=rank,
        timeout_s=float(_positive(extra, plugin_key("timeout_s", plugin_name), DEFAULT_TIMEOUT_S)),
        pool_size=int(_positive(extra, plugin_key("pool_size", plugin_name), DEFAULT_POOL_SIZE, integer=True)),
    )

