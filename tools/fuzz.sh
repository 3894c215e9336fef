#!/usr/bin/env bash
# Builds the libFuzzer harnesses (tests/fuzz, clang, ASan + UBSan) and runs
# each one for a bounded time from its seed corpus.
#   tools/fuzz.sh [seconds per harness (default 60)] [harness ...]
# Exits non-zero when a harness finds a crash, a sanitizer report or an
# oracle failure; the reproducer is left in build-fuzz/findings/. Findings
# and new coverage go to a scratch corpus under build-fuzz/, never into the
# committed seeds. FM_FUZZ_RUNS=<n> bounds executions instead of time.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
secs=${1:-60}
shift || true
harnesses=("$@")
[ ${#harnesses[@]} -gt 0 ] || harnesses=(fuzz_descriptor_validation fuzz_quantize_roundtrip fuzz_requantize_oracle fuzz_npy_reader fuzz_moe_ops_oracle)

command -v clang >/dev/null 2>&1 || { echo "fuzz.sh: clang is not installed (libFuzzer ships with it)" >&2; exit 2; }
if ! command -v meson >/dev/null 2>&1 && [ -x "$root/.tools/bin/meson" ]; then
    export PYTHONPATH="$root/.tools/py${PYTHONPATH:+:$PYTHONPATH}" PATH="$root/.tools/bin:$PATH"
fi

dir=build-fuzz
if [ -f "$dir/build.ninja" ]; then
    meson setup --reconfigure "$dir" -Dfuzz=true -Dcuda=disabled -Doracle_tests=false >/dev/null
else
    CC=clang meson setup "$dir" -Dfuzz=true -Dcuda=disabled -Doracle_tests=false -Dbuildtype=debugoptimized
fi
targets=()
for h in "${harnesses[@]}"; do targets+=("tests/fuzz/$h"); done
ninja -C "$dir" -j "${FM_JOBS:-2}" "${targets[@]}"

mkdir -p "$dir/findings"
limit=(-max_total_time="$secs")
[ -n "${FM_FUZZ_RUNS:-}" ] && limit=(-runs="$FM_FUZZ_RUNS")
rc=0
for h in "${harnesses[@]}"; do
    work="$dir/corpus/$h"
    mkdir -p "$work"
    log="$dir/findings/$h.log"
    echo "== $h (${limit[*]})"
    # -jobs=1: one process on one core; the leak check stays on.
    if ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
        "$dir/tests/fuzz/$h" "${limit[@]}" -timeout=30 -rss_limit_mb=2048 -print_final_stats=1 \
        -artifact_prefix="$dir/findings/$h-" "$work" "tests/fuzz/corpus/$h" >"$log" 2>&1; then
        grep -E '^(Done|stat::number_of_executed_units)' "$log" | tr '\n' ' '; echo
    else
        echo "fuzz.sh: $h FAILED; log $log, reproducer $(ls "$dir/findings/$h-"* 2>/dev/null | grep -v '\.log$' | head -1)" >&2
        grep -E 'ORACLE|runtime error|ERROR: (AddressSanitizer|libFuzzer)|SUMMARY' "$log" | head -5 >&2
        rc=1
    fi
done
exit $rc
