"""``kvctl exporter``'s HTTP side: where it listens (``--listen``, loopback or not) and the server that runs the sampler.

:class:`kvctl.ops.exporter.Exporter` holds the store and the sampling; :class:`Server` serves it with
prometheus_client and owns the sampler thread.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable

from kvctl.core.errors import InvalidInput
from kvctl.core.threads import join_all
from kvctl.ops.exporter import STOP_GRACE_S, WAIT_SLICE_S, Exporter, Round


@dataclass(frozen=True)
class Listen:
    host: str
    port: int
    loopback: bool


def parse_listen(text: str) -> Listen:
    """``HOST:PORT`` (``[v6]:PORT``; port 0 picks a free one) with whether HOST is loopback only."""
    host, sep, port_s = text.rpartition(":")
    if not sep or not host:
        raise InvalidInput(f"--listen must be HOST:PORT, got {text!r}")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        port = int(port_s)
    except ValueError:
        raise InvalidInput(f"--listen port must be a number, got {port_s!r}") from None
    if not 0 <= port <= 65535:
        raise InvalidInput(f"--listen port must be in 0..65535, got {port}")
    return Listen(host, port, is_loopback(host))


def is_loopback(host: str) -> bool:
    """True when every address ``host`` resolves to is a loopback address."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        addrs = {ai[4][0] for ai in socket.getaddrinfo(host, None)}
    except OSError as e:
        raise InvalidInput(f"--listen host {host!r} does not resolve: {e}") from e
    return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


class Server:
    """The exporter's HTTP endpoint and sampler thread; :meth:`stop` ends both."""

    def __init__(self, exporter: Exporter, listen: Listen, on_round: Callable[[Round], None] | None = None, sample: bool = True) -> None:
        """Serve ``exporter`` on ``listen``; with ``sample`` False no sampler thread starts (the caller steps it)."""
        from prometheus_client import CollectorRegistry, start_http_server  # noqa: PLC0415

        self.exporter = exporter
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(exporter)
        try:
            self._httpd, self._http_thread = start_http_server(listen.port, listen.host, self.registry)
        except OSError as e:
            raise InvalidInput(f"cannot listen on {listen.host}:{listen.port}: {e.strerror or e}") from e
        self.host, self.port = listen.host, self._httpd.server_address[1]
        self.loopback = listen.loopback
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=exporter.run, args=(self._stop, on_round), name="kvctl-exporter-sampler", daemon=True)
        if sample:
            self._sampler.start()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def wait(self, timeout_s: float | None) -> bool:
        """Block until :meth:`stop` or ``timeout_s``; True when stopped.

        Waits in short slices: a signal the kernel hands to another thread (it does so when the main
        thread already has one pending) only runs its Python handler once the main thread wakes, so one
        unbounded wait could sleep through SIGTERM for good."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = WAIT_SLICE_S if deadline is None else min(WAIT_SLICE_S, deadline - time.monotonic())
            if left <= 0:
                return self._stop.is_set()
            if self._stop.wait(left):
                return True

    def request_stop(self) -> None:
        """Ask :meth:`wait` to return (safe from a signal handler)."""
        self._stop.set()

    def stop(self) -> None:
        """Stop sampling and serving within about STOP_GRACE_S: reads in flight are cut, not waited for.

        Waits (bounded) only for the threads this server started (:meth:`threads`); what is still alive then is
        left behind (:meth:`stragglers`), and, every one a daemon thread, holds neither the caller nor the exit."""
        deadline = time.monotonic() + STOP_GRACE_S
        self._stop.set()
        self.exporter.cancel()
        self._httpd.shutdown()
        self._httpd.server_close()
        join_all([self._http_thread, self._sampler], max(0.0, deadline - time.monotonic()))
        self.exporter.close()
        join_all(self.exporter.threads(), max(0.0, deadline - time.monotonic()))

    def threads(self) -> list[threading.Thread]:
        """Every thread this server started: its HTTP thread, its sampler (when it samples) and the exporter's readers."""
        return [self._http_thread, *([self._sampler] if self._sampler.ident is not None else []), *self.exporter.threads()]

    def stragglers(self) -> list[threading.Thread]:
        """This server's threads still alive (after :meth:`stop`: reads that did not return when cut); never another's."""
        return [t for t in self.threads() if t.is_alive()]
