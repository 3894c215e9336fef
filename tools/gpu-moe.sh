#!/usr/bin/env bash
# The MoE ops on a GPU machine: build, their GPU tests, fm-xval of the MoE
# ops, memcheck of their test, and the fm-bench rows of the MoE ops. Logs
# under $OUT; one summary at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
. tools/gpu-common.sh gpu-moe-out
gpu_build
t 200 tests.log meson test -C $B --num-processes 1 --print-errorlogs test_cuda_moe_ops_bitexact_with_cpu \
    test_cuda_mathfn_equals_host test_cuda_layer_matches_cpu
grep -E "^ *[0-9]+/[0-9]+ " "$OUT/tests.log" >>"$s"
cp "$B/meson-logs/testlog.txt" "$OUT/testlog.txt" 2>/dev/null
grep -E "patterns|values of" "$OUT/testlog.txt" >>"$s"
t 200 xval.log $B/tools/fm-xval -o moe_router -o moe_router_backward -o moe_permute -o moe_unpermute \
    -o moe_unpermute_backward -o moe_swiglu -o moe_swiglu_backward
grep -E "passed|FAIL" "$OUT/xval.log" | head -20 >>"$s"
t 200 memcheck.log compute-sanitizer --tool memcheck --error-exitcode 9 $B/tests/gpu/test_cuda_moe_ops_bitexact_with_cpu
grep -E "ERROR SUMMARY" "$OUT/memcheck.log" >>"$s"
t 200 bench.log $B/tools/fm-bench --no-layer --filter moe
grep -E "^\| (moe|unfused)|copy|x faster|Fused" "$OUT/bench.log" >>"$s"
cat "$s"
