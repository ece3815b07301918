"""The URLs, engine user and password file an engine config points at, for a local tier or a rendered fleet.

What ``kvctl deploy-valkey lmcache-config`` and ``vllm-config`` print is built from this; the commands only
render it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvctl.errors import InvalidInput
from kvctl.tier import spec
from kvctl.tier.lmcache_config import check_name
from kvctl.tier.targets import load_tier


@dataclass(frozen=True)
class TierUrls:
    urls: str | list[str]  # one URL per rank, or a {rank} template
    user: str | None  # the engine's ACL user
    password_file: str | None  # the engine's password file (its path, never the password)
    title: str
    not_running: list[int] = field(default_factory=list)  # ranks of a local tier with no live valkey-server


def tier_urls(
    target: str, tier_dir: Path | str, ranks: int | None, base_port: int, host: str, name: str, service: str | None,
    namespace: str | None, image: str, k8s_port: int, engine_password_file: str | None,
) -> TierUrls:
    """The tier an engine config points at: the state file of a local tier, or the names of a fleet target.

    Names that go into a config file are refused when they hold a control character (a newline would start
    a YAML line of its own)."""
    for value, what in ((str(tier_dir), "--dir"), (host, "--host"), (name, "--name"), (service, "--service"), (namespace, "--namespace"),
                        (image, "--image"), (engine_password_file, "--engine-password-file")):
        check_name(value, what)
    if target == "local":
        from kvctl.tier import local  # noqa: PLC0415 - psutil

        state = load_tier(tier_dir)
        urls = [i.url for i in sorted(state.instances, key=lambda i: i.rank)]
        check_name(state.dir, "the tier's directory")
        check_name(state.engine_password_file, "the tier's engine password file")
        stopped = [i.rank for i in local.not_running(state.instances)]
        return TierUrls(urls, state.engine_user, state.engine_password_file, f"the local tier in {state.dir} ({len(urls)} ranks)", stopped)
    from kvctl.tier import render_targets  # noqa: PLC0415

    if not ranks or ranks < 1:
        raise InvalidInput(f"--target {target} needs --ranks N (N ≥ 1)")
    # the fleet's names and ports, validated as `up` validates them (sizes and auth do not matter here)
    fleet = render_targets.FleetSpec.build(
        target=target, ranks=ranks, maxmemory=f"{ranks}mb", io_threads=1, base_port=base_port, host=host, k8s_port=k8s_port,
        password_file=None, insecure_no_auth=True, name=name, service=service, namespace=namespace, image=image,
    )  # fmt: skip
    user = spec.ENGINE_USER if engine_password_file else None
    return TierUrls(render_targets.remote_urls(fleet), user, engine_password_file, f"the {target} tier {name} ({ranks} ranks)")
