"""Unknown config keys and the known key each was probably meant to be: the one place kvctl says "did you mean".

Every config kvctl reads or edits (LMCache YAML and env files, vLLM's ``--kv-transfer-config`` and kvctl's
connector settings in it, the LMCache plugin's keys, a tier's state file, the drill engine's config, a bench file)
names a key it does not know through :func:`unknown` (or :func:`log_unknown`); ``kvctl loading`` asks
:func:`near_miss` before adding a key beside one. Pure: no I/O but the logger callers pass in.
"""

from __future__ import annotations

import difflib
import logging
from dataclasses import dataclass
from typing import Collection, Iterable, Mapping

from kvctl.core.thresholds import KEY_NEAR_MISS_RATIO


def nearest(key: str, known: Iterable[str]) -> str | None:
    """The known key most like ``key`` (case ignored), when alike enough to be a typo of it; else None."""
    by_lower: dict[str, str] = {}
    for k in sorted(known):
        by_lower.setdefault(k.lower(), k)
    found = difflib.get_close_matches(str(key).lower(), list(by_lower), n=1, cutoff=KEY_NEAR_MISS_RATIO)
    return by_lower[found[0]] if found else None


@dataclass(frozen=True)
class UnknownKey:
    """A key of a config that its reader does not know."""

    key: str  # as written, with its parents (``extra_config.kvctl_remote_url``)
    where: str  # the file or option it is in
    nearest: str | None  # the known key it is most like, when alike enough
    line: int | None = None  # 1-based, when known
    effect: str = ""  # what its reader does with it ("LMCache ignores it and uses its default")

    def message(self, effect: str = "") -> str:
        at = f"{self.where} line {self.line}" if self.line else self.where
        guess = f" (did you mean {self.nearest}?)" if self.nearest else ""
        effect = effect or self.effect
        return f"{at}: unknown key {self.key}{guess}" + (f": {effect}" if effect else "")


def unknown(keys: Iterable[object], known: Collection[str], where: str, prefix: str = "",
            lines: Mapping[str, int] | None = None, effect: str = "") -> list[UnknownKey]:
    """The ``keys`` not in ``known``, each with its nearest known key (``prefix`` names its parent: ``extra_config.``)."""
    return [UnknownKey(f"{prefix}{k}", where, nearest(str(k), known), (lines or {}).get(str(k)), effect)
            for k in keys if str(k) not in known]


def near_miss(key: str, found: Iterable[UnknownKey]) -> UnknownKey | None:
    """The unknown key of ``found`` that is a near miss of the known ``key``: kvctl would add ``key`` beside it."""
    return next((u for u in found if u.nearest == key), None)


def log_unknown(found: Iterable[UnknownKey], logger: logging.Logger, effect: str) -> None:
    """One warning line per unknown key (readers deep in a command, with no view to hand it to)."""
    for u in found:
        logger.warning("%s", u.message(effect))
