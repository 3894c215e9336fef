#!/usr/bin/env bash
# The GEMMs on a GPU machine: build, the GEMM test (cuBLASLt and the native
# sm_90a kernel against the CPU), memcheck and racecheck of it (racecheck on
# the native kernel only: cuBLASLt's own kernels report hazards we cannot
# act on), the native kernel's SASS (QGMMA count, local-memory accesses), and
# the fm-bench GEMM rows. Logs under $OUT; one summary at the end.
#   FM_GEMM_STEPS  steps after the build (default "test sass sanitizers bench")
set -uo pipefail
cd "$(dirname "$0")/.."
. tools/gpu-common.sh gpu-gemm-out
gpu_build
steps=" ${FM_GEMM_STEPS:-test sass sanitizers bench} "
if [[ $steps == *" test "* ]]; then
  t 300 test.log $B/tests/gpu/test_cuda_gemm_matches_cpu_within_tolerance
  grep -E "FAIL|test_cuda_gemm" "$OUT/test.log" | head -30 >>"$s"
  # the native kernel's every tile shape and its other cluster size (tuning
  # knobs, see grouped_gemm_sm90.cu): each product of the test runs on each
  for tile in 192x128 128x128 128x192; do
    for cl in 1 2; do
      FLOWMOE_SM90_TILE=$tile FLOWMOE_SM90_CLUSTER=$cl t 300 test-$tile-cl$cl.log \
          $B/tests/gpu/test_cuda_gemm_matches_cpu_within_tolerance
      echo "tile $tile cluster $cl: $(grep -E "FAIL|test_cuda_gemm" "$OUT/test-$tile-cl$cl.log" | head -30)" >>"$s"
    done
  done
fi
if [[ $steps == *" sass "* ]]; then
  obj=$(find $B -name '*grouped_gemm_sm90.cu.o' | head -1)
  t 60 sass.log cuobjdump -sass "$obj"
  for k in $(grep -oE "Function : \S+" "$OUT/sass.log" | awk '{print $3}' | sort -u); do
    sed -n "/Function : $k\$/,/Function : /p" "$OUT/sass.log" >"$OUT/sass-one.txt"
    echo "SASS $k: QGMMA $(grep -c QGMMA "$OUT/sass-one.txt"), LDL/STL $(grep -cE '\b(LDL|STL)\b' "$OUT/sass-one.txt")" >>"$s"
  done
  rm -f "$OUT/sass-one.txt"
fi
if [[ $steps == *" sanitizers "* ]]; then
  t 300 memcheck.log compute-sanitizer --tool memcheck --error-exitcode 9 $B/tests/gpu/test_cuda_gemm_matches_cpu_within_tolerance
  grep -E "ERROR SUMMARY" "$OUT/memcheck.log" >>"$s"
  t 300 racecheck.log compute-sanitizer --tool racecheck --kernel-name kns=gm_kernel --error-exitcode 9 \
      $B/tests/gpu/test_cuda_gemm_matches_cpu_within_tolerance
  grep -E "RACECHECK SUMMARY|ERROR SUMMARY" "$OUT/racecheck.log" >>"$s"
fi
if [[ $steps == *" bench "* ]]; then
  t 300 bench.log $B/tools/fm-bench --no-layer --no-ep --filter gemm
  grep -E "^\| .*gemm|copy" "$OUT/bench.log" >>"$s"
fi
cat "$s"
