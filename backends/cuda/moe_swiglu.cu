/* CUDA weighted SwiGLU and dSwiGLU, bit-exact with backends/cpu/moe_swiglu.c.
 *
 * Hot cases (what the FP8 recipes run) take one fused kernel: row-wise
 * BF16 [M, 2I], or E4M3 1x128 / E2M1 MX32 codes with compact scales, I a
 * multiple of 128, into FP8 BLOCK_1x128 outputs with compact, power-of-two
 * scales (the recipes' rule, compiled in: the encode has no run-time rule
 * branch), no column-wise copy and no cfg->amax / nonfinite_blocks. A warp
 * takes 256 output columns of one row, 8 per lane: 16 lanes make one
 * 128-column block, whose amax reduces by 4 shuffles. The activation is
 * mathfn.h's (the same F32 operations in the same order as the CPU), and each
 * block is scaled and encoded with the tile quantizer's helpers
 * (fm_pick_scale, fm_encode8, fm_nan_word), so the bytes are what
 * fm_quantize gives for the F32 tensor. The forward writes in_saved (E4M3
 * 1x128 or E2M1 MX32) from the same registers. The sigmoids of a lane's 8
 * gates come from fm_sigmoid_pm8 and the scales from fm_pick_scale_pow2
 * (fm_sigmoid_pm's and fm_pick_scale's bits, fewer instructions in the
 * common case). The backward's dprobs takes fm_dot_order_runs_f32's order:
 * a warp then owns a whole row and walks its chunks in increasing order,
 * and lane l's 8 adjacent columns of each are the run its partial sum p_l
 * accumulates.
 *
 * Every other case: the activation into `row` directly (unscaled), or into
 * an F32 buffer that fm_cuda_quantize quantizes; dprobs by one warp per row. */
#include <string.h>

#include "cuda.h"
#include "moe_common.cuh"

/* ---- fused kernels --------------------------------------------------------- */

#define SW_THREADS 256
#define SW_WARPS (SW_THREADS / 32)
#define SW_CHUNK 256 /* columns of one row a warp handles at a time */

typedef struct swparams {
    const void *in;         /* [M, 2I]: BF16, E4M3 1x128 or E2M1 MX32 codes */
    const void *in_scale;
    const uint16_t *dh;     /* backward: BF16 [M, I] */
    const float *probs;     /* [M] or NULL */
    uint8_t *out;           /* forward h [M, I], backward din [M, 2I]: FP8 codes */
    void *out_scale;
    uint8_t *sv;            /* forward in_saved [M, 2I] or NULL */
    void *sv_scale;
    float *dprobs;          /* backward, [M] or NULL */
    int64_t I;
    uint32_t nch;           /* SW_CHUNK-column chunks per row */
    fm_fastdiv chdiv;       /* by nch */
    uint32_t units;         /* work items: (row, chunk) pairs, or rows when dprobs is written */
    float eps;
} swparams;

FM_DI void sw_bf16x8(uint4 w, float *x)
{
    const uint32_t q[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int k = 0; k < 4; k++) {
        x[2 * k] = __uint_as_float(q[k] << 16);
        x[2 * k + 1] = __uint_as_float(q[k] & 0xFFFF0000u);
    }
}

/* code x scale, as decode_row: the hardware conversion is exact for every
 * E4M3 value; a NaN code gives some NaN, and a NaN never reaches an output
 * with its payload (quantized blocks turn NaN as a whole, the dot product's
 * result is made canonical). */
FM_DI void sw_e4m3x8(uint2 w, float s, float *x)
{
#pragma unroll
    for (int k = 0; k < 4; k++) {
        float lo, hi;
        fm_hw_e4m3x2_to_f32(((k < 2 ? w.x : w.y) >> (16 * (k & 1))) & 0xFFFFu, &lo, &hi);
        x[2 * k] = lo * s;
        x[2 * k + 1] = hi * s;
    }
}

FM_DI void sw_e2m1x8(uint32_t w, float s, float *x)
{
#pragma unroll
    for (int k = 0; k < 8; k++)
        x[k] = fm_fast_e2m1_to_f32((w >> (4 * k)) & 0xFu) * s;
}

/* Bytes of n columns' codes, and of their compact scales (n a multiple of
 * the block width: 128 with F32 scales, 32 with E8M0 for E2M1): BF16 has
 * no scales. */
template <int T>
FM_DI int64_t sw_code_bytes(int64_t n)
{
    return T == FM_DTYPE_BF16 ? 2 * n : T == FM_DTYPE_E2M1 ? n / 2 : n;
}

template <int T>
FM_DI int64_t sw_scale_bytes(int64_t n)
{
    return T == FM_DTYPE_BF16 ? 0 : T == FM_DTYPE_E2M1 ? n / 32 : 4 * (n / 128);
}

/* Row m of `in` [M, 2I] (codes) and of its compact scales (NULL for BF16). */
template <int IN>
FM_DI const uint8_t *sw_in_row(const swparams &p, int64_t m)
{
    return (const uint8_t *)p.in + m * sw_code_bytes<IN>(2 * p.I);
}

template <int IN>
FM_DI const uint8_t *sw_in_srow(const swparams &p, int64_t m)
{
    return IN == FM_DTYPE_BF16 ? NULL : (const uint8_t *)p.in_scale + m * sw_scale_bytes<IN>(2 * p.I);
}

/* Gate and up codes of one row, columns [col, col + 8), as loaded (BF16:
 * two 16-byte words; E4M3: 8 bytes each, and their blocks' F32 scales;
 * E2M1: 4 bytes each and E8M0 scales), so that a warp can have several
 * units' loads in flight before it decodes the first. Offsets within a row
 * are 32-bit (fused_setup checks 2I < 2^31). */
typedef struct sw_raw {
    uint4 g, u;
    float sg, su;
} sw_raw;

template <int IN>
FM_DI void sw_fetch_gu(const uint8_t *row, const uint8_t *srow, int I, int col, sw_raw *r)
{
    if (IN == FM_DTYPE_BF16) {
        const uint16_t *q = (const uint16_t *)row;
        r->g = __ldcs((const uint4 *)(q + col));
        r->u = __ldcs((const uint4 *)(q + I + col));
    } else if (IN == FM_DTYPE_E4M3) {
        const float *sc = (const float *)srow;
        const uint2 g = __ldcs((const uint2 *)(row + col)), u = __ldcs((const uint2 *)(row + I + col));
        r->g = make_uint4(g.x, g.y, 0u, 0u);
        r->u = make_uint4(u.x, u.y, 0u, 0u);
        r->sg = sc[(unsigned)col >> 7];
        r->su = sc[(unsigned)(I + col) >> 7];
    } else { /* 2I nibbles */
        r->g.x = __ldcs((const unsigned int *)(row + ((unsigned)col >> 1)));
        r->u.x = __ldcs((const unsigned int *)(row + ((unsigned)(I + col) >> 1)));
        r->sg = fm_e8m0_to_f32(srow[(unsigned)col >> 5]);
        r->su = fm_e8m0_to_f32(srow[(unsigned)(I + col) >> 5]);
    }
}

/* The fetched codes as exact F32 values (the scale dtype follows the mode:
 * F32 for 1x128, E8M0 for MX32). */
template <int IN>
FM_DI void sw_decode_gu(const sw_raw &r, float *g, float *u)
{
    if (IN == FM_DTYPE_BF16) {
        sw_bf16x8(r.g, g);
        sw_bf16x8(r.u, u);
    } else if (IN == FM_DTYPE_E4M3) {
        sw_e4m3x8(make_uint2(r.g.x, r.g.y), r.sg, g);
        sw_e4m3x8(make_uint2(r.u.x, r.u.y), r.su, u);
    } else {
        sw_e2m1x8(r.g.x, r.sg, g);
        sw_e2m1x8(r.u.x, r.su, u);
    }
}

/* One row block of the values x held 8 per lane by GROUP consecutive lanes
 * (16: a 128-column FP8 block with an F32 scale, 4: a 32-column E2M1 MX32
 * block with an E8M0 scale): amax by shuffles (every lane of the warp must
 * call), the scale rule and encoding of the tile quantizer; lanes of a block
 * outside the matrix store nothing. */
template <int ELEM, int GROUP>
FM_DI void sw_put_block(const float *x, bool valid, float eps, uint8_t *codes, void *scale, int sidx)
{
    uint32_t a = 0;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const uint32_t b = __float_as_uint(x[k]) & 0x7FFFFFFFu;
        a = b > a ? b : a;
    }
#pragma unroll
    for (int s = 1; s < GROUP; s <<= 1) {
        const uint32_t b = __shfl_xor_sync(0xFFFFFFFFu, a, s);
        a = b > a ? b : a;
    }
    float s32;
    uint8_t s8;
    const float mult = fm_pick_scale_pow2<ELEM>(a, eps, &s32, &s8);
    if (!valid)
        return;
    float y[8];
#pragma unroll
    for (int k = 0; k < 8; k++)
        y[k] = x[k] * mult;
    uint2 c = fm_encode8<ELEM>(y);
    if (mult != mult)
        c.x = c.y = fm_nan_word<ELEM>();
    if (ELEM == FM_DTYPE_E2M1)
        __stcs((unsigned int *)codes, c.x);
    else
        __stcs((uint2 *)codes, c);
    if ((threadIdx.x & (GROUP - 1)) == 0) {
        if (ELEM == FM_DTYPE_E2M1)
            ((uint8_t *)scale)[sidx] = s8;
        else
            ((float *)scale)[sidx] = s32;
    }
}

/* A row-wise quantized output of C columns: the lane's 8 values at column
 * col of the row whose codes start at `row` and compact scales at `srow`. */
template <int ELEM>
FM_DI void sw_put(const float *x, bool valid, float eps, uint8_t *row, uint8_t *srow, int col)
{
    if (ELEM == FM_DTYPE_E2M1) /* col >= 0: shifts, not signed divisions */
        sw_put_block<ELEM, 4>(x, valid, eps, row + ((unsigned)col >> 1), srow, (unsigned)col >> 5);
    else
        sw_put_block<ELEM, 16>(x, valid, eps, row + col, srow, (unsigned)col >> 7);
}

/* Row m of a row-wise quantized [M, C] output: codes, then compact scales. */
template <int ELEM>
FM_DI uint8_t *sw_out_row(uint8_t *data, int64_t m, int64_t C)
{
    return data + m * sw_code_bytes<ELEM>(C);
}

template <int ELEM>
FM_DI uint8_t *sw_out_srow(void *scale, int64_t m, int64_t C)
{
    return (uint8_t *)scale + m * sw_scale_bytes<ELEM>(C);
}

/* Units a warp takes at a time in the forward: their loads are all issued
 * before the first is decoded (one unit's 8-byte FP8 loads kept too few
 * bytes in flight: the recompute from E4M3 ran at 58% of copy bandwidth). */
#define SW_FWD_UNITS(IN) ((IN) == FM_DTYPE_BF16 ? 2 : 4)

/* h = (silu(g) · u) · p into OUT 1x128; SV: in_saved's element dtype
 * (E4M3 1x128, E2M1 MX32) or 0. FULL: I is a multiple of SW_CHUNK, so no
 * lane is ever past the row's end. */
template <int IN, int OUT, int SV, bool FULL>
__global__ void __launch_bounds__(SW_THREADS) swiglu_fwd_fused_kernel(const swparams p)
{
    const int lane = threadIdx.x & 31;
    const int I = (int)p.I;
    constexpr int U = SW_FWD_UNITS(IN);
    const uint32_t step = gridDim.x * SW_WARPS * U;
    for (uint32_t u0 = (blockIdx.x * SW_WARPS + (threadIdx.x >> 5)) * U; u0 < p.units; u0 += step) {
        sw_raw raw[U];
        int64_t mm[U];
        int cc[U];
#pragma unroll
        for (int j = 0; j < U; j++) {
            const uint32_t unit = u0 + j, m32 = fm_fastdiv_div(p.chdiv, unit);
            mm[j] = m32;
            cc[j] = (int)(unit - m32 * p.nch) * SW_CHUNK + lane * 8;
            raw[j] = sw_raw{};
            if (unit < p.units && (FULL || cc[j] < I))
                sw_fetch_gu<IN>(sw_in_row<IN>(p, mm[j]), sw_in_srow<IN>(p, mm[j]), I, cc[j], &raw[j]);
        }
#pragma unroll
        for (int j = 0; j < U; j++) {
            if (u0 + j >= p.units) /* warp-uniform: the block shuffles below see every lane */
                break;
            const int64_t m = mm[j];
            const int col = cc[j];
            const bool valid = FULL || col < I;
            float g[8], u[8], h[8];
            if (valid)
                sw_decode_gu<IN>(raw[j], g, u);
            else
#pragma unroll
                for (int k = 0; k < 8; k++)
                    g[k] = u[k] = 0.0f;
            const float pm = p.probs ? p.probs[m] : 0.0f;
            float sg[8], sgn[8];
            fm_sigmoid_pm8(g, sg, sgn);
#pragma unroll
            for (int k = 0; k < 8; k++) {
                const float v = (g[k] * sg[k]) * u[k]; /* fm_silu_rawf(g) * u */
                h[k] = p.probs ? v * pm : v;
            }
            sw_put<OUT>(h, valid, p.eps, sw_out_row<OUT>(p.out, m, I), sw_out_srow<OUT>(p.out_scale, m, I), col);
            if (SV) {
                uint8_t *sr = sw_out_row<SV>(p.sv, m, 2 * (int64_t)I),
                        *ss = sw_out_srow<SV>(p.sv_scale, m, 2 * (int64_t)I);
                sw_put<SV>(g, valid, p.eps, sr, ss, col);
                sw_put<SV>(u, valid, p.eps, sr, ss, I + col);
            }
        }
    }
}

/* din = [dg | du] into OUT 1x128, and dprobs when p.dprobs is set; FULL as
 * in the forward. */
template <int IN, int OUT, bool FULL>
__global__ void __launch_bounds__(SW_THREADS) swiglu_bwd_fused_kernel(const swparams p)
{
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int I = (int)p.I;
    const bool dp = p.dprobs != NULL;
    for (uint32_t unit = blockIdx.x * SW_WARPS + w; unit < p.units; unit += gridDim.x * SW_WARPS) {
        uint32_t m32, ch0, ch1;
        if (dp) {
            m32 = unit;
            ch0 = 0;
            ch1 = p.nch;
        } else {
            m32 = fm_fastdiv_div(p.chdiv, unit);
            ch0 = unit - m32 * p.nch;
            ch1 = ch0 + 1;
        }
        const int64_t m = m32;
        const float pm = p.probs ? p.probs[m] : 0.0f;
        /* The rows' places at chunk ch0, advanced a chunk at a time: kept in
         * registers, where the compiler had recomputed m times a stride for
         * each access of each chunk. Offsets within a chunk are the lane's
         * column (for the codes) and block (for the scales): I is a multiple
         * of 128 here, so chunk-relative block indices are exact. */
        const int c0 = (int)ch0 * SW_CHUNK, lc = lane * 8;
        const uint8_t *in_row = sw_in_row<IN>(p, m) + sw_code_bytes<IN>(c0);
        const uint8_t *in_srow = sw_in_srow<IN>(p, m) + sw_scale_bytes<IN>(c0);
        const uint16_t *dh_row = p.dh + m * I + c0;
        uint8_t *out_row = sw_out_row<OUT>(p.out, m, 2 * (int64_t)I) + sw_code_bytes<OUT>(c0);
        uint8_t *out_srow = sw_out_srow<OUT>(p.out_scale, m, 2 * (int64_t)I) + sw_scale_bytes<OUT>(c0);
        float acc = 0.0f;
        /* Chunk ch + 1's loads are issued before chunk ch is decoded (a
         * warp walks a whole row when it writes dprobs). */
        const int col = lc; /* within the chunk */
        sw_raw rn = {};
        uint4 dn = make_uint4(0u, 0u, 0u, 0u);
        if (FULL || (int)ch0 * SW_CHUNK + lc < I) {
            sw_fetch_gu<IN>(in_row, in_srow, I, col, &rn);
            dn = __ldcs((const uint4 *)(dh_row + col));
        }
        for (uint32_t ch = ch0; ch < ch1; ch++) {
            const bool valid = FULL || (int)ch * SW_CHUNK + lc < I;
            const sw_raw rc = rn;
            const uint4 dc = dn;
            in_row += sw_code_bytes<IN>(SW_CHUNK);
            in_srow += sw_scale_bytes<IN>(SW_CHUNK);
            dh_row += SW_CHUNK;
            if (ch + 1 < ch1 && (FULL || (int)(ch + 1) * SW_CHUNK + lc < I)) {
                sw_fetch_gu<IN>(in_row, in_srow, I, col, &rn);
                dn = __ldcs((const uint4 *)(dh_row + col));
            }
            float g[8], u[8], d[8], dg[8], du[8];
            if (valid) {
                sw_decode_gu<IN>(rc, g, u);
                sw_bf16x8(dc, d);
            } else
#pragma unroll
                for (int k = 0; k < 8; k++)
                    g[k] = u[k] = d[k] = 0.0f;
            float sg[8], sgn[8];
            fm_sigmoid_pm8(g, sg, sgn);
#pragma unroll
            for (int k = 0; k < 8; k++) {
                /* fm_silu_dsilu_rawf(g) */
                const float a = g[k] * sg[k], ds = sg[k] * fmaf(g[k], sgn[k], 1.0f);
                const float q = p.probs ? d[k] * pm : d[k];
                du[k] = q * a;
                dg[k] = (q * u[k]) * ds;
                u[k] = a * u[k]; /* a · u, what dprobs dots with dh */
            }
            sw_put<OUT>(dg, valid, p.eps, out_row, out_srow, col);
            sw_put<OUT>(du, valid, p.eps, out_row, out_srow, I + col);
            if (dp && valid) /* p_l = fmaf(dh_i, (a u)_i, p_l) over the lane's run, increasing */
#pragma unroll
                for (int k = 0; k < 8; k++)
                    acc = fmaf(d[k], u[k], acc);
            out_row += sw_code_bytes<OUT>(SW_CHUNK);
            out_srow += sw_scale_bytes<OUT>(SW_CHUNK);
        }
        if (dp) {
            const float v = fm_warp_tree(acc);
            if (lane == 0)
                p.dprobs[m] = v;
        }
    }
}

/* ---- general path ---------------------------------------------------------- */

__global__ void swiglu_fwd_kernel(fm_moe_rows in, const float *p, int64_t M, int64_t I, void *h, int hdt)
{
    int64_t n = M * I;
    for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < n;
         idx += (int64_t)gridDim.x * blockDim.x) {
        int64_t m = idx / I, i = idx % I;
        float v = fm_siluf(fm_moe_rows_get(in, m, i)) * fm_moe_rows_get(in, m, I + i);
        fm_moe_store(h, hdt, idx, p ? v * p[m] : v);
    }
}

__global__ void swiglu_bwd_kernel(fm_moe_rows dh, fm_moe_rows in, const float *p, int64_t M, int64_t I, void *din,
                                  int ddt)
{
    int64_t n = M * I;
    for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < n;
         idx += (int64_t)gridDim.x * blockDim.x) {
        int64_t m = idx / I, i = idx % I;
        float g = fm_moe_rows_get(in, m, i), u = fm_moe_rows_get(in, m, I + i), d = fm_moe_rows_get(dh, m, i);
        float a, ds;
        fm_silu_dsiluf(g, &a, &ds);
        float q = p ? d * p[m] : d;
        fm_moe_store(din, ddt, m * 2 * I + I + i, q * a);
        fm_moe_store(din, ddt, m * 2 * I + i, (q * u) * ds);
    }
}

__global__ void swiglu_dprobs_kernel(fm_moe_rows dh, fm_moe_rows in, int64_t M, int64_t I, float *dp)
{
    int lane = threadIdx.x & 31;
    /* A warp per row, striding: the grid is capped, M is not. */
    for (int64_t m = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5; m < M;
         m += ((int64_t)gridDim.x * blockDim.x) >> 5) {
        float acc = 0.0f; /* fm_dot_order_runs_f32: lane l takes the runs i / 8 = l (mod 32) */
        for (int64_t r = FM_DOT_RUN * lane; r < I; r += FM_DOT_RUN * FM_DOT_LANES)
            for (int64_t i = r; i < r + FM_DOT_RUN && i < I; i++)
                acc = fmaf(fm_moe_rows_get(dh, m, i),
                           fm_siluf(fm_moe_rows_get(in, m, i)) * fm_moe_rows_get(in, m, I + i), acc);
        float v = fm_warp_tree(acc);
        if (lane == 0)
            dp[m] = v; /* rows of no columns: +0, as on the CPU */
    }
}

static unsigned grid_for(int64_t n)
{
    int64_t b = (n + 255) / 256;
    return (unsigned)(b < 65535 * 8 ? (b > 0 ? b : 1) : 65535 * 8);
}

/* Activation into `row` directly (unscaled), or via an F32 buffer and the
 * CUDA quantizer. */
static fm_status run(fm_context *ctx, const fm_quant_config *cfg, const fm_tensor *dh, const fm_tensor *in,
                     const fm_tensor *probs, fm_tensor *row, fm_tensor *col, fm_tensor *dprobs, const char *op)
{
    fm_cuda_device_guard g;
    fm_status st = fm_cuda_enter(ctx, &g, op);
    if (st)
        return st;
    int64_t M = in->shape[0], I = in->shape[1] / 2, C = dh ? 2 * I : I;
    cudaStream_t s = fm_cuda_stream(ctx);
    const float *p = probs ? (const float *)probs->data : NULL;
    int quant = row->scale_mode != FM_SCALE_NONE;
    void *h = row->data;
    cudaError_t err = cudaSuccess;
    if (quant && M * C > 0)
        err = cudaMallocAsync(&h, (size_t)(M * C) * sizeof(float), s);
    if (err == cudaSuccess && M * I > 0) {
        int hdt = quant ? FM_DTYPE_F32 : (int)row->dtype;
        if (dh)
            swiglu_bwd_kernel<<<grid_for(M * I), 256, 0, s>>>(fm_moe_rows_of(dh), fm_moe_rows_of(in), p, M, I, h, hdt);
        else
            swiglu_fwd_kernel<<<grid_for(M * I), 256, 0, s>>>(fm_moe_rows_of(in), p, M, I, h, hdt);
        err = cudaGetLastError();
    }
    if (err == cudaSuccess && dprobs && M > 0) {
        swiglu_dprobs_kernel<<<grid_for(M * 32), 256, 0, s>>>(fm_moe_rows_of(dh), fm_moe_rows_of(in), M, I,
                                                               (float *)dprobs->data);
        err = cudaGetLastError();
    }
    if (err == cudaSuccess && quant) {
        fm_tensor ht = fm_tensor_2d(h, FM_DTYPE_F32, M, C);
        ht.device = FM_DEVICE_CUDA;
        st = fm_cuda_quantize(ctx, cfg, &ht, row, col);
    }
    if (quant && M * C > 0 && h != row->data) {
        cudaError_t e2 = cudaFreeAsync(h, s);
        if (err == cudaSuccess)
            err = e2;
    }
    fm_status st2 = fm_cuda_leave(ctx, &g, err, op);
    return st ? st : st2;
}

/* ---- hot-case selection ------------------------------------------------------ */

static int aligned_to(const void *p, uintptr_t a) { return (uintptr_t)p % a == 0; }

/* The element dtype of an `in` the fused kernels decode (vector loads need
 * the alignment), else 0. Core has checked it is row-wise, 2-D, compact. */
static int fused_in(const fm_tensor *t)
{
    if (t->dtype == FM_DTYPE_BF16 && t->scale_mode == FM_SCALE_NONE && aligned_to(t->data, 16))
        return FM_DTYPE_BF16;
    if (t->dtype == FM_DTYPE_E4M3 && t->scale_mode == FM_SCALE_BLOCK_1x128 && aligned_to(t->data, 8))
        return FM_DTYPE_E4M3;
    if (t->dtype == FM_DTYPE_E2M1 && t->scale_mode == FM_SCALE_MX32 && aligned_to(t->data, 4))
        return FM_DTYPE_E2M1;
    return 0;
}

/* FP8 BLOCK_1x128 with compact scales (the activation outputs), else 0. */
static int fused_out(const fm_tensor *t)
{
    if ((t->dtype != FM_DTYPE_E4M3 && t->dtype != FM_DTYPE_E5M2) || t->scale_mode != FM_SCALE_BLOCK_1x128 ||
        t->scale_layout != FM_SCALE_LAYOUT_COMPACT || !aligned_to(t->data, 8))
        return 0;
    return t->dtype;
}

/* in_saved as E4M3 1x128 or E2M1 MX32 with compact scales, else 0. */
static int fused_saved(const fm_tensor *t)
{
    if (t->scale_layout != FM_SCALE_LAYOUT_COMPACT)
        return 0;
    if (t->dtype == FM_DTYPE_E4M3 && t->scale_mode == FM_SCALE_BLOCK_1x128 && aligned_to(t->data, 8))
        return FM_DTYPE_E4M3;
    if (t->dtype == FM_DTYPE_E2M1 && t->scale_mode == FM_SCALE_MX32 && aligned_to(t->data, 4))
        return FM_DTYPE_E2M1;
    return 0;
}

/* The shape part of the hot case, and the parameters common to both
 * directions; 0 when the general path must run. */
static int fused_setup(swparams *p, const fm_quant_config *cfg, const fm_tensor *in, const fm_tensor *probs,
                       const fm_tensor *out, int by_row)
{
    const int64_t M = in->shape[0], I = in->shape[1] / 2;
    if (cfg->amax || cfg->nonfinite_blocks || M <= 0 || I <= 0 || I % 128 ||
        fm_effective_rule(cfg->rule, out->scale_mode) != FM_SCALE_RULE_POW2)
        return 0;
    const int64_t nch = fm_cdiv(I, SW_CHUNK), units = by_row ? M : M * nch;
    if (units >= ((int64_t)1 << 31) || 2 * I >= ((int64_t)1 << 31)) /* 32-bit unit and column indices */
        return 0;
    memset(p, 0, sizeof *p);
    p->in = in->data;
    p->in_scale = in->scale;
    p->probs = probs ? (const float *)probs->data : NULL;
    p->out = (uint8_t *)out->data;
    p->out_scale = out->scale;
    p->I = I;
    p->nch = (uint32_t)nch;
    p->chdiv = fm_fastdiv_make((uint32_t)nch);
    p->units = (uint32_t)units;
    p->eps = cfg->epsilon;
    return 1;
}

static unsigned fused_grid(uint32_t units)
{
    uint32_t b = (units + SW_WARPS - 1) / SW_WARPS;
    return b < 65535u * 16u ? b : 65535u * 16u;
}

static cudaError_t launch_fwd(const swparams &p, int in, int out, int sv, cudaStream_t s)
{
    const unsigned g = fused_grid((p.units + SW_FWD_UNITS(in) - 1) / SW_FWD_UNITS(in));
    const bool full = p.I % SW_CHUNK == 0;
#define FM_SW_FWD(IN_, OUT_, SV_)                                                   \
    if (in == IN_ && out == OUT_ && sv == SV_ && full)                              \
        swiglu_fwd_fused_kernel<IN_, OUT_, SV_, true><<<g, SW_THREADS, 0, s>>>(p);  \
    else if (in == IN_ && out == OUT_ && sv == SV_)                                 \
        swiglu_fwd_fused_kernel<IN_, OUT_, SV_, false><<<g, SW_THREADS, 0, s>>>(p); \
    else
#define FM_SW_FWD_OUT(OUT_)                                                        \
    FM_SW_FWD(FM_DTYPE_BF16, OUT_, 0)                                              \
    FM_SW_FWD(FM_DTYPE_BF16, OUT_, FM_DTYPE_E4M3)                                  \
    FM_SW_FWD(FM_DTYPE_BF16, OUT_, FM_DTYPE_E2M1)                                  \
    FM_SW_FWD(FM_DTYPE_E4M3, OUT_, 0)                                              \
    FM_SW_FWD(FM_DTYPE_E2M1, OUT_, 0)
    FM_SW_FWD_OUT(FM_DTYPE_E4M3) FM_SW_FWD_OUT(FM_DTYPE_E5M2) return cudaErrorInvalidValue;
#undef FM_SW_FWD_OUT
#undef FM_SW_FWD
    return cudaGetLastError();
}

static cudaError_t launch_bwd(const swparams &p, int in, int out, cudaStream_t s)
{
    const unsigned g = fused_grid(p.units);
    const bool full = p.I % SW_CHUNK == 0;
#define FM_SW_BWD(IN_, OUT_)                                                       \
    if (in == IN_ && out == OUT_ && full)                                          \
        swiglu_bwd_fused_kernel<IN_, OUT_, true><<<g, SW_THREADS, 0, s>>>(p);      \
    else if (in == IN_ && out == OUT_)                                             \
        swiglu_bwd_fused_kernel<IN_, OUT_, false><<<g, SW_THREADS, 0, s>>>(p);     \
    else
    FM_SW_BWD(FM_DTYPE_BF16, FM_DTYPE_E4M3) FM_SW_BWD(FM_DTYPE_E4M3, FM_DTYPE_E4M3)
    FM_SW_BWD(FM_DTYPE_E2M1, FM_DTYPE_E4M3) FM_SW_BWD(FM_DTYPE_BF16, FM_DTYPE_E5M2)
    FM_SW_BWD(FM_DTYPE_E4M3, FM_DTYPE_E5M2) FM_SW_BWD(FM_DTYPE_E2M1, FM_DTYPE_E5M2) return cudaErrorInvalidValue;
#undef FM_SW_BWD
    return cudaGetLastError();
}

/* The fused forward when the arguments are a hot case: 1 and *st set, else 0. */
static int swiglu_fused(fm_context *ctx, const fm_quant_config *cfg, const fm_tensor *in, const fm_tensor *probs,
                        fm_tensor *out_row, fm_tensor *out_col, fm_tensor *in_saved, fm_status *st)
{
    swparams p;
    const int ie = fused_in(in), oe = fused_out(out_row), se = in_saved ? fused_saved(in_saved) : 0;
    if (!ie || !oe || out_col || (in_saved && !se) || !fused_setup(&p, cfg, in, probs, out_row, 0))
        return 0;
    if (in_saved) {
        if (fm_effective_rule(cfg->rule, in_saved->scale_mode) != FM_SCALE_RULE_POW2)
            return 0;
        p.sv = (uint8_t *)in_saved->data;
        p.sv_scale = in_saved->scale;
    }
    fm_cuda_device_guard g;
    if ((*st = fm_cuda_enter(ctx, &g, "fm_moe_swiglu")))
        return 1;
    *st = fm_cuda_leave(ctx, &g, launch_fwd(p, ie, oe, se, fm_cuda_stream(ctx)), "fm_moe_swiglu");
    return 1;
}

static int swiglu_backward_fused(fm_context *ctx, const fm_quant_config *cfg, const fm_tensor *dh,
                                 const fm_tensor *in, const fm_tensor *probs, fm_tensor *din_row,
                                 fm_tensor *din_col, fm_tensor *dprobs, fm_status *st)
{
    swparams p;
    const int ie = fused_in(in), oe = fused_out(din_row);
    if (!ie || !oe || din_col || dh->dtype != FM_DTYPE_BF16 || dh->scale_mode != FM_SCALE_NONE ||
        !aligned_to(dh->data, 16) || !fused_setup(&p, cfg, in, probs, din_row, dprobs != NULL))
        return 0;
    p.dh = (const uint16_t *)dh->data;
    p.dprobs = dprobs ? (float *)dprobs->data : NULL;
    fm_cuda_device_guard g;
    if ((*st = fm_cuda_enter(ctx, &g, "fm_moe_swiglu_backward")))
        return 1;
    *st = fm_cuda_leave(ctx, &g, launch_bwd(p, ie, oe, fm_cuda_stream(ctx)), "fm_moe_swiglu_backward");
    return 1;
}

extern "C" fm_status fm_cuda_moe_swiglu(fm_context *ctx, const fm_quant_config *cfg, const fm_tensor *in,
                                        const fm_tensor *probs, fm_tensor *out_row, fm_tensor *out_col,
                                        fm_tensor *in_saved)
{
    fm_status st;
    if (swiglu_fused(ctx, cfg, in, probs, out_row, out_col, in_saved, &st))
        return st;
    st = run(ctx, cfg, NULL, in, probs, out_row, out_col, NULL, "fm_moe_swiglu");
    if (st || !in_saved)
        return st;
    /* A second read of `in` by the quantizer (same bits as the CPU's
     * fm_quantize of in; amax and the non-finite count belong to h). */
    fm_quant_config c = *cfg;
    c.amax = NULL;
    c.nonfinite_blocks = NULL;
    return fm_cuda_quantize(ctx, &c, in, in_saved, NULL);
}

extern "C" fm_status fm_cuda_moe_swiglu_backward(fm_context *ctx, const fm_quant_config *cfg, const fm_tensor *dh,
                                                 const fm_tensor *in, const fm_tensor *probs, fm_tensor *din_row,
                                                 fm_tensor *din_col, fm_tensor *dprobs)
{
    fm_status st;
    if (swiglu_backward_fused(ctx, cfg, dh, in, probs, din_row, din_col, dprobs, &st))
        return st;
    return run(ctx, cfg, dh, in, probs, din_row, din_col, dprobs, "fm_moe_swiglu_backward");
}
