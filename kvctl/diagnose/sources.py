"""The three things ``kvctl diagnose`` reads from the outside world.

* an engine's Prometheus text over HTTP (:mod:`kvctl.core.engine_http`: credentials, a size cap, a deadline);
* a Valkey instance's ``INFO`` (all sections, including ``commandstats``) through :class:`kvctl.tier.admin.Admin`:
  one deadline for the whole read, the reply typed;
* GPU utilisation through NVML, or a clear "no GPU visible".

Each is one small function that tests point at a real local server.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from kvctl.core.engine_http import EngineHttp, masked
from kvctl.core.errors import InvalidInput, KvctlError, Unreachable
from kvctl.core.thresholds import CHECK_TIMEOUT_S, READ_TIMEOUT_S
from kvctl.tier.admin import PASSWORD_HINT, Admin, AuthFailed, InstanceFailure, is_auth_error
from kvctl.tier.targets import Target


def metrics_url(url: str) -> str:
    """``http://host:8000`` → ``http://host:8000/metrics``; a URL with a path is kept."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise InvalidInput(f"--engine-url must be an http(s) URL, got {masked(url)!r}")
    path = parts.path if parts.path not in ("", "/") else "/metrics"
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def engine_address(url: str, resolve: bool = True) -> tuple[tuple[str, int | None, str, str], frozenset[str]]:
    """What tells one engine from another: (scheme, port, /metrics path, query) and the addresses its host
    stands for. Two URLs are the same engine when the first parts are equal and the addresses meet.

    ``resolve``: the host's addresses from the resolver (``localhost`` and ``127.0.0.1`` meet), else (or when
    it does not resolve) its lower-cased name. The port is the scheme's default when none is given.
    """
    parts = urlsplit(metrics_url(url))
    host = (parts.hostname or "").lower()
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:  # not a port: the URL fails when read; told apart by its text
        port = None
    addrs = frozenset({host})
    if resolve and port is not None:
        try:
            addrs = frozenset(ai[4][0] for ai in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except (OSError, UnicodeError):
            pass
    return (parts.scheme, port, parts.path, parts.query), addrs


def fetch_metrics(url: str, timeout_s: float = READ_TIMEOUT_S, http: EngineHttp | None = None) -> str:
    """GET the engine's ``/metrics`` text; Unreachable with the (masked) URL and reason on failure.

    ``timeout_s`` bounds the whole read (:meth:`EngineHttp.get`); the body is capped at
    ``http.max_bytes`` (TooLarge past it); credentials in the URL or ``http.api_key`` are sent
    as an ``Authorization`` header.
    """
    return (http or EngineHttp()).get(metrics_url(url), timeout_s).decode("utf-8", errors="replace")


def valkey_info(target: Target, timeout_s: float = CHECK_TIMEOUT_S) -> dict[str, Any]:
    """``INFO all`` of one instance as a typed dict (``cmdstat_*`` and ``db0`` as dicts of their own:
    :func:`kvctl.tier.replies.parse_info`), within one deadline of ``timeout_s`` (the ``--timeout`` a user gave per
    scrape) for the connect and the whole reply."""
    try:
        with Admin(target.url, timeout_s, password=target.password) as a:
            return a.info("all")
    except InstanceFailure as e:
        raise valkey_read_error(target, e) from e


def valkey_read_error(target: Target, exc: BaseException) -> KvctlError:
    """What a failed read of an instance is: ``auth`` (up, refusing the password, as doctor says), else unreachable
    with the reason (refused, timed out, or what it answered instead of INFO)."""
    where = f"Valkey {target.name} at {target.host}:{target.port}"
    reason = exc.reason if isinstance(exc, InstanceFailure) else f"unreachable: {exc}"
    if is_auth_error(exc):
        return AuthFailed(f"{where} auth: {reason}; {PASSWORD_HINT}")
    return Unreachable(f"{where} {reason}")


@dataclass(frozen=True)
class GpuSample:
    """Utilisation of each visible GPU at one instant (NVML), or why there is none."""

    utilization_pct: list[float] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    note: str = ""

    @property
    def visible(self) -> bool:
        return bool(self.utilization_pct)

    def to_dict(self) -> dict[str, Any]:
        return {"utilization_pct": list(self.utilization_pct), "names": list(self.names), "note": self.note}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "GpuSample":
        d = d or {}
        return cls([float(x) for x in d.get("utilization_pct", [])], [str(x) for x in d.get("names", [])], str(d.get("note", "")))


def gpu_sample() -> GpuSample:
    """NVML utilisation per device; ``note`` says "no GPU visible (...)" when NVML has none."""
    try:
        import pynvml  # noqa: PLC0415 - from nvidia-ml-py
    except ImportError:
        return GpuSample(note="no GPU visible (nvidia-ml-py not installed)")
    try:
        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - NVMLError subclasses vary by driver state
        return GpuSample(note=f"no GPU visible (NVML: {e})")
    try:
        count = pynvml.nvmlDeviceGetCount()
        utils, names = [], []
        for i in range(count):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            utils.append(float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu))
            name = pynvml.nvmlDeviceGetName(h)
            names.append(name.decode() if isinstance(name, bytes) else str(name))
        if not utils:
            return GpuSample(note="no GPU visible (NVML reports 0 devices)")
        return GpuSample(utils, names)
    except Exception as e:  # noqa: BLE001
        return GpuSample(note=f"no GPU visible (NVML: {e})")
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
