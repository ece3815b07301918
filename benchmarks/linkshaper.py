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
``ready <port>`` once listening and runs until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time

MB = 1e6


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
    up_host, up_port = args.upstream.rsplit(":", 1)
    host, port = args.listen.rsplit(":", 1)
    # a burst of a few slices absorbs the event loop's late wake-ups without letting a whole value through
    down = Bucket(args.down_mbps * MB, 4 * args.slice_bytes)
    up = Bucket(args.up_mbps * MB, 4 * args.slice_bytes)

    async def on_client(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            sr, sw = await asyncio.open_connection(up_host, int(up_port))
        except OSError:
            cw.close()
            return
        await asyncio.gather(pump(cr, sw, up, args.slice_bytes), pump(sr, cw, down, args.slice_bytes))

    server = await asyncio.start_server(on_client, host, int(port), limit=args.slice_bytes)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"ready {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--listen", required=True, help="HOST:PORT to accept on (port 0: any free one)")
    ap.add_argument("--upstream", required=True, help="HOST:PORT of the real server")
    ap.add_argument("--down-mbps", type=float, required=True, help="server -> client MB/s (0: unlimited)")
    ap.add_argument("--up-mbps", type=float, default=0.0, help="client -> server MB/s (0: unlimited)")
    ap.add_argument("--slice-bytes", type=int, default=16384, help="bytes forwarded per bucket draw")
    args = ap.parse_args(argv)
    if args.down_mbps < 0 or args.up_mbps < 0 or args.slice_bytes < 1:
        ap.error("rates must be >= 0 and --slice-bytes >= 1")
    asyncio.run(serve(args))
    return 0


def spawn(upstream_host: str, upstream_port: int, down_mbps: float, slice_bytes: int = 16384):
    """(process, port): a shaper in front of ``upstream_host:upstream_port`` in a session of its own, once it is
    listening on a free loopback port (the helper the benchmarks start their links with)."""
    import subprocess  # noqa: PLC0415

    p = subprocess.Popen([sys.executable, __file__, "--listen", "127.0.0.1:0", "--upstream", f"{upstream_host}:{upstream_port}",
                          "--down-mbps", str(down_mbps), "--slice-bytes", str(slice_bytes)],
                         stdout=subprocess.PIPE, text=True, start_new_session=True)
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
