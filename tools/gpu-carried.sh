#!/usr/bin/env bash
# Runs GPU test binaries built on the development machine (where nvcc builds
# but nothing runs) and carried to the device as build-carry/bins.tar.xz:
# a short device budget then goes to the tests, not to a rebuild. Each
# binary: its log under $OUT, a line in $OUT/summary.txt. Arguments: the
# binaries to run (names under the archive's bin/), in order; "TOOL:NAME"
# runs NAME under compute-sanitizer TOOL (memcheck, racecheck, initcheck,
# synccheck); FM_SANITIZER_ARGS adds options to every tool, e.g.
# "--report-api-errors no" (NCCL probes kernel images at init and each probe
# is reported as an API error) or "--kernel-name-exclude kns=nvjet" (leave
# cuBLASLt's kernels out).
#   local: strip + tar -cJ the binaries of build-test into build-carry/bins.tar.xz
#   device: OUT=$OUT tools/gpu-carried.sh test_a memcheck:test_a
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-carried-out}
mkdir -p "$OUT"
s=$OUT/summary.txt
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0
# NCCL: the image carries it in PyTorch's nvidia-nccl wheel.
pkg=$(python3 -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null)
[ -n "$pkg" ] && [ -f "$pkg/lib/libnccl.so.2" ] && export LD_LIBRARY_PATH=$pkg/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
mkdir -p /tmp/fm-carried && tar -xJf build-carry/bins.tar.xz -C /tmp/fm-carried || { echo "no build-carry/bins.tar.xz" >>"$s"; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader >>"$s"
for a in "$@"; do
    t0=$SECONDS
    case $a in
    memcheck:* | racecheck:* | initcheck:* | synccheck:*) tool=${a%%:*} b=${a#*:}; log=$OUT/$tool-$b.log
        timeout --kill-after=5 "${FM_CARRIED_LIMIT:-120}" compute-sanitizer --tool "$tool" ${FM_SANITIZER_ARGS:-} \
            --error-exitcode 9 /tmp/fm-carried/bin/$b >"$log" 2>&1; rc=$?
        echo "$tool $b -> rc=$rc ($((SECONDS - t0)) s): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1)" >>"$s" ;;
    fm-train*) log=$OUT/fm-train.log
        timeout --kill-after=5 "${FM_CARRIED_LIMIT:-120}" /tmp/fm-carried/bin/fm-train --backend cuda --steps 4 \
            --print-every 1 --out "$OUT/train" >"$log" 2>&1; rc=$?
        echo "fm-train --backend cuda -> rc=$rc ($((SECONDS - t0)) s)" >>"$s" ;;
    *) log=$OUT/$a.log
        timeout --kill-after=5 "${FM_CARRIED_LIMIT:-120}" /tmp/fm-carried/bin/$a >"$log" 2>&1; rc=$?
        echo "$a -> rc=$rc ($((SECONDS - t0)) s): $(tail -1 "$log")" >>"$s" ;;
    esac
done
cat "$s"
