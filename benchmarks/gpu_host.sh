#!/usr/bin/env bash
# The GPU engine tests and the engine benchmark on the GPU host, after shared/gpu-host/install.sh has put vLLM's
# CUDA build and this working tree's kvctl into /tmp/site (shared/gpu-host/README.md says how).
#
#   bash benchmarks/gpu_host.sh bench [OUT_DIR]    benchmarks/engine_gpu.py (Lite-shaped model, K = 1 and 4, sync + async)
#   bash benchmarks/gpu_host.sh bench-glm5 [OUT_DIR]  the same for GLM-5 (MLA + sparse-attention indexer, issue 34):
#                                                  78 layers of GLM-5's attention, 8 experts, FLASHMLA_SPARSE, fp8_ds_mla,
#                                                  8k/16k/32k, K = 4 (GLM5_LAYERS=N to shrink it if it does not fit)
#   bash benchmarks/gpu_host.sh layered [OUT_DIR]  issue 45: one instance (K = 1, Valkey 9.1 where KVCTL_VALKEY_SERVER
#                                                  points at it; IO_THREADS, CONNS), compiled, the Lite shape: a sync hit
#                                                  loaded layer group by group (LAYER_GROUPS, vLLM's async scheduling off),
#                                                  then the serial hit of vLLM's defaults (receive path), side by side;
#                                                  SWITCH_MS=0.5 adds the layered run with layered_switch_ms between;
#                                                  LAYERED_RUNS picks of "layered switch serial" (default all three)
#   bash benchmarks/gpu_host.sh lmcache [OUT_DIR]  issue 47: LMCache 0.5.6 (benchmarks/gpu_lmcache.sh install first) behind
#                                                  vLLM, compiled, K = 1: kvctl's RESP plugin, LMCache's native client,
#                                                  then KvctlConnector, the same prompts (LMC_MODES to pick), sync + async;
#                                                  the engines' logs too (LMCache logs each retrieval: tokens, GB/s)
#   bash benchmarks/gpu_host.sh lmcache-ops [OUT_DIR]  issue 47: benchmarks/lmcache_ops.py, kvctl's ops commands against
#                                                  a compiled LMCache engine (gpu_lmcache.sh install first)
#   bash benchmarks/gpu_host.sh overhead [OUT_DIR] issue 46: benchmarks/connector_overhead.py, compiled: lone prompts on
#                                                  engines with no connector, a no-op one and KvctlConnector (off, on)
#   bash benchmarks/gpu_host.sh tests [OUT_DIR]    python -m pytest -m gpu tests/gpu (engine chains, faults, shutdown)
#   bash benchmarks/gpu_host.sh paper [OUT_DIR]    benchmarks/paper_gpu.py (the paper's Table 2 here, issue 33), the steps
#                                                  in PAPER_STEPS (default all; the host's 10-minute calls take a part
#                                                  each: calib,R1,R2 then R3,R4,R5), work dir .gpu-work/paper (kept
#                                                  while the host stays warm; PAPER_WORK=NAME for .gpu-work/NAME, a
#                                                  run with other flags), its raw files copied to OUT_DIR/paper
#   bash benchmarks/gpu_host.sh paper-set [OUT_DIR]  several paper runs in one call, an archive each
#                                                  (benchmarks/gpu_paper_set.sh: PAPER_SET="NAME|STEPS|ARGS[|CAP_S];...")
#
# GLM-5 (bench-glm5, the sparse test jobs) needs CuTe DSL besides the bundle: benchmarks/gpu_extras.sh.
# Everything it prints also goes to OUT_DIR (default $OUT, else /tmp/gpu-out): logs survive a killed call.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:?bench or tests}
out=${2:-${OUT:-/tmp/gpu-out}}
mkdir -p "$out"
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
# CuTe DSL (benchmarks/gpu_extras.sh): its wheel puts `cutlass` on sys.path with a .pth file, which PYTHONPATH skips
[ -d /tmp/site/nvidia_cutlass_dsl/dsl_packages ] && export PYTHONPATH=$PYTHONPATH:/tmp/site/nvidia_cutlass_dsl/dsl_packages
export VLLM_USE_FLASHINFER_SAMPLER=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# the tree's kvctl/ is a package whose connector/ and plugins/ live beside it (setup.cfg's package_dir): with the
# tree first on sys.path (pytest's rootdir, the hooks' PYTHONPATH) it must be whole
[ -e kvctl/connector ] || ln -s ../connector kvctl/connector
[ -e kvctl/plugins ] || ln -s ../plugins kvctl/plugins
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv; nproc; free -g | head -2; } > "$out/host.txt" 2>&1
case "$what" in
  bench)
    timeout "${BENCH_TIMEOUT_S:-540}" python3 benchmarks/engine_gpu.py --json "$out/engine_gpu.json" \
      --logs "$out/engine_logs.tar.gz" ${BENCH_FLAGS:---async --profile} ${BENCH_ARGS:-} 2>&1 | tee "$out/engine_gpu.txt"
    ;;
  layered)
    common=(--compiled --instances 1 --io-threads "${IO_THREADS:-8}" --connections "${CONNS:-8}"
            --lengths "${LENGTHS:-1024,2048,8192,16384,32000}" --prompts "${PROMPTS:-3}" ${BENCH_ARGS:-})
    runs=" ${LAYERED_RUNS:-layered switch serial} "  # which of the three (a short lease takes two per call)
    [[ $runs != *" layered "* ]] || timeout "${BENCH_TIMEOUT_S:-280}" python3 benchmarks/engine_gpu.py "${common[@]}" \
      --layer-groups "${LAYER_GROUPS:-4}" --no-async-scheduling --json "$out/layered.json" 2>&1 | tee "$out/layered.txt"
    # SWITCH_MS: the same layered run with the connector's layered_switch_ms (benchmarks/lanes_gil.py's lead)
    [ -z "${SWITCH_MS:-}" ] || [[ $runs != *" switch "* ]] || timeout "${BENCH_TIMEOUT_S:-280}" python3 benchmarks/engine_gpu.py "${common[@]}" \
      --layer-groups "${LAYER_GROUPS:-4}" --no-async-scheduling --layered-switch-ms "$SWITCH_MS" \
      --json "$out/layered-switch.json" 2>&1 | tee "$out/layered-switch.txt"
    [ -n "${SKIP_SERIAL:-}" ] || [[ $runs != *" serial "* ]] || timeout "${BENCH_TIMEOUT_S:-280}" python3 benchmarks/engine_gpu.py "${common[@]}" \
      --json "$out/serial.json" 2>&1 | tee "$out/serial.txt"
    ;;
  lmcache)
    for mode in ${LMC_MODES:-lmcache lmcache-native kvctl}; do
      timeout "${BENCH_TIMEOUT_S:-180}" python3 benchmarks/engine_gpu.py --compiled --instances 1 --connector "$mode" --async \
        --lengths "${LENGTHS:-2048,8192,16384,32000}" --prompts "${PROMPTS:-3}" --json "$out/lmcache-$mode.json" ${BENCH_ARGS:-} \
        --logs "$out/lmcache-$mode-logs.tar.gz" 2>&1 | tee "$out/lmcache-$mode.txt"
    done
    ;;
  overhead)
    timeout "${BENCH_TIMEOUT_S:-560}" python3 benchmarks/connector_overhead.py --compiled --json "$out/overhead.json" \
      ${BENCH_ARGS:-} 2>&1 | tee "$out/overhead.txt"
    ;;
  lmcache-ops)
    # issue 47 item 2: kvctl's ops commands (doctor, replay/report, diagnose, exporter, loading async with the restart)
    # against one compiled LMCache engine on a local tier; every step's output in OUT_DIR/lmcache-ops
    timeout "${BENCH_TIMEOUT_S:-560}" python3 benchmarks/lmcache_ops.py --out "$out/lmcache-ops" ${BENCH_ARGS:-} \
      2>&1 | tee "$out/lmcache-ops.txt"
    # one archive: a device call brings back a bounded number of files (2026-12-07: 8 of 98 came back)
    # what LMCache itself logged and exported, printed here too (the call's output tail survives a lost archive):
    # its retrieves per engine (`Retrieved N out of M required tokens`) against its hit counter in each scrape
    for d in "$out"/lmcache-ops/engine-*; do
      [ -f "$d/server.log" ] || continue
      echo "== ${d##*/}: LMCache retrieves $(grep -c 'Retrieved [0-9]* out of' "$d/server.log"), tokens" \
        "$(grep -o 'Retrieved [0-9]* out of' "$d/server.log" | awk '{s += $2} END {print s + 0}')"
      grep -E 'Retrieved [0-9]+ out of' "$d/server.log" | tail -3 | cut -c1-260
      grep -E 'Traceback|Error|WARN' "$d/server.log" | sed -E 's/^.*(Traceback|Error|WARN)/\1/' | sort | uniq -c |
        sort -rn | head -6 | cut -c1-220
    done
    for p in "$out"/lmcache-ops/*.prom; do
      [ -f "$p" ] || continue
      echo "== ${p##*/}"
      grep -E '^lmcache:(num_hit_tokens|num_requested_tokens|num_retrieve_requests|num_lookup_[a-z]+|num_vllm_hit_tokens|num_remote_read_[a-z]+)' \
        "$p" | cut -c1-200 | head -16
    done
    tar czf "$out/lmcache-ops.tar.gz" -C "$out" lmcache-ops && rm -rf "$out/lmcache-ops"
    ;;
  bench-glm5)
    timeout "${BENCH_TIMEOUT_S:-580}" python3 benchmarks/engine_gpu.py --json "$out/engine_gpu_glm5.json" \
      --logs "$out/engine_logs_glm5.tar.gz" --shape configs/models/glm-5-shrunk-shape.json \
      --set num_hidden_layers="${GLM5_LAYERS:-78}" --backend FLASHMLA_SPARSE --kv-cache-dtype fp8 \
      --lengths 8192,16384,32000 --instances 4 --kv-cache-gb 16 --tier-gb 20 ${BENCH_FLAGS:---async} ${BENCH_ARGS:-} \
      2>&1 | tee "$out/engine_gpu_glm5.txt"
    ;;
  tests)
    KVCTL_GPU_TEST_OUT="$out/gpu-tests" timeout "${TESTS_TIMEOUT_S:-520}" python3 -m pytest -m gpu tests/gpu/test_engine_gpu.py tests/gpu \
      -p no:cacheprovider -q -rs --timeout 1500 ${TEST_ARGS:-} 2>&1 | tee "$out/pytest.txt"
    tar czf "$out/gpu-tests.tar.gz" -C "$out" gpu-tests 2>/dev/null && rm -rf "$out/gpu-tests"
    ;;
  paper)
    work=".gpu-work/${PAPER_WORK:-paper}"
    case "${PAPER_WORK:-paper}" in */*|.*) echo "PAPER_WORK: a plain name, not ${PAPER_WORK}" >&2; exit 2 ;; esac
    mkdir -p "$work" "$out/paper"
    timeout "${BENCH_TIMEOUT_S:-560}" python3 benchmarks/paper_gpu.py --workdir "$PWD/$work" \
      --only "${PAPER_STEPS:-calib,R1,R2,R3,R4,R5}" ${BENCH_ARGS:-} 2>&1 | tee -a "$out/paper_gpu.txt"
    # one archive: the device call brings back a bounded number of files
    (cd "$work" && tar czf "$out/paper/runs.tar.gz" -- *.jsonl *.json *.txt *.yaml *.err 2>/dev/null)
    # the engines' logs (where a start's minutes went: compile, CUDA graphs, the KV cache's profile)
    (cd "$work" && tar czf "$out/paper/engine-logs.tar.gz" -- *-engine/*.log 2>/dev/null)
    ;;
  paper-set)
    bash benchmarks/gpu_paper_set.sh "$out"
    ;;
  *) echo "usage: $0 bench|bench-glm5|layered|lmcache|lmcache-ops|overhead|tests|paper|paper-set [OUT_DIR]" >&2; exit 2 ;;
esac
