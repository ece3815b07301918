"""The open-loop sender: every request goes out at its original offset, whatever the engine is doing.

One asyncio task schedules: it sleeps until request i's offset (÷ ``--speed``) from the start and
starts a task that posts it to the engine's OpenAI ``/v1/completions``; it never waits for an answer.
``--max-in-flight`` only protects the client: when that many requests are open the scheduler waits
for a slot, and every request whose send that wait delayed is recorded as ``capped``. Answers are streamed
(``stream_options.include_usage``) so the first token and the usage with
``prompt_tokens_details.cached_tokens`` are both seen. Rows go to the run file as requests finish.

SIGINT (Ctrl-C), SIGTERM and SIGHUP cancel the requests still open: what finished is already on disk,
each request still open gets a row with status ``interrupted by SIG...`` (its ``finished_s`` is the
moment of the stop), the run file gets its summary line with ``interrupted: true`` and ``signal``, and
the caller exits 128 + the signal's number (130, 143, 129).

An answer that is not what the OpenAI API promises (an SSE ``data:`` line that is not a JSON object,
a ``usage`` that is not an object, a list for a whole answer) fails that request, recorded with its
status; the run goes on. Prompts longer than the engine's ``max_model_len`` (from ``/v1/models``)
are refused before anything is sent, each named by its trace line.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable

from kvctl import __version__
from kvctl.connector.urls import redacted_repr
from kvctl.core.engine_http import EngineHttp, masked
from kvctl.core.errors import InvalidInput, Unreachable
from kvctl.replay.engine_api import (
    engine_base, check_lengths, discover_model, list_models, max_model_len, pool_from_engine, scrape_after_run, scrape_metrics,
)
from kvctl.replay.prompts import PromptBuilder, pool_from_tokenizer
from kvctl.records.runfile import INTERRUPTED, RunWriter
from kvctl.records.trace import Trace, TraceRequest

#: Signals that stop a replay the way Ctrl-C does (the exit code is 128 + the number).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class BadAnswer(ValueError):
    """The engine answered with something the OpenAI API does not allow (that request fails, the run goes on)."""


@dataclass(frozen=True)
class ReplayOptions:
    __repr__ = redacted_repr  # URLs shown with their passwords masked (issue 44)
    url: str
    model: str | None = None
    speed: float = 1.0
    max_in_flight: int = 1024
    timeout_s: float = 600.0
    max_tokens: int | None = 1  # None: each request's max_tokens from the trace (1 where it has none)
    stream: bool = True
    block_tokens: int = 512
    tokenizer: str | None = None
    seed: int = 0


@dataclass
class ReplayState:
    """Live counters (for the progress bar)."""

    total: int
    sent: int = 0
    finished: int = 0
    errors: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    cap_hits: int = 0
    started: float = field(default_factory=time.monotonic)
    note: str | None = None  # what the replay waits for after its last answer (LMCache's counters), for the progress


@dataclass(frozen=True)
class ReplayResult:
    out: str
    model: str
    requests: int
    finished: int
    ok: int
    errors: int
    max_in_flight: int
    cap_hits: int
    duration_s: float
    interrupted: bool
    token_pool: str | None
    signal: str | None = None  # "SIGINT", "SIGTERM" or "SIGHUP" when a signal stopped it
    unfinished: int = 0  # requests still open at the stop, recorded as interrupted

    @property
    def exit_code(self) -> int | None:
        """128 + the signal's number after a stop signal (the shell's convention), else None."""
        return 128 + int(signal.Signals[self.signal]) if self.signal else None


def schedule(trace: Trace, speed: float) -> list[tuple[TraceRequest, float]]:
    """(request, scheduled seconds from the start) in sending order."""
    if not speed > 0:
        raise InvalidInput(f"--speed must be positive, got {speed}")
    return [(r, r.offset_s / speed) for r in trace.requests]


def _count(v: Any, what: str) -> int | None:
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise BadAnswer(f"{what} is not a token count: {str(v)[:40]!r}")
    return v


def _usage(obj: Any) -> tuple[int | None, int | None]:
    """(prompt tokens, cached tokens) of an answer's ``usage``; BadAnswer when it is not shaped as the API says."""
    if not isinstance(obj, dict):
        raise BadAnswer(f"the answer is a JSON {type(obj).__name__}, not an object")
    usage = obj.get("usage") or {}
    if not isinstance(usage, dict):
        raise BadAnswer(f"usage is a JSON {type(usage).__name__}, not an object")
    details = usage.get("prompt_tokens_details") or {}
    if not isinstance(details, dict):
        raise BadAnswer(f"usage.prompt_tokens_details is a JSON {type(details).__name__}, not an object")
    return _count(usage.get("prompt_tokens"), "usage.prompt_tokens"), _count(details.get("cached_tokens"), "cached_tokens")


class _Replayer:
    def __init__(self, session: Any, base: str, model: str, opts: ReplayOptions, builder: PromptBuilder,
                 writer: RunWriter, state: ReplayState, on_update: Callable[[ReplayState], None]) -> None:
        self.session, self.base, self.model, self.opts = session, base, model, opts
        self.builder, self.writer, self.state, self.on_update = builder, writer, state, on_update
        self.sem = asyncio.Semaphore(opts.max_in_flight)
        self.tasks: set[asyncio.Task] = set()
        self.ok = 0
        self.t0 = 0.0
        self.stopped_by: str | None = None  # the stop signal's name, once one arrived
        self.unfinished = 0

    def _now(self) -> float:
        return asyncio.get_running_loop().time() - self.t0

    def _body(self, req: TraceRequest) -> bytes:
        max_tokens = self.opts.max_tokens if self.opts.max_tokens is not None else (req.max_tokens or 1)
        # ignore_eos (vLLM): exactly max_tokens come out, as the trace (or --max-tokens) asks
        body: dict[str, Any] = {"model": self.model, "prompt": self.builder.build(req), "max_tokens": max(1, max_tokens),
                                "temperature": 0.0, "ignore_eos": True, "stream": self.opts.stream}
        if self.opts.stream:
            body["stream_options"] = {"include_usage": True}
        return json.dumps(body, separators=(",", ":")).encode()

    async def _post(self, body: bytes) -> tuple[str, float | None, int | None, int | None]:
        """(status, first-token time, prompt tokens, cached tokens) of one request."""
        first = None
        prompt_tokens = cached = None
        async with self.session.post(self.base + "/v1/completions", data=body,
                                     headers={"content-type": "application/json"}) as r:
            if r.status != 200:
                text = (await r.text())[:200].replace("\n", " ")
                return f"http {r.status}: {text}", None, None, None
            if not self.opts.stream:
                obj = await r.json(content_type=None)
                prompt_tokens, cached = _usage(obj)
                return "ok", None, prompt_tokens, cached
            done = False
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    break
                obj = json.loads(payload)
                if not isinstance(obj, dict):
                    raise BadAnswer(f"an SSE data line is a JSON {type(obj).__name__}, not an object")
                if first is None and obj.get("choices"):
                    first = self._now()
                if obj.get("usage"):
                    prompt_tokens, cached = _usage(obj)
                if "error" in obj:
                    return f"error: {str(obj['error'])[:200]}", first, prompt_tokens, cached
            if not done:
                return "error: the stream ended before [DONE]", first, prompt_tokens, cached
        return "ok", first, prompt_tokens, cached

    async def _send(self, req: TraceRequest, body: bytes, scheduled_s: float, capped: bool) -> None:
        import aiohttp  # noqa: PLC0415

        st = self.state
        st.sent += 1
        st.in_flight += 1
        in_flight = st.in_flight
        st.max_in_flight = max(st.max_in_flight, in_flight)
        sent = self._now()
        cancelled = False
        try:
            status, first, prompt_tokens, cached = await self._post(body)
        except asyncio.TimeoutError:
            status, first, prompt_tokens, cached = f"timeout after {self.opts.timeout_s:g} s", None, None, None
        except BadAnswer as e:
            status, first, prompt_tokens, cached = f"error: bad answer: {e}"[:240], None, None, None
        except (aiohttp.ClientError, OSError, ValueError) as e:
            status, first, prompt_tokens, cached = f"error: {type(e).__name__}: {e}"[:240], None, None, None
        except asyncio.CancelledError:  # a stop signal: record the request as open at the stop, then unwind
            cancelled = True
            status, first, prompt_tokens, cached = f"{INTERRUPTED} by {self.stopped_by or 'a stop'} before the answer", None, None, None
        finally:
            st.in_flight -= 1
            self.sem.release()
        finished = self._now()
        if cancelled:
            self.unfinished += 1
        else:
            st.finished += 1
            if status == "ok":
                self.ok += 1
            else:
                st.errors += 1
        self.writer.row({
            "index": req.index,
            "scheduled_s": round(scheduled_s, 6),
            "sent_s": round(sent, 6),
            "first_token_s": None if first is None else round(first, 6),
            "finished_s": round(finished, 6),
            "latency_s": round(finished - scheduled_s, 6),
            "prompt_tokens": prompt_tokens if prompt_tokens is not None else req.token_count,
            "cached_tokens": cached,
            "status": status,
            "in_flight": in_flight,
            "capped": capped,
            "request": req.source,
        })
        if cancelled:
            raise asyncio.CancelledError
        self.on_update(st)

    async def run(self, plan: list[tuple[TraceRequest, float]]) -> None:
        loop = asyncio.get_running_loop()
        self.t0 = loop.time()
        cap_released = self.t0
        for req, at in plan:
            body = self._body(req)  # built while waiting for its turn
            delay = self.t0 + at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            # capped: its send was delayed by --max-in-flight, because the cap was full when it was due
            # or because the scheduler was still waiting for a slot for an earlier request
            full = self.sem.locked()
            capped = full or self.t0 + at < cap_released
            if capped:
                self.state.cap_hits += 1
            await self.sem.acquire()
            if full:
                cap_released = loop.time()
            task = asyncio.create_task(self._send(req, body, at, capped))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
            self.on_update(self.state)
        while self.tasks:
            await asyncio.gather(*list(self.tasks))


async def _replay(trace: Trace, opts: ReplayOptions, out: str, overwrite: bool, on_update: Callable[[ReplayState], None],
                  options_meta: dict[str, Any], http: EngineHttp) -> ReplayResult:
    import aiohttp  # noqa: PLC0415

    base, auth = http.auth_header(engine_base(opts.url))  # USER:PASS@ or the API key: a header, never in the URL sent or saved
    plan = schedule(trace, opts.speed)
    connector = aiohttp.TCPConnector(limit=opts.max_in_flight)
    timeout = aiohttp.ClientTimeout(total=opts.timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=auth) as session:
        try:
            models = await list_models(session, base)
        except Unreachable:
            if not opts.model:
                raise
            models = []  # --model given: /v1/models only bounds prompt lengths, when the engine has it
        model = opts.model or await discover_model(session, base, models)
        limit = max_model_len(models, model)
        if limit is not None:
            check_lengths(trace, limit, model)
        builder = PromptBuilder(None, opts.block_tokens, opts.seed)
        pool = None
        if any(builder.needs_pool(r) for r in trace.requests):
            pool = await pool_from_engine(session, base, model)
            if pool is None and opts.tokenizer:
                pool = pool_from_tokenizer(opts.tokenizer)
            if pool is None:
                raise InvalidInput(
                    f"prompts given by length need the engine's tokenizer and {base}/tokenize did not answer; "
                    "pass --tokenizer PATH (a local Hugging Face tokenizer directory)"
                )
            builder = PromptBuilder(pool, opts.block_tokens, opts.seed)
        metrics_before, before_error = await scrape_metrics(session, base, http.max_bytes)
        now = datetime.now(timezone.utc)
        metadata = {
            "trace": trace.path,
            "trace_sha256": trace.sha256,
            "trace_format": trace.format,
            "requests": len(plan),
            "engine_url": masked(base),
            "model": model,
            "kvctl_version": __version__,
            "start_utc": now.isoformat(timespec="milliseconds"),
            "start_unix": now.timestamp(),
            "host": socket.gethostname(),
            "options": {**options_meta, **asdict(opts), "url": masked(opts.url)},
            "token_pool": pool.source if pool else None,
            "metrics_before": metrics_before,
            **({"metrics_before_error": before_error} if before_error else {}),
        }
        writer = RunWriter(out, metadata, overwrite=overwrite)
        state = ReplayState(total=len(plan))
        rep = _Replayer(session, base, model, opts, builder, writer, state, on_update)
        interrupted = False
        loop = asyncio.get_running_loop()
        driver = asyncio.create_task(rep.run(plan))
        closing: list[asyncio.Task] = []  # the scrape after the run, which a stop signal also cuts short

        def on_signal(sig: signal.Signals) -> None:
            nonlocal interrupted
            if interrupted:
                return  # a second signal: the first one's unwinding is already under way
            interrupted = True
            rep.stopped_by = sig.name
            driver.cancel()
            for t in closing:
                t.cancel()

        handled = []
        for sig in STOP_SIGNALS:
            try:
                loop.add_signal_handler(sig, on_signal, sig)
                handled.append(sig)
            except (RuntimeError, ValueError, NotImplementedError):  # not the main thread
                break
        try:
            await driver
        except asyncio.CancelledError:
            if not interrupted:
                raise
            for t in list(rep.tasks):
                t.cancel()
            await asyncio.gather(*list(rep.tasks), return_exceptions=True)
        finally:
            duration = loop.time() - rep.t0 if rep.t0 else 0.0
            last_answer = time.monotonic()
            metrics_after, after_error = None, None

            def waiting(note: str) -> None:
                state.note = note
                on_update(state)

            if not interrupted:  # still under the handlers: a signal now skips (or cuts) the scrape, the summary is written
                closing.append(asyncio.create_task(scrape_after_run(session, base, last_answer, http.max_bytes, waiting)))
                try:
                    metrics_after, after_error = await closing[0]
                except asyncio.CancelledError:
                    if not interrupted:
                        raise
                state.note = None
            for sig in handled:
                loop.remove_signal_handler(sig)
            writer.close({
                "requests": len(plan),
                "finished": state.finished,
                "ok": rep.ok,
                "errors": state.errors,
                "max_in_flight": state.max_in_flight,
                "cap_hits": state.cap_hits,
                "duration_s": round(duration, 6),
                "interrupted": interrupted,
                "signal": rep.stopped_by,
                "unfinished": rep.unfinished,
                "metrics_after": metrics_after,
                # an error when nothing was read; a note on what was read (LMCache's counters read early)
                **({("metrics_after_note" if metrics_after is not None else "metrics_after_error"): after_error} if after_error else {}),
            })
    return ReplayResult(out, model, len(plan), state.finished, rep.ok, state.errors, state.max_in_flight,
                        state.cap_hits, duration, interrupted, pool.source if pool else None, rep.stopped_by, rep.unfinished)


def _allow_open_files(wanted: int) -> None:
    """Raise the soft limit on open files (one socket per request in flight) up to the hard limit."""
    try:
        import resource  # noqa: PLC0415 - POSIX only

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ImportError, ValueError, OSError):
        pass  # a low limit shows up as per-request connection errors in the run file


def run_replay(trace: Trace, opts: ReplayOptions, out: str, *, overwrite: bool = False,
               on_update: Callable[[ReplayState], None] | None = None,
               options_meta: dict[str, Any] | None = None, http: EngineHttp | None = None) -> ReplayResult:
    """Replay ``trace`` against ``opts.url``, writing ``out``; returns counts (``interrupted`` after SIGINT)."""
    if opts.max_in_flight < 1:
        raise InvalidInput(f"--max-in-flight must be at least 1, got {opts.max_in_flight}")
    _allow_open_files(opts.max_in_flight + 256)
    return asyncio.run(_replay(trace, opts, out, overwrite, on_update or (lambda s: None), options_meta or {}, http or EngineHttp()))

