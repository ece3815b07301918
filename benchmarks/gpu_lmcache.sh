#!/usr/bin/env bash
# LMCache 0.5.6 on the GPU host (issue 47): its wheel and the runtime packages it needs that neither the host
# (shared/gpu-host/host-packages.txt) nor shared/gpu-host's vLLM 0.32 bundle has (cupy-cuda13x, cufile-python, nvtx,
# awscrt, ... from the wheel's own metadata), for Python 3.12, in parts of at most 50 MB. LMCache's CUDA extension
# (lmcache.cuda_ops) was built for torch 2.13: it imports beside the bundle's torch 2.13.0+cu130 and not beside the
# host's own torch 2.11 (undefined c10 symbol, seen on the H200 on 2026-12-04), so install it after the bundle.
#
#   bash benchmarks/gpu_lmcache.sh build [GPU_HOST_DIR]   here: .gpu-lmcache/l00, l01, ... (GPU_HOST_DIR: shared/gpu-host,
#                                                         default ../shared/gpu-host; the bundle's wheels are read from
#                                                         ~/.cache/kvctl-gpu-bundle/bundle, where build-bundle.sh keeps them)
#   bash benchmarks/gpu_lmcache.sh install DIR...         on the GPU host, after the bundle: moves each part to
#                                                         /tmp/lparts; once all are there, installs into /tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  build)
    host_dir=${2:-../shared/gpu-host}
    cache=${BUNDLE_CACHE:-$HOME/.cache/kvctl-gpu-bundle}
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
          --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64)
    # what the host and the bundle already hold (the bundle's version wins: it shadows the host's on PYTHONPATH), by
    # name and version: pip resolves LMCache's needs against them, except the packages LMCache 0.5.6 caps below the
    # host's version (numpy<=2.2.6, prometheus_client<=0.24.1, protobuf<7, opentelemetry-api<=1.40): those come along
    python3 - "$host_dir/host-packages.txt" "$cache/bundle" > "$work/constraints.txt" <<'PY'
import re, sys
from pathlib import Path
from packaging.utils import canonicalize_name as c
have = {}
for line in open(sys.argv[1]):
    if "==" in line:
        name, ver = line.strip().split("==", 1)
        have[c(name)] = ver.split("+")[0]
for whl in Path(sys.argv[2]).glob("*.whl"):
    name, ver = whl.name.split("-")[:2]
    have[c(name)] = ver.split("+")[0]
# LMCache's caps, and what torch 2.13's own CUDA pins (nvidia-*, triton) and cuda-python bring: resolved afresh
capped = re.compile(r"^(numpy|prometheus-client|protobuf|opentelemetry-.*|grpcio.*|setuptools|cuda-.*|nvidia-.*|triton)$")
for name, ver in sorted(have.items()):
    if not capped.match(name):
        print(f"{name}=={ver}")
PY
    # LMCache's own requirements but torch (the bundle's torch 2.13.0 is the one its CUDA extension was built for;
    # resolving torch again would pull its CUDA wheels)
    python3 -m pip download -q --no-deps "${plat[@]}" -d "$work/lmc" lmcache==0.5.6
    unzip -p "$work"/lmc/lmcache-0.5.6-*.whl '*/METADATA' | sed -n 's/^Requires-Dist: //p' | grep -v 'extra ==' \
      | grep -v -E '^torch( |$|[<>=;])' > "$work/reqs.txt"
    python3 -m pip install -q --dry-run --ignore-installed --report "$work/report.json" "${plat[@]}" --target "$work/x" \
      -c "$work/constraints.txt" -r "$work/reqs.txt"
    python3 - "$work/report.json" "$work/constraints.txt" > "$work/need.txt" <<'PY'
import json, sys
from packaging.utils import canonicalize_name as c
have = {c(l.split("==")[0]): l.split("==")[1].strip() for l in open(sys.argv[2]) if "==" in l}
for i in json.load(open(sys.argv[1]))["install"]:
    m = i["metadata"]
    if have.get(c(m["name"])) != m["version"]:
        print(f'{m["name"]}=={m["version"]}')
PY
    rm -rf .gpu-lmcache && mkdir -p .gpu-lmcache/wheels
    python3 -m pip download -q --no-deps "${plat[@]}" -d .gpu-lmcache/wheels -r "$work/need.txt"
    cp "$work"/lmc/lmcache-0.5.6-*.whl .gpu-lmcache/wheels/
    echo "lmcache: $(wc -l < "$work/need.txt") wheels to bring: $(tr '\n' ' ' < "$work/need.txt")"
    tar cf - -C .gpu-lmcache wheels | split -b 50000000 -d -a 2 - .gpu-lmcache/part
    for p in .gpu-lmcache/part*; do n=${p##*part}; mkdir -p ".gpu-lmcache/l$n" && mv "$p" ".gpu-lmcache/l$n/lpart$n"; done
    rm -rf .gpu-lmcache/wheels
    ls .gpu-lmcache
    ;;
  install)
    shift
    mkdir -p /tmp/lparts
    for d in "$@"; do mv "$d"/lpart* /tmp/lparts/ 2>/dev/null || true; done
    if [[ -f /tmp/site/.lmcache-ok ]]; then echo "lmcache installed"; exit 0; fi
    if ! cat /tmp/lparts/lpart* 2>/dev/null | tar t >/dev/null 2>&1; then echo "lmcache incomplete: $(ls /tmp/lparts | wc -l) part(s)"; exit 3; fi
    rm -rf /tmp/lmcache-x && mkdir -p /tmp/lmcache-x && cat /tmp/lparts/lpart* | tar x -C /tmp/lmcache-x
    if ! python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/lmcache-x/wheels/*.whl \
        > /tmp/lmcache-pip.log 2>&1; then
      grep -v "Target directory" /tmp/lmcache-pip.log >&2; echo "lmcache: pip install failed" >&2; exit 1
    fi
    rm -rf /tmp/lmcache-x && touch /tmp/site/.lmcache-ok
    PYTHONPATH=/tmp/site python3 -c "import torch, lmcache, lmcache.cuda_ops; print('lmcache', lmcache.__version__ if hasattr(lmcache, '__version__') else '0.5.6', 'cuda_ops ok, torch', torch.__version__)"
    ;;
  *) echo "usage: $0 build [GPU_HOST_DIR] | install DIR..." >&2; exit 2 ;;
esac
