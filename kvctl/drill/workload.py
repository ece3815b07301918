"""The drill's workload: sizes from a model config, scaled down, and a Mooncake-format trace.

Sizes: one chunk of the model's KV (:func:`kvctl.core.kvsize.kv_size_from_file`, e.g. DeepSeek-V3 FP8:
9.0 MB per 256 tokens) times ``bytes_scale`` (1/128 by default), so a drill moves a few MB/s and
fits next to other work on two cores. Every bandwidth of the drill is in the same scaled bytes, so
the ratios diagnose computes (ρ, B against B*) are the ones of the unscaled deployment.

The trace is Mooncake/FAST'25 JSONL (``kvctl replay`` reads it, ``kvctl simulate --trace`` too):
``docs`` documents of ``blocks`` hash-id blocks (512 tokens each) asked in turn, so after each
document's first request every request hits the tier for all its full chunks; ``tail_tokens``
unique tokens at the end are always computed. Arrivals are spaced 1/λ apart with a uniform jitter
of ± half a gap (seeded): the count in a window is nearly exact, the gaps vary.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from kvctl.core.files import write_atomic
from kvctl.core.kvsize import kv_size_from_file
from kvctl.records.trace import DEFAULT_BLOCK_TOKENS
from kvctl.core.thresholds import CHUNK_TOKENS

#: the model whose chunk size the drills use (the paper's family: MLA, FP8)
DEFAULT_MODEL_CONFIG = "deepseek-v3.json"
DEFAULT_DTYPE = "fp8"
DEFAULT_BYTES_SCALE = 1 / 128


@dataclass(frozen=True)
class Sizes:
    model: str
    chunk_bytes: int  # scaled
    bytes_per_token: float  # scaled s: chunk_bytes / CHUNK_TOKENS (every rank's share counted)
    model_chunk_bytes: int  # unscaled, for the narration
    bytes_scale: float


def model_config_path(name: str = DEFAULT_MODEL_CONFIG) -> Path:
    """A model config shipped in ``configs/models/`` of the repository, or the package's samples when installed."""
    here = Path(__file__).resolve().parent
    for d in (here.parent.parent / "configs" / "models", here.parent / "samples" / "models"):
        if (d / name).is_file():
            return d / name
    from kvctl.core.errors import InvalidInput  # noqa: PLC0415

    raise InvalidInput(f"model config {name} not found in configs/models/ or kvctl/samples/models/")


def sizes(model_config: Path | str | None = None, dtype: str = DEFAULT_DTYPE, bytes_scale: float = DEFAULT_BYTES_SCALE) -> Sizes:
    path = Path(model_config) if model_config else model_config_path()
    kv = kv_size_from_file(path, dtype=dtype)
    chunk = max(1024, int(kv.chunk_bytes * bytes_scale))
    return Sizes(kv.model, chunk, chunk / CHUNK_TOKENS, int(kv.chunk_bytes), bytes_scale)


@dataclass(frozen=True)
class Workload:
    rate_per_s: float
    duration_s: float
    docs: int = 4
    blocks: int = 8  # 8 × 512 tokens = 16 chunks of 256
    tail_tokens: int = 64
    seed: int = 0
    start_s: float = 0.0

    @property
    def prompt_tokens(self) -> int:
        return self.blocks * DEFAULT_BLOCK_TOKENS + self.tail_tokens

    @property
    def hit_chunks(self) -> int:
        return self.blocks * DEFAULT_BLOCK_TOKENS // CHUNK_TOKENS


def trace_lines(w: Workload) -> list[dict]:
    rng = random.Random(w.seed)
    gap = 1.0 / w.rate_per_s
    n = max(1, int(w.duration_s * w.rate_per_s))
    out = []
    for i in range(n):
        doc = i % w.docs
        t = w.start_s + (i + 0.5 + rng.uniform(-0.5, 0.5)) * gap
        out.append({"timestamp": round(t * 1000.0, 3), "input_length": w.prompt_tokens, "output_length": 1,
                    "hash_ids": [doc * 1000 + b for b in range(w.blocks)]})
    return sorted(out, key=lambda r: r["timestamp"])


#: the calibration trace shipped as kvctl/samples/calib-trace.jsonl: requests this far apart (low load: each alone
#: in flight, for T0), then a burst of this many this close together (a few times faster than the drill engine
#: serves them: where the share of T0 that holds the engine shows)
CALIB_LOW_GAP_S = 0.5
CALIB_LOW_REQUESTS = 15
CALIB_BURST_REQUESTS = 10
CALIB_BURST_GAP_S = 0.05


def calibration_lines(w: Workload | None = None) -> list[dict]:
    """The calibration trace (see the constants above): the drill's documents, the first of each a miss."""
    w = w or Workload(rate_per_s=1.0, duration_s=1.0)
    offsets = [i * CALIB_LOW_GAP_S for i in range(CALIB_LOW_REQUESTS)]
    offsets += [offsets[-1] + CALIB_LOW_GAP_S + i * CALIB_BURST_GAP_S for i in range(CALIB_BURST_REQUESTS)]
    return [{"timestamp": round(t * 1000.0, 3), "input_length": w.prompt_tokens, "output_length": 1,
             "hash_ids": [(i % w.docs) * 1000 + b for b in range(w.blocks)]} for i, t in enumerate(offsets)]


def calibration_text() -> str:
    return "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in calibration_lines())


def write_trace(path: Path | str, w: Workload) -> Path:
    return write_atomic(path, "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in trace_lines(w)))
