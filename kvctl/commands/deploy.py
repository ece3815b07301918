"""``kvctl deploy-valkey``: one Valkey instance per rank (paper §5.2), or K per rank, locally, as systemd units, or on k8s."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import click

from kvctl.core import render

from kvctl.core import thresholds
from kvctl.commands.options import (
    INSTANCES_PER_RANK, ByteSize, FiniteFloat, RenamedOption, count, non_negative, options, output_options, positive, valkey_options,
    valkey_targets,
)
from kvctl.core.signals import signals_raise
from kvctl.core.errors import InvalidInput, Unreachable
from kvctl.hooks import hookimpl
from kvctl.tier import sizing, spec
from kvctl.tier.targets import load_tier
from kvctl.views.deploy import show_down, show_engine_config, show_rendered, show_status, show_up

RANKS = count(4096)
#: The tier's total memory: beyond 1 PiB is a typo whatever the target (local tiers are also checked against the host).
MAXMEMORY = ByteSize(2**50)


@hookimpl
def register_commands(cli: click.Group) -> None:
    cli.add_command(deploy_group)


@hookimpl(tryfirst=True)  # built-ins register first, so a plugin cannot take their names
def register_deploy_targets(register: Callable) -> None:
    from kvctl.tier import render_targets  # noqa: PLC0415

    register("systemd", render_targets.render_systemd)
    register("k8s", render_targets.render_k8s)


def fleet_renderers() -> dict[str, Callable]:
    """Deployment targets from all plugins (built-ins included): name -> renderer(FleetSpec)."""
    from kvctl.hooks import plugin_manager  # noqa: PLC0415

    found: dict[str, Callable] = {}
    plugin_manager().hook.register_deploy_targets(register=lambda name, fn: found.setdefault(name, fn))
    return found


#: Targets that `up --apply` knows how to install; a plugin's target is rendered to --out only.
APPLY_TARGETS = ("systemd", "k8s")


class TargetChoice(click.Choice):
    """``local`` plus every target registered through ``register_deploy_targets``, read when the option is used."""

    def __init__(self) -> None:
        super().__init__(["local"])

    @property
    def choices(self) -> tuple[str, ...]:
        return ("local", *fleet_renderers())

    @choices.setter
    def choices(self, value: Any) -> None:  # click.Choice.__init__ assigns; the registered targets win
        pass


def dir_option(func: Callable) -> Callable:
    return click.option(
        "--dir",
        "tier_dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=thresholds.TIER_DIR,
        show_default=True,
        envvar="KVCTL_TIER_DIR",
        help="Directory of the local tier: configs, logs, pidfiles and the state file.",
    )(func)


password_options = options(
    click.option(
        "--password-file",
        type=click.Path(dir_okay=False),
        envvar="KVCTL_PASSWORD_FILE",
        help="File (mode 0600) holding the tier password; required to bind a non-loopback address.",
    ),
    click.option("--insecure-no-auth", is_flag=True, help="Allow a non-loopback bind address without a password (test rigs only)."),
)

#: --instances-per-rank of `up`, lmcache-config and vllm-config (the tools that read a tier take kvctl.commands.options').
instances_per_rank_option = click.option(
    "--instances-per-rank", type=INSTANCES_PER_RANK, default=1, show_default=True,
    help="Valkey instances K per rank: rank r's owned chunk c lives on its instance (c // W) mod K, more GET bandwidth per rank. "
    "Instance i of rank r is number n = r*K + i: port base-port + n (local, systemd), unit NAME@<r>-<i> (systemd), pod NAME-<n> (k8s).",
)

#: --io-threads of `up` (and of lmcache-config/vllm-config for a fleet: the connections follow it)
IO_THREADS = count(256)
HOST_CORES = count(1 << 16)

#: Options of the systemd and k8s targets.
fleet_options = options(
    click.option("--name", default="valkey-kv", show_default=True, help="Name of the unit template / StatefulSet (pods are NAME-<rank>)."),
    click.option("--service", help="Headless Service name for k8s (default: --name)."),
    click.option("--namespace", help="k8s namespace (also used in the per-rank host names)."),
    click.option("--image", default=thresholds.K8S_VALKEY_IMAGE, show_default=True,
                 help="Container image for k8s (Valkey 9.x: its tag says the version; a tag that is no 9.x version gets no "
                 "min-io-threads-avoid-copy-reply, which 8.x refuses)."),
    click.option("--k8s-port", type=click.IntRange(1, 65535), default=6379, show_default=True, help="Port every k8s pod listens on."),
    click.option("--host-cores", type=HOST_CORES,
                 help=f"Cores of the host the systemd/k8s tier runs on, for its io-threads when --io-threads is not given (default "
                 f"{thresholds.FLEET_HOST_CORES}: kvctl cannot see that host; the W × K instances are sized as sharing it). A local tier "
                 "sizes from this host's cores."),
)



@click.group("deploy-valkey")
def deploy_group() -> None:
    """Stand up one Valkey instance per rank (instance r holds exactly rank r's chunks), or K per rank.

    With --instances-per-rank K, rank r's owned chunk c lives on its instance
    (c // W) mod K; engines of the same W and K share every key.

    \b
    kvctl deploy-valkey up --ranks 4 --base-port 17400 --maxmemory 400mb --dir ./kv-tier
    kvctl deploy-valkey status --dir ./kv-tier
    kvctl deploy-valkey lmcache-config --dir ./kv-tier
    kvctl deploy-valkey vllm-config --dir ./kv-tier --shell
    kvctl deploy-valkey down --dir ./kv-tier
    kvctl deploy-valkey up --target k8s --ranks 8 --maxmemory 64gb --password-file pw --out k8s/
    kvctl deploy-valkey up --ranks 1 --instances-per-rank 4 --maxmemory 8gb --dir ./kv-tier
    """


@deploy_group.command("up")
@click.option("--target", type=TargetChoice(), default="local", show_default=True, help="Start local processes, or render systemd units / k8s manifests (or a plugin's registered target).")
@click.option("--ranks", type=RANKS, required=True, help="Number of ranks W (rank r on instance r, or on its K instances with --instances-per-rank).")
@instances_per_rank_option
@click.option("--base-port", type=click.IntRange(1, 65535), envvar="KVCTL_BASE_PORT", help=(
    "Port of rank 0; rank r listens on base-port + r, instance i of rank r on base-port + r*K + i (local, systemd; env KVCTL_BASE_PORT). "
    f"Default, local: {thresholds.BASE_PORT} when its W × K ports are free, else free loopback ports (a busy host's other tiers keep "
    f"theirs; the state file and status say which); systemd: {thresholds.BASE_PORT}. A port given is used, or refused when taken."))
@click.option("--maxmemory", type=MAXMEMORY, default=thresholds.TIER_MAXMEMORY, show_default=True, help="TOTAL memory of the tier, split evenly across all W × K instances (400mb = 400 MB = 4e8 bytes; 400MiB = 400 × 2^20).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Bind address (local, systemd). Non-loopback needs --password-file or --insecure-no-auth.")
@click.option("--io-threads", type=IO_THREADS, help=(
    "Valkey io-threads per instance, main thread included. Default: clamp(floor(0.75 × cores / instances on the host), 1, 8): "
    f"this host's cores for a local tier (here {sizing.io_threads_for()} for one instance), --host-cores for systemd/k8s. "
    "An explicit --io-threads wins. With Valkey 9.x and io-threads ≥ 2 the instance also gets min-io-threads-avoid-copy-reply "
    "at the same number (copy-free replies of large values); engines' connections per instance follow it (vllm-config, lmcache-config)."))
@dir_option
@password_options
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), help="Output directory for --target systemd/k8s.")
@click.option("--apply", "apply_", is_flag=True, help="systemd: install and enable the units (needs root); k8s: kubectl apply -f OUT.")
@fleet_options
@output_options
def up_cmd(target: str, ranks: int, instances_per_rank: int, base_port: int | None, maxmemory: int, host: str, io_threads: int | None, tier_dir: Path, password_file: str | None, insecure_no_auth: bool, out: Path | None, apply_: bool, name: str, service: str | None, namespace: str | None, image: str, k8s_port: int, host_cores: int | None, as_json: bool) -> None:
    """Start (local) or render (systemd, k8s) one Valkey instance per rank, or K per rank.

    Local: all instances answer PING or none is left running; the state file
    in --dir lists each instance as soon as it starts (bench and diagnose read
    it via --dir), so `down` can clean up after an `up` that was killed.
    SIGINT/SIGTERM stop what was started and exit 130/143. A second `up`
    into a --dir another kvctl is working on is refused.

    \b
    --instances-per-rank K: W × K instances; instance i of rank r is number
    n = r*K + i (port base-port + n; systemd unit NAME@<r>-<i>; k8s: one
    StatefulSet of W × K pods, pod NAME-<n>). Rank r's owned chunk c lives on
    its instance (c // W) mod K; vllm-config / lmcache-config name them.
    """
    if ranks < 1:
        raise InvalidInput(f"--ranks must be at least 1, got {ranks}")
    if target != "local":
        _render_fleet(target, ranks, base_port or thresholds.BASE_PORT, maxmemory, host, io_threads, password_file, insecure_no_auth, out, apply_, name, service, namespace, image, k8s_port, as_json,
                      instances_per_rank, host_cores or thresholds.FLEET_HOST_CORES)
        return
    if out or apply_:
        raise InvalidInput("--out and --apply are for --target systemd or k8s")
    if host_cores is not None:
        raise InvalidInput("--host-cores is for --target systemd or k8s: a local tier sizes its io-threads from this host's cores (or give --io-threads)")
    from kvctl.tier import local  # noqa: PLC0415 - psutil only when a command runs, not for `kvctl --help`

    req = local.UpRequest(tier_dir, ranks, base_port, maxmemory, host, io_threads, password_file, insecure_no_auth, instances_per_rank)
    # a stop signal: local.up stops what it started, then KvctlGroup says so and exits 128 + N
    with signals_raise(said="stopped the instance(s) already started; nothing of this `up` is left running"), \
            render.progress(f"starting {req.instances} valkey-server(s)", total=req.instances, enabled=not as_json, lines=False) as advance:
        state = local.up(req, on_progress=lambda name, port: advance(1, f"{name} on :{port} answers PING"))
    show_up(state, as_json)


def _render_fleet(target: str, ranks: int, base_port: int, maxmemory: int, host: str, io_threads: int | None, password_file: str | None, insecure_no_auth: bool, out: Path | None, apply_: bool, name: str, service: str | None, namespace: str | None, image: str, k8s_port: int, as_json: bool,
                  instances_per_rank: int = 1, host_cores: int = thresholds.FLEET_HOST_CORES) -> None:
    from kvctl.tier import render_targets  # noqa: PLC0415

    renderers = fleet_renderers()
    if target not in renderers:
        raise InvalidInput(f"unknown target {target!r}; known: local, {', '.join(sorted(renderers))}")
    if apply_ and target not in APPLY_TARGETS:
        raise InvalidInput(f"--apply installs only {' and '.join(APPLY_TARGETS)}; --target {target} (a plugin's target) is rendered to --out, to be installed with its own tools")
    if out is None:
        raise InvalidInput(f"--target {target} needs --out DIR")
    fleet = render_targets.FleetSpec.build(
        target=target,
        ranks=ranks,
        maxmemory=maxmemory,
        io_threads=io_threads,
        base_port=base_port,
        host=host,
        k8s_port=k8s_port,
        password_file=password_file,
        insecure_no_auth=insecure_no_auth,
        name=name,
        service=service,
        namespace=namespace,
        image=image,
        instances_per_rank=instances_per_rank,
        host_cores=host_cores,
    )
    files = render_targets.write_files(out, renderers[target](fleet))
    applied = render_targets.apply(target, out, fleet) if apply_ else None
    show_rendered(target, out, files, applied, render_targets.remote_urls(fleet), ranks, instances_per_rank, as_json)


@deploy_group.command("status")
@valkey_options(dir_default=thresholds.TIER_DIR, dir_envvar="KVCTL_TIER_DIR")
@output_options
@click.pass_context
def status_cmd(ctx: click.Context, valkey_urls: tuple[str, ...], ranks: int | None, instances_per_rank: int | None, tier_dir: str, password_file: str | None, as_json: bool) -> None:
    """Per instance: up, memory, keys, evictions, clients, GET calls and µs per GET (INFO).

    
    kvctl deploy-valkey status --dir ./kv-tier
    kvctl deploy-valkey status --valkey resp://valkey-{rank}:6379 --ranks 8
    Of the tier in --dir (default ./kv-tier, or $KVCTL_TIER_DIR), or of any
    instances named by --valkey. An instance of a --dir tier that does not
    answer is "down" (no process) or "alive, not answering (state T)" (stopped,
    hung: see `kvctl diagnose stalls --pid`); one named by URL is "down"
    (refused) or "not answering" (timed out). Exits 5 (unreachable) when any
    instance does not answer, 1 when one refuses the password (or wants one:
    --password-file).
    """
    from click.core import ParameterSource  # noqa: PLC0415
    from kvctl.tier import status as tier_status  # noqa: PLC0415
    from kvctl.tier.admin import AuthFailed  # noqa: PLC0415

    if valkey_urls or ranks:  # --dir only when given here: its default and env var name the tier when no URL is
        explicit_dir = tier_dir if ctx.get_parameter_source("tier_dir") == ParameterSource.COMMANDLINE else None
        st = tier_status.targets_status(valkey_targets(valkey_urls, ranks, explicit_dir, password_file, instances_per_rank=instances_per_rank))
    else:
        recorded = load_tier(tier_dir).instances_per_rank
        if instances_per_rank and instances_per_rank != recorded:
            raise InvalidInput(f"--instances-per-rank {instances_per_rank}, but the tier in {tier_dir} has {recorded} per rank; drop the option")
        st = tier_status.status(tier_dir, password_file)
    show_status(st, as_json)
    down = [i for i in st.instances if not i.up]
    refused = [i for i in down if i.state == "auth refused"]
    if refused:
        raise AuthFailed(f"{len(refused)} of {len(st.instances)} instance(s) refused the login: {refused[0].hint}")
    if down:
        raise Unreachable(
            f"{len(down)} of {len(st.instances)} instance(s) not answering: " + ", ".join(f"{i.name} ({i.host}:{i.port}) {i.state}" for i in down)
        )


@deploy_group.command("down")
@dir_option
@click.option("--purge", is_flag=True, help="Also delete configs, logs, pidfiles and the state file.")
@click.option("--timeout", "timeout_s", type=FiniteFloat(min=0.1, max=3600), default=10.0, show_default=True, help="Seconds to wait after SIGTERM before SIGKILL.")
@output_options
def down_cmd(tier_dir: Path, purge: bool, timeout_s: float, as_json: bool) -> None:
    """Stop the valkey-servers working in --dir: those `up` recorded, and any it started without recording.

    A dead instance is reported and skipped; a recorded pid that is not a
    valkey-server of this directory (another process now, or the original
    tier of a copied directory) is never signalled. The drill engine that
    `kvctl drill engine --dir` left on the tier is stopped first. Config files
    stay (the state file then says the tier was stopped, so `doctor` in this
    directory does not check it unless named) unless --purge, which removes
    only the files `up` and the drill engine wrote in --dir, and nothing while
    a server of the directory still runs. Says what is left in --dir.
    """
    from kvctl.drill import standalone as drill_engine  # noqa: PLC0415
    from kvctl.tier import local  # noqa: PLC0415

    state = local.tier_to_stop(tier_dir)
    try:
        engine = drill_engine.stop_engine(tier_dir)  # before the tier it reads from
    except InvalidInput as e:  # an unreadable drill-engine.json must not keep the tier running
        engine = None
        render.warn(f"{e}; no drill engine was stopped")
    with render.progress("stopping valkey-server(s)", total=len(state.instances) or None, enabled=not as_json, lines=False) as advance:
        results = local.down(tier_dir, purge=purge, timeout_s=timeout_s, on_progress=lambda name, port: advance(1, f"{name} on :{port}"))
    if purge:
        drill_engine.purge(tier_dir)
        local.remove_if_empty(tier_dir)
    show_down(state, results, purge, timeout_s, as_json, engine, local.left_in(tier_dir))


#: Options that name the tier an engine config points at (lmcache-config, vllm-config).
tier_config_options = options(
    click.option("--target", type=TargetChoice(), default="local", show_default=True, help="Tier kind: local reads --dir; systemd/k8s (or a plugin's target) take the same options as `up`."),
    dir_option,
    click.option("--ranks", type=RANKS, help="Number of ranks (systemd, k8s)."),
    click.option("--instances-per-rank", type=INSTANCES_PER_RANK, help="Instances K per rank (systemd, k8s; default 1, as given to `up`); a local tier knows its own."),
    click.option("--base-port", type=click.IntRange(1, 65535), default=thresholds.BASE_PORT, show_default=True, envvar="KVCTL_BASE_PORT", help="Port of rank 0 (systemd; env KVCTL_BASE_PORT, as for `up`)."),
    click.option("--host", default="127.0.0.1", show_default=True, help="Host the systemd instances run on, as engines reach it."),
    fleet_options,
    click.option("--io-threads", type=IO_THREADS, help="io-threads of the systemd/k8s tier's instances, as given to `up` (default: what `up` "
                 "chooses from --host-cores); a local tier records its own. The engine's connections per instance follow them."),
    click.option("--engine-password-file", type=click.Path(dir_okay=False), help="Engine password file for systemd/k8s tiers with auth (names user kvctl-engine)."),
)


def _tier_urls(target: str, tier_dir: Path, ranks: int | None, base_port: int, host: str, name: str, service: str | None, namespace: str | None, image: str, k8s_port: int, engine_password_file: str | None, instances_per_rank: int | None,
               host_cores: int | None = None, io_threads: int | None = None) -> Any:
    """The tier's URLs (kvctl.tier.engine_urls.tier_urls), with a warning when a local tier is not running."""
    from kvctl.tier.engine_urls import tier_urls  # noqa: PLC0415 - yaml

    if target == "local" and (host_cores is not None or io_threads is not None):
        raise InvalidInput("--io-threads and --host-cores are for systemd/k8s tiers: a local tier's state file records its io-threads")
    t = tier_urls(target, tier_dir, ranks, base_port, host, name, service, namespace, image, k8s_port, engine_password_file, instances_per_rank,
                  host_cores or thresholds.FLEET_HOST_CORES, io_threads)
    if t.not_running:
        which = f"rank(s) {', '.join(n.removeprefix('rank ') for n in t.not_running)}" if t.instances_per_rank == 1 else ", ".join(t.not_running)
        render.warn(
            f"the tier in {tier_dir} is not running (no valkey-server for {which}): "
            f"engines given these URLs will find nothing there; start it with `kvctl deploy-valkey up`"
        )
    return t


@deploy_group.command("lmcache-config")
@tier_config_options
@click.option("--chunk-tokens", "chunk_size", type=count(1 << 20), default=thresholds.CHUNK_TOKENS, show_default=True, cls=RenamedOption, old=["--chunk-size"],
              help="Tokens per chunk: LMCache's chunk_size.")
@click.option("--local-cpu/--no-local-cpu", default=True, show_default=True, help="LMCache L1 in host memory.")
@click.option("--max-local-cpu-size", type=non_negative(1e5), default=5.0, show_default=True, help="LMCache L1 size in GB per engine worker.")
@click.option("--loading", type=click.Choice(["sync", "async"]), default="sync", show_default=True, cls=RenamedOption,
              old_flags={"--async-loading": "async", "--sync-loading": "sync"}, help="Loading mode: LMCache's enable_async_loading.")
@click.option("--plugin/--native", default=True, show_default=True, help="--plugin (the default): kvctl's RESP client as LMCache's remote-storage plugin (remote_storage_plugins: [kvctl], no remote_url). --native: LMCache's own resp:// client in remote_url, with a warning (it hangs on a missing key; kvctl doctor fails it).")
@click.option("--out", "out_file", type=click.Path(dir_okay=False, path_type=Path), help="Write the YAML to this file instead of stdout.")
@output_options
def lmcache_config_cmd(target: str, tier_dir: Path, ranks: int | None, instances_per_rank: int | None, base_port: int, host: str, name: str, service: str | None, namespace: str | None, image: str, k8s_port: int, host_cores: int | None, io_threads: int | None, engine_password_file: str | None, chunk_size: int, local_cpu: bool, max_local_cpu_size: float, loading: str, plugin: bool, out_file: Path | None, as_json: bool) -> None:
    """Print the LMCache YAML for this tier: chunk size, L1 settings, per-rank remote URL.

    Local tiers get the per-rank list form (ports differ); k8s gets the
    {rank} template form (hosts differ). With K instances per rank the list
    holds, per rank, its K URLs, and remote_storage_plugin.kvctl.instances_per_rank
    says K (the plugin spreads a rank's keys over them). The default form loads kvctl's RESP
    client into LMCache (kvctl.plugins.lmcache): a missing key is a miss
    within the deadline, never a hang. --native writes LMCache's own resp://
    client instead, which LMCache <= 0.5.6 cannot run safely (warned).
    """
    from kvctl.tier.lmcache_config import LMCacheSettings, lmcache_config, render_lmcache_yaml  # noqa: PLC0415 - yaml

    t = _tier_urls(target, tier_dir, ranks, base_port, host, name, service, namespace, image, k8s_port, engine_password_file, instances_per_rank,
                   host_cores, io_threads)
    settings = LMCacheSettings(chunk_size, local_cpu, max_local_cpu_size, "naive", loading == "async", t.connections_per_instance)
    cfg = lmcache_config(t.urls, settings, t.user, t.password_file, plugin=plugin, instances_per_rank=t.instances_per_rank)
    password_file, tier = t.password_file, t.title
    notes = [] if target == "local" or password_file else [no_credentials_note(target, name)]
    if not plugin:
        notes.append(NATIVE_CLIENT_NOTE)
    for n in notes:
        render.warn(n)
    show_engine_config(cfg, lambda: render_lmcache_yaml(cfg, f"LMCache config for {tier}", notes), out_file, as_json)


#: What --native costs (paper §5.4); `kvctl doctor --config` fails this form for the same reason.
NATIVE_CLIENT_NOTE = (
    "--native: LMCache's own resp:// client (LMCache <= 0.5.6) hangs on a GET of a missing key and can lose a "
    "completion (paper §5.4 bugs 1 and 2); `kvctl doctor --config` fails this form. Drop --native for kvctl's plugin"
)


def no_credentials_note(target: str, name: str) -> str:
    """Where an engine finds its password when a fleet was rendered with --password-file."""
    where = (
        f"mount key engine-password of Secret {name}-auth into the engine pod"
        if target == "k8s"
        else "copy engine.password from the --out directory of `up` to the engine host (mode 0600)"
    )
    return (
        f"no engine credentials in this config: if the tier was rendered with --password-file, engines must log in as "
        f"{spec.ENGINE_USER}: {where} and pass its path with --engine-password-file"
    )


@deploy_group.command("vllm-config")
@tier_config_options
@click.option("--chunk-tokens", type=count(max=1 << 20), default=thresholds.CHUNK_TOKENS, show_default=True, help="Tokens per chunk of the kvctl connector (a multiple of vLLM's block size).")
@click.option("--loading", type=click.Choice(["sync", "async"]), default="sync", show_default=True, cls=RenamedOption,
              old_flags={"--async-loading": "async", "--sync-loading": "sync"},
              help="Loading mode: the connector's async_loading (paper §5.3: async loads in the background while the request waits).")
@click.option("--timeout", "timeout_s", type=positive(max=3600), cls=RenamedOption, old=["--timeout-s"],
              help=f"Seconds a lookup or load of the engine's connector may take before it recomputes (its timeout_s; default {thresholds.CONNECTOR_TIMEOUT_S:g}, the connector's).")
@click.option("--shell", "as_shell", is_flag=True, help="Print the whole quoted argument, --kv-transfer-config '...', for a shell or a systemd ExecStart line.")
@click.option("--out", "out_file", type=click.Path(dir_okay=False, path_type=Path), help="Write the output to this file instead of stdout.")
@output_options
def vllm_config_cmd(target: str, tier_dir: Path, ranks: int | None, instances_per_rank: int | None, base_port: int, host: str, name: str, service: str | None, namespace: str | None, image: str, k8s_port: int, host_cores: int | None, io_threads: int | None, engine_password_file: str | None, chunk_tokens: int, loading: str, timeout_s: float | None, as_shell: bool, out_file: Path | None, as_json: bool) -> None:
    """Print vLLM's --kv-transfer-config JSON that loads kvctl's connector over this tier.

    One compact JSON line (the argument's value); --shell prints the quoted
    argument, --json the same mapping indented. Local and systemd tiers get a
    per-rank "urls" list (ports differ); k8s gets a "url" {rank} template
    (hosts differ). With K instances per rank, "urls" holds per rank the
    list of its K URLs (k8s too: pod r*K + i is no template) and
    "instances_per_rank" says K. With a password, the tier's engine user is in the URLs
    and only the password file's path is written.

    \b
    python -m vllm.entrypoints.openai.api_server ... \\
        --kv-transfer-config "$(kvctl deploy-valkey vllm-config --dir ./kv-tier)"
    """
    from kvctl.tier.vllm_config import ConnectorOptions, kv_transfer_config, render_json, render_shell  # noqa: PLC0415

    if as_shell and as_json:
        raise InvalidInput("--shell and --json are two output forms; pick one")
    t = _tier_urls(target, tier_dir, ranks, base_port, host, name, service, namespace, image, k8s_port, engine_password_file, instances_per_rank,
                   host_cores, io_threads)
    cfg = kv_transfer_config(t.urls, ConnectorOptions(chunk_tokens, loading == "async", timeout_s, t.connections_per_instance), t.user,
                             t.password_file, t.instances_per_rank)
    show_engine_config(cfg, lambda: (render_shell(cfg) if as_shell else render_json(cfg)) + "\n", out_file, as_json)
