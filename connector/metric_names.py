"""The kvctl connector's Prometheus names: one place for the engine side, the drill engine and the CLI.

Torch-free and vLLM-free: :mod:`kvctl.plugins.vllm_stats` registers these with vLLM's metrics,
:mod:`kvctl.drill.engine` exports the same names, ``kvctl diagnose``, ``report``, ``doctor`` and the
exporter read them (tests/test_metric_names.py: no ``"kvctl:..."`` literal anywhere else).
"""

from __future__ import annotations

PREFIX = "kvctl:"
# each counter's name (without the _total that Prometheus adds to counters), for the readers
L2_GET_BYTES = "kvctl:l2_get_bytes"
L2_GET_SECONDS = "kvctl:l2_get_seconds"
CHUNKS_HIT = "kvctl:chunks_hit"
CHUNKS_MISSED = "kvctl:chunks_missed"
REMOTE_HIT_TOKENS = "kvctl:remote_hit_tokens"
AGREED_PREFIX_SHORTFALL_CHUNKS = "kvctl:agreed_prefix_shortfall_chunks"
LOAD_ERRORS = "kvctl:load_errors"
LOOKUP_TIMEOUTS = "kvctl:lookup_timeouts"
# where a hit's time goes (docs/gpu.md): summed over ranks and loads; divide by kvctl:loads for a mean
LOADS = "kvctl:loads"
LOAD_SECONDS = "kvctl:load_seconds"
LOAD_GET_SECONDS = "kvctl:load_get_seconds"
LOAD_COPY_SECONDS = "kvctl:load_copy_seconds"
LOAD_EXCHANGE_SECONDS = "kvctl:load_exchange_seconds"
LOAD_INSERT_SECONDS = "kvctl:load_insert_seconds"
LOAD_WAIT_SECONDS = "kvctl:load_wait_seconds"
LOOKUPS = "kvctl:lookups"
LOOKUP_SECONDS = "kvctl:lookup_seconds"
CHUNKS_STORED = "kvctl:chunks_stored"
SAVE_ERRORS = "kvctl:save_errors"
SAVES_ABANDONED = "kvctl:saves_abandoned"

# name -> help text: what the engine registers
COUNTERS = {
    L2_GET_BYTES: "Bytes the engine's workers read from the L2 tier (GET), summed over ranks.",
    L2_GET_SECONDS: "Wall seconds the engine's workers spent in L2 GETs, summed over ranks.",
    CHUNKS_HIT: "Chunks the scheduler's lookup found on every owner (loaded instead of recomputed).",
    CHUNKS_MISSED: "Loadable chunks past the agreed hit (recomputed).",
    REMOTE_HIT_TOKENS: "Prompt tokens the scheduler's lookup found in the tier (loaded instead of recomputed).",
    AGREED_PREFIX_SHORTFALL_CHUNKS: "Chunks the lookup promised but the agreed-prefix load could not provide.",
    LOAD_ERRORS: "Loads that came up short; their blocks were handed back to vLLM to recompute.",
    LOOKUP_TIMEOUTS: "Lookups in which an instance erred or did not answer within timeout_s.",
    LOADS: "Loads of a hit from the tier, counted on every rank (a load at W ranks counts W).",
    LOAD_SECONDS: "Wall seconds of loads, from fetch to the queued insert, summed over ranks.",
    LOAD_GET_SECONDS: "Of kvctl:load_seconds: until the last GET of the load ended (copies to the device overlap it).",
    LOAD_COPY_SECONDS: "Of kvctl:load_seconds: copies to the device still running after the last GET.",
    LOAD_EXCHANGE_SECONDS: "Of kvctl:load_seconds: the agreed-prefix message and the chunks' move between ranks.",
    LOAD_INSERT_SECONDS: "Of kvctl:load_seconds: building slots and queueing the scatter into the paged cache.",
    LOAD_WAIT_SECONDS: "Seconds requests waited for their loads (sync: the step's load; async: queued until done), rank 0.",
    LOOKUPS: "Scheduler lookups sent to the tier (EXISTS on every owner's instances).",
    LOOKUP_SECONDS: "Wall seconds of the scheduler's lookups.",
    CHUNKS_STORED: "Chunks written to the tier (SET), summed over ranks.",
    SAVE_ERRORS: "Saves that failed (the tier erred or timed out); their chunks are future misses.",
    SAVES_ABANDONED: "Saves still queued or running when a worker shut down and its save_drain_s ran out.",
}
#: gauges the workers report each step (the largest rank's value): the saves queued or running right now
SAVES_PENDING = "kvctl:saves_pending"
GAUGES = {SAVES_PENDING: "Saves queued or running on a worker's background saver, the largest rank's (a backlog grows when the tier "
                         "is slower than the prompts: at shutdown what is left after save_drain_s is abandoned)."}
#: the gauge W: the ranks whose GET seconds ``kvctl:l2_get_seconds`` sums (``kvctl diagnose`` multiplies by it)
RANKS = "kvctl:ranks"
RANKS_HELP = "Ranks of the shard group (W): instance r holds rank r's chunks."
