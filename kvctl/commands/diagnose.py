"""``kvctl diagnose``: live break-even and ρ from an engine's /metrics and its Valkey tier.

``kvctl diagnose`` samples twice over ``--window`` (or reads ``--from DIR``),
``kvctl diagnose capture`` saves the samples for a post-mortem, and
``kvctl diagnose stalls`` (its own module) reads stack dumps.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any, Callable

import click

from kvctl import __version__, render
from kvctl.commands.options import output_options, severity_exit
from kvctl.commands.cost import NONNEG, POS, bytes_per_token_options
from kvctl.commands.diagnose_stalls import stalls_cmd
from kvctl.diagnose import capture as cap
from kvctl.diagnose.analysis import Diagnosis, Params, analyse
from kvctl.errors import ExitStatus
from kvctl.hooks import hookimpl
from kvctl.tier.targets import Target, resolve_targets



@hookimpl
def register_commands(cli: click.Group) -> None:
    cli.add_command(diagnose_group)


def source_options(func: Callable) -> Callable:
    """Where to sample: engine URLs, the Valkey instances, the window."""

    @click.option("--engine-url", "engine_urls", multiple=True, envvar="KVCTL_ENGINE_URL", help="Engine base URL or /metrics URL (repeatable), e.g. http://HOST:8000.")
    @click.option("--valkey", "valkey_urls", multiple=True, help="Valkey URL per rank (repeatable, index = rank), or one {rank} template with --ranks.")
    @click.option("--ranks", type=click.IntRange(min=1), help="Number of ranks for a {rank} template URL.")
    @click.option("--dir", "tier_dir", type=click.Path(file_okay=False), help="Directory of a tier started by `kvctl deploy-valkey up`.")
    @click.option("--password-file", type=click.Path(dir_okay=False), help="File (mode 0600) holding the Valkey password.")
    @click.option("--window", type=POS, default=60.0, show_default=True, help="Seconds between the two samples.")
    @click.option("--timeout", "timeout_s", type=POS, default=5.0, show_default=True, help="Per-scrape timeout in seconds.")
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return func(*args, **kwargs)

    return wrapper


def model_options(func: Callable) -> Callable:
    """s, R and T0 for B*, n* and ρ."""

    @bytes_per_token_options(required=False)
    @click.option("--prefill-rate", type=POS, help="Prefill tokens/s R (default: derived from vllm:request_prefill_time_seconds).")
    @click.option("--t0", type=NONNEG, help="Fixed per-hit cost T0 in seconds for n* (default 0.33, the paper's; fit yours with `kvctl cost fit-t0`).")
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return func(*args, **kwargs)

    return wrapper


def _targets(valkey_urls: tuple[str, ...], ranks: int | None, tier_dir: str | None, password_file: str | None) -> list[Target]:
    if not valkey_urls and not tier_dir:
        if ranks:
            raise click.UsageError("--ranks needs a {rank} --valkey URL")
        return []
    return resolve_targets(valkey_urls, ranks, tier_dir, password_file)


def _parameters(bytes_per_token: float | None, prefill_rate: float | None, t0: float | None) -> dict[str, Any]:
    return {k: v for k, v in {"bytes_per_token": bytes_per_token, "prefill_rate": prefill_rate, "t0_s": t0}.items() if v is not None}


def _collect(engine_urls, targets, window, parameters, timeout_s, show_progress: bool) -> cap.Capture:
    with render.progress(f"sampling for {window:g} s", total=window, enabled=show_progress) as advance:
        return cap.collect(engine_urls, targets, window, parameters, tick=advance, timeout_s=timeout_s)


def diagnosis_json(diag: Diagnosis, explain: bool = False) -> dict[str, Any]:
    data = {"kvctl_version": __version__, **render.to_jsonable(diag)}
    if not explain:
        data.pop("explain")
    return data


@click.group("diagnose", invoke_without_command=True)
@source_options
@model_options
@click.option("--from", "from_dir", type=click.Path(file_okay=False), help="Analyse a capture directory instead of sampling live.")
@click.option("--save", "save_dir", type=click.Path(file_okay=False), help="Also save the samples analysed to this directory (replay with --from).")
@click.option("--explain", is_flag=True, help="Show the formula and source of every number.")
@click.option("--watch", is_flag=True, help="Keep sampling and refresh the table every --window seconds.")
@click.option("--count", type=click.IntRange(min=1), help="With --watch: stop after this many refreshes (default: until Ctrl-C).")
@output_options
@click.pass_context
def diagnose_group(
    ctx: click.Context,
    engine_urls: tuple[str, ...],
    valkey_urls: tuple[str, ...],
    ranks: int | None,
    tier_dir: str | None,
    password_file: str | None,
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
    """Is the remote tier helping? λ, hit fraction, bandwidth B, B*, n* and ρ, with findings.

    \b
    kvctl diagnose --engine-url http://HOST:8000 --valkey resp://valkey-{rank}:6379 --ranks 8 \\
                   --bytes-per-token 48437.5 --window 60
    kvctl diagnose --from DIR          analyse a saved capture exactly as live
    Exit code: 0 healthy, 3 warning finding, 4 critical finding, 5 unreachable.
    """
    if ctx.invoked_subcommand is not None:
        return
    params = Params(bytes_per_token=bytes_per_token, prefill_rate=prefill_rate, t0_s=t0)
    if from_dir:
        if engine_urls or valkey_urls or tier_dir or watch or save_dir:
            raise click.UsageError("--from analyses a saved capture; it takes no --engine-url/--valkey/--dir/--watch/--save")
        diag = analyse(cap.load_capture(from_dir), params)
        _show(diag, explain, as_json)
        ctx.exit(int(severity_exit(diag.worst_severity)))
    if not engine_urls:
        raise click.UsageError("give --engine-url (repeatable), or --from DIR")
    targets = _targets(valkey_urls, ranks, tier_dir, password_file)
    parameters = _parameters(bytes_per_token, prefill_rate, t0)
    if watch:
        if save_dir:
            raise click.UsageError("--save cannot be combined with --watch")
        _watch(ctx, engine_urls, targets, window, parameters, params, timeout_s, explain, as_json, count)
        return
    capture = _collect(engine_urls, targets, window, parameters, timeout_s, show_progress=not as_json)
    if save_dir:
        cap.save_capture(capture, save_dir)
    diag = analyse(capture, params)
    cap.save_last_diagnosis({"saved_at": cap.now_iso(), **diagnosis_json(diag)})
    _show(diag, explain, as_json)
    if save_dir and not as_json:
        render.message(f"samples saved to {save_dir} (replay: kvctl diagnose --from {save_dir})")
    ctx.exit(int(severity_exit(diag.worst_severity)))


def _watch(ctx, engine_urls, targets, window, parameters, params, timeout_s, explain, as_json, count) -> None:
    prev = cap.take_sample(engine_urls, targets, timeout_s)
    code = ExitStatus.OK
    try:
        for i in itertools.count():
            if count is not None and i >= count:
                break
            cap.wait_until(prev.t_s + window)
            new = cap.take_sample(engine_urls, targets, timeout_s)
            diag = analyse(cap.Capture(list(engine_urls), [t.url for t in targets], [prev, new], parameters, cap.now_iso()), params)
            cap.save_last_diagnosis({"saved_at": cap.now_iso(), **diagnosis_json(diag)})
            code = severity_exit(diag.worst_severity)
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


def render_diagnosis(diag: Diagnosis, explain: bool = False) -> None:
    """Summary, per-instance table, findings, and (with --explain) the formulas."""
    pct = lambda x: None if x is None else f"{x:.1%}"  # noqa: E731
    render.key_values(
        f"Diagnosis over {diag.window_s:.1f} s ({len(diag.engine_urls)} engine(s), {len(diag.instances)} Valkey instance(s))",
        [
            ("arrival rate λ (req/s)", diag.arrival_rate_per_s),
            ("mean prompt tokens", diag.mean_prompt_tokens),
            ("typical (median) prompt tokens", diag.typical_prompt_tokens),
            ("hit-token fraction", pct(diag.hit_token_fraction)),
            ("L2-served tokens/s", diag.l2_tokens_per_s),
            ("delivered bandwidth B (GB/s)", diag.bandwidth_gbps),
            ("break-even B* = s·R (GB/s)", diag.breakeven_gbps),
            ("min hit tokens n* = R·T0", diag.min_hit_tokens),
            ("prefill rate R (tok/s)", diag.prefill_rate_tok_s),
            ("ρ = λ·n·s/B (sync loading)", diag.rho),
            ("requests waiting (start → end)", f"{render.fmt(diag.requests_waiting_start)} → {render.fmt(diag.requests_waiting_end)}"),
            ("GPU utilisation (%)", ", ".join(f"{u:.0f}" for u in diag.gpu_utilization_pct) if diag.gpu_utilization_pct else diag.gpu_note),
        ],
        caption=f"B from {diag.bandwidth_source}" if diag.bandwidth_source else None,
    )
    if diag.instances:
        render.table(
            "Valkey instances",
            ["rank", "GET/s", "MB out/s", "µs per GET", "GET busy", "GB/s in GETs", "evicted"],
            [(i.rank, i.get_rate_per_s, i.bytes_out_per_s / 1e6, i.usec_per_get, pct(i.get_busy_fraction), i.bandwidth_gbps, i.evicted_keys) for i in diag.instances],
        )
    if diag.findings:
        render.text_table("Findings", ["severity", "id", "finding", "recommendation"], [(f.severity, f.id, f.message, f.recommendation) for f in diag.findings])
    else:
        render.message("No findings: the tier keeps up with this load.", style="green")
    for note in diag.notes:
        render.warn(note)
    if explain:
        render.text_table("How each number was computed", ["quantity", "value", "formula", "source"], [(q.name, q.value, q.formula, q.source) for q in diag.explain])


@diagnose_group.command("capture")
@source_options
@model_options
@click.option("--out", "out_dir", type=click.Path(file_okay=False), required=True, help="Directory to write the capture to (must not hold one).")
@output_options
def capture_cmd(
    engine_urls: tuple[str, ...],
    valkey_urls: tuple[str, ...],
    ranks: int | None,
    tier_dir: str | None,
    password_file: str | None,
    window: float,
    timeout_s: float,
    bytes_per_token: float | None,
    prefill_rate: float | None,
    t0: float | None,
    out_dir: str,
    as_json: bool,
) -> None:
    """Save two samples (engine /metrics text, Valkey INFO per instance, GPU, timestamps) to --out.

    Analyse later with `kvctl diagnose --from DIR`, on any machine.
    """
    if not engine_urls:
        raise click.UsageError("give --engine-url (repeatable)")
    targets = _targets(valkey_urls, ranks, tier_dir, password_file)
    capture = _collect(engine_urls, targets, window, _parameters(bytes_per_token, prefill_rate, t0), timeout_s, show_progress=not as_json)
    path = cap.save_capture(capture, out_dir)
    if as_json:
        render.emit_json({"out": str(path), "samples": len(capture.samples), "engines": len(engine_urls), "valkey_instances": len(targets), "window_s": capture.samples[-1].t_s - capture.samples[0].t_s})
        return
    render.message(f"capture saved to {path} ({len(capture.samples)} samples, {len(engine_urls)} engine(s), {len(targets)} Valkey instance(s)); analyse with: kvctl diagnose --from {path}")


diagnose_group.add_command(stalls_cmd)
