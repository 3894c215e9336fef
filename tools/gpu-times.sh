#!/usr/bin/env bash
# Where a multi-launch op's time goes: the GPU time of every kernel launch of
# chosen fm-bench cases, on a machine with a CUDA device. Nsight Systems
# (when installed) gives the launches as they ran, gaps included; otherwise
# Nsight Compute gives each launch's duration on its own (serialised, warm
# caches). Reports go to $OUT/times-N.txt; the per-kernel summary to stdout.
#
#   OUT=/dir tools/gpu-times.sh 'fm-bench filter' ...
#   e.g. tools/gpu-times.sh moe_permute
set -uo pipefail
cd "$(dirname "$0")/.."
. tools/gpu-common.sh gpu-times-out
[ -x "$B/tools/fm-bench" ] || gpu_build
NSYS=$(command -v nsys || ls /opt/nvidia/nsight-systems/*/bin/nsys /usr/local/cuda/bin/nsys 2>/dev/null | head -1)
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
n=0
for f in "$@"; do
    n=$((n + 1))
    r=$OUT/times-$n.txt
    echo "== $f" | tee "$r"
    if [ -n "$NSYS" ]; then
        timeout 240 "$NSYS" profile -o "$OUT/nsys-$n" --force-overwrite true -t cuda \
            "$B/tools/fm-bench" --reps 20 --filter "$f" >>"$r" 2>&1
        "$NSYS" stats -r cuda_gpu_kern_sum,cuda_gpu_trace -f csv -o "$OUT/nsys-$n" "$OUT/nsys-$n.nsys-rep" >>"$r" 2>&1
        # the kernel summary: name, launches, median ns
        "$NSYS" stats -r cuda_gpu_kern_sum "$OUT/nsys-$n.nsys-rep" 2>/dev/null | head -30
        rm -f "$OUT/nsys-$n.nsys-rep" "$OUT/nsys-$n.sqlite"
    else
        timeout 240 "$NCU" --clock-control none --cache-control none --metrics gpu__time_duration.sum \
            --launch-skip 40 --launch-count 40 "$B/tools/fm-bench" --reps 20 --filter "$f" >>"$r" 2>&1
        awk '/^  [a-z_]+.*\(/ {k=substr($1, 1, index($1, "(") - 1)} /gpu__time_duration.sum/ {print k, $NF, $(NF-1)}' "$r" |
            sort | awk '{s[$1]+=$2; c[$1]++; u[$1]=$3} END {for (k in s) printf "%-40s %4d launches, mean %.2f %s\n", k, c[k], s[k]/c[k], u[k]}'
    fi
done
