"""Types shared by ``kvctl.loading.edit`` and ``kvctl.loading.vllm`` (kept below both, so neither imports the other back)."""

from __future__ import annotations

from dataclasses import dataclass

from kvctl.core.known_keys import UnknownKey

__all__ = ["SourceState", "UnknownKey"]


@dataclass(frozen=True)
class SourceState:
    """What one file says about async loading."""

    path: str
    kind: str  # "yaml" or "env" (LMCache), "vllm-yaml" or "vllm-args" (kvctl's vLLM connector, kvctl.loading.vllm)
    async_loading: bool | None  # None: not set (LMCache's and the connector's default is synchronous)
    line: int | None  # 1-based line of the setting, when set
    found: str | None = None  # what kind of file was detected, for vLLM files
    unknown_keys: tuple[UnknownKey, ...] = ()  # keys its reader does not know, each with the nearest known one
