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
#: The largest ``kvctl bench --save`` file read (plan/simulate ``--bench``, ``--get-times-from``, ``--readers-from``):
#: a sweep's is a few KB.
BENCH_FILE_MAX_BYTES = 64 * 2**20
#: The largest trace or run file read (``replay``, ``simulate``/``plan`` ``--trace``, ``--fit-from``, ``report``):
#: a million-request trace is about 200 MB.
TRACE_MAX_BYTES = 256 * 2**20
#: Nesting of JSON kvctl parses from a file (a bench file, each line of a trace or run file): theirs is 5 or less.
JSON_MAX_DEPTH = 64
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

# --- the tier's own settings (kvctl doctor's Valkey lines, docs/runbooks/tier_settings.md) --

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

# --- defaults of options (click's default= reads these; tests/test_thresholds.py checks) ---

#: port of rank 0 of a local or systemd tier; rank r listens on BASE_PORT + r (env KVCTL_BASE_PORT).
BASE_PORT = 17400
#: where `kvctl deploy-valkey` keeps a local tier (configs, logs, pidfiles, the state file) and where `status`
#: and `doctor` look for one: `--dir` (env KVCTL_TIER_DIR).
TIER_DIR = "./kv-tier"
#: a tier's TOTAL memory, split evenly over its instances (`deploy-valkey up --maxmemory`, in Valkey's units).
TIER_MAXMEMORY = "400mb"
#: Seconds one read of a sampled source may take (an engine's /metrics, a Valkey INFO): `kvctl diagnose --timeout`
#: and the most the exporter's may be (its default is --interval, at most this); a source slower than it is reported
#: and the rest analysed.
READ_TIMEOUT_S = 5.0
#: Seconds each engine or Valkey read of a one-pass check may take: `kvctl doctor --timeout`, `deploy-valkey status`
#: (one INFO per instance, no --timeout), and a lone INFO read (kvctl.diagnose.sources.valkey_info).
CHECK_TIMEOUT_S = 3.0
#: Seconds any socket operation of `kvctl bench` may take before it counts as an error (`--timeout`): the bench's own
#: deadline per call, equal to READ_TIMEOUT_S but not the same setting.
BENCH_TIMEOUT_S = 5.0
#: seconds between the two samples of a diagnosis: `kvctl diagnose --window` and the exporter's sliding window.
DIAGNOSIS_WINDOW_S = 60.0
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
