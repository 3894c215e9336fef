#!/usr/bin/env bash
# Correctness pass on a GPU machine, shorter than gpu-check.sh: build, the GPU
# suite (fm-xval included), fm-train on CUDA next to CPU, memcheck over the
# GPU tests. Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-quick-out}
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH
B=build-gpu
s=$OUT/summary.txt
: >"$s"
t() { local lim=$1 log=$2; shift 2; local t0=$SECONDS; timeout --kill-after=5 "$lim" "$@" >>"$OUT/$log" 2>&1; local rc=$?; echo "$* -> rc=$rc ($((SECONDS - t0)) s)" >>"$s"; return $rc; }
nvidia-smi --query-gpu=name --format=csv,noheader >>"$s"
[ -f $B/build.ninja ] || t 120 build.log meson setup $B -Dcuda=enabled -Doracle_tests=false
t 400 build.log ninja -C $B -j "$(nproc)" || { tail -40 "$OUT/build.log"; exit 1; }
grep -c "warning" "$OUT/build.log" | sed 's/^/build warnings: /' >>"$s"
names=$(meson test -C $B --suite gpu --list 2>/dev/null | awk -F: '{print $NF}' | grep -v '^fm-xval$')
t 300 tests.log meson test -C $B --num-processes 1 --print-errorlogs $names
grep -E "^ *[0-9]+/[0-9]+ " "$OUT/tests.log" >>"$s"
t 200 xval.log $B/tools/fm-xval
grep -E "passed" "$OUT/xval.log" >>"$s"
t 60 train.log $B/tools/fm-train --backend cuda --steps 6 --print-every 1 --out "$OUT/train-cuda"
t 60 train.log $B/tools/fm-train --backend cpu --steps 6 --print-every 1 --out "$OUT/train-cpu"
if [ "${FM_MEMCHECK:-1}" = 1 ]; then
  for x in $B/tests/gpu/test_cuda_*; do [ -f "$x" ] && [ -x "$x" ] || continue
    t 120 memcheck.log compute-sanitizer --tool memcheck --error-exitcode 9 "$x"
  done
  t 200 memcheck.log compute-sanitizer --tool memcheck --error-exitcode 9 $B/tools/fm-xval -q
fi
cat "$s"
