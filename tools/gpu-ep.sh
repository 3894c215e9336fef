#!/usr/bin/env bash
# Expert parallelism on a machine with 2 or more GPUs: builds with NCCL (the
# CUDA image carries it in PyTorch's nvidia-nccl wheel, without the
# unversioned libnccl.so meson looks for: a prefix of links supplies it),
# runs the GPU suite's EP test and the EP rows of fm-bench. Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0
. tools/gpu-common.sh gpu-ep-out
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
gpu_build -Dnccl=enabled ${root:+-Dnccl_root=$root}
grep -E "NCCL *:" "$OUT/build.log" | tail -1 >>"$s"
t 300 ep.log $B/tests/gpu/test_cuda_ep_nccl_equals_inproc
tail -3 "$OUT/ep.log" >>"$s"
t 300 bench-ep.log $B/tools/fm-bench --ep-only
grep -E "^\||x faster|copy" "$OUT/bench-ep.log" >>"$s"
cat "$s"
