"""``kvctl doctor``: check a deployment in one pass (engine, Valkey tier, LMCache, configs, host)."""

from __future__ import annotations

from pathlib import Path

import click

from kvctl.core import thresholds
from kvctl.commands.diagnose import TIMEOUT_S
from kvctl.commands.options import ByteSize, count, engine_http, engine_http_options, output_options, valkey_options, valkey_targets
from kvctl.hooks import hookimpl

MAX_CHUNK_BYTES = 16 * 2**30


@hookimpl
def register_commands(cli: click.Group) -> None:
    cli.add_command(doctor_cmd)


@click.command("doctor")
@click.option("--engine-url", "engine_urls", multiple=True, envvar="KVCTL_ENGINE_URL", help="Engine base URL or /metrics URL (repeatable), e.g. http://HOST:8000.")
@engine_http_options
@valkey_options(dir_default=thresholds.TIER_DIR, dir_envvar="KVCTL_TIER_DIR")
@click.option("--config", "lmcache_config", type=click.Path(dir_okay=False), envvar="LMCACHE_CONFIG_FILE", help="LMCache YAML config the engines use (default: $LMCACHE_CONFIG_FILE).")
@click.option("--kv-transfer-config", help="vLLM's --kv-transfer-config JSON, inline or @FILE.")
@click.option("--world-size", type=count(4096), help="Ranks of the engine's shard group (TP x PCP); default: the engine's kvctl:ranks gauge.")
@click.option("--diagnosis", "diagnosis_path", type=click.Path(dir_okay=False), help="kvctl diagnose --json output to compare the loading mode with (default: the one `kvctl diagnose` saved for this tier or these engines).")
@click.option("--timeout", "timeout_s", type=TIMEOUT_S, default=thresholds.READ_TIMEOUT_S, show_default=True, help="Seconds each engine or Valkey read may take (all are read at once).")
@click.option("--chunk-bytes", type=ByteSize(MAX_CHUNK_BYTES), help="Bytes of one stored chunk (12.4mb, or `kvctl cost kv-size`'s chunk_bytes) for the proto-max-bulk-len, output-buffer and value-size checks; default: the largest of a few values sampled from the tier.")
@click.option("--engines", type=count(100_000), help="Engines sharing the tier, for the maxclients check (default: the number of --engine-url, at least 1).")
@click.option("--no-host-checks", is_flag=True, help="Skip the py-spy (ptrace) and NVML checks of this host.")
@output_options
@click.pass_context
def doctor_cmd(
    ctx: click.Context, engine_urls: tuple[str, ...], engine_api_key_file: str | None, max_metrics_bytes: int, valkey_urls: tuple[str, ...], ranks: int | None, instances_per_rank: int | None, tier_dir: str | None, password_file: str | None,
    lmcache_config: str | None, kv_transfer_config: str | None, world_size: int | None, diagnosis_path: str | None, timeout_s: float,
    chunk_bytes: int | None, engines: int | None, no_host_checks: bool, as_json: bool,
) -> None:
    """Check a deployment in one pass: a checklist of ok / warning / fail, each with its fix.

    \b
    kvctl doctor --engine-url http://HOST:8000 --dir ./kv-tier --config lmcache.yaml
    kvctl doctor --valkey resp://valkey-{rank}:6379 --ranks 8 --kv-transfer-config @kv.json
    Engine: /metrics reachable, vLLM version, KV connector in use. Valkey: every instance
    up, auth (a refused password says so), maxmemory, eviction policy and key TTLs,
    persistence, io-threads against cores, proto-max-bulk-len, output buffer limits,
    maxclients, fragmentation, evictions against hits, transparent huge pages, value size,
    one instance per rank (each line with its runbook). LMCache: installed version and its known client bugs. Configs:
    remote_url next to a plugin, chunk size vs block size, URL count vs world size,
    {rank} templates, loading mode vs the latest ρ, the layer groups the tier's chunks are stored in vs
    layer_groups. Host: py-spy can attach, NVML.
    The tier is --dir (default ./kv-tier, or $KVCTL_TIER_DIR, when a tier is there) or --valkey.
    Exit code: 0 all ok, 3 a warning, 4 a failure, 5 no engine or instance given answered (all read at once,
    within --timeout), 6 nothing of the deployment checked.
    """
    from click.core import ParameterSource  # noqa: PLC0415
    from kvctl.tier.targets import state_path  # noqa: PLC0415
    from kvctl.ops.doctor import DoctorInput, run  # noqa: PLC0415
    from kvctl.views.doctor import show_doctor  # noqa: PLC0415

    if diagnosis_path and not Path(diagnosis_path).is_file():
        raise click.BadParameter(f"{diagnosis_path} does not exist", param_hint="'--diagnosis'")
    stopped = None  # a tier `deploy-valkey down` stopped in --dir and left there: said, and checked only when named
    if tier_dir and not (valkey_urls or ranks) and state_path(tier_dir).is_file():
        from kvctl.tier.local import stopped_tier  # noqa: PLC0415

        left = stopped_tier(tier_dir)
        stopped = (str(tier_dir), left.stopped_at) if left is not None else None
    if ctx.get_parameter_source("tier_dir") in (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP) and (
        valkey_urls or ranks or not state_path(tier_dir).is_file() or stopped
    ):
        tier_dir = None  # the default ./kv-tier only when a running tier is there and no URL was given, as `deploy-valkey status`
    targets = valkey_targets(valkey_urls, ranks, tier_dir, password_file, required=False, instances_per_rank=instances_per_rank)
    report = run(DoctorInput(
        tuple(engine_urls), tuple(targets), lmcache_config, kv_transfer_config, world_size,
        diagnosis_path, timeout_s, host_checks=not no_host_checks, chunk_bytes=chunk_bytes, engines=engines,
        http=engine_http(engine_api_key_file, max_metrics_bytes), stopped_tier=stopped,
    ))
    show_doctor(report, as_json)
    ctx.exit(int(report.exit_status))
