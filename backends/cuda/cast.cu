/* CUDA fm_cast, bit-exact with backends/cpu/cast.c: through F32 with the
 * format.h codecs. Same layouts: a flat grid-stride loop; different layouts:
 * the stored index is recomputed per element (the layer never asks for it on
 * a hot path). */
#include <stdint.h>

#include "cuda.h"

typedef struct castparams {
    const void *in;
    void *out;
    int din, dout, lin, lout;
    int64_t R, C, n; /* per-matrix logical shape, total elements */
} castparams;

static __device__ __forceinline__ float load(const void *p, int t, int64_t i)
{
    if (t == FM_DTYPE_BF16)
        return fm_bf16_to_f32(((const uint16_t *)p)[i]);
    if (t == FM_DTYPE_F16)
        return fm_f16_to_f32(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}

static __device__ __forceinline__ void store(void *p, int t, int64_t i, float v)
{
    if (t == FM_DTYPE_BF16)
        ((uint16_t *)p)[i] = fm_bf16_from_f32(v);
    else if (t == FM_DTYPE_F16)
        ((uint16_t *)p)[i] = fm_f16_from_f32(v);
    else
        ((float *)p)[i] = fm_f32_canon(v);
}

static __device__ __forceinline__ int64_t stored(int lay, int64_t R, int64_t C, int64_t i)
{
    /* i enumerates the logical elements row-major, expert by expert. */
    int64_t RC = R * C, e = i / RC, rc = i - e * RC, r = rc / C, c = rc - r * C;
    return e * RC + (lay == FM_LAYOUT_ROWWISE ? r * C + c : c * R + r);
}

static __global__ void cast_kernel(castparams p)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < p.n; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t si = p.lin == p.lout ? i : stored(p.lin, p.R, p.C, i);
        int64_t so = p.lin == p.lout ? i : stored(p.lout, p.R, p.C, i);
        store(p.out, p.dout, so, load(p.in, p.din, si));
    }
}

extern "C" fm_status fm_cuda_cast(fm_context *ctx, const fm_tensor *in, fm_tensor *out)
{
    int r = in->ndim == 3 ? 1 : 0;
    castparams p = {in->data, out->data, (int)in->dtype, (int)out->dtype, (int)in->layout, (int)out->layout,
                    in->shape[r], in->shape[r + 1], fm_tensor_numel(in)};
    if (p.n == 0)
        return FM_OK;
    fm_cuda_device_guard g;
    fm_status st = fm_cuda_enter(ctx, &g, "fm_cast");
    if (st)
        return st;
    int64_t blocks = (p.n + 255) / 256;
    int cap = fm_cuda(ctx)->prop.multiProcessorCount * 8;
    cast_kernel<<<(unsigned)(blocks < cap ? blocks : cap), 256, 0, fm_cuda_stream(ctx)>>>(p);
    return fm_cuda_leave(ctx, &g, cudaGetLastError(), "fm_cast: cast_kernel");
}
