#!/usr/bin/env bash
# What vLLM 0.32's CUDA build needs beyond shared/gpu-host's bundle for MLA with a sparse-attention indexer
# (GLM-5, DeepSeek-V3.2, issue 34): CuTe DSL, `nvidia-cutlass-dsl[cu13]==4.8.0` (vLLM's own pin). Without it
# every FLASHMLA_SPARSE engine fails its first forward: deepseek_v32's fused_q imports `cutlass` on CUDA
# (vllm/models/deepseek_v32/common/kernels.py, fused_q), "No module named 'cutlass'" on the H200, 2026-12-02.
# With CuTe DSL present vLLM also warms its CuTe router GEMM, which imports QuACK (`quack-kernels`, with its
# apache-tvm-ffi and torch-c-dlpack-ext; vllm/model_executor/kernels/linear/cute_dsl/ll_bf16.py):
# "No module named 'quack'" on the H200 at the engine's warm-up, 2026-12-02 (second run).
#
#   bash benchmarks/gpu_extras.sh build          here: the wheels into .gpu-extras/q00, q01, q02 (parts of ≤ 50 MB)
#   bash benchmarks/gpu_extras.sh install DIR... on the GPU host, after shared/gpu-host's install.sh: moves each
#                                                part to /tmp/xparts; once all are there, installs into /tmp/site
# benchmarks/gpu_host.sh puts the DSL's package folder on PYTHONPATH (its .pth file is not read from there).
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  build)
    rm -rf .gpu-extras && mkdir -p .gpu-extras/wheels
    python3 -m pip download -q --no-deps --python-version 3.12 --platform manylinux_2_28_x86_64 --only-binary=:all: \
      -d .gpu-extras/wheels nvidia-cutlass-dsl-libs-base==4.8.0 nvidia-cutlass-dsl-libs-core==4.8.0 \
      nvidia-cutlass-dsl-libs-cu13==4.8.0 quack-kernels==0.6.5 "apache-tvm-ffi>=0.1.6,<0.2" torch-c-dlpack-ext==0.1.5
    tar cf - -C .gpu-extras wheels | split -b 50000000 -d -a 2 - .gpu-extras/part
    for p in .gpu-extras/part*; do n=${p##*part}; mkdir -p ".gpu-extras/q$n" && mv "$p" ".gpu-extras/q$n/xpart$n"; done
    rm -rf .gpu-extras/wheels
    ls .gpu-extras
    ;;
  install)
    shift
    mkdir -p /tmp/xparts
    for d in "$@"; do mv "$d"/xpart* /tmp/xparts/ 2>/dev/null || true; done
    if [[ -f /tmp/site/.extras-ok ]]; then echo "extras installed"; exit 0; fi
    if ! cat /tmp/xparts/xpart* 2>/dev/null | tar t >/dev/null 2>&1; then echo "extras incomplete: $(ls /tmp/xparts | wc -l) part(s)"; exit 3; fi
    rm -rf /tmp/extras-x && mkdir -p /tmp/extras-x && cat /tmp/xparts/xpart* | tar x -C /tmp/extras-x
    if ! python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/extras-x/wheels/*.whl \
        > /tmp/extras-pip.log 2>&1; then
      grep -v "Target directory" /tmp/extras-pip.log >&2; echo "extras: pip install failed" >&2; exit 1
    fi
    rm -rf /tmp/extras-x && touch /tmp/site/.extras-ok
    PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages python3 -c "import cutlass, quack; print('cutlass', cutlass.__file__, 'quack', quack.__version__)"
    ;;
  *) echo "usage: $0 build | install PART_DIR..." >&2; exit 2 ;;
esac
