"""Options shared by several commands. Importing this registers nothing (unlike ``kvctl.cli``)."""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import click

from kvctl.errors import ExitStatus, InvalidInput

if TYPE_CHECKING:
    from kvctl.tier.targets import Target


class FiniteFloat(click.FloatRange):
    """A float option that rejects NaN, ±inf and values outside ``[min, max]`` (exit 2).

    Every numeric option needs an upper bound: a value past it is a typo, and
    past ~1e308 arithmetic turns into ``inf`` and JSON into ``Infinity``.
    """

    name = "number"

    def __init__(self, min: float | None = None, max: float | None = None, min_open: bool = False, max_open: bool = False) -> None:
        if max is None or not math.isfinite(max):
            raise ValueError("FiniteFloat needs a finite max: every numeric option has an absurd end")
        super().__init__(min=min, max=max, min_open=min_open, max_open=max_open, clamp=False)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        rv = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return super().convert(rv, param, ctx)


def positive(max: float) -> FiniteFloat:
    """A finite float in ``(0, max]``."""
    return FiniteFloat(min=0, max=max, min_open=True)


def non_negative(max: float) -> FiniteFloat:
    """A finite float in ``[0, max]``."""
    return FiniteFloat(min=0, max=max)


def count(max: int, min: int = 1) -> click.IntRange:
    """An integer in ``[min, max]`` (click's int parser already refuses nan/inf/1e9)."""
    return click.IntRange(min=min, max=max)


class ByteSize(click.ParamType):
    """A Valkey-style size (``400mb`` = MiB, ``2g`` = 10^9, a byte count) up to ``max_bytes``; converts to bytes."""

    name = "size"

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from kvctl.tier.spec import format_size, parse_size  # noqa: PLC0415

        if isinstance(value, int):
            return value
        try:
            n = parse_size(value)
        except InvalidInput as e:
            self.fail(str(e), param, ctx)
        if n > self.max_bytes:
            self.fail(f"{value} is more than {format_size(self.max_bytes)}.", param, ctx)
        return n


#: Help of the options every command names its Valkey instances with (the messages: kvctl.tier.targets.NAMING).
VALKEY_URL_HELP = "Valkey instance per rank, resp://[USER@]HOST:PORT (repeatable, index = rank), or one {rank} template with --ranks; --url is an alias."
RANKS_HELP = "Number of ranks to expand a {rank} --valkey template to."
TIER_DIR_HELP = "Directory of a tier started by `kvctl deploy-valkey up` (instead of --valkey)."
PASSWORD_FILE_HELP = "File (mode 0600) holding the Valkey password (default with --dir: the one `up` recorded)."


def valkey_options(func: Callable | None = None, *, dir_default: str | None = None, dir_envvar: str | None = None) -> Callable:
    """The Valkey instances a command talks to: ``--valkey``/``--url``, ``--ranks``, ``--dir``, ``--password-file``.

    Every command that reads Valkey takes these four, with the same spellings,
    help and env var (``KVCTL_PASSWORD_FILE``); :func:`valkey_targets` turns
    them into targets. ``dir_default``/``dir_envvar`` give ``--dir`` a default
    (``deploy-valkey status``: its tier directory).
    """

    def decorate(f: Callable) -> Callable:
        @click.option("--valkey", "--url", "valkey_urls", multiple=True, help=VALKEY_URL_HELP)
        @click.option("--ranks", type=count(4096), help=RANKS_HELP)
        @click.option("--dir", "tier_dir", type=click.Path(file_okay=False), default=dir_default, show_default=dir_default is not None, envvar=dir_envvar, help=TIER_DIR_HELP)
        @click.option("--password-file", type=click.Path(dir_okay=False), envvar="KVCTL_PASSWORD_FILE", help=PASSWORD_FILE_HELP)
        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return f(*args, **kwargs)

        return wrapper

    return decorate(func) if func is not None else decorate


def valkey_targets(valkey_urls: Sequence[str], ranks: int | None, tier_dir: str | Path | None, password_file: str | None, *, required: bool = True) -> list[Target]:
    """The per-rank instances :func:`valkey_options` named; ``[]`` when none is named and ``required`` is False.

    Errors (both or neither of URLs and ``--dir``, ``--ranks`` without a
    ``{rank}`` template, an unreadable password file) are ``InvalidInput``, exit 2.
    """
    from kvctl.tier.targets import resolve_targets  # noqa: PLC0415 - keep `kvctl --help` light

    if not required and not (valkey_urls or ranks or tier_dir):
        return []
    return resolve_targets(valkey_urls, ranks, tier_dir, password_file)


def output_options(func: Callable) -> Callable:
    """``--json``: plain JSON on stdout instead of tables."""

    @click.option("--json", "as_json", is_flag=True, help="Print plain JSON on stdout (no styling).")
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return func(*args, **kwargs)

    return wrapper


def severity_exit(severity: str | None) -> ExitStatus:
    """Exit status for the worst finding: 3 for a warning, 4 for critical, 0 otherwise."""
    value = getattr(severity, "value", severity)
    return {"warning": ExitStatus.FINDING_WARNING, "critical": ExitStatus.FINDING_CRITICAL}.get(value, ExitStatus.OK)


def engine_http_options(func: Callable) -> Callable:
    """How to read an engine over HTTP: its API key and the /metrics size cap (kvctl.engine_http)."""
    from kvctl.thresholds import METRICS_MAX_BYTES  # noqa: PLC0415

    @click.option("--engine-api-key-file", type=click.Path(dir_okay=False), envvar="KVCTL_ENGINE_API_KEY_FILE",
                  help="File holding the engine's API key (vLLM's --api-key), sent as Authorization: Bearer (default: $KVCTL_ENGINE_API_KEY). "
                  "USER:PASS@ in --engine-url is sent as basic auth instead. Both are masked wherever a URL is shown or saved.")
    @click.option("--max-metrics-bytes", type=count(1 << 30, min=1024), default=METRICS_MAX_BYTES, show_default=True,
                  help="Largest engine /metrics answer read; a larger one is refused and reported (the engine counts as not answering).")
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return func(*args, **kwargs)

    return wrapper


def engine_http(api_key_file: str | None, max_metrics_bytes: int, inflight: Any = None) -> Any:
    """The :class:`kvctl.engine_http.EngineHttp` the options above describe (the key file read here, never quoted)."""
    from kvctl.engine_http import EngineHttp, read_api_key  # noqa: PLC0415

    return EngineHttp(read_api_key(api_key_file), max_metrics_bytes, inflight)
