"""Saved diagnoses, one per tier: what ``kvctl diagnose`` keeps for ``kvctl loading sync`` and ``kvctl doctor``.

A live diagnosis is saved (0600: it names URLs, masked) as ``$KVCTL_HOME/diagnoses/<key>.json``, the key a hash of
what it diagnosed: the Valkey instances (each as one ``(address, port)`` spelling, :func:`kvctl.connector.urls.
server_address`) and the engines (scheme, host, port and path of their ``/metrics``, every loopback spelling one).
Another job's diagnosis of another tier no longer replaces the engineer's (issue 48: one ``last-diagnosis.json`` per
user did, within minutes, and ``loading sync`` trusted it). A reader asks :func:`find` with what it knows of its own
tier: instance URLs (a ``{rank}`` template is expanded to the ranks of each saved diagnosis), engine URLs, or both;
the newest saved diagnosis of exactly those instances, else of exactly those engines, is the one. At most
:data:`SAVED_KEPT` are kept, the oldest removed first. ``$KVCTL_HOME/last-diagnosis.json`` still holds the latest of
any tier, for a person to read; kvctl reads only the tier's own.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import urlsplit

from kvctl.connector.urls import InvalidUrl, expand_rank_urls, instances_in, server_address
from kvctl.core.errors import InvalidInput
from kvctl.core.files import read_json, write_atomic
from kvctl.core.thresholds import CONFIG_MAX_BYTES

SAVED_DIR = "diagnoses"
LAST_DIAGNOSIS = "last-diagnosis.json"
#: diagnoses kept under $KVCTL_HOME/diagnoses (one per tier or engine set diagnosed), the oldest removed past it
SAVED_KEPT = 64
#: one saved diagnosis read back: a few kB in practice
SAVED_MAX_BYTES = 16 * CONFIG_MAX_BYTES
_LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1", "0.0.0.0", "::", "")


def kvctl_home() -> Path:
    """kvctl's state directory: $KVCTL_HOME, else ~/.kvctl."""
    return Path(os.environ.get("KVCTL_HOME") or Path.home() / ".kvctl")


@dataclass(frozen=True)
class Identity:
    """What a diagnosis diagnosed: the instances' addresses and the engines', each sorted, each one spelling."""

    valkey: tuple[str, ...] = ()
    engines: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        return hashlib.sha256(json.dumps([self.valkey, self.engines]).encode()).hexdigest()[:20]

    def describe(self) -> str:
        parts = ([f"Valkey {', '.join(self.valkey)}"] if self.valkey else []) + ([f"engines {', '.join(self.engines)}"] if self.engines else [])
        return "; ".join(parts) or "nothing named"


def valkey_address(url: str) -> str | None:
    """``host:port`` of an instance URL as one spelling (``loopback:17400`` for every loopback name), None if no URL."""
    try:
        host, port = server_address(url)
    except (InvalidUrl, InvalidInput, ValueError, TypeError):
        return None
    return f"{host}:{port}"


def engine_address(url: str) -> str | None:
    """An engine URL as one spelling: scheme, host (every loopback name one), port and /metrics path; None if no URL."""
    try:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None
    host = (parts.hostname or "").lower().rstrip(".")
    host = "loopback" if host in _LOOPBACK_HOSTS or host.startswith("127.") else host
    path = parts.path.rstrip("/")
    path = path if path.endswith("/metrics") else path + "/metrics"
    return f"{parts.scheme}://{host}:{port}{path}"


def _addresses(urls: Sequence[Any], fn) -> tuple[str, ...]:
    return tuple(sorted({a for u in urls if isinstance(u, str) for a in [fn(u)] if a}))


def identity_of(data: dict[str, Any]) -> Identity:
    """The instances and engines a diagnosis (its JSON form) read."""
    instances = data.get("instances") if isinstance(data.get("instances"), list) else []
    engines = data.get("engine_urls") if isinstance(data.get("engine_urls"), list) else []
    return Identity(_addresses([i.get("url") for i in instances if isinstance(i, dict)], valkey_address), _addresses(engines, engine_address))


def save(data: dict[str, Any]) -> Path:
    """Keep a diagnosis (JSON form) as the one of its tier, and as the latest of any; the tier's file."""
    text = json.dumps(data, indent=2) + "\n"
    home = kvctl_home()
    write_atomic(home / LAST_DIAGNOSIS, text, mode=0o600)
    ident = identity_of(data)
    if not (ident.valkey or ident.engines):  # nothing to key it by: the latest alone, which no reader trusts
        return home / LAST_DIAGNOSIS
    path = write_atomic(home / SAVED_DIR / f"{ident.key}.json", text, mode=0o600)
    _prune(home / SAVED_DIR)
    return path


def _saved(directory: Path) -> list[Path]:
    """The saved diagnoses, newest first."""
    try:
        found = [p for p in directory.iterdir() if p.suffix == ".json" and p.is_file() and not p.is_symlink()]
    except OSError:
        return []
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def _prune(directory: Path) -> None:
    for old in _saved(directory)[SAVED_KEPT:]:
        with contextlib.suppress(OSError):
            old.unlink()


def _expand(templates: Sequence[tuple[str, int]], instances: int) -> tuple[str, ...] | None:
    """The addresses ``templates`` name for a tier of ``instances`` instances (W = instances / K), None if they cannot."""
    out = []
    for template, k in templates:
        if k < 1 or instances % k:
            return None
        try:
            out += [u for r in range(instances // k) for u in expand_rank_urls(template, r, k)]
        except (InvalidUrl, InvalidInput, ValueError):
            return None
    return _addresses(out, valkey_address)


def find(valkey_urls: Sequence[str] = (), engine_urls: Sequence[str] = (), templates: Sequence[tuple[str, int]] = ()) -> Path | None:
    """The newest saved diagnosis of exactly these Valkey instances (URLs, or ``(template, K)`` with ``{rank}``),
    else of exactly these engines; None when none was saved (or nothing was named)."""
    valkey = _addresses(valkey_urls, valkey_address)
    engines = _addresses(engine_urls, engine_address)
    named_tier = bool(valkey or templates)
    if not (named_tier or engines):
        return None
    by_engines = None
    for path in _saved(kvctl_home() / SAVED_DIR):  # newest first
        try:
            ident = identity_of(read_json(path, "saved diagnosis", SAVED_MAX_BYTES, kind="a kvctl diagnosis"))
        except (InvalidInput, OSError):
            continue
        if named_tier and ident.valkey:
            tier = valkey
            if templates:  # expanded for as many instances as this diagnosis read
                expanded = _expand(templates, len(ident.valkey) - len(valkey))
                tier = tuple(sorted(set(expanded) | set(valkey))) if expanded is not None else ()
            if tier and ident.valkey == tier:
                return path
        # of these engines, and of no other tier than the one named (a diagnosis without instances, or no tier named)
        if by_engines is None and engines and ident.engines == engines and not (named_tier and ident.valkey):
            by_engines = path
    return by_engines


def tier_urls(urls: Any, instances_per_rank: Any = None) -> tuple[list[str], list[tuple[str, int]]]:
    """(instance URLs, ``(template, K)``) of a config's tier: a per-rank list (of URLs, or of K URLs each), or a
    ``{rank}`` template with its instances per rank; ([], []) for anything else."""
    k = instances_per_rank if isinstance(instances_per_rank, int) and not isinstance(instances_per_rank, bool) and instances_per_rank > 0 else 1
    if isinstance(urls, str) and urls:
        return ([], [(urls, k)]) if "{rank}" in urls else ([urls], [])
    if isinstance(urls, list):
        try:
            instances_in(urls)
        except (InvalidInput, ValueError, TypeError):
            return [], []
        return [u for rank in urls for u in ([rank] if isinstance(rank, str) else rank) if isinstance(u, str)], []
    return [], []
