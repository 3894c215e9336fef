#!/usr/bin/env bash
# Nsight Compute over chosen fm-bench cases, on a machine with a CUDA device:
# builds fm-bench (CUDA enabled) and profiles one launch of the named kernel
# in each case, with the sections that say where a memory-bound kernel loses
# time (speed of light, occupancy, scheduler and warp-state statistics,
# memory workload). Reports go to $OUT/ncu-N.txt. With FM_NCU_SOURCE=1 also
# the per-instruction counts (SourceCounters): the report $OUT/ncu-N.ncu-rep,
# its SASS page as $OUT/ncu-N-sass.csv (executed count per instruction) and
# its source page as $OUT/ncu-N-src.csv (per CUDA line: the kernels carry
# -lineinfo); tools/ncu-lines.py ncu-N-src.csv sums and ranks the lines.
#
#   OUT=/dir tools/gpu-profile.sh 'KERNEL_REGEX|fm-bench filter' ...
#   e.g. tools/gpu-profile.sh 'quant_tile_kernel|BF16->E4M3 1x128 row+col'
# FM_CARRIED=1 runs the fm-bench of build-carry/bins.tar.xz (tools/gpu-pack.sh
# tools/fm-bench here, carry ["build-carry"]) instead of building one;
# FM_BENCH=PATH runs that fm-bench binary.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-profile-out}
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH
B=build-gpu
if [ -n "${FM_BENCH:-}" ]; then
    BENCH=$FM_BENCH # a given fm-bench binary, e.g. one variant of an A/B pair
elif [ -f build-carry/bins.tar.xz ] && [ -n "${FM_CARRIED:-}" ]; then
    # fm-bench built here by tools/gpu-pack.sh tools/fm-bench: no rebuild on the device
    mkdir -p /tmp/fm-carried && tar -xJf build-carry/bins.tar.xz -C /tmp/fm-carried || exit 1
    BENCH=/tmp/fm-carried/bin/fm-bench
else
    if [ ! -f "$B/build.ninja" ]; then
        meson setup "$B" -Dcuda=enabled -Doracle_tests=false -Dbuildtype=debugoptimized >"$OUT/build.log" 2>&1 || exit 1
    fi
    ninja -C "$B" tools/fm-bench >>"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
    BENCH=$B/tools/fm-bench
fi
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
# Where warps wait, as average cycles per warp (ratios between them are what matter).
STALLS=$(printf 'smsp__average_warp_latency_issue_stalled_%s,' barrier long_scoreboard short_scoreboard \
    mio_throttle lg_throttle math_pipe_throttle wait not_selected dispatch_stall | sed 's/,$//')
# What reaches DRAM and L2: partial-sector writes show as more DRAM reads or more L2 write sectors.
TRAFFIC=dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_srcunit_tex_op_write.sum,lts__t_sectors_srcunit_tex_op_read.sum
n=0
for spec in "$@"; do
    n=$((n + 1))
    k=${spec%%|*} f=${spec#*|}
    echo "== $k in '$f'" | tee "$OUT/ncu-$n.txt"
    timeout 240 "$NCU" --clock-control none -k "regex:$k" --launch-skip 3 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \
        --section MemoryWorkloadAnalysis --section LaunchStats --section InstructionStats \
        --metrics "$STALLS,smsp__inst_executed.sum,$TRAFFIC" \
        ${FM_NCU_SOURCE:+--section SourceCounters --import-source no -o "$OUT/ncu-$n"} \
        "$BENCH" --reps 5 --filter "$f" >>"$OUT/ncu-$n.txt" 2>&1
    if [ -n "${FM_NCU_SOURCE:-}" ]; then
        "$NCU" -i "$OUT/ncu-$n.ncu-rep" --page details >>"$OUT/ncu-$n.txt" 2>&1
        "$NCU" -i "$OUT/ncu-$n.ncu-rep" --page source --csv --print-source sass >"$OUT/ncu-$n-sass.csv" 2>&1
        "$NCU" -i "$OUT/ncu-$n.ncu-rep" --page source --csv --print-source cuda,sass >"$OUT/ncu-$n-src.csv" 2>&1
    fi
    grep -E "Duration|DRAM Throughput|Compute \(SM\)|Achieved Occupancy|Registers Per|No Eligible|Warp Cycles Per Issued|stalled_.*ratio|inst_executed.sum|dram__bytes|lts__t_sectors" "$OUT/ncu-$n.txt" | head -40
done
