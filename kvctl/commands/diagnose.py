"""``kvctl diagnose``: live break-even and ρ from an engine's /metrics and its Valkey tier.

A group: ``kvctl diagnose run`` samples twice over ``--window`` (or reads
``--from DIR``), ``kvctl diagnose capture`` saves the samples for a
post-mortem, ``kvctl diagnose stalls`` (its own module) reads stack dumps.
Plain ``kvctl diagnose --engine-url ...`` is ``run``. Options given before a
subcommand are carried to it when it takes them; one it does not take, or one
given on both sides with different values, is a usage error (never dropped).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import click
from click.core import ParameterSource

from kvctl.core import render

from kvctl.core import thresholds
from kvctl.commands.diagnose_stalls import stalls_cmd
from kvctl.commands.options import (
    BYTES_PER_TOKEN, PREFILL_RATE, PREFILL_RATE_HELP, T0_HELP, T0_S, WINDOW_HELP, bytes_per_token_options, count, default_tier_dir, dir_given, engine_http, engine_http_options,
    options, output_options, positive, valkey_options, valkey_targets,
)
from kvctl.diagnose import capture as cap
from kvctl.diagnose import polls
from kvctl.diagnose import run as diagnose_run
from kvctl.diagnose.analysis import Params, analyse
from kvctl.core.engine_http import masked
from kvctl.core.errors import ExitStatus
from kvctl.hooks import hookimpl
from kvctl.views.diagnose import show_capture, show_diagnosis, show_refresh

WINDOW_S = positive(cap.MAX_WINDOW_S)
TIMEOUT_S = positive(600.0)
MAX_BYTES_PER_TOKEN = BYTES_PER_TOKEN.max  # also for s derived from --model-config
TIER_GBPS = positive(thresholds.MAX_BANDWIDTH_GBPS)  # a B above it is what the analysis calls implausible


@hookimpl
def register_commands(cli: click.Group) -> None:
    cli.add_command(diagnose_group)


#: Where to sample: engine URLs, the Valkey instances, the window.
source_options = options(
    click.option("--engine-url", "engine_urls", multiple=True, envvar="KVCTL_ENGINE_URL", help="Engine base URL or /metrics URL (repeatable; a repeat, or another spelling of the same host and port, is read once), e.g. http://HOST:8000."),
    engine_http_options,
    valkey_options(dir_default=thresholds.TIER_DIR, dir_envvar="KVCTL_TIER_DIR"),  # ./kv-tier read when a tier is there, as doctor
    click.option("--window", type=WINDOW_S, default=thresholds.DIAGNOSIS_WINDOW_S, show_default=True,
                 help=f"{WINDOW_HELP}: one at the start and one --window later, each engine's /metrics read every second between (at most one day)."),
    click.option("--timeout", "timeout_s", type=TIMEOUT_S, default=thresholds.READ_TIMEOUT_S, show_default=True, help="Per-source read timeout in seconds; a source that does not answer is reported, the rest analysed."),
)

_model_bundle = options(
    bytes_per_token_options(required=False),
    click.option("--prefill-rate", type=PREFILL_RATE, help=f"{PREFILL_RATE_HELP} (default: derived from vllm:request_prefill_time_seconds)."),
    click.option("--t0", type=T0_S, help=f"{T0_HELP}, for n* (default {thresholds.PAPER_T0_S:g}, the paper's; fit yours with `kvctl cost fit-t0`)."),
    click.option("--tier-gbps", type=TIER_GBPS, help=(
        "Bandwidth B the engine sees, GB/s, for ρ: the tier's GET bandwidth measured with `kvctl bench` (its aggregate_gbps); "
        "used instead of the engine's counters (default: from kvctl:/lmcache: counters, else Valkey's GET time). Give it where "
        "they time no read: LMCache 0.5.6 under async loading.")),
)


def model_options(func: Callable) -> Callable:
    """s, R, T0 and B given for B*, n* and ρ."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        bpt = kwargs.get("bytes_per_token")
        if bpt is not None and not (math.isfinite(bpt) and 0 < bpt <= MAX_BYTES_PER_TOKEN):
            raise click.BadParameter(f"{bpt!r} is not a number of bytes in (0, {MAX_BYTES_PER_TOKEN:g}].", param_hint="'--bytes-per-token'")
        return func(*args, **kwargs)

    return _model_bundle(wrapper)


#: What the analysing run adds: a saved capture in, a capture out, formulas, refreshes.
run_options = options(
    click.option("--from", "from_dir", type=click.Path(file_okay=False), help="Analyse a capture directory instead of sampling live."),
    click.option("--save", "save_dir", type=click.Path(file_okay=False), help="Also save the samples analysed to this directory (replay with --from)."),
    click.option("--explain", is_flag=True, help="Show the formula and source of every number."),
    click.option("--watch", is_flag=True, help="Keep sampling and refresh the table every --window seconds."),
    click.option("--count", type=count(10**6), help="With --watch: stop after this many refreshes (default: until Ctrl-C)."),
)


def _engine_urls(engine_urls: tuple[str, ...], as_json: bool) -> list[str]:
    urls, dropped = cap.unique_engine_urls(engine_urls)
    if dropped and not as_json:
        render.warn(cap.merged_warning(dropped))
    return urls


def _sampling(window: float, show_progress: bool) -> Any:
    """The progress of sampling a window (its ``advance`` is the samplers' ``tick``)."""
    return render.progress(f"sampling for {window:g} s", total=window, enabled=show_progress, what="diagnose", unit=" s")


# --- the group and option carrying ------------------------------------------------------

MODEL_SIZE_OPTIONS = ("bytes_per_token", "model_config", "dtype", "tp")


def _explicit(ctx: click.Context) -> dict[str, Any]:
    """Parameters given on the command line (not defaults, not env vars)."""
    return {k: v for k, v in ctx.params.items() if ctx.get_parameter_source(k) == ParameterSource.COMMANDLINE}


def _dir_given(ctx: click.Context) -> bool:
    """--dir given to this command or carried from the group's (not its default ./kv-tier)."""
    return dir_given(ctx) or "tier_dir" in ((ctx.parent.obj or {}).get("group_options", {}) if ctx.parent else {})


def _option_flag(cmd: click.Command, name: str) -> str:
    for p in cmd.params:
        if p.name == name and isinstance(p, click.Option):
            return max(p.opts, key=len)
    return name


def _carry(ctx: click.Context, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A subcommand's parameters with the group's explicit options carried in (conflicts are usage errors)."""
    given = (ctx.parent.obj or {}).get("group_options", {}) if ctx.parent else {}
    mine = _explicit(ctx)
    if any(k in mine for k in MODEL_SIZE_OPTIONS):  # s given here, as bytes or through a model config
        mine["bytes_per_token"] = kwargs.get("bytes_per_token")
    out = dict(kwargs)
    for name, value in given.items():
        if name in mine and mine[name] != value:
            flag = _option_flag(ctx.command, name)
            raise click.UsageError(f"{flag} given before and after `{ctx.info_name}` with different values; give it once", ctx=ctx)
        out[name] = value
    return out


@click.group("diagnose", invoke_without_command=True)
@source_options
@model_options
@run_options
@output_options
@click.pass_context
def diagnose_group(ctx: click.Context, **kwargs: Any) -> None:
    """Is the remote tier helping? Offered λ, hit fraction, bandwidth B, B*, n* and ρ, with findings.

    \b
    kvctl diagnose [run] --engine-url http://HOST:8000 --valkey resp://valkey-{rank}:6379 --ranks 8 \\
                   --bytes-per-token 48437.5 --window 60
    kvctl diagnose --from DIR           analyse a saved capture exactly as live
    kvctl diagnose capture --out DIR    save the samples for a post-mortem
    kvctl diagnose stalls --match vllm  stalled lookups from thread stacks
    Exit code: 0 healthy, 3 warning, 4 critical, 5 a component unreachable (the rest is
    still analysed; when nothing answers the first sample, at once, without waiting the
    window), 6 insufficient data (with the next step).
    """
    if ctx.invoked_subcommand is None:
        _run(ctx, **kwargs)
        return
    explicit = _explicit(ctx)
    sub = diagnose_group.commands[ctx.invoked_subcommand]
    takes = {p.name for p in sub.params}
    stray = [n for n in explicit if n not in takes]
    if stray:
        flags = ", ".join(_option_flag(ctx.command, n) for n in stray)
        raise click.UsageError(f"`kvctl diagnose {ctx.invoked_subcommand}` does not take {flags}: drop it, or put the options it takes after `{ctx.invoked_subcommand}`", ctx=ctx)
    if any(k in explicit for k in MODEL_SIZE_OPTIONS):  # carry s itself, derived here from --model-config/--dtype/--tp
        for k in MODEL_SIZE_OPTIONS:
            explicit.pop(k, None)
        explicit["bytes_per_token"] = kwargs.get("bytes_per_token")
    ctx.obj = {"group_options": explicit}


@diagnose_group.command("run")
@source_options
@model_options
@run_options
@output_options
@click.pass_context
def run_cmd(ctx: click.Context, **kwargs: Any) -> None:
    """Sample (or read --from DIR) and analyse: the same as plain `kvctl diagnose`."""
    _run(ctx, **_carry(ctx, kwargs))


def _run(
    ctx: click.Context,
    engine_urls: tuple[str, ...],
    valkey_urls: tuple[str, ...],
    ranks: int | None,
    instances_per_rank: int | None,
    tier_dir: str | None,
    password_file: str | None,
    engine_api_key_file: str | None,
    max_metrics_bytes: int,
    window: float,
    timeout_s: float,
    bytes_per_token: float | None,
    prefill_rate: float | None,
    t0: float | None,
    tier_gbps: float | None,
    from_dir: str | None,
    save_dir: str | None,
    explain: bool,
    watch: bool,
    count: int | None,
    as_json: bool,
) -> None:
    params = Params(bytes_per_token=bytes_per_token, prefill_rate=prefill_rate, t0_s=t0, bandwidth_gbps=tier_gbps)
    tier_dir = default_tier_dir(tier_dir, _dir_given(ctx), valkey_urls, ranks)  # ./kv-tier when a tier is there, as doctor
    if from_dir:
        if engine_urls or valkey_urls or tier_dir or watch or save_dir:
            raise click.UsageError("--from analyses a saved capture; it takes no --engine-url/--valkey/--dir/--watch/--save")
        diag = analyse(cap.load_capture(from_dir), params)
        show_diagnosis(diag, explain, as_json)
        ctx.exit(int(diag.exit_status))
    if not engine_urls:
        raise click.UsageError("give --engine-url (repeatable), or --from DIR")
    urls = _engine_urls(engine_urls, as_json)
    http = engine_http(engine_api_key_file, max_metrics_bytes)
    targets = valkey_targets(valkey_urls, ranks, tier_dir, password_file, required=False, instances_per_rank=instances_per_rank)
    if watch:
        if save_dir:
            raise click.UsageError("--save cannot be combined with --watch")
        _watch(ctx, urls, targets, window, params, timeout_s, explain, as_json, count, http)
        return
    with _sampling(window, not as_json) as advance:
        diag = diagnose_run.once(urls, targets, window, params, timeout_s, http, tick=advance, save_dir=save_dir)
    show_diagnosis(diag, explain, as_json, saved_to=save_dir)
    ctx.exit(int(diag.exit_status))


def _watch(ctx, engine_urls, targets, window, params, timeout_s, explain, as_json, count, http) -> None:
    code = ExitStatus.OK
    refreshes = diagnose_run.watch(engine_urls, targets, window, params, timeout_s, count, http)
    try:
        for i, diag in enumerate(refreshes):
            code = diag.exit_status
            show_refresh(diag, explain, as_json, i, count, window)
    except KeyboardInterrupt:
        pass
    ctx.exit(int(code))


@diagnose_group.command("capture")
@source_options
@model_options
@click.option("--out", "out_dir", type=click.Path(file_okay=False), required=True, help="Directory to write the capture to (must not hold one).")
@output_options
@click.pass_context
def capture_cmd(ctx: click.Context, **kwargs: Any) -> None:
    """Save two samples (engine /metrics text, Valkey INFO per instance, GPU, per-source times) to --out.

    A component that does not answer is recorded with its error and the rest is
    saved (exit 5). Analyse later with `kvctl diagnose --from DIR`, on any machine.
    """
    kw = _carry(ctx, kwargs)
    if not kw["engine_urls"]:
        raise click.UsageError("give --engine-url (repeatable), before or after `capture`")
    urls = _engine_urls(kw["engine_urls"], kw["as_json"])
    tier_dir = default_tier_dir(kw["tier_dir"], _dir_given(ctx), kw["valkey_urls"], kw["ranks"])  # ./kv-tier when a tier is there
    targets = valkey_targets(kw["valkey_urls"], kw["ranks"], tier_dir, kw["password_file"], required=False, instances_per_rank=kw["instances_per_rank"])
    params = diagnose_run.recorded(Params(bytes_per_token=kw["bytes_per_token"], prefill_rate=kw["prefill_rate"], t0_s=kw["t0"],
                                          bandwidth_gbps=kw["tier_gbps"]))
    http = engine_http(kw["engine_api_key_file"], kw["max_metrics_bytes"])
    with _sampling(kw["window"], not kw["as_json"]) as advance:
        capture = polls.collect(urls, targets, kw["window"], params, tick=advance, timeout_s=kw["timeout_s"], http=http)
    path = cap.save_capture(capture, kw["out_dir"])
    missing = cap.failures(capture, [masked(u) for u in urls], [t.url for t in targets])
    show_capture(path, capture, len(urls), len(targets), missing, kw["as_json"])
    if missing:
        ctx.exit(int(ExitStatus.UNREACHABLE))


diagnose_group.add_command(stalls_cmd)
