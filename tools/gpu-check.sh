#!/usr/bin/env bash
# The GPU check, in one go on a machine with a CUDA device: build (CUDA
# enabled), the GPU test suite (which includes fm-xval), fm-bench (markdown
# and JSON), the SASS facts of the kernels, then compute-sanitizer memcheck
# over the GPU tests and a reduced fm-xval, racecheck over the quantize
# kernels. Logs go to $OUT (default ./gpu-check-out); a short summary is
# printed last. Each step has a time limit so the whole stays inside
# FM_GPU_CHECK_BUDGET seconds (default 560): what does not fit is reported as
# not run, never silently dropped.
#
#   OUT=/some/dir tools/gpu-check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
budget=${FM_GPU_CHECK_BUDGET:-560}
export PATH=/usr/local/cuda/bin:$PATH
B=build-gpu
summary=$OUT/summary.txt
: >"$summary"
note() { echo "$*" >>"$summary"; }
left() { echo $((budget - SECONDS)); }
# step NAME SECONDS LOG CMD...: runs CMD with a limit, appends its rc to the summary.
step() {
    local name=$1 lim=$2 log=$3; shift 3
    local l; l=$(left)
    [ "$lim" -gt "$l" ] && lim=$l
    if [ "$lim" -lt 10 ]; then
        note "$name: NOT RUN (time budget spent)"
        return 99
    fi
    echo "== $name (limit ${lim}s)" >>"$log"
    local t0=$SECONDS
    timeout --kill-after=5 "$lim" "$@" >>"$log" 2>&1
    local rc=$?
    local how="rc=$rc"
    [ $rc -eq 124 ] && how="TIMED OUT after ${lim}s"
    note "$name: $how ($((SECONDS - t0)) s)"
    return $rc
}

{
    echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "host: $(uname -srm)"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader 2>&1
    nvcc --version | tail -1
    echo "meson $(meson --version 2>&1), ninja $(ninja --version 2>&1)"
} >>"$summary"

# ---- build -------------------------------------------------------------------
rm -rf "$B"
step "configure" 120 "$OUT/build.log" meson setup "$B" -Dcuda=enabled -Doracle_tests=false -Dbuildtype=debugoptimized
step "build" 400 "$OUT/build.log" ninja -C "$B" -j "$(nproc)"
build_rc=$?
if grep -E "warning" "$OUT/build.log" | grep -v "^ninja" >/dev/null; then
    note "build warnings: $(grep -c warning "$OUT/build.log")"
else
    note "build warnings: 0"
fi
if [ $build_rc -ne 0 ]; then
    note "BUILD FAILED: see build.log"
    tail -30 "$OUT/build.log"
    exit 1
fi

# ---- GPU suite (fm-xval included) ---------------------------------------------
step "meson test --suite gpu" 200 "$OUT/tests.log" meson test -C "$B" --suite gpu --num-processes 1 --print-errorlogs
cat "$B/meson-logs/testlog.txt" >>"$OUT/tests.log" 2>/dev/null
grep -E "^ *[0-9]+/[0-9]+ .*(OK|FAIL|SKIP|TIMEOUT|ERROR)" "$OUT/tests.log" | head -20 >>"$summary"
grep -E "^[a-z_]+ +[0-9]+ passed" "$OUT/tests.log" >>"$summary"

# ---- fm-bench -------------------------------------------------------------------
step "fm-bench" 120 "$OUT/bench.md" "$B/tools/fm-bench"
step "fm-bench --json" 120 "$OUT/bench.json" "$B/tools/fm-bench" --json

# ---- SASS: 16-byte accesses, registers, no local memory ---------------------------
{
    obj=$(ls "$B"/libflowmoe.a.p/backends_cuda_quantize.cu.o 2>/dev/null)
    for f in quantize dequantize; do
        o="$B/libflowmoe.a.p/backends_cuda_$f.cu.o"
        echo "== $f: instruction counts over all kernels (sm_90a)"
        cuobjdump -sass -arch sm_90a "$o" 2>/dev/null | grep -oE "(LDG|STG|LDS|STS|LDL|STL)(\.[A-Z0-9_]+)*" | sort | uniq -c
    done
    echo "== quant_tile_kernel<BF16, E4M3, E4M3, 1x128> (the target case)"
    cuobjdump -sass -arch sm_90a -fun '_Z17quant_tile_kernelILi1ELi3ELi3ELi3EEv7qparams' "$obj" 2>/dev/null |
        grep -oE "(LDG|STG|LDS|STS|LDL|STL|F2FP|SHFL|BAR)(\.[A-Z0-9_]+)*" | sort | uniq -c
    cuobjdump -res-usage "$obj" 2>/dev/null | grep -A1 "quant_tile_kernelILi1ELi3ELi3ELi3E" | head -4
} >"$OUT/sass.txt" 2>&1

# ---- compute-sanitizer --------------------------------------------------------
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
san=$OUT/sanitizer.log
if [ -z "$CS" ]; then
    note "compute-sanitizer: NOT FOUND"
else
    for t in test_cuda_quantize_bitexact_with_cpu test_cuda_rejects_host_pointer test_cuda_rejects_misaligned_buffers \
             test_cuda_ops_never_block_the_host test_cuda_stats_count_casts; do
        step "memcheck $t" 120 "$san" "$CS" --tool memcheck --error-exitcode 3 --leak-check full "$B/tests/gpu/$t"
    done
    step "memcheck fm-xval -q" 200 "$san" "$CS" --tool memcheck --error-exitcode 3 "$B/tools/fm-xval" -q
    step "racecheck fm-xval -q -o quantize" 150 "$san" "$CS" --tool racecheck --error-exitcode 3 "$B/tools/fm-xval" -q -o quantize
    step "racecheck fm-xval -q -o transpose_scaled -o convert_scaled" 150 "$san" "$CS" --tool racecheck \
        --error-exitcode 3 "$B/tools/fm-xval" -q -o transpose_scaled -o convert_scaled
    step "synccheck test_cuda_quantize_bitexact_with_cpu" 100 "$san" "$CS" --tool synccheck --error-exitcode 3 "$B/tests/gpu/test_cuda_quantize_bitexact_with_cpu"
    grep -E "ERROR SUMMARY|LEAK SUMMARY|RACECHECK SUMMARY" "$san" | sort | uniq -c >>"$summary"
fi

echo
echo "================ summary ================"
cat "$summary"
echo
sed -n '/^| op/,/target(s) missed/p' "$OUT/bench.md"
grep -E "^Device-to-device|speed-up|speedup" "$OUT/bench.md"
