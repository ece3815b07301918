"""The URLs, engine user and password file an engine config points at, for a local tier or a rendered fleet.

What ``kvctl deploy-valkey lmcache-config`` and ``vllm-config`` print is built from this; the commands only
render it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvctl.core.errors import InvalidInput
from kvctl.core.thresholds import FLEET_HOST_CORES
from kvctl.tier import sizing, spec
from kvctl.tier.lmcache_config import check_name
from kvctl.tier.targets import instance_name, load_tier


@dataclass(frozen=True)
class TierUrls:
    urls: str | list[str] | list[list[str]]  # one URL per rank, a {rank} template, or (K > 1) per rank the list of its K URLs
    user: str | None  # the engine's ACL user
    password_file: str | None  # the engine's password file (its path, never the password)
    title: str
    not_running: list[str] = field(default_factory=list)  # a local tier's instances with no live valkey-server: "rank 0 instance 1"
    instances_per_rank: int = 1
    io_threads: int | None = None  # each instance's io-threads (the state file's, or the fleet's); None: unknown

    @property
    def connections_per_instance(self) -> int:
        """What the engine's connector keeps busy per instance: one connection per I/O thread (kvctl.tier.sizing)."""
        return sizing.connections_for(self.io_threads)


def tier_urls(
    target: str, tier_dir: Path | str, ranks: int | None, base_port: int, host: str, name: str, service: str | None,
    namespace: str | None, image: str, k8s_port: int, engine_password_file: str | None, instances_per_rank: int | None = None,
    host_cores: int = FLEET_HOST_CORES, io_threads: int | None = None,
) -> TierUrls:
    """The tier an engine config points at: the state file of a local tier, or the names of a fleet target.

    ``instances_per_rank``: a fleet's K (None: 1); a local tier's comes from its state file (another K
    given is refused). With K > 1 ``urls`` is per rank the list of its K URLs, instance i of rank r
    being the state file's instance (r, i) or the fleet's number r*K + i. ``io_threads``: a fleet's, as `up` was given
    them (None: what `up` chooses on a host of ``host_cores`` cores); a local tier's come from its state file.

    Names that go into a config file are refused when they hold a control character (a newline would start
    a YAML line of its own)."""
    for value, what in ((str(tier_dir), "--dir"), (host, "--host"), (name, "--name"), (service, "--service"), (namespace, "--namespace"),
                        (image, "--image"), (engine_password_file, "--engine-password-file")):
        check_name(value, what)
    if target == "local":
        from kvctl.tier import local  # noqa: PLC0415 - psutil

        state = load_tier(tier_dir)
        k = state.instances_per_rank
        if instances_per_rank is not None and instances_per_rank != k:
            raise InvalidInput(f"--instances-per-rank {instances_per_rank}, but the tier in {state.dir} has {k} instance(s) per rank; drop the option")
        ordered = state.in_tier_order()
        check_name(state.dir, "the tier's directory")
        check_name(state.engine_password_file, "the tier's engine password file")
        stopped = [instance_name(i.rank, i.instance, k) for i in local.not_running(ordered, state.dir)]
        threads = state.io_threads or None  # 0: a state file of an older kvctl, which did not record them
        if k == 1:
            return TierUrls([i.url for i in ordered], state.engine_user, state.engine_password_file,
                            f"the local tier in {state.dir} ({len(ordered)} ranks)", stopped, io_threads=threads)
        by_rank = [[i.url for i in ordered if i.rank == r] for r in sorted({i.rank for i in ordered})]
        if any(len(urls) != k for urls in by_rank):
            raise InvalidInput(f"the tier in {state.dir} records {len(ordered)} instances, not {k} for each of its ranks: "
                               f"an `up` that did not finish? restart it (`kvctl deploy-valkey down`, then `up`)")
        return TierUrls(by_rank, state.engine_user, state.engine_password_file,
                        f"the local tier in {state.dir} ({len(by_rank)} ranks × {k} instances)", stopped, k, threads)
    from kvctl.tier import render_targets  # noqa: PLC0415

    if not ranks or ranks < 1:
        raise InvalidInput(f"--target {target} needs --ranks N (N ≥ 1)")
    # the fleet's names and ports, validated as `up` validates them (sizes and auth do not matter here)
    k = instances_per_rank or 1
    fleet = render_targets.FleetSpec.build(
        target=target, ranks=ranks, maxmemory=f"{ranks * k}mb", io_threads=io_threads, base_port=base_port, host=host, k8s_port=k8s_port,
        password_file=None, insecure_no_auth=True, name=name, service=service, namespace=namespace, image=image, instances_per_rank=k,
        host_cores=host_cores,
    )  # fmt: skip
    user = spec.ENGINE_USER if engine_password_file else None
    layout = f"{ranks} ranks" + (f" × {k} instances" if k > 1 else "")
    return TierUrls(render_targets.remote_urls(fleet), user, engine_password_file, f"the {target} tier {name} ({layout})", instances_per_rank=k,
                    io_threads=fleet.io_threads)
