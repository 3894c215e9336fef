/* CUDA dequantize: value = code * scale_inv in F32, then F32 / BF16 / F16
 * (RNE, canonical NaN), bit-exact with backends/cpu/dequantize.c.
 *
 * Same layout in and out, with rows that split into whole 16-byte code
 * groups: a streaming kernel in which each warp-wide store writes 512
 * contiguous bytes (dequant_stream_kernel). Everything else (a layout change, odd shapes, unaligned buffers):
 * 64 x 64 tiles through shared memory, transposed on the way when the
 * layouts differ. */
#include <stdint.h>
#include <string.h>

#include "cuda.h"
#include "kernels.cuh"

typedef struct dqparams {
    const uint8_t *in;
    const void *scale;
    void *out;
    int mode, layout, e8;
    int64_t E, R, C;       /* stored input matrix */
    int64_t per;           /* scale entries per expert */
    int64_t ngroups;       /* streaming: units (one 16-byte output store each) in all */
    fm_fastdiv gpr;        /* streaming: units per stored row */
    fm_fastdiv rdiv;       /* streaming: R */
    int64_t ntr, ntc, ntiles;
    fm_fastdiv ntrd, ntcd; /* tile kernel: ntr, ntc for fm_tile_place (ntiles < 2^31) */
    int vec_in, vec_out;
} dqparams;

static __device__ __forceinline__ float load_scale(const dqparams &p, int64_t e, int64_t r, int64_t c)
{
    int64_t off = e * p.per + fm_scale_offset((fm_scale_mode)p.mode, (fm_scale_layout)p.layout, p.R, p.C, r, c);
    if (p.e8)
        return fm_e8m0_to_f32(((const uint8_t *)p.scale)[off]);
    return ((const float *)p.scale)[off];
}

/* Four codes (one 32-bit word; E2M1: 8 nibbles, two words' worth) to F32. */
template <int ELEM>
static __device__ __forceinline__ void decode4(uint32_t wd, float *x)
{
    if (ELEM == FM_DTYPE_E4M3) {
        fm_hw_e4m3x2_to_f32(wd & 0xFFFFu, &x[0], &x[1]);
        fm_hw_e4m3x2_to_f32(wd >> 16, &x[2], &x[3]);
    } else {
        fm_hw_e5m2x2_to_f32(wd & 0xFFFFu, &x[0], &x[1]);
        fm_hw_e5m2x2_to_f32(wd >> 16, &x[2], &x[3]);
    }
}

static __device__ __forceinline__ float canon(float y) { return y != y ? __uint_as_float(FM_F32_CANON_NAN) : y; }

/* n (even) values to the output dtype, as 32-bit words. */
template <int OUT>
static __device__ __forceinline__ void pack_out(const float *y, uint32_t *o, int n)
{
#pragma unroll
    for (int i = 0; i < n; i += 2) {
        if (OUT == FM_DTYPE_F32) {
            o[i] = __float_as_uint(canon(y[i]));
            o[i + 1] = __float_as_uint(canon(y[i + 1]));
        } else if (OUT == FM_DTYPE_BF16) {
            o[i / 2] = fm_hw_bf16x2(y[i], y[i + 1]);
        } else {
            o[i / 2] = fm_hw_f16x2(y[i], y[i + 1]);
        }
    }
}

/* Four E2M1 codes (the low 16 bits of w) -> four exact BF16 values, as two
 * BF16 pairs: the magnitude's low and high BF16 bytes come from two 8-entry
 * byte tables (PRMT), the sign bit is moved into place. */
static __device__ __forceinline__ void e2m1x4_to_bf16(uint32_t w, uint32_t *o0, uint32_t *o1)
{
    const uint32_t sel = w & 0x7777u;
    const uint32_t lo = __byte_perm(0xC0800000u, 0xC0804000u, sel); /* 0, .5, 1, 1.5 | 2, 3, 4, 6 */
    const uint32_t hi = __byte_perm(0x3F3F3F00u, 0x40404040u, sel);
    *o0 = __byte_perm(lo, hi, 0x5140) | ((w << 12) & 0x8000u) | ((w << 24) & 0x80000000u);
    *o1 = __byte_perm(lo, hi, 0x7362) | ((w << 4) & 0x8000u) | ((w << 16) & 0x80000000u);
}

static __device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b)
{
    uint32_t d;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

/* Streaming: the unit of work is the codes of one 16-byte output store (8
 * elements for BF16 / F16, 4 for F32), and lane l of a warp takes units
 * base + 32 i + l, so every warp-wide store writes 512 contiguous bytes and
 * every load reads a contiguous 64-256 bytes. A unit never straddles a scale
 * block (blocks are 32, 128 or whole rows long and start at multiples of 32).
 * UNR units per lane are loaded before any is decoded, to keep enough loads
 * in flight. */
template <int ELEM, int OUT>
__global__ void __launch_bounds__(256) dequant_stream_kernel(const dqparams p)
{
    constexpr int OB = OUT == FM_DTYPE_F32 ? 4 : 2;
    constexpr int EPU = 16 / OB;                               /* elements per unit */
    constexpr int U = ELEM == FM_DTYPE_E2M1 ? EPU / 2 : EPU;   /* code bytes per unit: 2, 4 or 8 */
    constexpr int UNR = 4;
    const int lane = threadIdx.x & 31;
    const int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5;
    const int64_t nwarps = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t base = warp * 32 * UNR; base < p.ngroups; base += nwarps * 32 * UNR) {
        uint2 raw[UNR];
#pragma unroll
        for (int i = 0; i < UNR; i++) {
            const int64_t g = base + i * 32 + lane;
            raw[i] = make_uint2(0, 0);
            if (g < p.ngroups) {
                if (U == 8)
                    raw[i] = __ldcs((const uint2 *)(p.in + g * 8));
                else if (U == 4)
                    raw[i].x = __ldcs((const unsigned int *)(p.in + g * 4));
                else
                    raw[i].x = __ldcs((const unsigned short *)(p.in + g * 2));
            }
        }
#pragma unroll
        for (int i = 0; i < UNR; i++) {
            const int64_t g = base + i * 32 + lane;
            if (g >= p.ngroups)
                break;
            const uint32_t row = fm_fastdiv_div(p.gpr, (uint32_t)g); /* e * R + r */
            const uint32_t e = fm_fastdiv_div(p.rdiv, row);
            const int64_t r = row - (int64_t)e * p.R, c = ((int64_t)g - (int64_t)row * p.gpr.d) * EPU;
            const float s = load_scale(p, e, r, c);
            /* E2M1 -> BF16 with a power-of-two scale of moderate size: the
             * product of a 2-bit-significand value and the scale is exact in
             * BF16, so one BF16 multiply gives the bits the F32 path rounds
             * to. Tiny or huge scales (subnormal or overflowing products) and
             * NaN take the F32 path. */
            if (ELEM == FM_DTYPE_E2M1 && OUT == FM_DTYPE_BF16 && s >= 0x1p-100f && s <= 0x1p100f) {
                const uint32_t s2 = (__float_as_uint(s) >> 16) * 0x10001u;
                uint32_t o[4];
                e2m1x4_to_bf16(raw[i].x, &o[0], &o[1]);
                e2m1x4_to_bf16(raw[i].x >> 16, &o[2], &o[3]);
                __stcs((uint4 *)((uint8_t *)p.out + g * 16),
                       make_uint4(bf16x2_mul(o[0], s2), bf16x2_mul(o[1], s2), bf16x2_mul(o[2], s2),
                                  bf16x2_mul(o[3], s2)));
                continue;
            }
            float y[EPU];
            if (ELEM == FM_DTYPE_E2M1) {
#pragma unroll
                for (int k = 0; k < EPU; k++)
                    y[k] = fm_fast_e2m1_to_f32((raw[i].x >> (4 * k)) & 0xFu) * s;
            } else {
                decode4<ELEM>(raw[i].x, &y[0]);
                if (EPU == 8)
                    decode4<ELEM>(raw[i].y, &y[4]);
#pragma unroll
                for (int k = 0; k < EPU; k++)
                    y[k] *= s;
            }
            uint32_t o[4];
            pack_out<OUT>(y, o, EPU);
            __stcs((uint4 *)((uint8_t *)p.out + g * 16), make_uint4(o[0], o[1], o[2], o[3]));
        }
    }
}

#define DT 64

template <int ELEM, int OUT, int TR>
__global__ void __launch_bounds__(256) dequant_tile_kernel(const dqparams p)
{
    __shared__ float tile[DT][DT + 1];
    const int tid = threadIdx.x;
    for (int64_t t = blockIdx.x; t < p.ntiles; t += gridDim.x) {
        uint32_t eu, tru, tcu;
        fm_tile_place(p.ntcd, p.ntrd, (uint32_t)t, &eu, &tru, &tcu);
        const int64_t e = eu, r0 = (int64_t)tru * DT, c0 = (int64_t)tcu * DT;
        const bool full = r0 + DT <= p.R && c0 + DT <= p.C;

        /* Load: 16 codes of one stored row per thread. */
        {
            const int i = tid >> 2, q = tid & 3;
            const int64_t r = r0 + i, cs = c0 + q * 16;
            if (r < p.R && cs < p.C) {
                const float s = load_scale(p, e, r, cs);
                float y[16];
                if (ELEM == FM_DTYPE_E2M1) {
                    const uint8_t *row = p.in + (e * p.R + r) * (p.C / 2);
                    uint32_t wd[2];
                    if (full && p.vec_in) {
                        uint2 v = *(const uint2 *)(row + cs / 2);
                        wd[0] = v.x;
                        wd[1] = v.y;
                    } else {
                        wd[0] = wd[1] = 0;
                        for (int b = 0; b < 8; b++)
                            if (cs + 2 * b < p.C)
                                wd[b >> 2] |= (uint32_t)row[cs / 2 + b] << (8 * (b & 3));
                    }
#pragma unroll
                    for (int k = 0; k < 16; k++)
                        y[k] = fm_fast_e2m1_to_f32((wd[k >> 3] >> (4 * (k & 7))) & 0xFu) * s;
                } else {
                    const uint8_t *row = p.in + (e * p.R + r) * p.C;
                    uint32_t wd[4];
                    if (full && p.vec_in) {
                        uint4 v = *(const uint4 *)(row + cs);
                        wd[0] = v.x;
                        wd[1] = v.y;
                        wd[2] = v.z;
                        wd[3] = v.w;
                    } else {
                        wd[0] = wd[1] = wd[2] = wd[3] = 0;
                        for (int b = 0; b < 16; b++)
                            if (cs + b < p.C)
                                wd[b >> 2] |= (uint32_t)row[cs + b] << (8 * (b & 3));
                    }
#pragma unroll
                    for (int k4 = 0; k4 < 4; k4++) {
                        decode4<ELEM>(wd[k4], &y[4 * k4]);
#pragma unroll
                        for (int k = 0; k < 4; k++)
                            y[4 * k4 + k] *= s;
                    }
                }
#pragma unroll
                for (int k = 0; k < 16; k++) {
                    if (TR)
                        tile[q * 16 + k][i] = y[k];
                    else
                        tile[i][q * 16 + k] = y[k];
                }
            }
        }
        __syncthreads();

        /* Store: 8 consecutive elements of one output stored row per thread. */
        {
            const int64_t OR = TR ? p.C : p.R, OC = TR ? p.R : p.C; /* stored output matrix */
            const int64_t or0 = TR ? c0 : r0, oc0 = TR ? r0 : c0;
#pragma unroll
            for (int pass = 0; pass < 2; pass++) {
                const int idx = tid + pass * 256, i = idx >> 3, q = idx & 7;
                const int64_t orr = or0 + i, occ = oc0 + q * 8;
                if (orr >= OR || occ >= OC)
                    continue;
                float y[8];
#pragma unroll
                for (int k = 0; k < 8; k++)
                    y[k] = tile[i][q * 8 + k];
                uint32_t o[8];
                pack_out<OUT>(y, o, 8);
                const int64_t base = (e * OR + orr) * OC + occ;
                if (full && p.vec_out) {
                    uint4 *dst = (uint4 *)((uint8_t *)p.out + base * (OUT == FM_DTYPE_F32 ? 4 : 2));
                    dst[0] = make_uint4(o[0], o[1], o[2], o[3]);
                    if (OUT == FM_DTYPE_F32)
                        dst[1] = make_uint4(o[4], o[5], o[6], o[7]);
                } else {
                    for (int k = 0; k < 8; k++) {
                        if (occ + k >= OC)
                            break;
                        if (OUT == FM_DTYPE_F32)
                            ((uint32_t *)p.out)[base + k] = o[k];
                        else
                            ((uint16_t *)p.out)[base + k] = (uint16_t)(o[k >> 1] >> (16 * (k & 1)));
                    }
                }
            }
        }
        __syncthreads();
    }
}

template <int ELEM, int OUT>
static void launch(const dqparams &p, int stream_path, int tr, cudaStream_t s)
{
    if (stream_path) {
        int64_t blocks = fm_cdiv(p.ngroups, 256 * 4);
        dequant_stream_kernel<ELEM, OUT><<<(unsigned)(blocks < (1 << 30) ? blocks : (1 << 30)), 256, 0, s>>>(p);
        return;
    }
    unsigned g = (unsigned)(p.ntiles < (1 << 30) ? p.ntiles : (1 << 30));
    if (tr)
        dequant_tile_kernel<ELEM, OUT, 1><<<g, 256, 0, s>>>(p);
    else
        dequant_tile_kernel<ELEM, OUT, 0><<<g, 256, 0, s>>>(p);
}

template <int ELEM>
static void launch_out(const dqparams &p, int out, int stream_path, int tr, cudaStream_t s)
{
    if (out == FM_DTYPE_F32)
        launch<ELEM, FM_DTYPE_F32>(p, stream_path, tr, s);
    else if (out == FM_DTYPE_BF16)
        launch<ELEM, FM_DTYPE_BF16>(p, stream_path, tr, s);
    else
        launch<ELEM, FM_DTYPE_F16>(p, stream_path, tr, s);
}

extern "C" fm_status fm_cuda_dequantize(fm_context *ctx, const fm_tensor *in, fm_tensor *out)
{
    fm_cuda_device_guard guard;
    fm_status st = fm_cuda_enter(ctx, &guard, "fm_dequantize");
    if (st)
        return st;
    cudaStream_t s = fm_cuda_stream(ctx);
    dqparams p;
    memset(&p, 0, sizeof p);
    p.in = (const uint8_t *)in->data;
    p.scale = in->scale;
    p.out = out->data;
    p.mode = in->scale_mode;
    p.layout = in->scale_layout;
    p.e8 = in->scale_dtype == FM_DTYPE_E8M0;
    p.E = fm_tensor_experts(in);
    p.R = fm_tensor_stored_rows(in);
    p.C = fm_tensor_stored_cols(in);
    p.per = fm_scale_count_2d(in->scale_mode, in->scale_layout, p.R, p.C);
    const int64_t numel = p.E * p.R * p.C;
    if (numel == 0)
        return fm_cuda_leave(ctx, &guard, cudaSuccess, NULL);
    const int tr = in->layout != out->layout;
    const int fp4 = in->dtype == FM_DTYPE_E2M1;
    const int G = fp4 ? 32 : 16;
    const int ob = out->dtype == FM_DTYPE_F32 ? 4 : 2;
    const int64_t OC = tr ? p.R : p.C;

    int stream_path = !tr && p.C % G == 0 && (uintptr_t)in->data % 16 == 0 && (uintptr_t)out->data % 16 == 0;
    if (stream_path) {
        const int epu = 16 / ob; /* elements per 16-byte output store */
        p.ngroups = numel / epu;
        /* The fast divisions are 32-bit. */
        if (p.ngroups >= ((int64_t)1 << 31) || p.C / epu >= ((int64_t)1 << 31) || p.E * p.R >= ((int64_t)1 << 31))
            stream_path = 0;
        else {
            p.gpr = fm_fastdiv_make((uint32_t)(p.C / epu));
            p.rdiv = fm_fastdiv_make((uint32_t)p.R);
        }
    }
    p.ntr = fm_cdiv(p.R, DT);
    p.ntc = fm_cdiv(p.C, DT);
    p.ntiles = p.E * p.ntr * p.ntc;
    if (!stream_path) {
        if (p.ntiles >= ((int64_t)1 << 31)) {
            fm_cuda_leave(ctx, &guard, cudaSuccess, NULL);
            return fm_error(ctx, FM_ERR_UNSUPPORTED,
                            "fm_dequantize: %lld tiles of 64 x 64 exceed the kernel's 31-bit tile index",
                            (long long)p.ntiles);
        }
        p.ntrd = fm_fastdiv_make((uint32_t)p.ntr);
        p.ntcd = fm_fastdiv_make((uint32_t)p.ntc);
    }
    p.vec_in = (fp4 ? p.C % 16 == 0 && (uintptr_t)in->data % 8 == 0 : p.C % 16 == 0 && (uintptr_t)in->data % 16 == 0);
    p.vec_out = OC % 8 == 0 && (uintptr_t)out->data % 16 == 0;

    if (in->dtype == FM_DTYPE_E4M3)
        launch_out<FM_DTYPE_E4M3>(p, out->dtype, stream_path, tr, s);
    else if (in->dtype == FM_DTYPE_E5M2)
        launch_out<FM_DTYPE_E5M2>(p, out->dtype, stream_path, tr, s);
    else
        launch_out<FM_DTYPE_E2M1>(p, out->dtype, stream_path, tr, s);
    return fm_cuda_leave(ctx, &guard, cudaGetLastError(), "fm_dequantize: kernel launch");
}
