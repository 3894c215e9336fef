#!/usr/bin/env bash
# The test command: builds flowmoe (CUDA compiled when nvcc is present, so a
# .cu compile error fails here too), runs the whole suite (GPU tests skip
# without a GPU), then the CPU suites again under AddressSanitizer +
# UndefinedBehaviorSanitizer, and the threaded ones under ThreadSanitizer.
# Installs meson and ninja when they are missing.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
jobs=${FM_JOBS:-$(nproc 2>/dev/null || echo 2)}

ensure_build_tools() {
    local need=()
    command -v meson >/dev/null 2>&1 || need+=(meson)
    command -v ninja >/dev/null 2>&1 || need+=(ninja)
    [ ${#need[@]} -eq 0 ] && return 0
    echo "test.sh: installing ${need[*]} into $root/.tools (pip)"
    python3 -m pip install --quiet --disable-pip-version-check --target "$root/.tools/py" "${need[@]}"
    mkdir -p "$root/.tools/bin"
    export PYTHONPATH="$root/.tools/py${PYTHONPATH:+:$PYTHONPATH}"
    for t in "${need[@]}"; do
        if [ -x "$root/.tools/py/bin/$t" ]; then
            ln -sf "$root/.tools/py/bin/$t" "$root/.tools/bin/$t"
        fi
    done
    export PATH="$root/.tools/bin:$PATH"
    command -v meson >/dev/null && command -v ninja >/dev/null || {
        echo "test.sh: could not install meson/ninja" >&2; exit 1; }
}

configure() { # dir, options...
    local dir=$1; shift
    if [ -f "$dir/build.ninja" ]; then
        meson setup --reconfigure "$dir" "$@" >/dev/null
    else
        meson setup "$dir" "$@"
    fi
}

ensure_build_tools
rc=0

echo "== build (CUDA auto) and full suite"
configure build-test
ninja -C build-test -j "$jobs"
meson test -C build-test --num-processes "$jobs" --print-errorlogs || rc=1

echo "== CPU suites under ASan + UBSan"
configure build-asan -Dcuda=disabled -Db_sanitize=address,undefined -Db_lundef=false -Dbuildtype=debugoptimized
ninja -C build-asan -j "$jobs"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    meson test -C build-asan --suite cpu --num-processes "$jobs" --timeout-multiplier 4 --print-errorlogs || rc=1

# The tests that run threads of their own (the in-process expert-parallel
# ranks, fm-train --ep, the worker pool at several thread counts) under
# ThreadSanitizer, where the compiler has it and its programs run here.
echo "== threaded CPU tests under ThreadSanitizer"
tsan_tests="test_ep_dispatch_combine_equals_single_rank test_ep_rejects_mismatched_ranks
    test_moe_layer_ep_equals_single_rank test_moe_layer_is_deterministic test_ops_are_deterministic fm_train_smoke"
probe=$(mktemp -d)
if printf 'int main(void) { return 0; }\n' >"$probe/p.c" && ${CC:-cc} -fsanitize=thread "$probe/p.c" -o "$probe/p" \
    >/dev/null 2>&1 && "$probe/p" >/dev/null 2>&1; then
    configure build-tsan -Dcuda=disabled -Doracle_tests=false -Db_sanitize=thread -Db_lundef=false \
        -Dbuildtype=debugoptimized
    ninja -C build-tsan -j "$jobs"
    # shellcheck disable=SC2086
    TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
        meson test -C build-tsan --num-processes "$jobs" --timeout-multiplier 6 --print-errorlogs $tsan_tests || rc=1
else
    echo "ThreadSanitizer SKIPPED: ${CC:-cc} cannot build or run a -fsanitize=thread program here"
    rm -f build-tsan/meson-logs/testlog.json
fi
rm -rf "$probe"

python3 - build-test/meson-logs/testlog.json build-asan/meson-logs/testlog.json build-tsan/meson-logs/testlog.json <<'PY'
import json, sys
p = f = s = 0
for path in sys.argv[1:]:
    try:
        lines = open(path).read().splitlines()
    except OSError:
        continue
    for line in lines:
        r = json.loads(line).get("result", "")
        if r in ("OK", "EXPECTEDFAIL"): p += 1
        elif r == "SKIP": s += 1
        else: f += 1
print(f"{p} passed, {f} failed, {s} skipped")
PY
exit $rc
