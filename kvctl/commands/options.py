"""Options shared by several commands. Importing this registers nothing (unlike ``kvctl.cli``)."""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

import click

from kvctl.connector.urls import MAX_INSTANCES_PER_RANK
from kvctl.core.errors import ExitStatus, InvalidInput
from kvctl.core.kvsize import DTYPE_BYTES, kv_size_from_file
from kvctl.core.render import REPORT_PLOT_FILES
from kvctl.core.thresholds import BYTES_PER_TOKEN_MAX, METRICS_MAX_BYTES

if TYPE_CHECKING:
    from kvctl.tier.targets import Target

F = TypeVar("F", bound=Callable[..., Any])


def options(*decorators: Callable[[F], F]) -> Callable[[F], F]:
    """Several options as one decorator: ``options(click.option(...), click.option(...), other_bundle)``.

    Applied in the order given, so ``--help`` lists them as written; a bundle may hold
    other bundles. Every option shared by several commands is one such bundle.
    """

    def apply(func: F) -> F:
        for decorate in reversed(decorators):
            func = decorate(func)
        return func

    return apply


class RenamedOption(click.Option):
    """An option whose old names still work for one release, hidden from ``--help``, with a warning on stderr.

    ``old`` are old spellings taking the same value (``--url`` of ``--valkey``); ``old_flags`` old flags that
    stand for a value (``{"--async-loading": "async"}`` of ``--loading``); ``why`` ends the warning (what the new
    name does that the old did not). The old names are parsed into a destination of their own, so the option keeps
    its type, bounds, ``required`` and env var; different values given under several names are a usage error (mixed,
    a repeatable option's order, rank order for ``--valkey``, would be lost), one value given under several names of a
    single-valued option is that value (``--bench F --get-times-from F``). docs/reference.md's "Names" table lists
    every old name (tests/cli/test_names.py).
    """

    def __init__(self, *args: Any, old: Sequence[str] = (), old_flags: dict[str, Any] | None = None, why: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.old_opts = tuple(old)
        self.old_flags = dict(old_flags or {})
        self.why = why

    @property
    def old_names(self) -> tuple[str, ...]:
        return (*self.old_opts, *self.old_flags)

    def _old_dest(self, opt: str) -> str:
        return f"{self.name}__old{opt}"

    def add_to_parser(self, parser: Any, ctx: click.Context) -> None:
        super().add_to_parser(parser, ctx)
        action = "append" if self.multiple else "store"
        for opt in self.old_opts:
            parser.add_option(obj=self, opts=[opt], dest=self._old_dest(opt), action=action, nargs=self.nargs)
        for opt, value in self.old_flags.items():
            parser.add_option(obj=self, opts=[opt], dest=self._old_dest(opt), action="store_const", const=value)

    def consume_value(self, ctx: click.Context, opts: Any) -> Any:
        given = {opt: opts[self._old_dest(opt)] for opt in self.old_names if self._old_dest(opt) in opts}
        if given:
            new = max(self.opts, key=len)
            for opt in given:
                from kvctl.core import render  # noqa: PLC0415 - warnings are drawn by render

                to = f"{new} {self.old_flags[opt]}" if opt in self.old_flags else new
                render.warn(f"{opt} is renamed {to}{f' ({self.why})' if self.why else ''}; the old name works until the next release")
            opts = dict(opts)
            values = list(given.values()) + ([opts[self.name]] if self.name in opts else [])
            if len(values) > 1 and (self.multiple or any(v != values[0] for v in values)):  # a repeatable one: its order (ranks) would be lost
                raise click.UsageError(f"give every value as {new} ({', '.join(given)} is its old name; do not mix the two)", ctx=ctx)
            opts[self.name] = values[0]
        return super().consume_value(ctx, opts)


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
    """The one parser of every byte-sized option (:func:`kvctl.core.sizes.parse_size`): ``12.4e6`` or ``12.4mb`` (10^6),
    ``12MiB`` (2^20), ``2g`` (10^9), from ``min_bytes`` up to ``max_bytes``; converts to bytes."""

    name = "size"

    def __init__(self, max_bytes: int, min_bytes: int = 1) -> None:
        self.max_bytes, self.min_bytes = max_bytes, min_bytes

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from kvctl.core.sizes import parse_size  # noqa: PLC0415
        from kvctl.tier.spec import format_size  # noqa: PLC0415

        if isinstance(value, int):
            return value
        try:
            n = parse_size(value)
        except InvalidInput as e:
            self.fail(str(e), param, ctx)
        if n > self.max_bytes:
            self.fail(f"{value} is more than {format_size(self.max_bytes)}.", param, ctx)
        if n < self.min_bytes:
            self.fail(f"{value} is less than {self.min_bytes} bytes.", param, ctx)
        return n


# The cost model's quantities with the bounds past which a value is a typo (and the
# arithmetic would overflow into inf/NaN). Divisors have a floor above zero.
BYTES_PER_TOKEN = FiniteFloat(min=1, max=BYTES_PER_TOKEN_MAX)  # 1 B to 1 GB per token (s from a --model-config too)
PREFILL_RATE = FiniteFloat(min=1e-3, max=1e9)  # tokens/s
T0_S = non_negative(3600.0)
LATENCY_S = positive(86400.0)
PROMPT_GB = positive(1e6)
BANDWIDTH_GBPS = FiniteFloat(min=1e-6, max=1e6)
ARRIVAL_RATE = positive(1e6)  # requests/s
TOKENS = count(10**9)
TP = count(4096)
CHUNK_TOKENS = count(1 << 20)

BYTES_PER_TOKEN_HELP = "KV bytes per prompt token of the WHOLE model (s), all ranks' shares together."
TP_HELP = ("Tensor-parallel ranks, one tier instance each: --model-config splits the KV heads over them; s is the whole model's, "
           "and counts each KV head once per copy when --tp exceeds the KV heads (kv_head_copies).")
#: The one wording of R and T0: every command's --prefill-rate and --t0 help starts with these (issue 49: six wordings
#: each), then says what the command does with it.
PREFILL_RATE_HELP = "Prefill throughput R, tokens/s"
T0_HELP = "Fixed per-hit cost T0, seconds"

#: The options of :func:`bytes_per_token_options` as (declarations, click keywords): kvctl.commands.whatif_options
#: declares simulate's and plan's from here too.
BYTES_PER_TOKEN_SPECS: tuple[tuple[tuple[str, ...], dict[str, Any]], ...] = (
    (("--bytes-per-token",), {"type": BYTES_PER_TOKEN, "help": BYTES_PER_TOKEN_HELP}),
    (("--model-config",), {"type": click.Path(dir_okay=False), "help": "Hugging Face config.json to derive bytes per token from (instead of --bytes-per-token)."}),
    (("--dtype",), {"type": click.Choice(sorted(DTYPE_BYTES)), "help": "KV dtype with --model-config."}),
    (("--tp",), {"type": TP, "default": 1, "show_default": True, "help": TP_HELP}),
)

_bytes_per_token_bundle = options(*(click.option(*decls, **kwargs) for decls, kwargs in BYTES_PER_TOKEN_SPECS))


def bytes_per_token_of(bytes_per_token: float | None, model_config: str | None, dtype: str | None, tp: int, required: bool = True) -> float | None:
    """s, the whole model's bytes per token: ``bytes_per_token`` as given, else derived from ``model_config`` (usage
    error when neither is given and ``required``)."""
    if bytes_per_token is None and model_config:
        bytes_per_token = kv_size_from_file(model_config, dtype=dtype, tp=tp).bytes_per_token
    if bytes_per_token is None and required:
        raise click.UsageError("give --bytes-per-token or --model-config")
    return bytes_per_token


def bytes_per_token_options(required: bool = True, pass_tp: bool = False) -> Callable:
    """``--bytes-per-token`` or ``--model-config`` (+ ``--dtype``/``--tp``); passes ``bytes_per_token``.

    ``bytes_per_token`` is always the whole model's s (kvctl.core.kvsize), whatever
    ``--tp``; with ``pass_tp`` the command also gets ``tp`` and reports each
    rank's share s/tp (``bytes_per_token_per_rank``).
    """

    def decorate(func: Callable) -> Callable:
        @functools.wraps(func)
        def wrapper(*args: Any, bytes_per_token: float | None, model_config: str | None, dtype: str | None, tp: int, **kwargs: Any) -> Any:
            bytes_per_token = bytes_per_token_of(bytes_per_token, model_config, dtype, tp, required)
            if pass_tp:
                kwargs["tp"] = tp
            return func(*args, bytes_per_token=bytes_per_token, **kwargs)

        return _bytes_per_token_bundle(wrapper)

    return decorate


#: The one rule of ``--plot`` where a command draws one chart (simulate, plan, bench), as its --help says it.
PLOT_FILE_RULE = "written to FILE.png when FILE does not end in .png, else to FILE; stderr says the path"
#: ... and where it draws several (report): the directory and the names of the files in it.
PLOT_DIR_RULE = f"written into DIR (made when missing) as {', '.join(REPORT_PLOT_FILES)}; stderr says each path"
PLOT_SUFFIX = ".png"


def plot_path(value: str) -> str:
    """Where ``--plot FILE`` writes: FILE when it ends in .png (any case), else FILE.png."""
    return value if value.lower().endswith(PLOT_SUFFIX) else value + PLOT_SUFFIX


def plot_file(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """The callback of a one-chart ``--plot FILE``: the path written (:func:`plot_path`); a directory is a usage error."""
    if value is None:
        return None
    path = plot_path(value)
    if Path(path).is_dir():
        raise click.BadParameter(f"{path} is a directory: give the chart a file name", ctx=ctx, param=param)
    return path


def _plot_dir(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and value.lower().endswith(PLOT_SUFFIX):
        raise click.BadParameter(f"{value}: this --plot takes a directory (it writes {len(REPORT_PLOT_FILES)} charts: "
                                 f"{', '.join(REPORT_PLOT_FILES)}), not a .png name", ctx=ctx, param=param)
    return value


def plot_option(what: str, when: str = "Draw") -> Callable:
    """``--plot FILE`` of a command that draws one chart, ``what`` (the command gets the path written: :func:`plot_path`);
    ``when`` opens the help ("With --sweep: draw")."""
    return click.option("--plot", type=click.Path(dir_okay=False), metavar="FILE", callback=plot_file, help=plot_help(what, when))


def plot_help(what: str, when: str = "Draw") -> str:
    """The help of a one-chart ``--plot FILE`` that draws ``what``."""
    return f"{when} {what} as a PNG, {PLOT_FILE_RULE}."


def plot_dir_option(what: str, dest: str = "plot_dir") -> Callable:
    """``--plot DIR`` of a command that draws several charts, ``what``, into one directory (the command gets DIR as ``dest``)."""
    return click.option("--plot", dest, type=click.Path(file_okay=False), metavar="DIR", callback=_plot_dir,
                        help=f"Draw {what} as PNGs, {PLOT_DIR_RULE}.")


#: What ``--window`` means wherever a diagnosis is made (diagnose, the exporter): one meaning, each command adding how
#: it samples that span (issue 48: "two samples apart" in one, "a sliding window" in the other).
WINDOW_HELP = "Seconds a diagnosis spans: its λ, B and ρ are rates between two samples this far apart"

#: Help of the options every command names its Valkey instances with (the messages: kvctl.tier.targets.NAMING).
VALKEY_URL_HELP = "Valkey instance per rank, resp://[USER@]HOST:PORT (repeatable, index = rank), or one {rank} template with --ranks."
RANKS_HELP = "Number of ranks to expand a {rank} --valkey template to."
TIER_DIR_HELP = "Directory of a tier started by `kvctl deploy-valkey up` (instead of --valkey)."
PASSWORD_FILE_HELP = "File (mode 0600) holding the Valkey password (default with --dir: the one `up` recorded)."
INSTANCES_PER_RANK_HELP = ("Valkey instances per rank K (default 1; a --dir tier knows its own): rank r holds its chunk c on instance "
                           "(c // W) mod K; --valkey URLs are then rank by rank (instance i of rank r is URL r*K + i), a template takes {instance}.")
#: --instances-per-rank K: the one option type, bounded as the connector bounds it
INSTANCES_PER_RANK = count(MAX_INSTANCES_PER_RANK)


def valkey_options(func: Callable | None = None, *, dir_default: str | None = None, dir_envvar: str | None = None) -> Callable:
    """The Valkey instances a command talks to: ``--valkey`` (old name ``--url``), ``--ranks``, ``--instances-per-rank``,
    ``--dir``, ``--password-file``.

    Every command that reads Valkey takes these five, with the same spellings,
    help and env var (``KVCTL_PASSWORD_FILE``); :func:`valkey_targets` turns
    them into targets. ``dir_default``/``dir_envvar`` give ``--dir`` a default
    (``deploy-valkey status``: its tier directory).
    """
    bundle = options(
        click.option("--valkey", "valkey_urls", multiple=True, cls=RenamedOption, old=["--url"], help=VALKEY_URL_HELP),
        click.option("--ranks", type=count(4096), help=RANKS_HELP),
        click.option("--instances-per-rank", type=INSTANCES_PER_RANK, help=INSTANCES_PER_RANK_HELP),
        click.option("--dir", "tier_dir", type=click.Path(file_okay=False), default=dir_default, show_default=dir_default is not None, envvar=dir_envvar, help=TIER_DIR_HELP),
        click.option("--password-file", type=click.Path(dir_okay=False), envvar="KVCTL_PASSWORD_FILE", help=PASSWORD_FILE_HELP),
    )
    return bundle(func) if func is not None else bundle


def default_tier_dir(tier_dir: str | None, given: bool, valkey_urls: Sequence[str], ranks: int | None) -> str | None:
    """The tier a command that may read one reads (diagnose, as doctor): --dir as given (or as $KVCTL_TIER_DIR says);
    its default, ./kv-tier, only when a running tier is there (not one `deploy-valkey down` stopped and left) and no
    --valkey URL (or --ranks template) names the instances."""
    from kvctl.tier.local import stopped_tier  # noqa: PLC0415 - keep `kvctl --help` light
    from kvctl.tier.targets import state_path  # noqa: PLC0415

    if given or tier_dir is None:
        return tier_dir
    return None if valkey_urls or ranks or not state_path(tier_dir).is_file() or stopped_tier(tier_dir) is not None else tier_dir


def dir_given(ctx: click.Context, name: str = "tier_dir") -> bool:
    """Whether --dir (``name``) was given on the command line or by its env var, not left at its default."""
    from click.core import ParameterSource  # noqa: PLC0415

    return ctx.get_parameter_source(name) not in (None, ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)


def valkey_targets(valkey_urls: Sequence[str], ranks: int | None, tier_dir: str | Path | None, password_file: str | None, *,
                   required: bool = True, instances_per_rank: int | None = None) -> list[Target]:
    """The instances :func:`valkey_options` named, in tier order; ``[]`` when none is named and ``required`` is False.

    Errors (both or neither of URLs and ``--dir``, ``--ranks`` without a
    ``{rank}`` template, URLs that are not K per rank, an unreadable password
    file) are ``InvalidInput``, exit 2.
    """
    from kvctl.tier.targets import resolve_targets  # noqa: PLC0415 - keep `kvctl --help` light

    if not required and not (valkey_urls or ranks or tier_dir):
        if instances_per_rank:
            raise InvalidInput("--instances-per-rank goes with --valkey URLs (or a template and --ranks)")
        return []
    return resolve_targets(valkey_urls, ranks, tier_dir, password_file, instances_per_rank)


#: ``--json``: plain JSON on stdout instead of tables.
output_options = options(click.option("--json", "as_json", is_flag=True, help="Print plain JSON on stdout (no styling)."))


def severity_exit(severity: str | None) -> ExitStatus:
    """Exit status for the worst finding: 3 for a warning, 4 for critical, 0 otherwise."""
    value = getattr(severity, "value", severity)
    return {"warning": ExitStatus.FINDING_WARNING, "critical": ExitStatus.FINDING_CRITICAL}.get(value, ExitStatus.OK)


#: How to read an engine over HTTP: its API key and the /metrics size cap (kvctl.core.engine_http).
engine_http_options = options(
    click.option("--engine-api-key-file", type=click.Path(dir_okay=False), envvar="KVCTL_ENGINE_API_KEY_FILE",
                 help="File holding the engine's API key (vLLM's --api-key), sent as Authorization: Bearer (default: $KVCTL_ENGINE_API_KEY). "
                 "USER:PASS@ in --engine-url is sent as basic auth instead. Both are masked wherever a URL is shown or saved."),
    click.option("--max-metrics-bytes", type=ByteSize(1 << 30, min_bytes=1024), default=METRICS_MAX_BYTES, show_default=True,
                 help="Largest engine /metrics answer read; a larger one is refused and reported (the engine counts as not answering)."),
)


def engine_http(api_key_file: str | None, max_metrics_bytes: int, inflight: Any = None) -> Any:
    """The :class:`kvctl.core.engine_http.EngineHttp` the options above describe (the key file read here, never quoted)."""
    from kvctl.core.engine_http import EngineHttp, read_api_key  # noqa: PLC0415

    return EngineHttp(read_api_key(api_key_file), max_metrics_bytes, inflight)
