#!/usr/bin/env bash
# The convergence study of issue 8: fm-train over several seeds, each
# recipe's final-loss gap to bf16 per seed, then their mean, smallest and
# largest, the mean gap of the same final weights run through bf16 layers
# (what training did, apart from the recipe's own forward) and the mean gap
# of bf16's final weights run through the recipe's layers (what its forward's
# format costs alone; gaps.txt files from before that column show "-"); with
# --control also each recipe's gap minus the control's, seed by seed. Means
# come with their standard error (sample sd / sqrt(seeds)). One run's gap is
# not a measure of a recipe (the students' trajectories drift apart
# differently for each seed); the mean over seeds, next to its spread, is.
#
#   tools/convergence.sh SEEDS [fm-train arguments...]
#       e.g. tools/convergence.sh 8 --steps 600 --lr 3e-3
#   tools/convergence.sh --summary GAPS.txt...
#       the table alone, over the seeds of several studies' gaps.txt (a study
#       extended by FM_CONV_FIRST: its seeds must not repeat)
#       (with --control, bf16-control's row is the spread two bf16 runs show
#       on their own: the noise floor the recipes' gaps are read against)
#
# Runs SEEDS seeds one after the other, from ${FM_CONV_FIRST:-1} on, with the
# fm-train of build/ (run tools/demo.sh once first); each run's full output
# lands in ${FM_CONV_OUT:-out/convergence}/seed-N.txt. Environment:
# FM_BUILD_DIR (default build).
set -euo pipefail
cd "$(dirname "$0")/.."
usage() {
    echo "usage: tools/convergence.sh SEEDS [fm-train arguments...] | --summary GAPS.txt..." >&2
    exit 2
}
summary() {
    awk '
    { printf "seed %s %-14s final %s gap %s%% (bf16 forward: %s%%, bf16 weights: %s%%)\n", $1, $2, $3, $4, $5, (NF > 5 ? $6 : "-") }
    $2 != "bf16" {
        n[$2]++; sum[$2] += $4; sq[$2] += $4 * $4; sum16[$2] += $5; gap[$2, $1] = $4
        if (NF > 5 && $6 != "-") { nf[$2]++; sumf[$2] += $6; sqf[$2] += $6 * $6 }
        if (!($2 in lo) || $4 < lo[$2]) lo[$2] = $4
        if (!($2 in hi) || $4 > hi[$2]) hi[$2] = $4
    }
    # mean and standard error of the mean (sample sd / sqrt(n)); "-" for one seed
    function se(s, q, k) { return k > 1 ? sqrt((q - s * s / k) / (k - 1) / k) : -1 }
    function pm(v) { return v < 0 ? "-" : sprintf("%.2f", v) }
    END {
        print "\n| recipe | seeds | mean gap to bf16 +- SE | smallest | largest | mean gap, final weights through bf16 layers | mean gap, bf16'"'"'s final weights through its layers +- SE | minus bf16-control, seed by seed, +- SE |"
        print "|---|---:|---:|---:|---:|---:|---:|---:|"
        split("fp8-blockwise fp8-flow fp8-flow-fp4 bf16-control", order, " ")
        for (i = 1; i <= 4; i++) {
            if (!((r = order[i]) in n))
                continue
            d = "-"
            if (r != "bf16-control" && ("bf16-control" in n)) {
                k = 0; ds = 0; dq = 0
                for (key in gap) {
                    split(key, part, SUBSEP)
                    if (part[1] == r && (("bf16-control", part[2]) in gap)) {
                        v = gap[key] - gap["bf16-control", part[2]]; k++; ds += v; dq += v * v
                    }
                }
                if (k > 0)
                    d = sprintf("%+.2f +- %s", ds / k, pm(se(ds, dq, k)))
            }
            f = r in nf ? sprintf("%+.2f%% +- %s", sumf[r] / nf[r], pm(se(sumf[r], sqf[r], nf[r]))) : "-"
            printf "| %s | %d | %+.2f%% +- %s | %+.2f%% | %+.2f%% | %+.2f%% | %s | %s |\n", r, n[r], sum[r] / n[r],
                pm(se(sum[r], sq[r], n[r])), lo[r], hi[r], sum16[r] / n[r], f, d
        }
    }'
}
if [ "${1:-}" = --summary ]; then
    shift
    [ $# -ge 1 ] || usage
    cat "$@" | summary
    exit
fi
[ $# -ge 1 ] && [[ $1 =~ ^[1-9][0-9]*$ ]] || usage
seeds=$1
shift
first=${FM_CONV_FIRST:-1}
[[ $first =~ ^[1-9][0-9]*$ ]] || usage
last=$((first + seeds - 1))
bin=${FM_BUILD_DIR:-build}/tools/fm-train
[ -x "$bin" ] || {
    echo "convergence.sh: $bin is missing; run tools/demo.sh first" >&2
    exit 1
}
out=${FM_CONV_OUT:-out/convergence}
mkdir -p "$out"
echo "fm-train $* (seeds $first..$last)"
for s in $(seq "$first" "$last"); do
    "$bin" "$@" --seed "$s" --out "$out/seed-$s" >"$out/seed-$s.txt"
    # the final table's rows: | recipe | final loss | gap | bf16-forward loss | its gap | bf16 weights' loss | its gap | ...
    awk -v s="$s" -F'|' '$2 ~ /^ (bf16|bf16-control|fp8-[a-z0-9-]+) $/ {
        gsub(/ /, "", $2); gsub(/ /, "", $3); gsub(/[ %]/, "", $4); gsub(/[ %]/, "", $6); gsub(/[ %]/, "", $8)
        print s, $2, $3, $4, $6, $8 }' \
        "$out/seed-$s.txt"
done | tee "$out/gaps.txt" | summary
