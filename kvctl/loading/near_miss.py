"""The refusal of ``kvctl loading sync|async`` to add its setting beside a near miss of it (below both
``kvctl.loading.edit`` and ``kvctl.loading.vllm``, which ask it).

With ``enable_async_loadin: false`` in a file, adding ``enable_async_loading`` would leave two keys, the typo still
there and looking like the setting; the engine reads only the one spelled right. Refused with exit 2, naming both,
unless forced.
"""

from __future__ import annotations

from kvctl.core.errors import InvalidInput
from kvctl.core.known_keys import UnknownKey, near_miss


class NearMiss(InvalidInput):
    """The setting is absent but a near miss of it is there: kvctl would add the setting beside the typo (exit 2)."""


def refuse_near_miss(path: str, setting: str, found: tuple[UnknownKey, ...], force: bool, parent: str = "") -> None:
    """NearMiss when ``setting`` (under ``parent``) is to be added and a key the file's engine does not know (``found``)
    is a near miss of it, unless ``force``."""
    typo = near_miss(setting, found)
    if typo is None or force:
        return
    at = f" on line {typo.line}" if typo.line else ""
    want = f"{parent}{setting}"
    raise NearMiss(f"{path}: {typo.key}{at} is a near miss of {want}, which is not set: kvctl would add {want} beside it "
                   f"and the engine would read only {want}; correct the key's spelling (or pass --force to add {want} anyway); "
                   "the file was not changed")
