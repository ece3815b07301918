"""The kvctl connector's Prometheus names: one place for the engine side, the drill engine and the CLI.

Torch-free and vLLM-free: :mod:`kvctl.plugins.vllm_stats` registers these with vLLM's metrics,
:mod:`kvctl.drill.engine` exports the same names, ``kvctl diagnose`` reads them.
"""

from __future__ import annotations

# name (without the _total that Prometheus adds to counters) -> help text
COUNTERS = {
    "kvctl:l2_get_bytes": "Bytes the engine's workers read from the L2 tier (GET), summed over ranks.",
    "kvctl:l2_get_seconds": "Wall seconds the engine's workers spent in L2 GETs, summed over ranks.",
    "kvctl:chunks_hit": "Chunks the scheduler's lookup found on every owner (loaded instead of recomputed).",
    "kvctl:chunks_missed": "Loadable chunks past the agreed hit (recomputed).",
    "kvctl:remote_hit_tokens": "Prompt tokens the scheduler's lookup found in the tier (loaded instead of recomputed).",
    "kvctl:agreed_prefix_shortfall_chunks": "Chunks the lookup promised but the agreed-prefix load could not provide.",
    "kvctl:load_errors": "Loads that came up short; their blocks were handed back to vLLM to recompute.",
    "kvctl:lookup_timeouts": "Lookups in which an instance erred or did not answer within timeout_s.",
}
#: the gauge W: the ranks whose GET seconds ``kvctl:l2_get_seconds`` sums (``kvctl diagnose`` multiplies by it)
RANKS = "kvctl:ranks"
RANKS_HELP = "Ranks of the shard group (W): instance r holds rank r's chunks."
