"""The ``--kv-transfer-config`` that loads kvctl's own vLLM connector over a tier (paper §5.2).

The JSON is what vLLM's ``KVTransferConfig`` (``vllm/config/kv_transfer.py``)
takes: ``kv_connector`` + ``kv_connector_module_path`` name the connector class
``kvctl.plugins.vllm.KvctlConnector`` (the module path wins over vLLM's own
registry), ``kv_role`` is ``kv_both`` (the engine stores and loads), and
``kv_load_failure_policy`` is ``recompute`` so a chunk that cannot be loaded is
recomputed instead of failing the request (vLLM's default is ``fail``).
``kv_connector_extra_config`` is the connector's own settings:

* ``urls``: one URL per rank, index = rank (a local or systemd tier, ports differ), or
* ``url``: a ``{rank}`` template (a k8s tier, hosts differ);
* with K > 1 instances per rank: ``urls`` holds per rank the list of its K URLs (instance i
  of rank r at ``urls[r][i]``), or ``url`` is a template with ``{rank}`` and ``{instance}``;
  either way ``instances_per_rank`` is K (the connector puts chunk c of rank r on instance
  ``(c // W) mod K``);
* ``chunk_tokens``, ``async_loading``, ``connections_per_instance`` (one per I/O thread of the tier's instances:
  :func:`kvctl.tier.sizing.connections_for`), optionally ``timeout_s`` and ``password_file``.

With a password the tier's ACL user goes into the URLs (``resp://kvctl-engine@host:port``)
and only the path of the password file is written, never the password.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import Any, Sequence

from kvctl.connector import config_keys as K  # the keys' one home, shared with the connector's reader
from kvctl.connector.config_keys import CONNECTOR, EXTRA, MODULE_PATH  # noqa: F401 - re-exported
from kvctl.connector.settings import RANGES
from kvctl.connector.urls import with_credentials
from kvctl.core.errors import InvalidInput
from kvctl.tier.targets import check_instances
from kvctl.core.thresholds import CHUNK_TOKENS

ARG = "--kv-transfer-config"
ASYNC_KEY = K.ASYNC_LOADING


@dataclass(frozen=True)
class ConnectorOptions:
    """What ``vllm-config`` writes besides the tier's URLs (the connector's reader parses the whole setting
    into :class:`kvctl.connector.settings.ConnectorSettings`)."""

    chunk_tokens: int = CHUNK_TOKENS
    async_loading: bool = False
    timeout_s: float | None = None  # None: the connector's default
    connections_per_instance: int | None = None  # None: the connector's default (kvctl.connector.settings.DEFAULT_CONNECTIONS)


def with_user(url: str, username: str | None) -> str:
    """``url`` logging in as ``username`` (no password: that stays in the file); see ``with_credentials``."""
    return with_credentials(url, user=username or None)


def kv_transfer_config(
    urls: str | Sequence[str] | Sequence[Sequence[str]],
    settings: ConnectorOptions = ConnectorOptions(),
    username: str | None = None,
    password_file: str | None = None,
    instances_per_rank: int = 1,
) -> dict[str, Any]:
    """The ``--kv-transfer-config`` mapping: ``urls`` is a ``{rank}`` template, one URL per rank, or
    (``instances_per_rank`` K > 1) per rank the list of its K URLs or a ``{rank}``/``{instance}`` template."""
    if settings.chunk_tokens < 1:
        raise InvalidInput(f"chunk tokens must be at least 1, got {settings.chunk_tokens}")
    if settings.timeout_s is not None and not settings.timeout_s > 0:
        raise InvalidInput(f"timeout must be > 0 s, got {settings.timeout_s}")
    lo, hi = RANGES[K.CONNECTIONS_PER_INSTANCE]
    if settings.connections_per_instance is not None and not lo <= settings.connections_per_instance <= hi:
        raise InvalidInput(f"connections per instance must be in {lo:g}..{hi:g} (the connector's range), got {settings.connections_per_instance}")
    check_instances(urls, instances_per_rank)
    extra: dict[str, Any] = {}
    if isinstance(urls, str):
        extra[K.URL] = with_user(urls, username)
    elif instances_per_rank == 1:
        extra[K.URLS] = [with_user(u, username) for u in urls]
    else:
        extra[K.URLS] = [[with_user(u, username) for u in rank] for rank in urls]
    if instances_per_rank > 1:
        extra[K.INSTANCES_PER_RANK] = instances_per_rank
    extra[K.CHUNK_TOKENS] = settings.chunk_tokens
    extra[K.ASYNC_LOADING] = settings.async_loading
    if settings.connections_per_instance is not None:
        extra[K.CONNECTIONS_PER_INSTANCE] = settings.connections_per_instance
    if settings.timeout_s is not None:
        extra[K.TIMEOUT_S] = settings.timeout_s
    if password_file:
        extra[K.PASSWORD_FILE] = password_file
    return {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": MODULE_PATH,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        EXTRA: extra,
    }


def render_json(cfg: dict[str, Any]) -> str:
    """One line of compact JSON, the value of ``--kv-transfer-config``."""
    return json.dumps(cfg, separators=(",", ":"))


def render_shell(cfg: dict[str, Any]) -> str:
    """The whole argument, quoted for a POSIX shell or a systemd ExecStart line."""
    return f"{ARG} {shlex.quote(render_json(cfg))}"
