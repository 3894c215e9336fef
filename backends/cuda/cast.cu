/* CUDA fm_cast, bit-exact with backends/cpu/cast.c: through F32 with the
 * format.h codecs. F32 -> BF16 / F16 in one layout (the bf16 and
 * fp8-blockwise layers' x and dy every step) streams 16-byte loads and
 * 8-byte stores through the hardware conversion; other same-layout casts
 * take a flat grid-stride loop; different layouts recompute the stored
 * index per element (the layer asks for them only at a weight refresh). */
#include <stdint.h>

#include "cuda.h"
#include "kernels.cuh"

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

/* Units of 4 elements (one 16-byte load, one 8-byte store); lane l of a
 * warp takes units base + 32 i + l, so every warp-wide access is
 * contiguous, and UNR units a lane are loaded before any is converted, to
 * keep loads in flight. cvt.rn with NaN made canonical (kernels.cuh) equals
 * format.h's fm_bf16_from_f32 / fm_f16_from_f32 on every input
 * (tests/gpu/test_cuda_hw_fp8_cvt_equals_codec.cu). The n % 4 elements past
 * the last unit go through the codec. */
template <int DOUT>
static __global__ void __launch_bounds__(256) cast_f32_narrow_kernel(const float *in, uint16_t *out, int64_t n)
{
    constexpr int UNR = 4;
    const int64_t nunits = n / 4;
    const int lane = threadIdx.x & 31;
    const int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5;
    const int64_t nwarps = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t base = warp * 32 * UNR; base < nunits; base += nwarps * 32 * UNR) {
        float4 v[UNR];
#pragma unroll
        for (int i = 0; i < UNR; i++) {
            const int64_t u = base + 32 * i + lane;
            if (u < nunits)
                v[i] = __ldcs((const float4 *)in + u);
        }
#pragma unroll
        for (int i = 0; i < UNR; i++) {
            const int64_t u = base + 32 * i + lane;
            if (u >= nunits)
                break;
            const uint2 o = DOUT == FM_DTYPE_BF16
                                ? make_uint2(fm_hw_bf16x2(v[i].x, v[i].y), fm_hw_bf16x2(v[i].z, v[i].w))
                                : make_uint2(fm_hw_f16x2(v[i].x, v[i].y), fm_hw_f16x2(v[i].z, v[i].w));
            __stcs((uint2 *)out + u, o);
        }
    }
    const int64_t i = 4 * nunits + blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n)
        out[i] = DOUT == FM_DTYPE_BF16 ? fm_bf16_from_f32(in[i]) : fm_f16_from_f32(in[i]);
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
    if (p.lin == p.lout && p.din == FM_DTYPE_F32 && (p.dout == FM_DTYPE_BF16 || p.dout == FM_DTYPE_F16) &&
        (uintptr_t)p.in % 16 == 0 && (uintptr_t)p.out % 8 == 0) {
        /* one pass of 4 units a thread, at most 8 CTAs an SM (then grid-stride) */
        const int64_t nb = (p.n / 4 + 256 * 4 - 1) / (256 * 4);
        const unsigned g = (unsigned)(nb < 1 ? 1 : nb < cap ? nb : cap);
        if (p.dout == FM_DTYPE_BF16)
            cast_f32_narrow_kernel<FM_DTYPE_BF16>
                <<<g, 256, 0, fm_cuda_stream(ctx)>>>((const float *)p.in, (uint16_t *)p.out, p.n);
        else
            cast_f32_narrow_kernel<FM_DTYPE_F16>
                <<<g, 256, 0, fm_cuda_stream(ctx)>>>((const float *)p.in, (uint16_t *)p.out, p.n);
    } else {
        cast_kernel<<<(unsigned)(blocks < cap ? blocks : cap), 256, 0, fm_cuda_stream(ctx)>>>(p);
    }
    return fm_cuda_leave(ctx, &g, cudaGetLastError(), "fm_cast: cast_kernel");
}
