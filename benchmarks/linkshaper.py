#!/usr/bin/env python3
"""A slow network link on loopback: a TCP forwarder with one token bucket per direction.

    python benchmarks/linkshaper.py --listen 127.0.0.1:7001 --upstream 127.0.0.1:6379 --down-mbps 2

Every connection accepted on ``--listen`` is forwarded to ``--upstream``. Bytes from the server to
the client (GET replies) draw from one ``--down-mbps`` bucket shared by every connection, bytes the
other way (SETs) from one ``--up-mbps`` bucket: a full-duplex link of that bandwidth in front of one
Valkey instance, so a real server behaves like one reached over a slower network. Waiters are
served first come first served in slices of ``--slice-bytes``, so a small reply (an EXISTS)
waits for at most one slice of every other busy connection, not for a whole value.

``simulate_vs_replay.py`` puts one in front of each tier instance to make ρ > 1 reachable on this
machine (a loopback Valkey serves GBs/s; the tiny model's prompts need MB/s). It prints
``ready <port>`` once listening and runs until SIGTERM/SIGINT, which end it within STOP_GRACE_S
with clients connected: every connection it holds is aborted and its tasks cancelled (Python 3.12's
``Server.wait_closed`` waits for every connection, so the server alone would wait for the clients).

Both addresses must be loopback (127.0.0.0/8, ::1, ``localhost``): the relay has no password of its own
and stands in front of a Valkey that usually has none. ``--allow-non-loopback`` takes others, with a
warning.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import signal
import sys
import time

MB = 1e6
STOP_GRACE_S = 2.0  # the most a stop signal waits for the connections to close and the tasks to end
CONNECT_TIMEOUT_S = 10.0  # the most a new client waits for the upstream connection


class Bucket:
    """A token bucket of ``rate`` bytes/s holding at most ``burst`` bytes; ``take`` waits FIFO."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self.tokens, self.stamp = burst, time.monotonic()
        self.lock = asyncio.Lock()  # asyncio.Lock wakes waiters in arrival order

    async def take(self, n: int) -> None:
        if self.rate <= 0:  # unlimited
            return
        async with self.lock:
            while True:
                now = time.monotonic()
                self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
                self.stamp = now
                if self.tokens >= n:
                    self.tokens -= n
                    return
                await asyncio.sleep((n - self.tokens) / self.rate)


async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, bucket: Bucket, slice_bytes: int) -> None:
    try:
        while data := await reader.read(slice_bytes):
            await bucket.take(len(data))
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        try:
            writer.close()
        except (ConnectionError, OSError, RuntimeError):
            pass


async def serve(args: argparse.Namespace) -> None:
    (host, port), (up_host, up_port) = args.listen, args.upstream
    # a burst of a few slices absorbs the event loop's late wake-ups without letting a whole value through
    down = Bucket(args.down_mbps * MB, 4 * args.slice_bytes)
    up = Bucket(args.up_mbps * MB, 4 * args.slice_bytes)
    writers: set[asyncio.StreamWriter] = set()  # every connection held, both sides: aborted at a stop
    tasks: set[asyncio.Task] = set()  # every client's task: cancelled at a stop

    async def on_client(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        tasks.add(task)
        writers.add(cw)
        sw = None
        try:
            sr, sw = await asyncio.wait_for(asyncio.open_connection(up_host, up_port), CONNECT_TIMEOUT_S)
            writers.add(sw)
            await asyncio.gather(pump(cr, sw, up, args.slice_bytes), pump(sr, cw, down, args.slice_bytes))
        except (OSError, asyncio.TimeoutError):
            pass
        except asyncio.CancelledError:  # a stop: the task ends normally (3.12.1's done callback calls task.exception(),
            pass  # which raises for a cancelled task and logs a traceback)
        finally:
            for w in (cw, sw):
                if w is not None:
                    writers.discard(w)
                    w.close()
            tasks.discard(task)

    server = await asyncio.start_server(on_client, host, port, limit=args.slice_bytes)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"ready {server.sockets[0].getsockname()[1]}", flush=True)
    try:
        await stop.wait()
    finally:
        await shut(server, writers, tasks)


async def shut(server: asyncio.Server, writers: set[asyncio.StreamWriter], tasks: set[asyncio.Task]) -> None:
    """Stop accepting, abort every connection, cancel every client's task, and wait at most STOP_GRACE_S for it all.

    ``Server.wait_closed`` returns at once on 3.11 but waits for every connection on 3.12 and later, so the
    connections are ended here: 3.13's ``abort_clients`` where it exists, and on every version the writers
    this server holds (3.12 has no way to reach a server's transports)."""
    server.close()
    await asyncio.sleep(0)  # a connection accepted just before the close gets its task (and its writer) now
    if hasattr(server, "abort_clients"):  # 3.13: every transport the server accepted, a task or not
        server.abort_clients()
    for w in list(writers):
        w.transport.abort()
    for t in list(tasks):
        t.cancel()
    deadline = loop_time() + STOP_GRACE_S
    if tasks:
        await asyncio.wait(list(tasks), timeout=STOP_GRACE_S)
    try:
        await asyncio.wait_for(server.wait_closed(), max(0.05, deadline - loop_time()))
    except asyncio.TimeoutError:  # a connection left over: the process ends anyway
        pass


def loop_time() -> float:
    return asyncio.get_running_loop().time()


def address(text: str, option: str, *, allow_port_0: bool) -> tuple[str, int]:
    """(host, port) of ``HOST:PORT`` (``[V6]:PORT`` too); ValueError naming ``option`` when it is not one."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") != host.endswith("]"):
        raise ValueError(f"{option} {text!r}: not HOST:PORT (an IPv6 address goes in brackets: [::1]:6379)")
    host = host[1:-1] if host.startswith("[") else host
    if not sep or not port.isdecimal() or not (0 if allow_port_0 else 1) <= int(port) <= 65535:
        raise ValueError(f"{option} {text!r}: not HOST:PORT with a port of {0 if allow_port_0 else 1}-65535")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 (an IPv4-mapped loopback too) or ``localhost``: nothing else, no name resolved."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--listen", required=True, help="HOST:PORT to accept on, loopback (port 0: any free one)")
    ap.add_argument("--upstream", required=True, help="HOST:PORT of the real server, loopback")
    ap.add_argument("--down-mbps", type=float, required=True, help="server -> client MB/s (0: unlimited)")
    ap.add_argument("--up-mbps", type=float, default=0.0, help="client -> server MB/s (0: unlimited)")
    ap.add_argument("--slice-bytes", type=int, default=16384, help="bytes forwarded per bucket draw")
    ap.add_argument("--allow-non-loopback", action="store_true",
                    help="take a --listen or --upstream address that is not loopback (a relay without a password: warned)")
    args = ap.parse_args(argv)
    if args.down_mbps < 0 or args.up_mbps < 0 or args.slice_bytes < 1:
        ap.error("rates must be >= 0 and --slice-bytes >= 1")
    try:
        args.listen = address(args.listen, "--listen", allow_port_0=True)
        args.upstream = address(args.upstream, "--upstream", allow_port_0=False)
    except ValueError as e:
        print(f"linkshaper: error: {e}", file=sys.stderr)
        return 2
    for option, (host, _) in (("--listen", args.listen), ("--upstream", args.upstream)):
        if is_loopback(host):
            continue
        if not args.allow_non_loopback:
            print(f"linkshaper: error: {option} {host or '(every address)'} is not a loopback address (127.0.0.0/8, ::1, "
                  f"localhost): refused; --allow-non-loopback takes it", file=sys.stderr)
            return 2
        print(f"linkshaper: warning: {option} {host or '(every address)'} is not a loopback address: "
              f"{'anyone who reaches it can use the server behind it' if option == '--listen' else 'bytes go off this host'}",
              file=sys.stderr, flush=True)
    if args.listen[0].lower().rstrip(".") == "localhost":  # one socket, so the port printed is the only one
        args.listen = ("127.0.0.1", args.listen[1])
    asyncio.run(serve(args))
    return 0


def spawn(upstream_host: str, upstream_port: int, down_mbps: float, slice_bytes: int = 16384):
    """(process, port): a shaper in front of ``upstream_host:upstream_port`` in a session of its own, once it is
    listening on a free loopback port (the helper the benchmarks start their links with). It dies with this process
    (SIGKILL included)."""
    import subprocess  # noqa: PLC0415

    from kvctl.core.procs import die_with_parent  # noqa: PLC0415

    p = subprocess.Popen([sys.executable, __file__, "--listen", "127.0.0.1:0", "--upstream", f"{upstream_host}:{upstream_port}",
                          "--down-mbps", str(down_mbps), "--slice-bytes", str(slice_bytes)],
                         stdout=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=die_with_parent())
    line = p.stdout.readline().split()
    if not line or line[0] != "ready":
        p.kill()
        raise RuntimeError("linkshaper did not start")
    return p, int(line[1])


def stop(procs, grace_s: float = 5.0) -> None:
    """SIGTERM each process given (a shaper :func:`spawn` started, or another the caller started: by its pid, nothing
    else), kill what is left after ``grace_s``, and close a pipe it was started with."""
    import subprocess  # noqa: PLC0415

    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=grace_s)
        if p.stdout is not None:  # spawn's pipe of the "ready" line
            p.stdout.close()


if __name__ == "__main__":
    sys.exit(main())
