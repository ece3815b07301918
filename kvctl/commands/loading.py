"""``kvctl loading show|sync|async``: flip LMCache's enable_async_loading safely."""

from __future__ import annotations

import functools
from typing import Any, Callable

import click

from kvctl.commands.options import options, output_options, positive
from kvctl.core.errors import KvctlError
from kvctl.core.thresholds import RHO_HIGH
from kvctl.hooks import hookimpl
from kvctl.loading import edit as loading
from kvctl.loading import flip as loading_flip
from kvctl.loading import safety as loading_safety
from kvctl.views.loading import show_flip, show_states


@hookimpl
def register_commands(cli: click.Group) -> None:
    cli.add_command(loading_group)


_file_bundle = options(
    click.option("--config", "config_path", type=click.Path(dir_okay=False), envvar="LMCACHE_CONFIG_FILE", help="LMCache YAML config (default: $LMCACHE_CONFIG_FILE)."),
    click.option("--env-file", type=click.Path(dir_okay=False), help="Env file (KEY=value lines) that sets LMCACHE_ENABLE_ASYNC_LOADING."),
    click.option("--vllm", "vllm_files", multiple=True, type=click.Path(dir_okay=False), help="vLLM file with kvctl's connector config (repeatable): a --config YAML whose kv-transfer-config holds it, or an env/systemd-unit file carrying --kv-transfer-config '{...}'; the kind is detected."),
)


def file_options(func: Callable) -> Callable:
    """The files to read or flip (--config, --env-file, --vllm), passed on as ``sources``: (path, detected kind)."""

    @functools.wraps(func)
    def wrapper(*args: Any, config_path: str | None, env_file: str | None, vllm_files: tuple[str, ...], **kwargs: Any) -> Any:
        if not config_path and not env_file and not vllm_files:
            raise click.UsageError("give --config lmcache.yaml, --env-file FILE and/or --vllm FILE")
        given = ([(config_path, "yaml")] if config_path else []) + ([(env_file, "env")] if env_file else []) + [(p, "vllm") for p in vllm_files]
        sources = [(p, loading.detect_kind(p, kind)) for p, kind in given]
        return func(*args, sources=sources, **kwargs)

    return _file_bundle(wrapper)


@click.group("loading")
def loading_group() -> None:
    """Show or flip synchronous/asynchronous loading: LMCache's enable_async_loading, or kvctl's vLLM connector's async_loading.

    \b
    kvctl loading show  --config lmcache.yaml
    kvctl loading show  --vllm vllm-config.yaml   (or a systemd unit / env file with --kv-transfer-config)
    kvctl loading async --config lmcache.yaml --restart-cmd 'systemctl restart vllm'
    kvctl loading sync  --config lmcache.yaml      refused when the last diagnosis has ρ ≥ 0.7
    Edits only the one setting (comments kept), shows a diff, backs up, writes atomically.
    """


@loading_group.command("show")
@file_options
@output_options
def show_cmd(sources: list[tuple[str, str]], as_json: bool) -> None:
    """Which loading mode each file sets, and the env-var form."""
    show_states([loading.state(p, kind) for p, kind in sources], as_json)


def _flip(value: bool, sources: list[tuple[str, str]], dry_run: bool, force: bool, diagnosis: str | None, restart_cmd: str | None, restart_timeout: float, no_backup: bool, as_json: bool, max_age_s: float = loading_safety.DEFAULT_MAX_AGE_S, engine_urls: tuple[str, ...] = ()) -> None:
    # a stop signal during the restart command: RestartInterrupted (a Signalled), said and exited 128 + N by KvctlGroup
    result = loading_flip.flip(
        value, sources, dry_run=dry_run, force=force, diagnosis=diagnosis, max_age_s=max_age_s, backup=not no_backup,
        restart_cmd=restart_cmd, restart_timeout_s=restart_timeout, engine_urls=engine_urls,
    )
    show_flip(result, as_json)
    result.raise_if_restart_failed()


RESTART_TIMEOUT_MAX_S = 86400.0


def _non_blank(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and not value.strip():
        raise click.BadParameter("is empty; give the command that restarts the engine, or leave the option out")
    return value


flip_options = options(
    file_options,
    click.option("--dry-run", is_flag=True, help="Show the diff; write nothing."),
    click.option("--restart-cmd", callback=_non_blank, help="Shell command to run after a change, e.g. 'systemctl restart vllm'; its result is reported. Ctrl-C/SIGTERM/SIGHUP during it stop it and what it started (exit 128+N)."),
    click.option("--restart-timeout", type=positive(max=RESTART_TIMEOUT_MAX_S), default=300.0, show_default=True, help=f"Seconds to wait for --restart-cmd (at most {RESTART_TIMEOUT_MAX_S:g}); then everything it started is killed."),
    click.option("--no-backup", is_flag=True, help="Do not keep a timestamped .bak copy of the file (the copy sits next to the file, a symlink's target, with its owner and mode)."),
    output_options,
)


@loading_group.command("async")
@flip_options
@click.option("--force", is_flag=True, help="Write a read-only file anyway (its mode and owner are kept), or one name of a hard-linked file; "
              "or add the setting beside a near miss of it (a typo such as enable_async_loadin, refused otherwise).")
def async_cmd(sources, dry_run, restart_cmd, restart_timeout, no_backup, as_json, force) -> None:
    """Switch to asynchronous loading (enable_async_loading: true)."""
    _flip(True, sources, dry_run, force, None, restart_cmd, restart_timeout, no_backup, as_json)


@loading_group.command("sync")
@flip_options
@click.option("--diagnosis", type=click.Path(dir_okay=False), help="`kvctl diagnose --json` output to check ρ against (default: the diagnosis `kvctl diagnose` saved for the tier the files name, or for --engine-url; never another tier's).")
@click.option("--engine-url", "engine_urls", multiple=True, help="Engine URL (repeatable) whose saved diagnosis to check when the files name no Valkey URL (an env file), as given to `kvctl diagnose`.")
@click.option("--max-age", "max_age", default="1h", show_default=True, help="Oldest diagnosis to trust: seconds or 30m, 1h, 2d.")
@click.option("--force", is_flag=True, help=f"Switch even when the diagnosis shows ρ ≥ {RHO_HIGH:g} or cannot decide (none, ρ unknown, a lower bound, too old); also write a read-only file (mode and owner kept) or one name of a hard-linked file, or add the setting beside a near miss of it.")
def sync_cmd(sources, dry_run, restart_cmd, restart_timeout, no_backup, as_json, diagnosis, engine_urls, max_age, force) -> None:
    """Switch to synchronous loading; refused unless --force when the tier's latest diagnosis shows ρ ≥ 0.7 or cannot tell.

    The diagnosis is the one `kvctl diagnose` saved for the Valkey instances the
    files name (or for --engine-url), never another tier's. Cannot tell: no
    diagnosis of this tier, ρ unknown/null/NaN, ρ only a lower bound (bandwidth
    from Valkey's server side), or a diagnosis older than --max-age.
    """
    try:
        max_age_s = loading_safety.parse_duration(max_age)
    except KvctlError as e:
        raise click.BadParameter(str(e), param_hint="'--max-age'") from e
    _flip(False, sources, dry_run, force, diagnosis, restart_cmd, restart_timeout, no_backup, as_json, max_age_s=max_age_s, engine_urls=engine_urls)
