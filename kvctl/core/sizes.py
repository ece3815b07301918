"""kvctl's one size syntax: every byte-sized option and setting is parsed here (pure).

The convention (README, "Commands"): kB, MB, GB, TB are powers of 1000 and KiB, MiB, GiB, TiB powers of 1024, on
input and output alike; case does not matter on input (``400mb`` = ``400MB`` = 4e8 bytes), a bare number (an
exponent included: ``12.4e6``) is bytes, and ``k``/``m``/``g``/``t`` alone are the decimal ones. Kubernetes'
``Ki``/``Mi``/``Gi``/``Ti`` are the binary ones. Valkey itself reads ``mb`` as MiB: kvctl never hands Valkey a
size in units, it writes whole bytes into every config it renders (``maxmemory 400000000``).
"""

from __future__ import annotations

import re

from kvctl.core.errors import InvalidInput

#: every unit kvctl reads, lower-cased, and its factor
UNITS: dict[str, int] = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "ki": 1024, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mi": 1024**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gi": 1024**3, "gib": 1024**3,
    "t": 1000**4, "tb": 1000**4, "ti": 1024**4, "tib": 1024**4,
}  # fmt: skip
#: the convention in one line, for help texts and error messages
CONVENTION = "kB/MB/GB = 10^3/10^6/10^9 bytes, KiB/MiB/GiB = 2^10/2^20/2^30, a bare number is bytes"
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?(?:e[+-]?\d+)?)\s*([a-z]*)\s*$", re.I)
#: no size is past this (2^63 bytes: beyond any memory; 1e999 would be inf)
MAX_BYTES = 2**63


def parse_size(text: str | int) -> int:
    """Bytes of a size: ``12.4mb`` / ``12.4MB`` (12,400,000), ``12MiB`` (12 × 2^20), ``2g`` (2 × 10^9), ``12.4e6``, ``4096``.

    InvalidInput, naming the convention, for anything else, zero, a negative size or one past 2^63 bytes."""
    if isinstance(text, bool):
        raise InvalidInput(f"cannot parse size {text!r}: {CONVENTION}")
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE_RE.match(str(text))
        unit = m.group(2).lower() if m else None
        if not m or unit not in UNITS:
            raise InvalidInput(f"cannot parse size {text!r}: use e.g. 12.4e6 or 12.4MB (12,400,000 bytes), 12MiB (12 × 2^20); {CONVENTION}")
        exact = float(m.group(1)) * UNITS[unit]
        if not exact < MAX_BYTES:
            raise InvalidInput(f"size {text!r} is beyond any memory (at most 2^63 bytes)")
        value = int(round(exact))
    if value <= 0:
        raise InvalidInput(f"size must be positive, got {text!r}")
    return value
