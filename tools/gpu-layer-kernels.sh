#!/usr/bin/env bash
# Where a layer step's GPU time goes, per kernel, for one recipe (Nsight
# Compute, durations only): runs the carried fm-bench (tools/gpu-pack.sh
# tools/fm-bench; carry ["build-carry"]) under ncu for the layer cases that
# match FILTER, and again for EXCLUDE (a longer name that FILTER also
# matches), and prints per-step microseconds per kernel of FILTER minus
# EXCLUDE, steps counted by the router's forward kernel (one a step).
#   OUT=$OUT tools/gpu-layer-kernels.sh "moe_layer forward+backward fp8-flow" fp8-flow-fp4
# or, with fm-bench's exact-name filter and nothing to subtract:
#   OUT=$OUT tools/gpu-layer-kernels.sh "=moe_layer forward+backward fp8-flow"
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-layer-out}
mkdir -p "$OUT" /tmp/fm-carried
tar -xJf build-carry/bins.tar.xz -C /tmp/fm-carried || exit 1
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
run() {
    timeout 300 "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv --print-summary per-kernel \
        /tmp/fm-carried/bin/fm-bench --reps 1 --no-ep --filter "$1" 2>/dev/null | grep '^"' >"$2"
}
run "$1" "$OUT/with.csv"
if [ -n "${2:-}" ]; then run "$2" "$OUT/without.csv"; else : >"$OUT/without.csv"; fi
python3 - "$OUT/with.csv" "$OUT/without.csv" <<'PY'
import csv, sys
def load(p):
    rows = list(csv.reader(open(p)))
    if not rows:
        return {}, 0
    h = rows[0]
    ki, ni, ai = h.index("Kernel Name"), h.index("Invocations"), h.index("Average")
    tot, steps = {}, 0
    for r in rows[1:]:
        name = r[ki].split("(")[0][:90]
        n, avg = int(r[ni]), float(r[ai].replace(",", ""))
        tot[name] = tot.get(name, 0.0) + n * avg
        if name.startswith("router_fwd_kernel"):
            steps += n
    return tot, steps
w, sw = load(sys.argv[1])
wo, so = load(sys.argv[2])
steps = sw - so
rows = sorted(((v - wo.get(k, 0.0)) / steps / 1000.0, k) for k, v in w.items())
total = sum(us for us, _ in rows)
print(f"{steps} steps; GPU kernel time per step: {total:.0f} us")
for us, k in reversed(rows):
    if us > 1:
        print(f"{us:9.1f} us  {100 * us / total:5.1f}%  {k}")
PY
