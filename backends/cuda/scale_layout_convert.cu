/* CUDA scale layout conversion (compact <-> GEMM-ready), bit-exact with
 * backends/cpu/scale_layout_convert.c: one thread per destination entry,
 * which finds its block through the inverse of fm_scale_offset and copies
 * the source entry, or writes 1.0 (E8M0 127) where the entry is padding. */
#include <stdint.h>

#include "cuda.h"
#include "kernels.cuh"

typedef struct slparams {
    const void *src;
    void *dst;
    int mode, src_layout, dst_layout;
    int64_t R, C, sper, dper, n;
} slparams;

template <typename T>
__global__ void __launch_bounds__(256) scale_layout_kernel(const slparams p, T one)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < p.n; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t e = i / p.dper, k = i % p.dper;
        int64_t r, c;
        T v = one;
        if (fm_scale_entry((fm_scale_mode)p.mode, (fm_scale_layout)p.dst_layout, p.R, p.C, k, &r, &c))
            v = ((const T *)p.src)[e * p.sper +
                                   fm_scale_offset((fm_scale_mode)p.mode, (fm_scale_layout)p.src_layout, p.R, p.C, r, c)];
        ((T *)p.dst)[i] = v;
    }
}

extern "C" fm_status fm_cuda_scale_layout_convert(fm_context *ctx, const fm_tensor *src, fm_tensor *dst)
{
    fm_cuda_device_guard guard;
    fm_status st = fm_cuda_enter(ctx, &guard, "fm_scale_layout_convert");
    if (st)
        return st;
    slparams p;
    p.src = src->scale;
    p.dst = dst->scale;
    p.mode = src->scale_mode;
    p.src_layout = src->scale_layout;
    p.dst_layout = dst->scale_layout;
    p.R = fm_tensor_stored_rows(src);
    p.C = fm_tensor_stored_cols(src);
    p.sper = fm_scale_count_2d(src->scale_mode, src->scale_layout, p.R, p.C);
    p.dper = fm_scale_count_2d(src->scale_mode, dst->scale_layout, p.R, p.C);
    p.n = fm_tensor_experts(src) * p.dper;
    if (p.n == 0)
        return fm_cuda_leave(ctx, &guard, cudaSuccess, NULL);
    int64_t blocks = fm_cdiv(p.n, 256);
    unsigned g = (unsigned)(blocks < 65536 ? blocks : 65536);
    if (src->scale_dtype == FM_DTYPE_E8M0)
        scale_layout_kernel<uint8_t><<<g, 256, 0, fm_cuda_stream(ctx)>>>(p, (uint8_t)127);
    else
        scale_layout_kernel<float><<<g, 256, 0, fm_cuda_stream(ctx)>>>(p, 1.0f);
    return fm_cuda_leave(ctx, &guard, cudaGetLastError(), "fm_scale_layout_convert: kernel launch");
}
