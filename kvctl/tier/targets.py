"""Which Valkey instances a command talks to, and the state file of a local tier.

Three ways to name the per-rank instances, shared by ``bench``, ``diagnose``,
``exporter``, ``doctor`` and ``deploy-valkey status`` (their options come
from :func:`kvctl.commands.options.valkey_options`):

* explicit URLs (``--valkey``, repeatable; index = rank);
* a ``{rank}`` template plus ``--ranks N``;
* ``--dir`` of a tier that ``kvctl deploy-valkey up`` started (its state file).

Several instances per rank (``--instances-per-rank K``, or what the state file
records): rank ``r`` has instances ``0 … K-1`` and holds its owned chunk ``c`` on
instance ``(c // W) mod K`` (:func:`kvctl.connector.urls.instance_of`). Targets
are then in tier order, instance ``i`` of rank ``r`` at ``r*K + i``
(:func:`~kvctl.connector.urls.flat_instance`): URLs given one by one are read in
that order, and a template takes ``{instance}`` next to ``{rank}``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from kvctl.connector.urls import (
    INSTANCE_PLACEHOLDER,
    MAX_INSTANCES_PER_RANK,
    RANK_PLACEHOLDER,
    InvalidUrl,
    check_distinct_servers,
    expand_rank_urls,
    instances_in,
    parse_resp_url,
    redacted_repr,
)
from kvctl.core.errors import InvalidInput
from kvctl.core.files import read_password_file
from kvctl.tier.state_file import STATE_FILE, InstanceState, TierState, load_tier, state_path  # noqa: F401 - the state file's readers import them here too

#: The options that name instances (kvctl.commands.options.valkey_options), for messages.
NAMING = f"--valkey URL (repeatable, index = rank, or one {RANK_PLACEHOLDER} template with --ranks N) or --dir"


def instance_name(rank: int, instance: int = 0, instances_per_rank: int = 1) -> str:
    """How messages and tables name an instance: ``rank 3``, or ``rank 3 instance 1`` when ranks have several."""
    return f"rank {rank}" if instances_per_rank <= 1 else f"rank {rank} instance {instance}"


@dataclass(frozen=True)
class Target:
    """One Valkey instance: instance ``instance`` of rank ``rank`` (the only one when ``instances_per_rank`` is 1)."""

    __repr__ = redacted_repr  # URLs shown with their passwords masked (issue 44)

    rank: int
    host: str
    port: int
    url: str
    password: str | None = field(default=None, repr=False)
    instance: int = 0
    instances_per_rank: int = 1

    @property
    def name(self) -> str:
        return instance_name(self.rank, self.instance, self.instances_per_rank)


def check_instances(urls: str | Sequence, instances_per_rank: int) -> None:
    """InvalidInput unless ``urls`` names K = ``instances_per_rank`` instances per rank: a template with
    ``{rank}`` (and ``{instance}`` exactly when K > 1), or a per-rank list whose entries are one URL (K = 1)
    or lists of K URLs. The engine configs of both connectors are checked with it."""
    k = instances_per_rank
    if isinstance(urls, str):
        if RANK_PLACEHOLDER not in urls:
            raise InvalidInput(f"a per-rank URL template must contain {RANK_PLACEHOLDER}: {urls}")
        if (INSTANCE_PLACEHOLDER in urls) != (k > 1):
            raise InvalidInput(f"{k} instance(s) per rank: the URL template {'needs' if k > 1 else 'must not hold'} {INSTANCE_PLACEHOLDER}: {urls}")
        return
    if not urls:
        raise InvalidInput("no instances to point the engine at")
    try:
        listed = instances_in(list(urls))
    except InvalidUrl as e:
        raise InvalidInput(str(e)) from None
    if listed != k or (k > 1 and any(isinstance(u, str) for u in urls)):
        raise InvalidInput(f"{k} instance(s) per rank, but every rank's entry lists {listed} URL(s)")
    if k > 1:  # one server under two spellings: what the connectors refuse at engine start (issue 44)
        try:
            check_distinct_servers([list(u) for u in urls])
        except InvalidUrl as e:
            raise InvalidInput(str(e)) from None


def resolve_targets(
    urls: Sequence[str] = (),
    ranks: int | None = None,
    tier_dir: Path | str | None = None,
    password_file: Path | str | None = None,
    instances_per_rank: int | None = None,
) -> list[Target]:
    """The instances named by exactly one of: URLs, a {rank} template + ranks, a tier dir; in tier order.

    ``instances_per_rank`` K (None: 1, or what a tier dir's state file says): URLs given one by one
    are rank-major (instance i of rank r is URL r*K + i, so their number is a multiple of K), and a
    template with K > 1 needs ``{instance}``. A tier dir that records another K is refused.
    The messages name the options of :func:`kvctl.commands.options.valkey_options`.
    """
    if instances_per_rank is not None and not 1 <= instances_per_rank <= MAX_INSTANCES_PER_RANK:
        raise InvalidInput(f"--instances-per-rank must be in 1..{MAX_INSTANCES_PER_RANK}, got {instances_per_rank}")
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
        k = state.instances_per_rank
        if instances_per_rank is not None and instances_per_rank != k:
            raise InvalidInput(f"--instances-per-rank {instances_per_rank}, but the tier in {tier_dir} has {k} instance(s) per rank; drop the option")
        return [Target(i.rank, i.host, i.port, i.url, password, i.instance, k) for i in state.in_tier_order()]
    k = instances_per_rank or 1
    urls = list(urls)
    if len(urls) == 1 and RANK_PLACEHOLDER in urls[0]:
        if not ranks or ranks < 1:
            raise InvalidInput(f"a {RANK_PLACEHOLDER} URL template needs --ranks N (N ≥ 1)")
        if k == 1 and INSTANCE_PLACEHOLDER in urls[0]:
            raise InvalidInput(f"a {INSTANCE_PLACEHOLDER} URL template needs --instances-per-rank K: {urls[0]}")
        try:
            urls = [u for r in range(ranks) for u in expand_rank_urls(urls[0], r, k)]
        except InvalidUrl as e:
            raise InvalidInput(f"--instances-per-rank {k}: {e}") from None
    elif ranks and ranks * k != len(urls):
        raise InvalidInput(f"--ranks {ranks}" + (f" × --instances-per-rank {k}" if k > 1 else "") + f" does not match the {len(urls)} URLs given")
    elif len(urls) % k:
        raise InvalidInput(f"{len(urls)} URLs for --instances-per-rank {k}: give K URLs per rank, rank by rank (instance i of rank r is URL r*K + i)")
    out = []
    for n, url in enumerate(urls):
        if RANK_PLACEHOLDER in url or INSTANCE_PLACEHOLDER in url:
            raise InvalidInput(f"only a single URL may be a {RANK_PLACEHOLDER} template: {url}")
        parsed = parse_resp_url(url)
        out.append(Target(n // k, parsed.host, parsed.port, url, password or parsed.password, n % k, k))
    return out
