#!/bin/sh
# fm_train_smoke: fm-train runs a few steps of every recipe on a tiny model and
# exits 0; loss.csv has its header and one finite, positive row per step, and
# every recipe's loss went down; the final table evaluates bf16's weights
# through every recipe's layers; loss.svg holds a curve per recipe; --control
# adds a perturbed bf16 column; --ep 2 trains over two in-process ranks to
# what one rank gives (first-step loss within 1e-3 relative: the forward
# differs only by the BF16 rounding of each rank's partial sums); a bad flag
# gives exit status 2.
#
#   fm-train-smoke.sh FM_TRAIN OUT_DIR
set -u
exe=$1
out=$2
steps=6
fail() {
    echo "fm_train_smoke: $*" >&2
    exit 1
}

rm -rf "$out"
mkdir -p "$out" || fail "cannot create $out"
"$exe" --steps $steps --layers 2 --hidden 128 --ffn 64 --experts 4 --topk 2 --tokens 64 --threads 1 \
    --out "$out" >"$out/stdout.txt" || fail "fm-train exited with status $?"
csv=$out/loss.csv
[ -f "$csv" ] || fail "no $csv"
lines=$(wc -l <"$csv")
[ "$lines" -eq $((steps + 1)) ] || fail "$csv has $lines lines, want $((steps + 1)) (a header and one per step)"
header=$(head -n 1 "$csv")
[ "$header" = "step,bf16,fp8-blockwise,fp8-flow,fp8-flow-fp4" ] || fail "$csv header is '$header'"
awk -F, -v steps=$steps '
    NR == 1 { next }
    $1 != NR - 1 { print "row " NR ": step " $1 ", want " NR - 1; bad = 1 }
    NF != 5 { print "row " NR ": " NF " fields"; bad = 1 }
    {
        for (i = 2; i <= NF; i++) {
            if ($i !~ /^[0-9.eE+-]+$/ || !($i + 0 > 0)) { print "row " NR ": loss \"" $i "\" is not finite and positive"; bad = 1 }
            if (NR == 2) first[i] = $i + 0
            if (NR == steps + 1 && !($i + 0 < first[i])) { print "column " i ": the loss did not go down (" first[i] " -> " $i ")"; bad = 1 }
        }
    }
    END { exit bad }' "$csv" || fail "$csv is wrong (above)"
# The final table: bf16's own final weights through bf16 layers are its final
# loss again; through each FP8 recipe's layers, a finite positive loss and a gap.
awk -F'|' '
    $2 ~ /^ (bf16|fp8-[a-z0-9-]+) $/ {
        rows++
        if ($2 == " bf16 " && $7 + 0 != $3 + 0) { print "bf16: its weights through bf16 layers give " $7 ", its final loss is " $3; bad = 1 }
        if ($2 != " bf16 " && (!($7 + 0 > 0) || $8 !~ /^ [+-][0-9.]+% $/)) { print $2 ": bf16'"'"'s weights through its layers: \"" $7 "\", gap \"" $8 "\""; bad = 1 }
    }
    END { if (rows != 4) { print rows " table rows, want 4"; bad = 1 } exit bad }' "$out/stdout.txt" ||
    fail "the final table is wrong (above)"
svg=$out/loss.svg
[ -f "$svg" ] || fail "no $svg"
curves=$(grep -c '<polyline' "$svg")
[ "$curves" -eq 4 ] || fail "$svg has $curves curves, want 4"
tail -n 1 "$svg" | grep -q '^</svg>$' || fail "$svg does not end with </svg>"

# --control adds a sixth column, bf16-control, trained from perturbed weights:
# its first loss differs from bf16's, and it trains too.
"$exe" --steps 3 --layers 1 --hidden 64 --ffn 32 --experts 4 --topk 2 --tokens 32 --threads 1 --control \
    --recipes bf16,fp8-flow --out "$out/control" >/dev/null || fail "fm-train --control exited with status $?"
header=$(head -n 1 "$out/control/loss.csv")
[ "$header" = "step,bf16,fp8-flow,bf16-control" ] || fail "--control: header is '$header'"
awk -F, 'NR == 2 && $2 == $4 { print "bf16-control starts where bf16 does (" $2 ")"; exit 1 }' \
    "$out/control/loss.csv" || fail "--control did not perturb the weights"
"$exe" --recipes fp8-flow --control --out "$out/never" >/dev/null 2>&1
rc=$?
[ $rc -eq 2 ] || fail "--control without bf16 gave exit status $rc, want 2"

# --ep 2: the same run over two ranks (tokens 33: unequal shares)
"$exe" --steps 3 --layers 1 --hidden 64 --ffn 32 --experts 4 --topk 2 --tokens 33 --threads 1 \
    --out "$out/ep1" >/dev/null || fail "fm-train (one rank) exited with status $?"
"$exe" --steps 3 --layers 1 --hidden 64 --ffn 32 --experts 4 --topk 2 --tokens 33 --threads 2 --ep 2 \
    --out "$out/ep2" >"$out/ep2.txt" || fail "fm-train --ep 2 exited with status $?"
grep -q "expert parallelism over 2 in-process ranks" "$out/ep2.txt" || fail "--ep 2: the header does not say so"
paste -d, "$out/ep1/loss.csv" "$out/ep2/loss.csv" | awk -F, '
    NR == 1 { next }
    NR == 2 { for (i = 2; i <= 5; i++) { d = $i - $(i + 5); if (d < 0) d = -d
              if (!(d <= 1e-3 * $i)) { print "column " i ": step 1 loss " $i " on one rank, " $(i + 5) " on two"; bad = 1 } } }
    END { exit bad }' || fail "--ep 2 does not train what one rank does (above)"
"$exe" --experts 4 --ep 3 --out "$out/never" >/dev/null 2>&1
rc=$?
[ $rc -eq 2 ] || fail "--ep 3 over 4 experts gave exit status $rc, want 2"

"$exe" --experts 4 --topk 5 --out "$out/never" >/dev/null 2>&1
rc=$?
[ $rc -eq 2 ] || fail "--topk > --experts gave exit status $rc, want 2"
"$exe" --recipes bf16,fp9 --out "$out/never" >/dev/null 2>&1
rc=$?
[ $rc -eq 2 ] || fail "an unknown recipe gave exit status $rc, want 2"
[ ! -e "$out/never" ] || fail "a rejected run wrote $out/never"
echo "fm_train_smoke: ok"
