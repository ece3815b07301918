"""A process's TCP connections and what its event loops wait on, from ``/proc`` (Linux).

py-spy cannot show a suspended coroutine, so a ``redis.asyncio`` GET that
never gets its reply leaves only an event loop idle in ``select``. The
kernel still knows what that loop waits for: the file descriptors registered
in the process's epoll instances (``/proc/PID/fdinfo/FD``, ``tfd:`` lines),
which map to sockets (``/proc/PID/fd/N`` → ``socket:[inode]``) and to TCP
endpoints (``/proc/PID/net/tcp{,6}``). :func:`read_sockets` returns that map;
None when ``/proc`` is not readable for the pid (another user, not Linux).
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass

TCP_STATES = {"01": "ESTABLISHED", "02": "SYN_SENT", "06": "TIME_WAIT", "08": "CLOSE_WAIT", "0A": "LISTEN"}


@dataclass(frozen=True)
class TcpConn:
    fd: int
    local: str
    remote: str
    state: str  # "ESTABLISHED", "LISTEN", ...

    def __str__(self) -> str:
        return f"{self.local} → {self.remote}" if self.state != "LISTEN" else f"listening on {self.local}"


@dataclass(frozen=True)
class ProcSockets:
    tcp: tuple[TcpConn, ...]
    epoll_fds: frozenset[int]  # descriptors registered in any epoll instance of the process

    @property
    def established(self) -> list[TcpConn]:
        return [c for c in self.tcp if c.state == "ESTABLISHED"]

    @property
    def loop_waits_on(self) -> list[TcpConn]:
        """Established TCP connections an event loop (epoll) is waiting to read from."""
        return [c for c in self.established if c.fd in self.epoll_fds]

    @property
    def loop_listens(self) -> bool:
        """An event loop watches a listening socket: a server's loop, idle between clients."""
        return any(c.state == "LISTEN" and c.fd in self.epoll_fds for c in self.tcp)


def _addr(hex_addr: str) -> str:
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        ip = socket.inet_ntop(socket.AF_INET, struct.pack("<I", struct.unpack(">I", raw)[0]))
    else:
        words = struct.unpack(">4I", raw)
        ip = socket.inet_ntop(socket.AF_INET6, struct.pack("<4I", *words))
        ip = f"[{ip}]"
    return f"{ip}:{int(port, 16)}"


def _tcp_table(pid: int) -> dict[int, tuple[str, str, str]]:
    """inode → (local, remote, state) for every TCP socket in the pid's network namespace."""
    out: dict[int, tuple[str, str, str]] = {}
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{name}") as fh:
                next(fh, None)
                for line in fh:
                    f = line.split()
                    if len(f) < 10:
                        continue
                    out[int(f[9])] = (_addr(f[1]), _addr(f[2]), TCP_STATES.get(f[3], f[3]))
        except (OSError, ValueError):
            continue
    return out


def read_sockets(pid: int) -> ProcSockets | None:
    base = f"/proc/{pid}"
    try:
        fds = os.listdir(f"{base}/fd")
    except OSError:
        return None
    socket_inodes: dict[int, int] = {}
    epoll: set[int] = set()
    for name in fds:
        try:
            link = os.readlink(f"{base}/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:["):
            socket_inodes[int(link[8:-1])] = int(name)
        elif link == "anon_inode:[eventpoll]":
            try:
                with open(f"{base}/fdinfo/{name}") as fh:
                    epoll.update(int(line.split()[1]) for line in fh if line.startswith("tfd:"))
            except (OSError, ValueError, IndexError):
                continue
    table = _tcp_table(pid)
    conns = tuple(TcpConn(fd, *table[ino]) for ino, fd in sorted(socket_inodes.items(), key=lambda x: x[1]) if ino in table)
    return ProcSockets(conns, frozenset(epoll))
