# Sourced by the tools/gpu-*.sh scripts, from the repository root, with the
# default name of their log folder as $1. Sets $OUT (created), the CUDA
# compiler on PATH, the build folder $B and the summary file $s (emptied),
# and defines
#   t LIMIT LOG CMD...  CMD under a time limit, its output appended to
#                       $OUT/LOG, a line with its status and seconds to $s;
#   gpu_build [MESON OPTIONS...]  configure $B once (CUDA, no PyPI oracle
#                       tests, plus the options), build it, count warnings.
OUT=${OUT:-$PWD/$1}
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH
B=${B:-build-gpu}
s=$OUT/summary.txt
: >"$s"
t() { local lim=$1 log=$2; shift 2; local t0=$SECONDS; timeout --kill-after=5 "$lim" "$@" >>"$OUT/$log" 2>&1; local rc=$?; echo "$* -> rc=$rc ($((SECONDS - t0)) s)" >>"$s"; return $rc; }
gpu_build() {
    [ -f "$B/build.ninja" ] || t 120 build.log meson setup "$B" -Dcuda=enabled -Doracle_tests=false "$@"
    t 400 build.log ninja -C "$B" -j "$(nproc)" || { tail -40 "$OUT/build.log"; exit 1; }
    grep -c "warning" "$OUT/build.log" | sed 's/^/build warnings: /' >>"$s"
}
