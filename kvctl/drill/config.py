"""The drill engine's config file: LMCache-style YAML, so ``kvctl loading`` edits it as it edits LMCache's.

``enable_async_loading`` (top level, :data:`kvctl.loading.edit.KEY`) picks synchronous or asynchronous
loading; ``chunk_size`` is LMCache's chunk length in tokens. Everything only the drill engine reads
sits under ``drill:``. The engine reads the file at start (and again on SIGHUP, its restart), through
:func:`kvctl.loading.edit.yaml_state` for the loading mode, exactly as ``kvctl loading show`` reads it.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from kvctl.loading import edit as loading
from kvctl.connector.urls import redacted_repr
from kvctl.core.errors import InvalidInput
from kvctl.core.files import write_atomic
from kvctl.core.known_keys import log_unknown, unknown
from kvctl.core.thresholds import CHUNK_TOKENS

log = logging.getLogger(__name__)

TIER_CLIENTS = ("kvctl", "fixed-header")
LOOKUPS = ("exists", "index")


@dataclass(frozen=True)
class EngineSettings:
    """What the drill engine simulates and where its tier is (the ``drill:`` mapping)."""

    __repr__ = redacted_repr  # URLs shown with their passwords masked (issue 44)

    remote_urls: list[str]  # one per rank: instance r holds rank r's chunks
    chunk_bytes: int  # bytes of one stored chunk value (kvctl.core.kvsize on a model config, scaled by the drill)
    prefill_tokens_per_s: float  # R: a miss holds the simulated GPU n/R seconds
    t0_s: float  # T0: a hit holds it T0 plus the measured load time
    stream_bytes_per_s: float  # one rank's link: bytes/s while a GET's bytes flow
    chunk_rtt_s: float = 0.0  # one round trip: paid per chunk by the synchronous loader, per batch by the async one
    model: str = "drill"
    async_streams: int = 1  # asynchronous loading: loads in flight per rank
    tier_client: str = "kvctl"  # "fixed-header": LMCache's native pattern, hangs on a missing key
    lookup: str = "exists"  # "index": answered from the chunks this engine stored (stale after an eviction)
    tier_timeout_s: float = 1.0
    load_policy: bool = False  # the kvctl connector's load-or-recompute decision (connector/policy.py) before each load
    chunk_tokens: int = CHUNK_TOKENS
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ranks(self) -> int:
        return len(self.remote_urls)


@dataclass(frozen=True)
class EngineConfig:
    path: str
    async_loading: bool
    settings: EngineSettings


HEADER = """\
# kvctl drill engine config (written by `kvctl drill`); LMCache-style keys.
chunk_size: {chunk}
# synchronous (false) or asynchronous (true) loading: `kvctl loading sync|async --config {name}` flips this line
enable_async_loading: {async_}
"""


def write_config(path: Path | str, settings: EngineSettings, async_loading: bool = False) -> Path:
    """Write the engine's config file (atomically)."""
    import yaml  # noqa: PLC0415

    drill = {k: v for k, v in asdict(settings).items() if k not in ("chunk_tokens", "extra")}
    text = HEADER.format(chunk=settings.chunk_tokens, name=Path(path).name, async_="true" if async_loading else "false")
    text += yaml.safe_dump({"drill": drill}, sort_keys=False, default_flow_style=False)
    return write_atomic(path, text)


def _need(d: dict[str, Any], key: str, kind: type | tuple[type, ...], path: str) -> Any:
    if key not in d:
        raise InvalidInput(f"{path}: drill.{key} is missing")
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, kind):
        raise InvalidInput(f"{path}: drill.{key} has the wrong type ({type(v).__name__})")
    return v


def read_config(path: Path | str) -> EngineConfig:
    """The config as the engine uses it; InvalidInput naming the file and key when it is not one."""
    p = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise InvalidInput(f"cannot read {p}: {e.strerror or e}") from e
    data = loading.parse_yaml(text, p)
    mode = loading.yaml_state(p).async_loading
    d = data.get("drill")
    if not isinstance(d, dict):
        raise InvalidInput(f"{p}: no drill: mapping (not a drill engine config)")
    drill_keys = {f.name for f in fields(EngineSettings)} - {"chunk_tokens", "extra"}
    log_unknown(unknown(data, {"chunk_size", loading.KEY, "drill"}, p) + unknown(d, drill_keys, p, "drill."), log,
                "the drill engine ignores it and uses its default")
    urls = _need(d, "remote_urls", list, p)
    if not urls or not all(isinstance(u, str) for u in urls):
        raise InvalidInput(f"{p}: drill.remote_urls must be a non-empty list of resp:// URLs")
    chunk = data.get("chunk_size", CHUNK_TOKENS)
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise InvalidInput(f"{p}: chunk_size must be a positive integer")
    s = EngineSettings(
        remote_urls=list(urls),
        chunk_bytes=int(_need(d, "chunk_bytes", int, p)),
        prefill_tokens_per_s=float(_need(d, "prefill_tokens_per_s", (int, float), p)),
        t0_s=float(_need(d, "t0_s", (int, float), p)),
        stream_bytes_per_s=float(_need(d, "stream_bytes_per_s", (int, float), p)),
        model=str(d.get("model", "drill")),
        chunk_rtt_s=float(d.get("chunk_rtt_s", 0.0)),
        async_streams=int(d.get("async_streams", 1)),
        tier_client=str(d.get("tier_client", "kvctl")),
        lookup=str(d.get("lookup", "exists")),
        tier_timeout_s=float(d.get("tier_timeout_s", 1.0)),
        load_policy=d.get("load_policy", False),
        chunk_tokens=chunk,
    )
    if not isinstance(s.load_policy, bool):
        raise InvalidInput(f"{p}: drill.load_policy must be true or false")
    if s.tier_client not in TIER_CLIENTS:
        raise InvalidInput(f"{p}: drill.tier_client must be one of {', '.join(TIER_CLIENTS)}")
    if s.lookup not in LOOKUPS:
        raise InvalidInput(f"{p}: drill.lookup must be one of {', '.join(LOOKUPS)}")
    if min(s.chunk_bytes, s.prefill_tokens_per_s, s.stream_bytes_per_s, s.async_streams, s.tier_timeout_s) <= 0 or s.t0_s < 0 or s.chunk_rtt_s < 0:
        raise InvalidInput(f"{p}: chunk_bytes, prefill_tokens_per_s, stream_bytes_per_s, async_streams and tier_timeout_s must be positive, t0_s and chunk_rtt_s not negative")
    return EngineConfig(p, bool(mode), s)
