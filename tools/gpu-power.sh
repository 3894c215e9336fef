#!/usr/bin/env bash
# SM clock and board power while fm-bench repeats the rows one filter picks,
# one run per argument (device side). ncu showed the native GEMM kernel at a
# lower SM clock than cuBLASLt's (notes/grouped_gemm_sm90.md, S18-7): this
# measures clock and power under a long load, where the power cap acts.
#   OUT=$OUT tools/gpu-power.sh BENCH REPS 'FILTER' ['ENV=VALUE ... @FILTER' ...]
# An argument may start with environment settings for that run, separated
# from the filter by '@' (FLOWMOE_SM90_TILE=128x192 @BF16, E=8 [native).
# Prints a line per run: the fm-bench row, then the median SM clock (MHz),
# power (W) and temperature over the samples taken while the row ran (50 ms
# apart; the first second and anything under 100 W left out), and how many
# of them the driver flagged as power capped. Raw samples: $OUT/power-samples.csv
# (a run's samples after a line '# run N: ARGUMENT').
set -uo pipefail
bench=$1
reps=$2
shift 2
out=${OUT:-/tmp}
n=0
for arg in "$@"; do
    n=$((n + 1))
    envs=()
    filter=$arg
    if [[ $arg == *@* ]]; then
        read -r -a envs <<<"${arg%%@*}"
        filter=${arg#*@}
    fi
    csv=$(mktemp)
    nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.sw_power_cap \
        --format=csv,noheader,nounits -lms 50 >"$csv" 2>/dev/null &
    smi=$!
    row=$(env "${envs[@]}" "$bench" --no-layer --no-ep --reps "$reps" --filter "$filter" 2>&1 |
        grep '^fm-bench: ' | grep -v -i 'copy\|skipped' | head -1 | sed 's/^fm-bench: //; s/  */ /g')
    kill "$smi" 2>/dev/null
    wait "$smi" 2>/dev/null
    { echo "# run $n: $arg"; cat "$csv"; } >>"$out/power-samples.csv"
    python3 - "$csv" "${envs[*]:-} $row" <<'EOF'
import statistics, sys
rows = []
for line in open(sys.argv[1]):
    f = [x.strip() for x in line.split(',')]
    try:
        rows.append((float(f[0]), float(f[1]), float(f[2]), f[3]))
    except (ValueError, IndexError):
        pass
rows = [r for r in rows[20:] if r[1] >= 100.0]
if not rows:
    print(f"{sys.argv[2]}: no samples")
else:
    capped = sum(1 for r in rows if r[3].lower() == 'active')
    print(f"{sys.argv[2]} | {statistics.median(r[0] for r in rows):.0f} MHz"
          f" {statistics.median(r[1] for r in rows):.0f} W {statistics.median(r[2] for r in rows):.0f} C"
          f" | {len(rows)} samples, {capped} power capped")
EOF
    rm -f "$csv"
done
