"""``kvctl replay``: send a request trace to an engine at its original offsets (open loop)."""

from __future__ import annotations

import click

from kvctl.core import render
from kvctl.commands.options import RenamedOption, count, engine_http, engine_http_options, output_options, positive
from kvctl.core.errors import KvctlError
from kvctl.hooks import hookimpl
from kvctl.records.trace import DEFAULT_BLOCK_TOKENS, read_trace
from kvctl.views.replay import show_replay, show_schedule

EXIT_INTERRUPTED = 130  # the shell's code for SIGINT: what finished is in --out


@hookimpl
def register_commands(cli: click.Group) -> None:
    cli.add_command(replay_cmd)


def _max_tokens(value: str) -> int | None:
    if value == "trace":
        return None
    try:
        n = int(value)
    except ValueError:
        raise click.BadParameter(f"expected a positive integer or 'trace', got {value!r}", param_hint="--max-tokens") from None
    if n < 1:
        raise click.BadParameter(f"must be at least 1, got {n}", param_hint="--max-tokens")
    return n


@click.command("replay")
@click.argument("trace", type=click.Path(dir_okay=False))
@click.option("--engine-url", "url", envvar="KVCTL_ENGINE_URL", cls=RenamedOption, old=["--url"], help="Engine's OpenAI server, e.g. http://engine:8000 (env KVCTL_ENGINE_URL).")
@click.option("--out", type=click.Path(dir_okay=False), help="Run file to write (JSONL, one row per finished request).")
@click.option("--force", is_flag=True, help="Overwrite --out if it exists.")
@click.option("--speed", type=positive(1e6), default=1.0, show_default=True, help="Time scale: 2 sends twice as fast (offsets ÷ 2).")
@click.option("--max-in-flight", type=count(1_000_000), default=1024, show_default=True, help="Client-side cap on open requests; a request that waits for it is recorded as capped.")
@click.option("--max-tokens", "max_tokens_opt", default="1", show_default=True, help="Output tokens per request: N, or 'trace' for each line's output_length/max_tokens (1 = prefill only).")
@click.option("--block-tokens", type=count(1 << 20), default=DEFAULT_BLOCK_TOKENS, show_default=True, help="Tokens per Mooncake hash_id block.")
@click.option("--model", help="Model name to request (default: the first of the engine's /v1/models).")
@click.option("--tokenizer", type=click.Path(), help="Local Hugging Face tokenizer dir, used when the engine has no /tokenize.")
@click.option("--timeout", "timeout_s", type=positive(86400), default=600.0, show_default=True, help="Seconds one request may take before it is recorded as a timeout.")
@click.option("--no-stream", is_flag=True, help="Ask for whole answers instead of a stream (no first-token time).")
@click.option("--seed", type=count(2**32 - 1, min=0), default=0, show_default=True, help="Seed of the token ids drawn for each hash_id block.")
@click.option("--dry-run", is_flag=True, help="Print the schedule and send nothing.")
@engine_http_options
@output_options
@click.pass_context
def replay_cmd(ctx: click.Context, trace: str, url: str | None, out: str | None, force: bool, speed: float, max_in_flight: int,
               max_tokens_opt: str, block_tokens: int, model: str | None, tokenizer: str | None, timeout_s: float,
               no_stream: bool, seed: int, dry_run: bool, engine_api_key_file: str | None, max_metrics_bytes: int, as_json: bool) -> None:
    """Replay TRACE against an engine at the original offsets, open loop, and record every request.

    \b
    TRACE is one of (recognised per line):
      Mooncake/FAST'25 JSONL  {"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}
      offsets JSONL           {"offset_s": t, "prompt": "..."} or {"offset_s": t, "prompt_tokens": n}
      a kvctl run file        (replays a past run's requests)
    Each request goes out at its offset (÷ --speed) whatever earlier requests are doing, to
    /v1/completions with max_tokens 1 (prefill only) unless --max-tokens says otherwise.
    Prompts given by length are token ids from the engine's tokenizer (/tokenize, or
    --tokenizer), so token counts match and shared hash_ids hit the prefix cache.
    The run file has a metadata line, one row per request (scheduled_s, sent_s, first_token_s,
    finished_s, latency_s, prompt_tokens, cached_tokens, status) and a summary line; read it with
    `kvctl report`. Ctrl-C, SIGTERM or SIGHUP stops: finished requests are kept, the ones still
    open are recorded as interrupted, exit code 130, 143 or 129.
    """
    max_tokens = _max_tokens(max_tokens_opt)
    tr = read_trace(trace)
    for w in tr.warnings:  # a run file replayed: its torn last line, skipped
        render.warn(f"{trace}: {w}")
    from kvctl.replay.sender import ReplayOptions, run_replay, schedule  # noqa: PLC0415 - aiohttp only when used

    if dry_run:
        show_schedule(tr, schedule(tr, speed), max_tokens, as_json)
        return
    if not url:
        raise click.UsageError("give --engine-url (or KVCTL_ENGINE_URL), or --dry-run")
    if not out:
        raise click.UsageError("give --out RUN.jsonl")
    opts = ReplayOptions(url=url, model=model, speed=speed, max_in_flight=max_in_flight, timeout_s=timeout_s,
                         max_tokens=max_tokens, stream=not no_stream, block_tokens=block_tokens, tokenizer=tokenizer, seed=seed)
    with render.replay_progress(len(tr.requests), enabled=not as_json) as update:
        res = run_replay(tr, opts, out, overwrite=force, on_update=update, options_meta={"trace": trace},
                         http=engine_http(engine_api_key_file, max_metrics_bytes))
    show_replay(tr, res, as_json)
    if res.interrupted:
        ctx.exit(res.exit_code or EXIT_INTERRUPTED)
    if res.finished and res.errors == res.finished:
        raise KvctlError(f"all {res.finished} requests failed; their statuses are in {res.out}")
