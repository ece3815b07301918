"""The kvctl connector's Prometheus names: one place for the engine side, the drill engine and the CLI.

Torch-free and vLLM-free: :mod:`kvctl.plugins.vllm_stats` registers these with vLLM's metrics,
:mod:`kvctl.drill.engine` exports the same names, ``kvctl diagnose``, ``report``, ``doctor`` and the
exporter read them (tests/connector/test_metric_names.py: no ``"kvctl:..."`` literal anywhere else). The vLLM and
LMCache names kvctl reads (``vllm:request_success``, ``lmcache:num_remote_read_bytes``, ...) are here too, at
the end: no reader in kvctl/ writes one of its own.
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
LAYERED_LOADS = "kvctl:layered_loads"
LOOKUPS = "kvctl:lookups"
LOOKUP_SECONDS = "kvctl:lookup_seconds"
CHUNKS_STORED = "kvctl:chunks_stored"
SAVE_ERRORS = "kvctl:save_errors"
SAVES_ABANDONED = "kvctl:saves_abandoned"
SAVES_DROPPED = "kvctl:saves_dropped"
# the load-or-recompute decision (connector/policy.py, docs/connector.md "Load or recompute") and what calibrates it
LOAD_DECISIONS = "kvctl:load_decisions"
RANK_GET_BYTES = "kvctl:rank_get_bytes"
RANK_GET_SECONDS = "kvctl:rank_get_seconds"
TIMED_LOADS = "kvctl:timed_loads"
LOAD_FIXED_SECONDS = "kvctl:load_fixed_seconds"
STEPS_TIMED = "kvctl:steps_timed"
STEP_PREFILL_TOKENS = "kvctl:step_prefill_tokens"
STEP_SECONDS = "kvctl:step_seconds"
STEPS_ABOVE_GRAPHS = "kvctl:steps_above_graphs"

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
    LAYERED_LOADS: "Sync loads written layer group by layer group while the forward ran (layer_groups > 1), rank 0; "
                   "their kvctl:load_wait_seconds is only what the forward waited.",
    LOOKUPS: "Scheduler lookups sent to the tier (EXISTS on every owner's instances).",
    LOOKUP_SECONDS: "Wall seconds of the scheduler's lookups.",
    CHUNKS_STORED: "Chunks written to the tier (SET), summed over ranks.",
    SAVE_ERRORS: "Saves that failed (the tier erred or timed out); their chunks are future misses.",
    SAVES_ABANDONED: "Saves still queued or running when a worker shut down and its save_drain_s ran out.",
    SAVES_DROPPED: "Saves not queued: the saves waiting for the tier already held save_queue_bytes of extracted chunks "
                   "(a tier slower than the engine's saves); their chunks are future misses.",
    LOAD_DECISIONS: "Hits the load-or-recompute decision judged, by decision (load, partial, recompute; given_up: an async "
                    "load stopped at its deadline, counted again on rank 0) and reason (docs/connector.md).",
    RANK_GET_BYTES: "Bytes one rank read from its instances (GET), per rank: its bandwidth for the decision.",
    RANK_GET_SECONDS: "Wall seconds one rank spent in GETs, per rank.",
    TIMED_LOADS: "Serial loads whose fixed cost was measured (kvctl:load_fixed_seconds), summed over ranks.",
    LOAD_FIXED_SECONDS: "Of kvctl:load_seconds of those loads: what was not GET time (T0 of the decision), summed over ranks.",
    STEPS_TIMED: "Engine steps with prefill tokens the connector timed (rank 0, no sync load in them).",
    STEP_PREFILL_TOKENS: "Prefill tokens of the timed steps (the prefill rate R of the decision is fitted on them).",
    STEP_SECONDS: "Seconds of the timed steps' forward (CUDA: device time between two events; CPU: wall time).",
    STEPS_ABOVE_GRAPHS: "Of the timed steps: those of more tokens than vLLM's largest CUDA graph (the decision fits "
                        "what such a step costs more).",
}
#: counters with labels of their own besides the engine's: name -> label names; a series' key in the stats is
#: :func:`labelled` (name and values), which :func:`split_labelled` reads back
LABELS = {LOAD_DECISIONS: ("decision", "reason"), RANK_GET_BYTES: ("rank",), RANK_GET_SECONDS: ("rank",)}


def labelled(name: str, *values: object) -> str:
    """The stats key of one series of a labelled counter: ``name{v1,v2}`` (values in :data:`LABELS` order)."""
    if len(values) != len(LABELS[name]):
        raise ValueError(f"{name} takes labels {LABELS[name]}, got {values!r}")
    return name + "{" + ",".join(str(v) for v in values) + "}"


def split_labelled(key: str) -> tuple[str, tuple[str, ...]]:
    """``(name, label values)`` of a stats key (no values for an unlabelled name)."""
    if not key.endswith("}") or "{" not in key:
        return key, ()
    name, _, rest = key.partition("{")
    return name, tuple(rest[:-1].split(","))
#: gauges the workers report each step (the largest rank's value): the saves queued or running right now
SAVES_PENDING = "kvctl:saves_pending"
GAUGES = {SAVES_PENDING: "Saves queued or running on a worker's background saver, the largest rank's (a backlog grows when the tier "
                         "is slower than the prompts: at shutdown what is left after save_drain_s is abandoned)."}
#: the gauge W: the ranks whose GET seconds ``kvctl:l2_get_seconds`` sums (``kvctl diagnose`` multiplies by it)
RANKS = "kvctl:ranks"
RANKS_HELP = "Ranks of the shard group (W): instance r holds rank r's chunks."

# --- the names kvctl reads from vLLM and LMCache (their engines register these, not kvctl's connector) ----------
# diagnose, the exporter's filter, doctor, report, the drill and its engine name them from here
# (tests/connector/test_metric_names.py: no "vllm:..." or "lmcache:..." literal anywhere else in kvctl/).
VLLM_PREFIX = "vllm:"
LMCACHE_PREFIX = "lmcache:"
VLLM_REQUEST_SUCCESS = "vllm:request_success"
VLLM_PROMPT_TOKENS = "vllm:prompt_tokens"
VLLM_GENERATION_TOKENS = "vllm:generation_tokens"
VLLM_REQUEST_PROMPT_TOKENS = "vllm:request_prompt_tokens"
VLLM_NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
VLLM_NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
VLLM_PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"
VLLM_PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"  # prompt tokens of the requests admitted (vLLM 0.32 counts at admission)
VLLM_ITERATION_TOKENS = "vllm:iteration_tokens_total"  # a histogram: one observation per engine step
VLLM_EXTERNAL_PREFIX_CACHE_HITS = "vllm:external_prefix_cache_hits"
VLLM_EXTERNAL_PREFIX_CACHE_QUERIES = "vllm:external_prefix_cache_queries"
VLLM_REQUEST_PREFILL_TIME_SECONDS = "vllm:request_prefill_time_seconds"
VLLM_TIME_TO_FIRST_TOKEN_SECONDS = "vllm:time_to_first_token_seconds"
VLLM_E2E_REQUEST_LATENCY_SECONDS = "vllm:e2e_request_latency_seconds"
VLLM_REQUEST_QUEUE_TIME_SECONDS = "vllm:request_queue_time_seconds"
VLLM_CACHE_CONFIG_INFO = "vllm:cache_config_info"
LMCACHE_NUM_REMOTE_READ_BYTES = "lmcache:num_remote_read_bytes"
LMCACHE_REMOTE_TIME_TO_GET = "lmcache:remote_time_to_get"
LMCACHE_NUM_HIT_TOKENS = "lmcache:num_hit_tokens"
LMCACHE_NUM_REQUESTED_TOKENS = "lmcache:num_requested_tokens"
LMCACHE_GET_BLOCKING_FAILED_COUNT = "lmcache:get_blocking_failed_count"
LMCACHE_TIME_TO_LOOKUP = "lmcache:time_to_lookup"
#: every vLLM and LMCache name above
ENGINE_NAMES = frozenset({
    VLLM_REQUEST_SUCCESS, VLLM_PROMPT_TOKENS, VLLM_GENERATION_TOKENS, VLLM_REQUEST_PROMPT_TOKENS, VLLM_NUM_REQUESTS_WAITING,
    VLLM_NUM_REQUESTS_RUNNING, VLLM_PREFIX_CACHE_HITS, VLLM_EXTERNAL_PREFIX_CACHE_HITS, VLLM_EXTERNAL_PREFIX_CACHE_QUERIES,
    VLLM_REQUEST_PREFILL_TIME_SECONDS, VLLM_TIME_TO_FIRST_TOKEN_SECONDS, VLLM_E2E_REQUEST_LATENCY_SECONDS,
    VLLM_REQUEST_QUEUE_TIME_SECONDS, VLLM_CACHE_CONFIG_INFO, VLLM_PREFIX_CACHE_QUERIES, VLLM_ITERATION_TOKENS,
    LMCACHE_NUM_REMOTE_READ_BYTES, LMCACHE_REMOTE_TIME_TO_GET, LMCACHE_NUM_HIT_TOKENS, LMCACHE_NUM_REQUESTED_TOKENS,
    LMCACHE_GET_BLOCKING_FAILED_COUNT, LMCACHE_TIME_TO_LOOKUP,
})
