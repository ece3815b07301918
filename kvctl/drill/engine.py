"""The drill engine: an OpenAI-compatible server that moves real KV chunks on a real tier and simulates a GPU.

    python -m kvctl.drill.engine --config ENGINE.yaml [--port N]

Prints ``PORT <n>`` once it listens on 127.0.0.1. A teaching and self-test tool for ``kvctl drill``,
never a stand-in for vLLM in the engine tests. Torch-free.

For each ``/v1/completions`` request (streamed or not) it

1. looks the prompt's full 256-token chunks up on the tier: each rank r asks its own instance for the
   chunks it owns (``c mod W == r``, :mod:`kvctl.connector.ownership`), keys from ``chunk_keys``; the
   hit is the longest prefix every owner has (``lookup: exists``), or, with ``lookup: index``, the
   prefix this engine remembers storing (stale once the tier evicts behind its back);
2. holds one simulated GPU (a FIFO lock): ``n/R`` seconds on a miss; ``T0 + (n - hit)/R`` plus the
   measured load time on a hit. The load really GETs every hit chunk into a buffer, each rank from its
   own instance in parallel. ``enable_async_loading: false`` loads while holding the GPU (the engine
   step waits: a single-server queue, ρ = λ·n·s/B) and chunk by chunk, each GET a round trip;
   ``true`` loads before taking the GPU (up to ``async_streams`` loads per rank at once), the
   prompt's chunks in one pipelined batch, and holds the GPU only for T0 and the rest. The link is
   simulated, the bytes are real: each rank's GETs are paced to ``stream_bytes_per_s`` plus
   ``chunk_rtt_s`` per round trip (a teaching model of why a pipelined loader sees more bandwidth;
   the paper's own fix for ρ > 1 at one instance is more instances, with async loading);
3. SETs the chunks it computed, each to its owner's instance.

With ``drill.load_policy: true`` each hit is first judged by the kvctl connector's own load-or-recompute
decision (:func:`kvctl.connector.policy.decide`): its predicted load (T0 and the fixed cost of a batch, the
bytes queued ahead of it on its owners' links and its own, over the link) against its recompute (its tokens
and the prefill work queued on the simulated GPU, over R); the part that loses is recomputed, and every
decision is counted as the connector counts it, ``kvctl:load_decisions{decision,reason}``. The drill
engine's decision has no deadline: a load it starts, it finishes.

``/metrics`` carries vLLM's names as ``kvctl diagnose`` reads them (``vllm:request_success``,
``vllm:num_requests_waiting``/``_running``, prompt-token, prefill-time, TTFT and latency histograms,
``vllm:external_prefix_cache_queries``/``_hits``) and the kvctl connector's (``kvctl:ranks``,
``kvctl:l2_get_bytes``, ``kvctl:l2_get_seconds``: per rank, the wall seconds with a GET in flight,
which is the sum of GET times when loads do not overlap). SIGHUP restarts the engine in place (its
config is read again, its queue and counters start from zero: what a real restart does); SIGTERM and
SIGINT stop it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvctl.connector import metric_names as MN
from kvctl.connector.metric_names import COUNTERS, LABELS, RANKS, RANKS_HELP
from kvctl.connector.ownership import chunk_keys, owner
from kvctl.connector.policy import Decision, Estimates, HitShape, TierQueue, decide
from kvctl.drill.config import EngineConfig, EngineSettings, read_config
from kvctl.core.procs import python_argv

KEY_FORMAT = "drill"
MAX_BODY_BYTES = 64 << 20
TOKEN_BUCKETS = (1, 16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
# vLLM's request-latency buckets, with finer ones below 0.3 s for the drill's scaled times
TIME_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


def token_ids(prompt: Any) -> list[int]:
    """Token ids of a prompt: a list as is, text one id per word (a stable hash, like the replay stand-in)."""
    if isinstance(prompt, list):
        return [int(t) for t in prompt]
    return [10 + zlib.crc32(w.encode()) % 50000 for w in str(prompt).split()]


class Metrics:
    def __init__(self, model: str, ranks: int) -> None:
        self.registry = r = CollectorRegistry()
        lab = ["model_name"]
        self.success = Counter(MN.VLLM_REQUEST_SUCCESS, "Finished requests.", lab + ["finished_reason"], registry=r).labels(model, "length")
        self.prompt_tokens = Counter(MN.VLLM_PROMPT_TOKENS, "Prefill tokens processed.", lab, registry=r).labels(model)
        self.generation_tokens = Counter(MN.VLLM_GENERATION_TOKENS, "Generation tokens processed.", lab, registry=r).labels(model)
        self.ext_queries = Counter(MN.VLLM_EXTERNAL_PREFIX_CACHE_QUERIES, "External prefix cache queries, in tokens.", lab, registry=r).labels(model)
        self.ext_hits = Counter(MN.VLLM_EXTERNAL_PREFIX_CACHE_HITS, "External prefix cache hits, in tokens.", lab, registry=r).labels(model)
        self.waiting = Gauge(MN.VLLM_NUM_REQUESTS_WAITING, "Requests waiting to be processed.", lab, registry=r).labels(model)
        self.running = Gauge(MN.VLLM_NUM_REQUESTS_RUNNING, "Requests on the (simulated) GPU.", lab, registry=r).labels(model)
        self.req_prompt = Histogram(MN.VLLM_REQUEST_PROMPT_TOKENS, "Prompt tokens per request.", lab, buckets=TOKEN_BUCKETS, registry=r).labels(model)
        hist = {
            "prefill": (MN.VLLM_REQUEST_PREFILL_TIME_SECONDS, "Time the request held the GPU for its prefill."),
            "ttft": (MN.VLLM_TIME_TO_FIRST_TOKEN_SECONDS, "Time to the first token."),
            "e2e": (MN.VLLM_E2E_REQUEST_LATENCY_SECONDS, "End-to-end request latency."),
            "queue": (MN.VLLM_REQUEST_QUEUE_TIME_SECONDS, "Time waiting before the GPU."),
        }
        self.hist = {k: Histogram(n, d, lab, buckets=TIME_BUCKETS, registry=r).labels(model) for k, (n, d) in hist.items()}
        Gauge(RANKS, RANKS_HELP, lab, registry=r).labels(model).set(ranks)
        self.kvctl = {n: Counter(n, d, lab, registry=r).labels(model) for n, d in COUNTERS.items() if n not in LABELS}
        self.decisions = Counter(MN.LOAD_DECISIONS, COUNTERS[MN.LOAD_DECISIONS], lab + list(LABELS[MN.LOAD_DECISIONS]), registry=r)
        self.model = model

    def decided(self, d: Decision) -> None:
        self.decisions.labels(self.model, d.decision, d.reason).inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)


class Tier:
    """The engine's side of the tier: per-rank clients, lookup, paced load, store (blocking; run in threads)."""

    def __init__(self, s: EngineSettings, metrics: Metrics) -> None:
        self.s, self.m = s, metrics
        self.W = s.ranks
        self.value = b"\x5a" * s.chunk_bytes
        self.index: set[str] = set()
        self._lock = threading.Lock()
        self._in_flight = [0] * self.W
        self._busy_since = [0.0] * self.W
        self.pool = ThreadPoolExecutor(max_workers=self.W * (s.async_streams + 2) + 4, thread_name_prefix="tier")
        self.clients = [self._client(u) for u in s.remote_urls]

    def _client(self, url: str) -> Any:
        if self.s.tier_client == "fixed-header":
            from kvctl.drill.native_client import FixedHeaderRespClient  # noqa: PLC0415

            return FixedHeaderRespClient(url, self.s.chunk_bytes)
        from kvctl.connector.resp import RespClient  # noqa: PLC0415

        return RespClient(url, timeout_s=self.s.tier_timeout_s, pool_size=self.s.async_streams + 2, parallel_gets=1)

    def close(self) -> None:
        for c in self.clients:
            try:
                c.close()
            except OSError:
                pass
        self.pool.shutdown(wait=False, cancel_futures=True)

    def keys(self, ids: list[int]) -> list[str]:
        full = len(ids) // self.s.chunk_tokens * self.s.chunk_tokens
        return chunk_keys(ids[:full], self.s.chunk_tokens, self.s.model, KEY_FORMAT) if full else []

    def _per_rank(self, fn, chunks: range) -> list[Any]:
        """``fn(rank, [chunk indexes it owns])`` on every rank that owns one, in parallel; results (or exceptions) by rank."""
        owned = {r: [c for c in chunks if owner(c, self.W) == r] for r in range(self.W)}
        futs = {r: self.pool.submit(fn, r, cs) for r, cs in owned.items() if cs}
        wait(list(futs.values()))
        out: list[Any] = [None] * self.W
        for r, f in futs.items():
            out[r] = f.exception() or f.result()
        return out

    def lookup(self, keys: list[str]) -> int:
        """Chunks of the longest prefix the tier holds (every owner asked; an owner that errs counts as missing)."""
        if not keys:
            return 0
        if self.s.lookup == "index":
            with self._lock:
                present = [k in self.index for k in keys]
        else:
            present = [False] * len(keys)
            res = self._per_rank(lambda r, cs: self.clients[r].batched_exists([keys[c] for c in cs]), range(len(keys)))
            for r, got in enumerate(res):
                if isinstance(got, BaseException):
                    self.m.kvctl[MN.LOOKUP_TIMEOUTS].inc()
                    continue
                if got is not None:
                    for c, ok in zip([c for c in range(len(keys)) if owner(c, self.W) == r], got):
                        present[c] = bool(ok)
        hit = next((i for i, p in enumerate(present) if not p), len(present))
        self.m.kvctl[MN.CHUNKS_HIT].inc(hit)
        self.m.kvctl[MN.CHUNKS_MISSED].inc(len(keys) - hit)
        return hit

    def _busy(self, rank: int, start: bool) -> None:
        with self._lock:
            now = time.monotonic()
            if start:
                if self._in_flight[rank] == 0:
                    self._busy_since[rank] = now
                self._in_flight[rank] += 1
            else:
                self._in_flight[rank] -= 1
                if self._in_flight[rank] == 0:
                    self.m.kvctl[MN.L2_GET_SECONDS].inc(now - self._busy_since[rank])

    def _load_rank(self, rank: int, chunks: list[int], keys: list[str], pipelined: bool) -> bool:
        """GET one rank's chunks: one pipelined batch (async) or chunk by chunk, a round trip each (sync); paced."""
        s = self.s
        bufs = [bytearray(s.chunk_bytes) for _ in chunks]
        batches = [list(range(len(chunks)))] if pipelined else [[i] for i in range(len(chunks))]
        ok: list[bool] = []
        self._busy(rank, True)
        try:
            t0 = time.monotonic()
            for b in batches:
                ok += self.clients[rank].batched_get([keys[chunks[i]] for i in b], [bufs[i] for i in b])
                due = len(ok) * s.chunk_bytes / s.stream_bytes_per_s + (1 if pipelined else len(ok)) * s.chunk_rtt_s
                pace = due - (time.monotonic() - t0)
                if pace > 0:
                    time.sleep(pace)
        finally:
            self._busy(rank, False)
        if all(ok):
            self.m.kvctl[MN.L2_GET_BYTES].inc(s.chunk_bytes * len(chunks))
        return all(ok)

    def load(self, keys: list[str], hit: int, pipelined: bool) -> bool:
        """GET the first ``hit`` chunks into buffers, each rank its own from its own instance; False when any came up short."""
        res = self._per_rank(lambda r, cs: self._load_rank(r, cs, keys, pipelined), range(hit))
        ok = all(x is None or x is True for x in res)
        if not ok:
            self.m.kvctl[MN.LOAD_ERRORS].inc()
        return ok

    def store(self, keys: list[str], start: int) -> None:
        """SET chunks ``start..`` on their owners (an instance that errs is skipped: the chunk stays uncached)."""
        if start >= len(keys):
            return

        def put(r: int, cs: list[int]) -> None:
            self.clients[r].batched_set([keys[c] for c in cs], [self.value] * len(cs))
            with self._lock:
                self.index.update(keys[c] for c in cs)

        self._per_rank(put, range(start, len(keys)))


class DrillEngine:
    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg, self.s = cfg, cfg.settings
        self.m = Metrics(self.s.model, self.s.ranks)
        self.tier = Tier(self.s, self.m)
        self.gpu = asyncio.Lock()  # FIFO: asyncio.Lock wakes waiters in arrival order
        self.load_slots = asyncio.Semaphore(self.s.async_streams)
        self.waiting = self.running = self.served = 0
        # what the decision sees (load_policy): bytes of the loads queued or running, per rank, and how many;
        # prompt tokens waiting for or on the simulated GPU
        self.queued_bytes = [0] * self.s.ranks
        self.queued_loads = 0
        self.gpu_tokens = 0

    def _decide(self, hit: int) -> int:
        """The chunks of a ``hit`` the connector's decision loads (load_policy); the decision counted."""
        s = self.s
        shape = HitShape(0, hit, 0, s.chunk_tokens, s.chunk_bytes, s.ranks)
        est = Estimates(s.prefill_tokens_per_s, s.t0_s + s.chunk_rtt_s, (s.stream_bytes_per_s,) * s.ranks)
        if self.cfg.async_loading:  # the load waits behind the tier's queue; the GPU computes its queue meanwhile
            d = decide(shape, est, TierQueue(tuple(self.queued_bytes), self.queued_loads), float(self.gpu_tokens))
        else:  # a synchronous load holds the engine step: judged against its own tokens
            d = decide(shape, est, TierQueue((0,) * s.ranks))
        self.m.decided(d)
        return d.tokens // s.chunk_tokens

    def _queue(self, hit: int, sign: int) -> None:
        for c in range(hit):
            self.queued_bytes[owner(c, self.s.ranks)] += sign * self.s.chunk_bytes
        self.queued_loads += sign if hit else 0

    def _gauges(self) -> None:
        self.m.waiting.set(self.waiting)
        self.m.running.set(self.running)

    async def _thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.tier.pool, fn, *args)

    async def _load(self, keys: list[str], hit: int) -> int:
        if not hit:
            return 0
        return hit if await self._thread(self.tier.load, keys, hit, self.cfg.async_loading) else 0

    async def serve_one(self, ids: list[int]) -> tuple[int, float]:
        """Run one request through lookup, GPU and store: (hit tokens, seconds to its first token)."""
        s, n = self.s, len(ids)
        arrived = time.monotonic()
        self.waiting += 1
        self._gauges()
        on_gpu = False
        try:
            keys = await self._thread(self.tier.keys, ids)
            hit = await self._thread(self.tier.lookup, keys)
            if s.load_policy and hit:
                hit = self._decide(hit)
            if self.cfg.async_loading:
                planned = hit
                self._queue(planned, +1)
                try:
                    async with self.load_slots:
                        hit = await self._load(keys, hit)
                finally:
                    self._queue(planned, -1)
            work = n - hit * s.chunk_tokens  # what the GPU computes of it: queued work the decision sees
            self.gpu_tokens += work
            try:
                async with self.gpu:
                    self.waiting -= 1
                    self.running += 1
                    on_gpu = True
                    self._gauges()
                    start = time.monotonic()
                    self.m.hist["queue"].observe(start - arrived)
                    if not self.cfg.async_loading:
                        hit = await self._load(keys, hit)
                    hit_tokens = hit * s.chunk_tokens
                    await asyncio.sleep((s.t0_s if hit else 0.0) + (n - hit_tokens) / s.prefill_tokens_per_s)
                    prefill = time.monotonic() - start
            finally:
                self.gpu_tokens -= work
            await self._thread(self.tier.store, keys, hit)
        finally:
            if on_gpu:
                self.running -= 1
            else:
                self.waiting -= 1
            self._gauges()
        ttft = time.monotonic() - arrived
        self.m.hist["prefill"].observe(prefill)
        self.m.hist["ttft"].observe(ttft)
        self.m.hist["e2e"].observe(ttft)
        self.m.prompt_tokens.inc(n)
        self.m.req_prompt.observe(n)
        self.m.ext_queries.inc(n)
        self.m.ext_hits.inc(hit_tokens)
        self.m.kvctl[MN.REMOTE_HIT_TOKENS].inc(hit_tokens)
        self.m.success.inc()
        return hit_tokens, ttft

    # --- HTTP --------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
            ids = token_ids(body["prompt"])
            out_tokens = max(1, int(body.get("max_tokens") or 1))
        except (ValueError, KeyError, TypeError) as e:
            return web.json_response({"error": {"message": f"bad request: {e}"}}, status=400)
        if not ids:
            return web.json_response({"error": {"message": "empty prompt"}}, status=400)
        hit_tokens, _ = await self.serve_one(ids)
        self.m.generation_tokens.inc(out_tokens)
        self.served += 1
        rid = f"cmpl-drill-{self.served}"
        usage = {"prompt_tokens": len(ids), "completion_tokens": out_tokens, "total_tokens": len(ids) + out_tokens,
                 "prompt_tokens_details": {"cached_tokens": hit_tokens}}
        if not body.get("stream"):
            choice = {"index": 0, "text": " x" * out_tokens, "finish_reason": "length"}
            return web.json_response({"id": rid, "object": "text_completion", "model": self.s.model, "choices": [choice], "usage": usage})
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(out_tokens):
            chunk = {"id": rid, "object": "text_completion", "model": self.s.model,
                     "choices": [{"index": 0, "text": " x", "finish_reason": "length" if i == out_tokens - 1 else None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(f"data: {json.dumps({'id': rid, 'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            ids = token_ids((await request.json())["prompt"])
        except (ValueError, KeyError, TypeError) as e:
            return web.json_response({"error": {"message": f"bad request: {e}"}}, status=400)
        return web.json_response({"count": len(ids), "max_model_len": 1 << 20, "tokens": ids})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.s.model, "object": "model", "owned_by": "kvctl-drill"}]})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.m.text(), content_type="text/plain")

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/health", self.health)
        return app


async def _serve(cfg: EngineConfig, port: int) -> tuple[str, int]:
    """Serve until SIGTERM/SIGINT ("stop") or SIGHUP ("restart"); (what, the port it listened on)."""
    engine = DrillEngine(cfg)
    runner = web.AppRunner(engine.app(), access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port, backlog=1024, reuse_address=True, shutdown_timeout=0.5)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    done: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    loop = asyncio.get_running_loop()
    for sig, what in ((signal.SIGTERM, "stop"), (signal.SIGINT, "stop"), (signal.SIGHUP, "restart")):  # before PORT is said:
        loop.add_signal_handler(sig, lambda w=what: done.done() or done.set_result(w))  # a SIGHUP right after it restarts
    mode = "asynchronous" if cfg.async_loading else "synchronous"
    sys.stdout.write(f"PORT {bound}\n")
    sys.stdout.write(f"drill engine pid {os.getpid()}: {cfg.settings.ranks} rank(s), {mode} loading, tier client {cfg.settings.tier_client}\n")
    sys.stdout.flush()
    what = await done
    try:
        await asyncio.wait_for(runner.cleanup(), timeout=2.0)
    except (asyncio.TimeoutError, OSError):
        pass
    engine.tier.close()
    return what, bound


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kvctl.drill.engine", description="kvctl's drill engine (see the module docstring).")
    ap.add_argument("--config", required=True, help="drill engine config (written by kvctl drill)")
    ap.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (0: a free port the kernel picks, kept across SIGHUP restarts)")
    args = ap.parse_args(argv)
    cfg = read_config(args.config)
    what, bound = asyncio.run(_serve(cfg, args.port))
    sys.stdout.flush()
    if what == "restart":  # a restart keeps the port it had: its clients (a replay, a drill) know the engine by it
        argv = python_argv("-m", "kvctl.drill.engine", "--config", args.config, "--port", str(bound))
        os.execv(argv[0], argv)


if __name__ == "__main__":
    main()
    # Only here, in the drill engine's own process (`python -m kvctl.drill.engine`, which kvctl drill starts as a
    # child): a tier thread blocked in a socket read (the missing-key drill) must not hold the exit. main() itself
    # returns, so a caller that runs it in-process is never ended by it (issue 44 defect 20).
    os._exit(0)
