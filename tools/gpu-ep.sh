#!/usr/bin/env bash
# Expert parallelism on a machine with 2 or more GPUs: builds with NCCL (the
# CUDA image carries it in PyTorch's nvidia-nccl wheel, without the
# unversioned libnccl.so meson looks for: a prefix of links supplies it),
# runs the GPU suite's EP test and the EP rows of fm-bench. Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-ep-out}
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0
B=${B:-build-gpu}
s=$OUT/summary.txt
: >"$s"
t() { local lim=$1 log=$2; shift 2; local t0=$SECONDS; timeout --kill-after=5 "$lim" "$@" >>"$OUT/$log" 2>&1; local rc=$?; echo "$* -> rc=$rc ($((SECONDS - t0)) s)" >>"$s"; return $rc; }
root=
if ! ls /usr/local/cuda/lib64/libnccl.so >/dev/null 2>&1; then
    pkg=$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__) if nvidia.nccl.__file__ else list(nvidia.nccl.__path__)[0])' 2>/dev/null)
    if [ -n "$pkg" ] && [ -f "$pkg/lib/libnccl.so.2" ]; then
        root=/tmp/fm-nccl-root
        mkdir -p $root/lib
        ln -sfn "$pkg/include" $root/include
        ln -sf "$pkg/lib/libnccl.so.2" $root/lib/libnccl.so
        ln -sf "$pkg/lib/libnccl.so.2" $root/lib/libnccl.so.2
        export LD_LIBRARY_PATH=$root/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    fi
fi
nvidia-smi --query-gpu=name --format=csv,noheader >>"$s"
[ -f $B/build.ninja ] || t 120 build.log meson setup $B -Dcuda=enabled -Dnccl=enabled -Doracle_tests=false ${root:+-Dnccl_root=$root}
grep -E "NCCL" "$OUT/build.log" | tail -1 >>"$s"
t 400 build.log ninja -C $B -j "$(nproc)" || { tail -40 "$OUT/build.log"; exit 1; }
grep -c "warning" "$OUT/build.log" | sed 's/^/build warnings: /' >>"$s"
t 300 ep.log $B/tests/gpu/test_cuda_ep_nccl_equals_inproc
tail -3 "$OUT/ep.log" >>"$s"
t 300 bench-ep.log $B/tools/fm-bench --ep-only
grep -E "^\||x faster|copy" "$OUT/bench-ep.log" >>"$s"
cat "$s"
