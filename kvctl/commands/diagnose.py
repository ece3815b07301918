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
import itertools
import math
from typing import Any, Callable

import click
from click.core import ParameterSource

from kvctl import render, thresholds
from kvctl.commands.diagnose_stalls import stalls_cmd
from kvctl.commands.options import (
    BYTES_PER_TOKEN, PREFILL_RATE, T0_S, bytes_per_token_options, count, engine_http, engine_http_options, options, output_options, positive,
    valkey_options, valkey_targets,
)
from kvctl.diagnose import capture as cap
from kvctl.diagnose.analysis import Diagnosis, Params, analyse
from kvctl.diagnose.jsonform import diagnosis_json
from kvctl.engine_http import masked
from kvctl.errors import ExitStatus
from kvctl.hooks import hookimpl
from kvctl.runbooks import runbook_for

WINDOW_S = positive(cap.MAX_WINDOW_S)
TIMEOUT_S = positive(600.0)
MAX_BYTES_PER_TOKEN = BYTES_PER_TOKEN.max  # also for s derived from --model-config


@hookimpl
def register_commands(cli: click.Group) -> None:
    cli.add_command(diagnose_group)


#: Where to sample: engine URLs, the Valkey instances, the window.
source_options = options(
    click.option("--engine-url", "engine_urls", multiple=True, envvar="KVCTL_ENGINE_URL", help="Engine base URL or /metrics URL (repeatable; a repeat, or another spelling of the same host and port, is read once), e.g. http://HOST:8000."),
    engine_http_options,
    valkey_options,
    click.option("--window", type=WINDOW_S, default=thresholds.DIAGNOSIS_WINDOW_S, show_default=True, help="Seconds between the two samples (at most one day)."),
    click.option("--timeout", "timeout_s", type=TIMEOUT_S, default=thresholds.READ_TIMEOUT_S, show_default=True, help="Per-source read timeout in seconds; a source that does not answer is reported, the rest analysed."),
)

_model_bundle = options(
    bytes_per_token_options(required=False),
    click.option("--prefill-rate", type=PREFILL_RATE, help="Prefill tokens/s R (default: derived from vllm:request_prefill_time_seconds)."),
    click.option("--t0", type=T0_S, help=f"Fixed per-hit cost T0 in seconds for n* (default {thresholds.PAPER_T0_S:g}, the paper's; fit yours with `kvctl cost fit-t0`)."),
)


def model_options(func: Callable) -> Callable:
    """s, R and T0 for B*, n* and ρ."""

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


def _parameters(bytes_per_token: float | None, prefill_rate: float | None, t0: float | None) -> dict[str, Any]:
    return {k: v for k, v in {"bytes_per_token": bytes_per_token, "prefill_rate": prefill_rate, "t0_s": t0}.items() if v is not None}


def _engine_urls(engine_urls: tuple[str, ...], as_json: bool) -> list[str]:
    urls, dropped = cap.unique_engine_urls(engine_urls)
    if dropped and not as_json:
        render.warn(cap.merged_warning(dropped))
    return urls


def _collect(engine_urls, targets, window, parameters, timeout_s, show_progress: bool, http: Any = None) -> cap.Capture:
    with render.progress(f"sampling for {window:g} s", total=window, enabled=show_progress, what="diagnose", unit=" s") as advance:
        return cap.collect(engine_urls, targets, window, parameters, tick=advance, timeout_s=timeout_s, http=http)


# --- the group and option carrying ------------------------------------------------------

MODEL_SIZE_OPTIONS = ("bytes_per_token", "model_config", "dtype", "tp")


def _explicit(ctx: click.Context) -> dict[str, Any]:
    """Parameters given on the command line (not defaults, not env vars)."""
    return {k: v for k, v in ctx.params.items() if ctx.get_parameter_source(k) == ParameterSource.COMMANDLINE}


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
    still analysed), 6 insufficient data (with the next step).
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
    from_dir: str | None,
    save_dir: str | None,
    explain: bool,
    watch: bool,
    count: int | None,
    as_json: bool,
) -> None:
    params = Params(bytes_per_token=bytes_per_token, prefill_rate=prefill_rate, t0_s=t0)
    if from_dir:
        if engine_urls or valkey_urls or tier_dir or watch or save_dir:
            raise click.UsageError("--from analyses a saved capture; it takes no --engine-url/--valkey/--dir/--watch/--save")
        diag = analyse(cap.load_capture(from_dir), params)
        _show(diag, explain, as_json)
        ctx.exit(int(diag.exit_status))
    if not engine_urls:
        raise click.UsageError("give --engine-url (repeatable), or --from DIR")
    urls = _engine_urls(engine_urls, as_json)
    http = engine_http(engine_api_key_file, max_metrics_bytes)
    targets = valkey_targets(valkey_urls, ranks, tier_dir, password_file, required=False, instances_per_rank=instances_per_rank)
    parameters = _parameters(bytes_per_token, prefill_rate, t0)
    if watch:
        if save_dir:
            raise click.UsageError("--save cannot be combined with --watch")
        _watch(ctx, urls, targets, window, parameters, params, timeout_s, explain, as_json, count, http)
        return
    capture = _collect(urls, targets, window, parameters, timeout_s, show_progress=not as_json, http=http)
    if save_dir:
        cap.save_capture(capture, save_dir)
    diag = analyse(capture, params)
    cap.save_last_diagnosis({"saved_at": cap.now_iso(), **diagnosis_json(diag)})
    _show(diag, explain, as_json)
    if save_dir and not as_json:
        render.message(f"samples saved to {save_dir} (replay: kvctl diagnose --from {save_dir})")
    ctx.exit(int(diag.exit_status))


def _watch(ctx, engine_urls, targets, window, parameters, params, timeout_s, explain, as_json, count, http) -> None:
    prev = cap.take_sample(engine_urls, targets, timeout_s, http=http)
    code = ExitStatus.OK
    try:
        for i in itertools.count():
            if count is not None and i >= count:
                break
            cap.wait_until(prev.t_s + window)
            new = cap.take_sample(engine_urls, targets, timeout_s, http=http)
            shown = [cap.masked_valkey_url(t.url) for t in targets]  # shown and saved: no password
            diag = analyse(cap.Capture([masked(u) for u in engine_urls], shown, [prev, new], parameters, cap.now_iso(),
                                       instances_per_rank=cap.instances_per_rank_of(targets)), params)
            cap.save_last_diagnosis({"saved_at": cap.now_iso(), **diagnosis_json(diag)})
            code = diag.exit_status
            if as_json:
                render.emit_json_line(diagnosis_json(diag, explain))
            else:
                render.clear_screen()
                render_diagnosis(diag, explain)
                render.message(f"refresh {i + 1}{f'/{count}' if count else ''} · every {window:g} s · Ctrl-C to stop", style="dim")
            prev = new
    except KeyboardInterrupt:
        pass
    ctx.exit(int(code))


def _show(diag: Diagnosis, explain: bool, as_json: bool) -> None:
    if as_json:
        render.emit_json(diagnosis_json(diag, explain))
    else:
        render_diagnosis(diag, explain)


def _rho_text(diag: Diagnosis) -> Any:
    if diag.rho is None:
        return None
    return f"≥ {diag.rho:.3g} (lower bound: B from Valkey server side)" if diag.rho_bound == "lower_bound" else diag.rho


def _median_label(diag: Diagnosis) -> str:
    """The typical prompt's row says whether it is exact (one histogram bucket: sum/count) or an estimate."""
    from kvctl.diagnose.quantities import MEDIAN_BASIS  # noqa: PLC0415

    return f"typical (median) prompt tokens, {MEDIAN_BASIS.get(diag.typical_prompt_tokens_basis, 'estimate')}"


def render_diagnosis(diag: Diagnosis, explain: bool = False) -> None:
    """Summary, per-component tables, findings, insufficient data, and (with --explain) the formulas."""
    pct = lambda x: None if x is None else f"{x:.1%}"  # noqa: E731
    bw_label = "bandwidth B, upper bound (GB/s)" if diag.rho_bound == "lower_bound" else "bandwidth the engine sees B (GB/s)"
    render.key_values(
        f"Diagnosis over {diag.window_s:.1f} s ({len(diag.engine_urls)} engine(s), {len(diag.instances)} Valkey instance(s))",
        [
            ("offered arrival rate λ (req/s)", diag.arrival_rate_per_s),
            ("completions (req/s)", diag.completion_rate_per_s),
            ("waiting + running growth", diag.queue_growth),
            ("mean prompt tokens", diag.mean_prompt_tokens),
            (_median_label(diag), diag.typical_prompt_tokens),
            ("hit-token fraction", pct(diag.hit_token_fraction)),
            ("L2-served tokens/s", diag.l2_tokens_per_s),
            (bw_label, diag.bandwidth_gbps),
            ("break-even B* = s·R (GB/s)", diag.breakeven_gbps),
            ("min hit tokens n* = R·T0", diag.min_hit_tokens),
            ("prefill rate R (tok/s)", diag.prefill_rate_tok_s),
            ("ρ = λ·n·s/B (sync loading)", _rho_text(diag)),
            ("requests waiting (start → end)", f"{render.fmt(diag.requests_waiting_start)} → {render.fmt(diag.requests_waiting_end)}"),
            ("GPU utilisation (%)", ", ".join(f"{u:.0f}" for u in diag.gpu_utilization_pct) if diag.gpu_utilization_pct else diag.gpu_note),
        ],
        caption=f"B from {diag.bandwidth_source_detail}" if diag.bandwidth_source_detail else None,
    )
    if len(diag.engines) > 1 or any(e.status != "ok" for e in diag.engines):
        render.table(
            "Engines",
            ["engine", "status", "window (s)", "finished", "queue start → end", "offered λ (req/s)", "note"],
            [
                (e.url, e.status, e.window_s, e.finished, f"{render.fmt(e.queue_start)} → {render.fmt(e.queue_end)}", e.arrival_rate_per_s,
                 e.error or (f"restarted: {', '.join(e.counter_resets)}" if e.counter_resets else ""))
                for e in diag.engines
            ],
        )
    k = max([i.instance + 1 for i in diag.instances] or [1])
    if diag.instances:
        render.table(
            "Valkey instances",
            ["rank", *(["inst"] if k > 1 else []), "status", "GET/s", "MB out/s", "µs per GET", "GET busy", "GB/s in GETs", "evicted"],
            [
                (i.rank, *([i.instance] if k > 1 else []), i.status if not i.error else f"{i.status}: {i.error}", i.get_rate_per_s,
                 None if i.bytes_out_per_s is None else i.bytes_out_per_s / 1e6, i.usec_per_get, pct(i.get_busy_fraction), i.bandwidth_gbps, i.evicted_keys)
                for i in diag.instances
            ],
        )
    if diag.engine_loads:
        render.table(
            "Engines sharing the tier",
            ["engine", "W (ranks)", "instances", "offered λ (req/s)", "L2 MB/request", "B it gets (GB/s)", "ρ"],
            [(e.url, f"{e.ranks} ({e.ranks_source})", f"0–{e.ranks - 1}", e.arrival_rate_per_s,
              None if e.l2_bytes_per_request is None else e.l2_bytes_per_request / 1e6, e.bandwidth_gbps, e.rho)
             for e in diag.engine_loads],
            caption="ρ_e = λ_e·(L2 bytes per request)/B_e, against what engine e gets; rank r of every engine uses instance r",
        )
        render.table(
            "Instances shared by engines",
            ["rank", *(["inst"] if k > 1 else []), "engines", "offered MB/s", "B_i (GB/s)", "ρ (all engines)", "per engine"],
            [(i.rank, *([i.instance] if k > 1 else []), ", ".join(str(e) for e in i.engines), i.offered_bytes_per_s / 1e6, i.bandwidth_gbps,
              None if i.rho is None else f"{i.rho:.3f}" + (" (lower bound)" if i.rho_bound == "lower_bound" else ""),
              " ".join(f"{e}: {v:.2f}" for e, v in i.shares))
             for i in diag.instance_loads],
            caption="ρ_i = Σ_e λ_e·(bytes_e / W_e) / B_i over the engines using instance i; B_i: the best B_e/W_e they saw "
                    "(else Valkey's server side, an upper bound)"
                    + (f"\n{k} instances per rank: a rank's bytes and its B_e/W_e are split over its {k} instances "
                       "(chunk c on instance (c // W) mod K)" if k > 1 else ""),
        )
    if diag.findings:
        render.text_table("Findings", ["severity", "id", "finding", "recommendation"], [(f.severity, f.id, f.message, f"{f.recommendation}\nrunbook: {runbook_for(f.id)}") for f in diag.findings])
    for reason in diag.insufficient_data:
        render.warn(f"insufficient data: {reason}")
    for u in diag.unreachable:
        render.warn(f"unreachable: {u}")
    if not diag.findings and not diag.insufficient_data and not diag.unreachable:
        if diag.rho_bound == "estimate":
            render.message(f"No findings: ρ = {diag.rho:.2f}, the tier keeps up with this load.", style="green")
        else:
            render.message("No findings from these samples (ρ is only a lower bound here: see the notes).")
    for note in diag.notes:
        render.warn(note)
    if explain:
        render.text_table("How each number was computed", ["quantity", "value", "formula", "source"], [(q.name, q.value, q.formula, q.source) for q in diag.explain])


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
    targets = valkey_targets(kw["valkey_urls"], kw["ranks"], kw["tier_dir"], kw["password_file"], required=False, instances_per_rank=kw["instances_per_rank"])
    params = _parameters(kw["bytes_per_token"], kw["prefill_rate"], kw["t0"])
    http = engine_http(kw["engine_api_key_file"], kw["max_metrics_bytes"])
    capture = _collect(urls, targets, kw["window"], params, kw["timeout_s"], show_progress=not kw["as_json"], http=http)
    path = cap.save_capture(capture, kw["out_dir"])
    seen: dict[str, int] = {}  # each failure once, with the number of samples it happened in
    for s in capture.samples:
        for kind, names, errs in (("engine", [masked(u) for u in urls], s.engine_errors), ("Valkey", [t.url for t in targets], s.valkey_errors)):
            for name, err in zip(names, errs):
                if err:
                    seen[f"{kind} {name}: {err}"] = seen.get(f"{kind} {name}: {err}", 0) + 1
    n = len(capture.samples)
    missing = [m if k == 1 else f"{m} (in {k} of {n} samples)" for m, k in seen.items()]
    if kw["as_json"]:
        render.emit_json({
            "out": str(path), "samples": len(capture.samples), "engines": len(urls), "valkey_instances": len(targets),
            "window_s": capture.samples[-1].t_s - capture.samples[0].t_s, "unreachable": missing,
            "exit_code": int(ExitStatus.UNREACHABLE if missing else ExitStatus.OK),
        })
    else:
        for m in missing:
            render.warn(f"unreachable: {m} (recorded in the capture)")
        render.message(f"capture saved to {path} ({len(capture.samples)} samples, {len(urls)} engine(s), {len(targets)} Valkey instance(s)); analyse with: kvctl diagnose --from {path}")
    if missing:
        ctx.exit(int(ExitStatus.UNREACHABLE))


diagnose_group.add_command(stalls_cmd)
