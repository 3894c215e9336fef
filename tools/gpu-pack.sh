#!/usr/bin/env bash
# Builds GPU programs on this machine (nvcc compiles here; nothing runs
# them) and packs them for tools/gpu-carried.sh on the device, so that a
# device call spends its time on tests instead of a 150 s rebuild:
#   tools/gpu-pack.sh [PROGRAM ...]   (default: every GPU test and fm-train)
# PROGRAM is a path under build-test (tests/gpu/NAME, tools/fm-bench, ...).
# Writes build-carry/bins.tar.xz (stripped binaries under bin/; xz finds the
# library they share, about 5 MB for all); then run with carry ["build-carry"]:
#   OUT=$OUT tools/gpu-carried.sh test_cuda_layer_matches_cpu memcheck:...
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v meson >/dev/null 2>&1 && [ -x .tools/bin/meson ]; then
    export PYTHONPATH=$PWD/.tools/py${PYTHONPATH:+:$PYTHONPATH} PATH=$PWD/.tools/bin:$PATH
fi
command -v nvcc >/dev/null 2>&1 || export PATH=/usr/local/cuda/bin:$PATH
[ -f build-test/build.ninja ] || meson setup build-test
progs=("$@")
if [ ${#progs[@]} -eq 0 ]; then
    for f in tests/gpu/*.c tests/gpu/*.cu; do progs+=("tests/gpu/$(basename "${f%.*}")"); done
    progs+=(tools/fm-train)
fi
ninja -C build-test -j "${FM_JOBS:-2}" "${progs[@]}"
rm -rf build-carry/bin && mkdir -p build-carry/bin
for p in "${progs[@]}"; do strip -o "build-carry/bin/$(basename "$p")" "build-test/$p"; done
tar -C build-carry -cf - bin | xz -9 -T"${FM_JOBS:-2}" >build-carry/bins.tar.xz
rm -rf build-carry/bin
ls -l build-carry/bins.tar.xz
