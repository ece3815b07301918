"""KvctlConnector's sync hits loaded layer group by layer group while vLLM's forward runs (see :mod:`kvctl.plugins.vllm`).

With ``layer_groups`` > 1 a chunk is one value per group of layers (:mod:`kvctl.connector.layer_groups`). On
vLLM's step path the worker starts a hit's load before the forward and writes each group into the paged cache
when vLLM asks for the first layer that needs it (``wait_for_layer_load``, just before that layer's attention):
the layers of earlier groups compute while later groups are on the wire (:mod:`kvctl.connector.pipeline`). The
worker (:mod:`kvctl.plugins.vllm_worker`) owns one :class:`LayeredLoads` and settles each load after the forward.
"""

from __future__ import annotations

from typing import Any, Sequence

from vllm.logger import init_logger

from kvctl.connector import switch
from kvctl.connector.pipeline import PipelinedLoad, begin

from .vllm_meta import LoadSpec

__all__ = ["LayeredLoads"]

logger = init_logger("vllm.kvctl.plugins.vllm")  # the facade's logger: one name in the engine's log


class LayeredLoads:
    """One worker's layer-by-layer sync loads of the current step.

    ``layer_names``: the attention layers in model order (a sparse-MLA group's latent layers); ``sparse``:
    a sparse-MLA group, whose indexer reads its cache before vLLM calls the layer's hook, so each hook also
    writes the next layer's group, and group 0 is written before the forward.
    """

    def __init__(self, datapath: Any, layer_names: Sequence[str], *, sparse: bool, hooked: bool = True,
                 switch_ms: float | None = None) -> None:
        self.datapath = datapath
        self.sparse = sparse
        # the setting layered_switch_ms: Python's switch interval while this step's loads run beside the forward
        # (the lanes need the GIL back after every recv; the forward's thread holds it: benchmarks/lanes_gil.py)
        self.switch_s = switch_ms / 1000 if switch_ms else None
        self._switch: float | None = None  # the handle of kvctl.connector.switch.lower while this step's loads run
        # whether vLLM calls wait_for_layer_load before these layers (CacheReading.without_layer_hooks); cleared
        # for good by the first load whose groups no layer asked for (off())
        self.hooked = hooked
        self.pipes: list[tuple[LoadSpec, PipelinedLoad]] = []
        self.groups = datapath.grouping.groups if datapath.pipelined else 0
        # attention layer name -> the last layer group that must be written before that layer's attention
        self.ensure_at: dict[str, int] = {}
        if datapath.pipelined:
            names = list(layer_names)
            group_of = [g for g, u in enumerate(datapath.grouping.units) for _ in range(*u.rows[0])]
            ahead = 1 if sparse else 0
            self.ensure_at = {name: group_of[min(i + ahead, len(names) - 1)] for i, name in enumerate(names)}

    @property
    def on(self) -> bool:
        """Whether hits can load layer by layer here (layer groups, a tier, and layers that call the hook)."""
        return bool(self.ensure_at) and self.hooked

    def off(self) -> None:
        """Load every later hit before the forward: a load's groups were not asked for before their layers ran."""
        self.hooked = False

    def start(self, spec: LoadSpec, *, group, meta_group) -> None:
        """Start ``spec``'s load; raises if nothing could start (the caller recomputes the hit)."""
        if self.switch_s is not None and self._switch is None:
            self._switch = switch.lower(self.switch_s)
        pipe = begin(self.datapath, spec.token_ids, spec.block_ids, spec.first_chunk, spec.end_chunk, spec.skip_tokens,
                     group=group, extra=spec.key_extra, meta_group=meta_group)
        self.pipes.append((spec, pipe))
        if self.sparse:
            self._ensure(0)  # layer 0's indexer reads its cache before the first hook

    def _ensure(self, g: int) -> None:
        for spec, pipe in self.pipes:
            try:
                pipe.ensure(g)
            except Exception:  # noqa: BLE001 - a broken group is a failed hit, never a broken forward
                logger.exception("KvctlConnector: layer group %d of %s failed: the hit is recomputed", g, spec.req_id)
                pipe.state.written = 0

    def wait(self, layer_name: str) -> None:
        """vLLM is about to run ``layer_name``'s attention: write every group it needs (collective, every rank alike)."""
        if self.pipes:
            self._ensure(self.ensure_at.get(layer_name, self.groups - 1))

    def finish(self) -> list[tuple[LoadSpec, PipelinedLoad, Any]]:
        """The step's loads, each finished: ``(spec, pipe, LoadOutcome)``; none is left for the next step."""
        pipes, self.pipes = self.pipes, []
        try:
            return [(spec, pipe, pipe.finish()) for spec, pipe in pipes]
        finally:
            if self._switch is not None:
                switch.restore(self._switch)
                self._switch = None
