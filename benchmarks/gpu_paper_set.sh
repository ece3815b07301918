#!/usr/bin/env bash
# Several benchmarks/paper_gpu.py runs in one device call (`bash benchmarks/gpu_host.sh paper-set [OUT_DIR]`), each
# in its own work directory and archive, so that a call brings back one file a run (a call brings back a bounded
# number of files; 2026-12-07, second: 8 of 98 came back) and a run cut by the call's end still leaves the others.
#
#   PAPER_SET="NAME|STEPS|BENCH_ARGS[|CAP_S];..."  the runs, in order: PAPER_WORK, PAPER_STEPS and BENCH_ARGS of
#                                               `gpu_host.sh paper`, and at most CAP_S seconds (default: what is left)
#   PAPER_SET_S=585                             the seconds the whole set may take (the device call's limit, less margin)
#   PAPER_SET_DRY=1                             print each run's command and timeout instead of running it
#
# Each run's directory and log go to OUT_DIR/NAME.tar.gz; a run with under 60 s left is skipped, and says so.
set -uo pipefail
out=${1:?OUT_DIR}
set_s=${PAPER_SET_S:-585}
case "$set_s" in ''|*[!0-9]*) echo "PAPER_SET_S: whole seconds, not $set_s" >&2; exit 2 ;; esac
end=$(( $(date +%s) + set_s ))
IFS=';' read -ra runs <<< "${PAPER_SET:?PAPER_SET=NAME|STEPS|BENCH_ARGS[|CAP_S];...}"
work=/tmp/paper-set
mkdir -p "$out" "$work"
for r in "${runs[@]}"; do  # every run checked before the first starts
  [ -n "${r// /}" ] || continue
  IFS='|' read -r name steps args cap <<< "$r"
  case "$name" in ''|*/*|.*|*[!A-Za-z0-9._-]*) echo "PAPER_SET: a run's name is a plain name, not '$name'" >&2; exit 2 ;; esac
  case "${cap:-0}" in *[!0-9]*) echo "PAPER_SET: $name's cap is whole seconds, not '$cap'" >&2; exit 2 ;; esac
  [ -n "$steps" ] || { echo "PAPER_SET: $name has no steps (calib, R1 ... R5)" >&2; exit 2; }
done
for r in "${runs[@]}"; do
  [ -n "${r// /}" ] || continue
  IFS='|' read -r name steps args cap <<< "$r"
  left=$(( end - $(date +%s) - 5 ))
  if [ "$left" -lt 60 ]; then echo "== $name: skipped, ${left} s left"; continue; fi
  to=$left; [ -n "$cap" ] && [ "$cap" -lt "$left" ] && to=$cap
  if [ -n "${PAPER_SET_DRY:-}" ]; then
    echo "== $name: PAPER_WORK=$name PAPER_STEPS=$steps BENCH_ARGS=\"$args\" BENCH_TIMEOUT_S=$to"
    continue
  fi
  t0=$(date +%s)
  PAPER_WORK=$name PAPER_STEPS=$steps BENCH_ARGS=$args BENCH_TIMEOUT_S=$to \
    bash benchmarks/gpu_host.sh paper "$work/$name" > "$work/$name.log" 2>&1
  echo "== $name: $(( $(date +%s) - t0 )) s (timeout $to s)"
  tail -8 "$work/$name/paper_gpu.txt" 2>/dev/null
  tar czf "$out/$name.tar.gz" -C "$work" "$name" "$name.log"
done
