"""The paper's cost model (§4): recompute vs load, break-even bandwidth, ρ.

Pure math, no I/O: the connector may import it. Units: GB = 1e9 bytes,
bandwidth in GB/s, time in seconds, rates in tokens/s.

* recompute: ``T_recompute = n / R``
* load: ``T_load = T0 + n·s / B``
* break-even bandwidth ``B* = s·R``; below ``n* = R·T0`` tokens no bandwidth helps
* synchronous loading is a single-server queue with ``ρ = λ·n·s / B``

s (``bytes_per_token``) is always the WHOLE model's KV bytes per token, what
loading a prompt token moves through the tier over all ranks, and B the
whole tier's bandwidth (all instances together). A rank-partitioned tier of
W instances (one per tp rank) moves ``bytes_per_token_per_rank`` = s / W
through each instance: compare that with ONE instance's bandwidth
(B*/W = (s/W)·R per instance), never with the tier's sum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from kvctl.core.errors import InvalidInput
from kvctl.core.thresholds import CHUNK_TOKENS, PAPER_CHUNK_BYTES, PAPER_T0_S, RHO_TARGET, RHO_UNSTABLE

GB = 1e9
MB = 1e6


def require_positive(name: str, value: float, allow_zero: bool = False) -> float:
    """Return ``value`` or raise InvalidInput naming the flag when it is not a positive number."""
    if value is None or not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = "non-negative" if allow_zero else "positive"
        raise InvalidInput(f"{name} must be a {bound} number, got {value}")
    return value


def recompute_s(tokens: float, prefill_rate: float) -> float:
    """Seconds to recompute ``tokens`` at ``prefill_rate`` tokens/s."""
    return tokens / prefill_rate


def load_s(tokens: float, bytes_per_token: float, bandwidth_gbps: float, t0_s: float) -> float:
    """Seconds to load ``tokens`` of KV over a tier of ``bandwidth_gbps`` plus fixed cost T0."""
    return t0_s + tokens * bytes_per_token / (bandwidth_gbps * GB)


def breakeven_gbps(bytes_per_token: float, prefill_rate: float) -> float:
    """B* = s·R in GB/s: the bandwidth at which loading matches recomputing (ignoring T0)."""
    return bytes_per_token * prefill_rate / GB


def min_hit_tokens(prefill_rate: float, t0_s: float) -> float:
    """n* = R·T0: below this many tokens a hit cannot beat recompute at any bandwidth."""
    return prefill_rate * t0_s


def fit_t0(latency_s: float, prompt_bytes: float, bandwidth_gbps: float) -> float:
    """T0 from one measured hit: ``t_measured − n·s / B``."""
    return latency_s - prompt_bytes / (bandwidth_gbps * GB)


def rho(arrival_rate: float, prompt_bytes: float, bandwidth_gbps: float) -> float:
    """Utilisation of the synchronous-load queue: ρ = λ·n·s / B."""
    return arrival_rate * prompt_bytes / (bandwidth_gbps * GB)


def instances_for_rho(rho_now: float, target: float = RHO_TARGET, instances_now: int = 1) -> int:
    """Instances of the same per-instance bandwidth needed to bring ρ down to ``target``."""
    return max(1, math.ceil(rho_now * instances_now / target - 1e-12))


def crossover_tokens(bytes_per_token: float, prefill_rate: float, bandwidth_gbps: float, t0_s: float) -> float | None:
    """Length above which loading wins at this bandwidth, or None if it never does (B ≤ B*)."""
    per_token_gain = 1.0 / prefill_rate - bytes_per_token / (bandwidth_gbps * GB)
    if per_token_gain <= 0:
        return None
    return t0_s / per_token_gain


@dataclass(frozen=True)
class Breakeven:
    bytes_per_token: float  # whole model (s)
    prefill_rate_tok_s: float
    breakeven_gbps: float  # B* = s·R: the whole tier
    t0_s: float | None = None
    min_hit_tokens: float | None = None
    tp: int = 1
    bytes_per_token_per_rank: float | None = None  # s / tp
    breakeven_gbps_per_rank: float | None = None  # (s / tp)·R: each of tp instances, one per rank


@dataclass(frozen=True)
class Prediction:
    tokens: int
    recompute_s: float
    load_s: float
    verdict: str  # "load" or "recompute"
    speedup: float  # recompute_s / load_s


@dataclass(frozen=True)
class RhoResult:
    arrival_rate_per_s: float
    prompt_gb: float  # the whole model's KV of one request (all ranks)
    instance_gbps: float  # one instance
    rho: float  # one instance serving every rank's share
    stable: bool
    instances_for_rho_target: int
    rho_target: float
    tp: int = 1
    rho_one_instance_per_rank: float | None = None  # tp instances, each moving prompt / tp: ρ / tp


def _check_tp(tp: int) -> int:
    if not isinstance(tp, int) or tp < 1:
        raise InvalidInput(f"--tp must be a positive integer, got {tp}")
    return tp


def summarize_breakeven(bytes_per_token: float, prefill_rate: float, t0_s: float | None = None, tp: int = 1) -> Breakeven:
    """B* for the whole tier from the whole model's s, and its 1/tp share for each rank's own instance."""
    require_positive("--bytes-per-token", bytes_per_token)
    require_positive("--prefill-rate", prefill_rate)
    _check_tp(tp)
    b_star = breakeven_gbps(bytes_per_token, prefill_rate)
    per_rank = dict(tp=tp, bytes_per_token_per_rank=bytes_per_token / tp, breakeven_gbps_per_rank=b_star / tp)
    if t0_s is None:
        return Breakeven(bytes_per_token, prefill_rate, b_star, **per_rank)
    require_positive("--t0", t0_s, allow_zero=True)
    return Breakeven(bytes_per_token, prefill_rate, b_star, t0_s, min_hit_tokens(prefill_rate, t0_s), **per_rank)


def predict(
    tokens: Iterable[int], bytes_per_token: float, prefill_rate: float, bandwidth_gbps: float, t0_s: float
) -> list[Prediction]:
    """Per-length verdicts: load when predicted strictly faster than recompute."""
    require_positive("--bytes-per-token", bytes_per_token)
    require_positive("--prefill-rate", prefill_rate)
    require_positive("--tier-gbps", bandwidth_gbps)
    require_positive("--t0", t0_s, allow_zero=True)
    out = []
    for n in tokens:
        if n is None or n <= 0:
            raise InvalidInput(f"--prompt-tokens must be positive integers, got {n}")
        rec = recompute_s(n, prefill_rate)
        lod = load_s(n, bytes_per_token, bandwidth_gbps, t0_s)
        out.append(Prediction(int(n), rec, lod, "load" if lod < rec else "recompute", rec / lod))
    return out


def summarize_rho(arrival_rate: float, prompt_bytes: float, bandwidth_gbps: float, target: float = RHO_TARGET, tp: int = 1) -> RhoResult:
    """ρ of one instance of ``bandwidth_gbps`` serving the whole prompt; with tp > 1 also ρ of tp such instances, one per rank."""
    require_positive("--arrival-rate", arrival_rate)
    require_positive("prompt size", prompt_bytes)
    require_positive("--instance-gbps", bandwidth_gbps)
    require_positive("--rho-target", target)
    _check_tp(tp)
    r = rho(arrival_rate, prompt_bytes, bandwidth_gbps)
    per_rank = rho(arrival_rate, prompt_bytes / tp, bandwidth_gbps) if tp > 1 else None
    return RhoResult(arrival_rate, prompt_bytes / GB, bandwidth_gbps, r, r < RHO_UNSTABLE, instances_for_rho(r, target), target, tp, per_rank)


#: The paper's measured setup (§4): GLM-5.3 FP8 MLA prefill on B300.
#: 12.4 MB per 256-token chunk; 52.2k prefill tokens/s; T0 ≈ 0.33 s; tier
#: bandwidths: one instance ≈ 0.85 GB/s (0.78–0.89 measured), 1.71 GB/s, and
#: one instance per rank 10.76 GB/s.
PAPER_PAIRING = {
    "name": "GLM-5.3 FP8 (MLA) on B300 — paper §4",
    "bytes_per_token": PAPER_CHUNK_BYTES / CHUNK_TOKENS,  # 12.4e6 / 256 = 48437.5
    "prefill_rate": 52200.0,
    "t0_s": PAPER_T0_S,
    "bandwidths_gbps": (0.85, 1.71, 10.76),
}
DEFAULT_REPORT_TOKENS = (2048, 4096, 8192, 16384, 32768, 65536, 131072)


@dataclass(frozen=True)
class BandwidthVerdicts:
    bandwidth_gbps: float
    crossover_tokens: float | None
    predictions: list[Prediction]


@dataclass(frozen=True)
class PairingReport:
    name: str
    bytes_per_token: float  # whole model (s); the bandwidths are whole tiers'
    prefill_rate_tok_s: float
    t0_s: float
    breakeven_gbps: float
    min_hit_tokens: float
    bandwidths: list[BandwidthVerdicts]
    tp: int = 1
    bytes_per_token_per_rank: float | None = None  # s / tp


def summarize_pairing(
    name: str,
    bytes_per_token: float,
    prefill_rate: float,
    t0_s: float,
    bandwidths_gbps: Iterable[float],
    tokens: Iterable[int] = DEFAULT_REPORT_TOKENS,
    tp: int = 1,
) -> PairingReport:
    """B*, n* and load-vs-recompute verdicts over lengths and bandwidths for one model/GPU pairing."""
    tokens = list(tokens)
    be = summarize_breakeven(bytes_per_token, prefill_rate, t0_s, tp)
    rows = [
        BandwidthVerdicts(b, crossover_tokens(bytes_per_token, prefill_rate, b, t0_s), predict(tokens, bytes_per_token, prefill_rate, b, t0_s))
        for b in bandwidths_gbps
    ]
    if not rows:
        raise InvalidInput("give at least one --tier-gbps")
    return PairingReport(name, bytes_per_token, prefill_rate, t0_s, be.breakeven_gbps, be.min_hit_tokens, rows, tp, be.bytes_per_token_per_rank)
