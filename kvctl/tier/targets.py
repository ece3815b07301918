"""Which Valkey instances a command talks to, and the state file of a local tier.

Three ways to name the per-rank instances, shared by ``bench``, ``diagnose``,
``exporter``, ``doctor`` and ``deploy-valkey status`` (their options come
from :func:`kvctl.commands.options.valkey_options`):

* explicit URLs (``--valkey``, repeatable; index = rank);
* a ``{rank}`` template plus ``--ranks N``;
* ``--dir`` of a tier that ``kvctl deploy-valkey up`` started (its state file).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

from kvctl.connector.urls import RANK_PLACEHOLDER, expand_url, parse_resp_url, read_password_file  # noqa: F401 - the one reader, re-exported
from kvctl.errors import InvalidInput
from kvctl.files import write_atomic

STATE_FILE = "kvctl-tier.json"
#: The options that name instances (kvctl.commands.options.valkey_options), for messages.
NAMING = f"--valkey URL (repeatable, index = rank, or one {RANK_PLACEHOLDER} template with --ranks N) or --dir"


@dataclass(frozen=True)
class Target:
    """One Valkey instance serving one rank."""

    rank: int
    host: str
    port: int
    url: str
    password: str | None = field(default=None, repr=False)


@dataclass
class InstanceState:
    rank: int
    host: str
    port: int
    pid: int
    url: str
    config: str
    logfile: str
    pidfile: str
    cmdline: list[str] = field(default_factory=list)
    create_time: float = 0.0  # psutil create_time at start: guards against pid reuse


@dataclass
class TierState:
    """What ``deploy-valkey up`` started in a directory (``<dir>/kvctl-tier.json``)."""

    dir: str
    instances: list[InstanceState]
    binary: str = ""
    server_version: str = ""
    maxmemory_total: int = 0
    password_file: str | None = None
    created_at: str = ""
    maxmemory_per_instance: int = 0
    io_threads: int = 0
    engine_user: str | None = None  # ACL user for engines (only with a password)
    engine_password_file: str | None = None
    complete: bool = True  # False while `up` is still starting instances (or when it died midway)

    def write(self) -> Path:
        """Atomically write the state file."""
        return write_atomic(Path(self.dir) / STATE_FILE, json.dumps(asdict(self), indent=2) + "\n")


def state_path(tier_dir: Path | str) -> Path:
    return Path(tier_dir) / STATE_FILE


def load_tier(tier_dir: Path | str) -> TierState:
    """Read the state file of a local tier; InvalidInput when absent or corrupt."""
    path = state_path(tier_dir)
    try:
        raw = json.loads(path.read_text())
        raw["instances"] = [InstanceState(**i) for i in raw["instances"]]
        return TierState(**raw)
    except FileNotFoundError as e:
        raise InvalidInput(f"{tier_dir} holds no kvctl tier ({STATE_FILE} missing); start one with `kvctl deploy-valkey up --dir {tier_dir}`") from e
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InvalidInput(f"cannot read tier state {path}: {e}") from e


def resolve_targets(
    urls: Sequence[str] = (),
    ranks: int | None = None,
    tier_dir: Path | str | None = None,
    password_file: Path | str | None = None,
) -> list[Target]:
    """The per-rank instances named by exactly one of: URLs, a {rank} template + ranks, a tier dir.

    The messages name the options of :func:`kvctl.commands.options.valkey_options`.
    """
    if ranks and not urls:
        raise InvalidInput(f"--ranks goes with one {RANK_PLACEHOLDER} --valkey template; a --dir tier knows its own ranks")
    if urls and tier_dir:
        raise InvalidInput(f"name the Valkey instances with {NAMING}, not both")
    if not urls and not tier_dir:
        raise InvalidInput(f"name the Valkey instances with {NAMING}")
    password = read_password_file(password_file) if password_file else None
    if tier_dir:
        state = load_tier(tier_dir)
        if password is None and state.password_file:
            password = read_password_file(state.password_file)
        return [Target(i.rank, i.host, i.port, i.url, password) for i in sorted(state.instances, key=lambda i: i.rank)]
    urls = list(urls)
    if len(urls) == 1 and RANK_PLACEHOLDER in urls[0]:
        if not ranks or ranks < 1:
            raise InvalidInput(f"a {RANK_PLACEHOLDER} URL template needs --ranks N (N ≥ 1)")
        urls = [expand_url(urls[0], r) for r in range(ranks)]
    elif ranks and ranks != len(urls):
        raise InvalidInput(f"--ranks {ranks} does not match the {len(urls)} URLs given")
    out = []
    for rank, url in enumerate(urls):
        if RANK_PLACEHOLDER in url:
            raise InvalidInput(f"only a single URL may be a {RANK_PLACEHOLDER} template: {url}")
        parsed = parse_resp_url(url)
        out.append(Target(rank, parsed.host, parsed.port, url, password or parsed.password))
    return out
