"""A stand-in OpenAI completions server for replay tests (a real HTTP server in its own process).

    python -m tests.replay.standin [--delay-s S] [--slow-after K --slow-delay-s S]

Prints ``PORT <n>`` on stdout once it listens on 127.0.0.1. It records the arrival time
(``time.monotonic()``, system-wide on Linux, so comparable with the test process) of every
completion request, answers after ``--delay-s`` (requests after the K-th wait ``--slow-delay-s``),
and reports usage with ``prompt_tokens_details.cached_tokens`` from a prefix cache of 16-token
blocks, like vLLM with ``--enable-prompt-tokens-details``. A prompt containing the word FAIL gets
HTTP 500. A prompt containing ``ODD_LIST``, ``ODD_NULL`` or ``ODD_USAGE`` gets an answer the OpenAI
API does not allow: an SSE ``data: [1,2]`` or ``data: null`` line (a ``[1,2]`` body without streaming),
or ``"usage": [1]`` (tests/hostile). ``GET /_arrivals`` returns the records; ``/tokenize`` (absent with
``--no-tokenize``), ``/v1/models`` (with ``max_model_len`` when ``--max-model-len`` is given) and
``/metrics`` answer as vLLM's do (the subset kvctl reads); ``--metrics-delay-s`` holds every
``/metrics`` answer after the first (a scrape after the run that hangs); ``--metrics-fail-first N``
answers the first N with HTTP 503. ``--lmcache-publish-s S`` adds LMCache's ``lmcache:num_hit_tokens`` and
``lmcache:num_remote_read_bytes`` (``LMCACHE_BYTES_PER_TOKEN`` a cached token) as LMCache 0.5.6 publishes them: a
task of its own copies the live counts to what ``/metrics`` shows, then sleeps S seconds (its stats logger, every
10 s), so between publishes ``/metrics`` lags what was served.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import zlib

from aiohttp import web

BLOCK = 16
MODEL = "standin"
#: bytes LMCache would read for one cached token (the stand-in's lmcache:num_remote_read_bytes)
LMCACHE_BYTES_PER_TOKEN = 100
#: Answers the OpenAI API does not allow, chosen by a word in the prompt (the SSE data line sent).
ODD = {"ODD_LIST": "[1,2]", "ODD_NULL": "null", "ODD_USAGE": '{"choices":[],"usage":[1]}'}


def token_ids(prompt) -> list[int]:
    if isinstance(prompt, list):
        return [int(t) for t in prompt]
    return [10 + zlib.crc32(w.encode()) % 1000 for w in str(prompt).split()]


class Standin:
    def __init__(self, delay_s: float, slow_after: int | None, slow_delay_s: float, max_model_len: int | None = None) -> None:
        self.delay_s, self.slow_after, self.slow_delay_s = delay_s, slow_after, slow_delay_s
        self.max_model_len = max_model_len
        self.metrics_delay_s = 0.0
        self.metrics_fail_first = 0
        self.metrics_reads = 0
        self.arrivals: list[dict] = []
        self.blocks: set[int] = set()
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.lmcache_publish_s = 0.0
        self.published_hits = 0  # cached tokens as of LMCache's last publish

    async def lmcache_publisher(self) -> None:
        """LMCache's stats logger: publish what was counted, then wait the interval (lmcache/observability.py)."""
        while True:
            self.published_hits = self.cached_tokens
            await asyncio.sleep(self.lmcache_publish_s)

    def _cached(self, ids: list[int]) -> int:
        cached = 0
        for end in range(BLOCK, len(ids) + 1, BLOCK):
            if hash(tuple(ids[:end])) in self.blocks:
                cached = end
            else:
                break
        for end in range(BLOCK, len(ids) + 1, BLOCK):
            self.blocks.add(hash(tuple(ids[:end])))
        return cached

    async def completions(self, request: web.Request) -> web.StreamResponse:
        arrived = time.monotonic()
        body = await request.json()
        n = len(self.arrivals)
        ids = token_ids(body["prompt"])
        self.arrivals.append({"t": arrived, "n_tokens": len(ids), "max_tokens": body.get("max_tokens")})
        delay = self.slow_delay_s if self.slow_after is not None and n >= self.slow_after else self.delay_s
        await asyncio.sleep(delay)
        if "FAIL" in str(body["prompt"]):
            return web.json_response({"error": {"message": "injected failure"}}, status=500)
        odd = next((k for k in ODD if k in str(body["prompt"])), None)
        if odd is not None:
            return await self._odd(request, odd, bool(body.get("stream")))
        cached = self._cached(ids)
        self.prompt_tokens += len(ids)
        self.cached_tokens += cached
        out_tokens = int(body.get("max_tokens") or 1)
        usage = {"prompt_tokens": len(ids), "completion_tokens": out_tokens, "total_tokens": len(ids) + out_tokens,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        choice = {"index": 0, "text": " x" * out_tokens, "finish_reason": "length"}
        if not body.get("stream"):
            return web.json_response({"id": f"cmpl-{n}", "object": "text_completion", "model": MODEL,
                                      "choices": [choice], "usage": usage})
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(out_tokens):
            chunk = {"id": f"cmpl-{n}", "object": "text_completion", "model": MODEL,
                     "choices": [{"index": 0, "text": " x", "finish_reason": "length" if i == out_tokens - 1 else None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(f"data: {json.dumps({'id': f'cmpl-{n}', 'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _odd(self, request: web.Request, kind: str, stream: bool) -> web.StreamResponse:
        if not stream:
            return web.json_response([1, 2] if kind != "ODD_USAGE" else {"choices": [], "usage": [1]})
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(f"data: {ODD[kind]}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        ids = token_ids(body["prompt"])
        return web.json_response({"count": len(ids), "max_model_len": 1 << 20, "tokens": ids})

    async def models(self, request: web.Request) -> web.Response:
        entry = {"id": MODEL, "object": "model"}
        if self.max_model_len is not None:
            entry["max_model_len"] = self.max_model_len
        return web.json_response({"object": "list", "data": [entry]})

    async def metrics(self, request: web.Request) -> web.Response:
        self.metrics_reads += 1
        if self.metrics_reads <= self.metrics_fail_first:  # an engine that just started and is not ready to answer
            return web.Response(status=503, text="not ready")
        if self.metrics_delay_s and self.metrics_reads > 1:  # the scrape after a run hangs; the one before does not
            await asyncio.sleep(self.metrics_delay_s)
        text = (
            "# TYPE vllm:prompt_tokens counter\n"
            f'vllm:prompt_tokens_total{{model_name="{MODEL}"}} {self.prompt_tokens}\n'
            "# TYPE vllm:prefix_cache_hits counter\n"
            f'vllm:prefix_cache_hits_total{{model_name="{MODEL}"}} {self.cached_tokens}\n'
        )
        if self.lmcache_publish_s:
            labels = f'{{model_name="{MODEL}",role="worker",worker_id="0"}}'
            text += (
                "# TYPE lmcache:num_hit_tokens counter\n"
                f"lmcache:num_hit_tokens_total{labels} {self.published_hits}\n"
                "# TYPE lmcache:num_remote_read_bytes counter\n"
                f"lmcache:num_remote_read_bytes_total{labels} {self.published_hits * LMCACHE_BYTES_PER_TOKEN}\n"
            )
        return web.Response(text=text, content_type="text/plain")

    async def get_arrivals(self, request: web.Request) -> web.Response:
        return web.json_response(self.arrivals)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--delay-s", type=float, default=0.0)
    ap.add_argument("--slow-after", type=int, default=None)
    ap.add_argument("--slow-delay-s", type=float, default=0.0)
    ap.add_argument("--no-tokenize", action="store_true", help="no /tokenize endpoint (404), like a non-vLLM server")
    ap.add_argument("--max-model-len", type=int, default=None, help="max_model_len in /v1/models, as vLLM lists it")
    ap.add_argument("--metrics-delay-s", type=float, default=0.0, help="hold every /metrics answer after the first this long")
    ap.add_argument("--metrics-fail-first", type=int, default=0, help="answer the first N /metrics reads with HTTP 503")
    ap.add_argument("--lmcache-publish-s", type=float, default=0.0, help="export LMCache's hit counters, published every S seconds")
    args = ap.parse_args(argv)
    s = Standin(args.delay_s, args.slow_after, args.slow_delay_s, args.max_model_len)
    s.metrics_delay_s = args.metrics_delay_s
    s.metrics_fail_first = args.metrics_fail_first
    s.lmcache_publish_s = args.lmcache_publish_s
    app = web.Application()
    app.router.add_post("/v1/completions", s.completions)
    if not args.no_tokenize:
        app.router.add_post("/tokenize", s.tokenize)
    app.router.add_get("/v1/models", s.models)
    app.router.add_get("/metrics", s.metrics)
    app.router.add_get("/_arrivals", s.get_arrivals)

    async def serve() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
        await site.start()
        publisher = asyncio.create_task(s.lmcache_publisher()) if s.lmcache_publish_s else None  # noqa: F841 - runs until exit
        port = site._server.sockets[0].getsockname()[1]
        sys.stdout.write(f"PORT {port}\n")
        sys.stdout.flush()
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
