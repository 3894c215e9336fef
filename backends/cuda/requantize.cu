/* CUDA scaling-aware transpose and direct FP8 <-> MXFP4 conversion
 * (fm_transpose_scaled, fm_convert_scaled): one re-encoding on codes and
 * power-of-two scale exponents, bit-exact with backends/cpu/requantize.c.
 *
 * Every input block (1 x 128 or 1 x 32 along a stored row) and every output
 * block, in either layout, lies inside one 128 x 128 tile of the stored
 * input matrix, so one CTA of 256 threads re-encodes a tile from registers:
 * each thread holds an 8 x 8 sub-tile of codes (8 consecutive rows, 8
 * consecutive columns; rows w*16 + hr*8 + k, columns cv*8 + j), still packed
 * (8 bytes or 4 bytes a row). The CTAs are persistent: each walks tiles with
 * a grid stride and loads the next tile's codes and scales while it works on
 * the current one.
 *
 *  1. Output block exponents. As in the CPU reference, an element's bid for
 *     its output block is fm_code_scale_exp(code) + p_in (TIGHT, MX_FLOOR) or
 *     p_in (ROWMAX), and the block exponent is the maximum bid. The per-code
 *     part comes from a shared-memory LUT filled with format.h's
 *     fm_code_scale_exp, replicated once per lane ([code][32 lanes]) so the
 *     lookups are free of bank conflicts. Sentinels fold the special cases
 *     into the same integer maximum: a zero code bids RQ_EMPTY (nothing), a
 *     non-finite code RQ_BIG, every element of a NaN-scale input block
 *     RQ_NAN_ROW + its code, elements outside the matrix RQ_EMPTY twice; a
 *     block maximum >= RQ_BIG / 2 is a non-finite block, <= -RQ_BIG / 2 an
 *     empty one (exponent 0), anything else the exponent, clamped to
 *     [-127, 127] exactly as the CPU does.
 *     Transposes reduce down the columns (the thread's 8 rows, its partner
 *     lane, then the 2 or 8 warps of the block through shared memory);
 *     conversions along the rows (the thread's 8 columns, then 4 or 16 lanes
 *     by shuffles).
 *  2. Codes. Each output code is fm_requant_code's arithmetic: the exact F32
 *     value of the input code (kernels.cuh's hardware FP8 decoders; E2M1 by
 *     placing its bits in an F32 and rescaling exactly) times 2^d,
 *     d = p_in - p_out clamped to [-149, 127], rounded to the output format
 *     with kernels.cuh's encoders (cvt.rn.satfinite; fm_encode8 / fm_fast_e2m1
 *     for E2M1), which equal format.h's on every non-NaN input. When every d of a
 *     thread's sub-tile lies in [-126, 127], 2^d is a normal F32 whose bits
 *     are ((p_in + 127) << 23) - (p_out << 23): one integer subtraction per
 *     element; otherwise the thread takes fm_exp2i of the clamped d. Codes of
 *     non-finite blocks become the output NaN code.
 *  3. Stores. Conversions store each row's 8 codes directly (a warp writes
 *     two whole 128-byte rows). Transposes pass the codes through a swizzled
 *     shared tile (the layout quantize.cu uses for its column-wise output)
 *     and leave in 16-byte (FP8) or 4-byte (E2M1) coalesced stores.
 *
 * Input F32 scales must be powers of two: a small kernel finds the first
 * block (in the CPU's order) whose scale is not, and the host reads that one
 * result back (one 16-byte copy and a stream synchronisation) before
 * anything is written, so a refused call leaves every output untouched.
 * E8M0 scales need no check, and then the op never waits for the device.
 * GEMM-layout padding entries get 1.0 (E8M0 127) from a separate kernel.
 * BLOCK_128x128 -> BLOCK_128x128 is an exact transpose of codes and scale
 * grid (no check, no re-rounding, nonfinite count 0), as on the CPU. */
#include <stdint.h>
#include <string.h>

#include <cuda_fp16.h>

#include "cuda.h"
#include "kernels.cuh"

#define RQT 128
#define RQTHREADS 256

#define RQ_BIG (1 << 20)
#define RQ_EMPTY (-(1 << 20))
#define RQ_NAN_ROW (4 * (1 << 20))
#define RQ_KEY_MIN (-(8 * (1 << 20)))
#define RQ_BADP 1000 /* output exponent slot of a non-finite block */

/* One group of fm_transpose_scaled_grouped, with a sentinel after the last:
 * its first input row, first tile row (of the [sum(M_i), N] input cut into
 * 128-row tiles group by group) and first output scale entry. */
typedef struct rqgrp {
    int64_t row0, trow0, s0;
} rqgrp;

typedef struct rqparams {
    const uint8_t *in;
    const void *in_scale;
    uint8_t *out;
    void *out_scale;
    unsigned long long *nonfinite; /* cfg->nonfinite_blocks, or NULL */
    int in_mode, in_layout, in_e8, bi, bi_shift;
    int out_mode, out_layout, out_e8, bo, bo_shift;
    int rule;
    int vec_in, vec_out;
    int64_t R, C;     /* stored input matrix */
    int64_t Ro, Co;   /* stored output matrix */
    int64_t nbi, nbo; /* blocks per stored input / output row */
    int64_t sin, sout; /* scale entries per expert */
    int64_t ib, ob;   /* code bytes per expert */
    uint32_t ntiles;
    fm_fastdiv ntc, ntr; /* tiles per tile row, tile rows per expert */
    /* Grouped: the table (groups + 1 entries), E2M1 halving of byte offsets,
     * and what a group's output needs for vector stores. */
    const rqgrp *grp;
    int64_t groups;
    int in_half, out_half;
    int vo_align, vo_cols;
} rqparams;

/* ---- small device helpers ------------------------------------------------- */

/* x with bit `from` moved to bit `to` (compile-time positions after unrolling). */
FM_DI uint32_t rq_move(uint32_t x, int from, int to) { return from >= to ? x >> (from - to) : x << (to - from); }

FM_DI int rq_max(int a, int b) { return a > b ? a : b; }
FM_DI int rq_min(int a, int b) { return a < b ? a : b; }

/* Tile t of one matrix: an expert of a 2-D / 3-D tensor, or (G) a group of
 * fm_transpose_scaled_grouped, whose rows are rows srow.. of the input and
 * whose output is its own column-wise matrix and scale array. */
typedef struct rqtile {
    int64_t r0, c0;      /* tile origin in the matrix's stored input */
    int64_t R;           /* the matrix's stored input rows */
    int64_t srow;        /* its row 0 among the p.R rows of the input scale array */
    int64_t sin0, sout0; /* first entries of its input and output scale arrays */
    int64_t Co, nbo;     /* its stored output columns, output blocks per stored output row */
    const uint8_t *in;
    uint8_t *out;
    bool vec_out;
} rqtile;

template <bool G>
FM_DI rqtile rq_tile(const rqparams &p, uint32_t t)
{
    rqtile k;
    const uint32_t tq = fm_fastdiv_div(p.ntc, t);
    k.c0 = (int64_t)(t - tq * p.ntc.d) * RQT;
    if (!G) {
        const uint32_t te = fm_fastdiv_div(p.ntr, tq);
        k.r0 = (int64_t)(tq - te * p.ntr.d) * RQT;
        k.R = p.R;
        k.srow = 0;
        k.sin0 = te * p.sin;
        k.sout0 = te * p.sout;
        k.Co = p.Co;
        k.nbo = p.nbo;
        k.in = p.in + te * p.ib;
        k.out = p.out + te * p.ob;
        k.vec_out = p.vec_out;
    } else {
        /* The last group starting at or before tile row tq: an empty group
         * starts where its successor does, so the search passes it over. */
        int lo = 0, hi = (int)p.groups - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (p.grp[mid].trow0 <= (int64_t)tq)
                lo = mid;
            else
                hi = mid - 1;
        }
        const int64_t row0 = p.grp[lo].row0;
        k.R = p.grp[lo + 1].row0 - row0;
        k.r0 = ((int64_t)tq - p.grp[lo].trow0) * RQT;
        k.srow = row0;
        k.sin0 = 0;
        k.sout0 = p.grp[lo].s0;
        k.Co = k.R;
        k.nbo = (k.R + p.bo - 1) >> p.bo_shift;
        k.in = p.in + ((row0 * p.C) >> p.in_half);
        k.out = p.out + ((row0 * p.C) >> p.out_half);
        k.vec_out = p.vec_out && k.Co % p.vo_cols == 0 && (uintptr_t)k.out % (uintptr_t)p.vo_align == 0;
    }
    return k;
}

/* Offset of the scale entry of stored element (r, c) of the matrix whose
 * scale array starts at entry `base`; compact layouts by multiplication and
 * shift (c / block), GEMM layouts through format.h. */
FM_DI int64_t rq_scale_off(int mode, int layout, int64_t R, int64_t C, int64_t nb, int shift, int64_t base,
                           int64_t r, int64_t c)
{
    if (layout == FM_SCALE_LAYOUT_COMPACT)
        return base + r * nb + (c >> shift);
    return base + fm_scale_offset((fm_scale_mode)mode, (fm_scale_layout)layout, R, C, r, c);
}

/* The block key of a code's magnitude taken alone (see the top comment). */
template <int TI, int TO>
static __device__ int rq_code_key(int mag, int rule)
{
    if (fm_elem_code_nonfinite((fm_dtype)TI, (uint8_t)mag))
        return RQ_BIG;
    if (rule == FM_REQUANT_ROWMAX)
        return 0;
    if (mag == 0)
        return RQ_EMPTY;
    return fm_code_scale_exp((fm_dtype)TI, (uint8_t)mag, (fm_dtype)TO, rule == FM_REQUANT_MX_FLOOR);
}

/* An input scale as a block exponent: p, or RQ_NAN_ROW for a NaN scale.
 * (Scales that are not powers of two were refused before any launch.) */
FM_DI int rq_pin(uint32_t raw, int e8)
{
    if (e8)
        return raw == FM_E8M0_NAN ? RQ_NAN_ROW : (int)raw - 127;
    int p = 0;
    return fm_f32_pow2_exp(__uint_as_float(raw), &p) == 2 ? RQ_NAN_ROW : p;
}

FM_DI int rq_pin_valid(int p) { return p > -1000 && p < 1000; }

/* One E2M1 nibble (low 4 bits) as F32: its sign and magnitude bits placed
 * in an F32 whose exponent field is the E2M1 one give the value times 2^-126
 * exactly (0.5 lands on the F32 subnormal 2^-127), and the exact rescale
 * gives the value: fm_e2m1_to_f32 bit for bit on all 16 nibbles. */
FM_DI float rq_e2m1_to_f32(uint32_t n)
{
    return __fmul_rn(__uint_as_float(((n & 8u) << 28) | ((n & 7u) << 22)), 0x1p126f);
}

/* Elements j and j + 1 (j even) of a row's packed codes, as exact F32
 * (non-finite codes give some NaN / Inf: their blocks are rewritten). */
template <int TI>
FM_DI void rq_decode2(const uint32_t *w, int j, float *a, float *b)
{
    if (TI == FM_DTYPE_E4M3) {
        fm_hw_e4m3x2_to_f32(w[j >> 2] >> (8 * (j & 3)), a, b);
    } else if (TI == FM_DTYPE_E5M2) {
        fm_hw_e5m2x2_to_f32(w[j >> 2] >> (8 * (j & 3)), a, b);
    } else {
        *a = rq_e2m1_to_f32(w[0] >> (4 * j));
        *b = rq_e2m1_to_f32(w[0] >> (4 * j + 4));
    }
}

/* Byte offset, in the LUT, of element j's magnitude in this lane's replica. */
template <int TI>
FM_DI uint32_t rq_lut_off(const uint32_t *w, int j, uint32_t lane4)
{
    if (TI == FM_DTYPE_E2M1)
        return (rq_move(w[0], 4 * j, 7) & 0x380u) | lane4;
    return (rq_move(w[j >> 2], 8 * (j & 3), 7) & 0x3F80u) | lane4;
}

FM_DI int rq_lut(const int *lut, uint32_t off) { return *(const int *)((const char *)lut + off); }

/* d = p_in - p_out as the CPU clamps it, and 2^d. */
FM_DI float rq_mult(int pin, int pout)
{
    const int d = pin - pout;
    return fm_exp2i(d < -149 ? -149 : d > 127 ? 127 : d);
}

/* ---- loads --------------------------------------------------------------- */

template <int TI>
struct rq_words {
    static const int n = TI == FM_DTYPE_E2M1 ? 1 : 2;
};

/* The thread's 8 x 8 sub-tile of codes of tile t; zeros outside the matrix. */
template <int TI, bool G>
FM_DI void rq_load_codes(const rqparams &p, uint32_t t, uint32_t (&cw)[8][rq_words<TI>::n])
{
    const int tid = threadIdx.x, w = tid >> 5, l = tid & 31;
    const rqtile tile = rq_tile<G>(p, t);
    const int64_t rb = tile.r0 + w * 16 + (l >> 4) * 8, cb = tile.c0 + (l & 15) * 8, R = tile.R;
    const uint8_t *base = tile.in;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const int64_t r = rb + k;
        const bool inside = r < R && cb < p.C;
        if (TI == FM_DTYPE_E2M1) {
            uint32_t v = 0;
            if (p.vec_in) {
                if (inside)
                    v = __ldcs((const unsigned int *)(base + (r * p.C + cb) / 2));
            } else if (r < R) {
#pragma unroll
                for (int b = 0; b < 4; b++)
                    if (cb + 2 * b < p.C)
                        v |= (uint32_t)base[(r * p.C + cb) / 2 + b] << (8 * b);
            }
            cw[k][0] = v;
        } else {
            uint2 v = make_uint2(0u, 0u);
            if (p.vec_in) {
                if (inside)
                    v = __ldcs((const uint2 *)(base + r * p.C + cb));
            } else if (r < R) {
#pragma unroll
                for (int b = 0; b < 8; b++)
                    if (cb + b < p.C) {
                        const uint32_t x = (uint32_t)base[r * p.C + cb + b] << (8 * (b & 3));
                        if (b < 4)
                            v.x |= x;
                        else
                            v.y |= x;
                    }
            }
            cw[k][0] = v.x;
            cw[k][1] = v.y;
        }
    }
}

/* The tile's input scales: entry idx = tid + 256 h covers tile row idx & 127,
 * input block idx >> 7 of the tile. Raw bits now, exponents at the store,
 * so the loads of the next tile overlap the current one. */
template <bool G>
FM_DI void rq_load_scales(const rqparams &p, uint32_t t, uint32_t (&raw)[2], int *ok)
{
    const rqtile tile = rq_tile<G>(p, t);
    const int nbt = RQT >> p.bi_shift;
    *ok = 0;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int idx = threadIdx.x + h * RQTHREADS, row = idx & (RQT - 1), b = idx >> 7;
        const int64_t r = tile.r0 + row, c = tile.c0 + ((int64_t)b << p.bi_shift);
        raw[h] = 0;
        if (b < nbt && r < tile.R && c < p.C) {
            const int64_t off =
                rq_scale_off(p.in_mode, p.in_layout, p.R, p.C, p.nbi, p.bi_shift, tile.sin0, tile.srow + r, c);
            raw[h] = p.in_e8 ? (uint32_t)((const uint8_t *)p.in_scale)[off] : ((const uint32_t *)p.in_scale)[off];
            *ok |= 1 << h;
        }
    }
}

FM_DI void rq_store_scales(const rqparams &p, int (*pin_s)[RQT], const uint32_t (&raw)[2], int ok)
{
    const int nbt = RQT >> p.bi_shift;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int idx = threadIdx.x + h * RQTHREADS, row = idx & (RQT - 1), b = idx >> 7;
        if (b < nbt)
            pin_s[b][row] = (ok >> h) & 1 ? rq_pin(raw[h], p.in_e8) : RQ_EMPTY;
    }
}

/* ---- output scales -------------------------------------------------------- */

FM_DI void rq_put_scale(const rqparams &p, const rqtile &tile, int64_t ro, int64_t co, int bad, int pv)
{
    const int64_t off =
        rq_scale_off(p.out_mode, p.out_layout, p.Ro, tile.Co, tile.nbo, p.bo_shift, tile.sout0, ro, co);
    if (p.out_e8)
        ((uint8_t *)p.out_scale)[off] = bad ? (uint8_t)FM_E8M0_NAN : (uint8_t)(pv + 127);
    else
        ((float *)p.out_scale)[off] = bad ? fm_bits_f32(FM_F32_CANON_NAN) : fm_exp2i(pv);
    if (bad && p.nonfinite)
        atomicAdd(p.nonfinite, 1ull);
}

/* A block's maximum key -> its exponent slot (RQ_BADP when non-finite). */
FM_DI int rq_block_exp(int key)
{
    if (key >= RQ_BIG / 2)
        return RQ_BADP;
    if (key <= -RQ_BIG / 2)
        return 0;
    return key < -127 ? -127 : key > 127 ? 127 : key;
}

/* ---- the transposed tile in shared memory --------------------------------
 * [tile column c][tile row], 128 bytes a column. FP8: 8-byte units u (8 tile
 * rows each) XOR-swizzled with c's 8-column group; E2M1: 4-byte units with
 * the same swizzle and a half-select bit; the layout of quantize.cu's
 * column-wise tile: the scattered writes and the row reads avoid bank
 * conflicts. */
template <int TO>
FM_DI void rq_tsm_put(uint8_t *tsm, int c, int u, uint2 code)
{
    const int f = (c >> 3) & 15;
    if (TO == FM_DTYPE_E2M1)
        *(uint32_t *)(tsm + c * 128 + 4 * (((u ^ f) & 15) | (((u ^ c) & 1) << 4))) = code.x;
    else
        *(uint2 *)(tsm + c * 128 + 8 * ((u ^ f) & 15)) = code;
}

/* Output stored rows c0 + c (input columns), columns r0 + ... (input rows). */
template <int TO>
FM_DI void rq_tsm_store(const rqparams &p, const uint8_t *tsm, const rqtile &tile)
{
    const int tid = threadIdx.x;
    const int64_t r0 = tile.r0, c0 = tile.c0, Co = tile.Co;
    uint8_t *dst = tile.out;
    if (TO == FM_DTYPE_E2M1) {
#pragma unroll
        for (int pass = 0; pass < 8; pass++) {
            const int idx = tid + pass * RQTHREADS, c = idx >> 4, uu = idx & 15, f = (c >> 3) & 15;
            const uint32_t word = *(const uint32_t *)(tsm + c * 128 + 4 * (((uu ^ f) & 15) | (((uu ^ c) & 1) << 4)));
            const int64_t sr = c0 + c, sc = r0 + 8 * uu;
            if (sr < p.Ro && sc < Co) {
                if (tile.vec_out) {
                    __stcs((unsigned int *)(dst + (sr * Co + sc) / 2), word);
                } else {
#pragma unroll
                    for (int b = 0; b < 4; b++)
                        if (sc + 2 * b < Co)
                            dst[(sr * Co + sc) / 2 + b] = (uint8_t)(word >> (8 * b));
                }
            }
        }
    } else {
#pragma unroll
        for (int pass = 0; pass < 4; pass++) {
            const int idx = tid + pass * RQTHREADS, c = idx >> 3, qq = idx & 7, f = (c >> 3) & 15;
            const int pu = (2 * qq) ^ f;
            uint4 val = *(const uint4 *)(tsm + c * 128 + 8 * (pu & ~1));
            if (pu & 1) {
                const uint32_t tx = val.x, ty = val.y;
                val.x = val.z;
                val.y = val.w;
                val.z = tx;
                val.w = ty;
            }
            const int64_t sr = c0 + c, sc = r0 + 16 * qq;
            if (sr < p.Ro && sc < Co) {
                if (tile.vec_out) {
                    __stcs((uint4 *)(dst + sr * Co + sc), val);
                } else {
                    const uint32_t wd[4] = {val.x, val.y, val.z, val.w};
#pragma unroll
                    for (int b = 0; b < 16; b++)
                        if (sc + b < Co)
                            dst[sr * Co + sc + b] = (uint8_t)(wd[b >> 2] >> (8 * (b & 3)));
                }
            }
        }
    }
}

/* The multipliers 2^d of rows k, k + 1 and columns j, j + 1 (m[row][column]). */
template <bool FAST>
FM_DI void rq_mults(const int (&pk)[8], const int (&pj)[8], int k, int j, float *m00, float *m01, float *m10,
                    float *m11)
{
    if (FAST) {
        const uint32_t ak0 = (uint32_t)(pk[k] + 127) << 23, ak1 = (uint32_t)(pk[k + 1] + 127) << 23;
        const uint32_t b0 = (uint32_t)pj[j] << 23, b1 = (uint32_t)pj[j + 1] << 23;
        *m00 = __uint_as_float(ak0 - b0);
        *m01 = __uint_as_float(ak0 - b1);
        *m10 = __uint_as_float(ak1 - b0);
        *m11 = __uint_as_float(ak1 - b1);
    } else {
        *m00 = rq_mult(pk[k], pj[j]);
        *m01 = rq_mult(pk[k], pj[j + 1]);
        *m10 = rq_mult(pk[k + 1], pj[j]);
        *m11 = rq_mult(pk[k + 1], pj[j + 1]);
    }
}

/* Transpose: the codes of the thread's 8 columns (rows k = 0..7 each) into
 * the shared tile, a column at a time through fm_encode8 (two rows per cvt
 * for FP8, its 8-wide encoder for E2M1). FAST: every d of the sub-tile is in
 * [-126, 127]. */
template <int TI, int TO, bool FAST>
FM_DI void rq_encode_cols(const uint32_t (&cw)[8][rq_words<TI>::n], const int (&pk)[8], const int (&pj)[8],
                          uint8_t *tsm, int u, int cv)
{
#pragma unroll
    for (int j = 0; j < 8; j += 2) {
        float y0[8], y1[8]; /* columns j and j + 1, rows 0..7 */
#pragma unroll
        for (int k = 0; k < 8; k += 2) {
            float a0, b0, a1, b1, m00, m01, m10, m11;
            rq_decode2<TI>(cw[k], j, &a0, &b0);
            rq_decode2<TI>(cw[k + 1], j, &a1, &b1);
            rq_mults<FAST>(pk, pj, k, j, &m00, &m01, &m10, &m11);
            y0[k] = __fmul_rn(a0, m00);
            y0[k + 1] = __fmul_rn(a1, m10);
            y1[k] = __fmul_rn(b0, m01);
            y1[k + 1] = __fmul_rn(b1, m11);
        }
        uint2 c0 = fm_encode8<TO>(y0), c1 = fm_encode8<TO>(y1);
        if (pj[j] == RQ_BADP)
            c0.x = c0.y = fm_nan_word<TO>();
        if (pj[j + 1] == RQ_BADP)
            c1.x = c1.y = fm_nan_word<TO>();
        rq_tsm_put<TO>(tsm, cv * 8 + j, u, c0);
        rq_tsm_put<TO>(tsm, cv * 8 + j + 1, u, c1);
    }
}

/* Conversion: one row's 8 codes, all in one output block (multiplier m). */
template <int TI, int TO>
FM_DI uint2 rq_encode_row(const uint32_t *w, float m)
{
    float y[8];
#pragma unroll
    for (int j = 0; j < 8; j += 2) {
        float a, b;
        rq_decode2<TI>(w, j, &a, &b);
        y[j] = __fmul_rn(a, m);
        y[j + 1] = __fmul_rn(b, m);
    }
    return fm_encode8<TO>(y);
}

/* ---- the tile kernel -------------------------------------------------------- */

template <int TI, int TO, int TR, bool G>
__global__ void __launch_bounds__(RQTHREADS, 2) requant_tile_kernel(const rqparams p)
{
    constexpr int NMAG = TI == FM_DTYPE_E2M1 ? 8 : 128;
    constexpr int NW = rq_words<TI>::n;
    __shared__ int lut[NMAG * 32];
    __shared__ int pin_s[2][4][RQT];            /* input block exponents, double-buffered by tile */
    __shared__ int red[TR ? 8 : 1][RQT];        /* per-warp column maxima, permuted columns */
    __shared__ int pout_s[TR ? 4 : 1][RQT];     /* output block exponents, permuted columns */
    __shared__ __align__(16) uint8_t tsm[TR ? RQT * RQT : 16];

    const int tid = threadIdx.x, w = tid >> 5, l = tid & 31, hr = l >> 4, cv = l & 15;
    const int rl = w * 16 + hr * 8, cl = cv * 8, u = w * 2 + hr;
    const uint32_t lane4 = (uint32_t)l * 4u;

    uint32_t t = blockIdx.x;
    if (t >= p.ntiles)
        return;
    for (int i = tid; i < NMAG * 32; i += RQTHREADS)
        lut[i] = rq_code_key<TI, TO>(i >> 5, p.rule);

    uint32_t cw[8][NW], nw[8][NW], raw[2];
    int ok;
    rq_load_codes<TI, G>(p, t, cw);
    rq_load_scales<G>(p, t, raw, &ok);
    rq_store_scales(p, pin_s[0], raw, ok);
    __syncthreads();

    for (int it = 0; t < p.ntiles; it++) {
        const int buf = it & 1;
        const uint32_t tn = t + gridDim.x;
        const bool more = tn < p.ntiles && tn > t;
        if (more) {
            rq_load_codes<TI, G>(p, tn, nw);
            rq_load_scales<G>(p, tn, raw, &ok);
        }
        const rqtile tile = rq_tile<G>(p, t);
        const int64_t r0 = tile.r0, c0 = tile.c0;

        int pk[8];
        {
            const int b = cl >> p.bi_shift;
#pragma unroll
            for (int k = 0; k < 8; k++)
                pk[k] = pin_s[buf][b][rl + k];
        }

        if (TR) {
            /* 1. column keys: the thread's 8 rows, its partner lane, the warps */
            int ck[8];
#pragma unroll
            for (int j = 0; j < 8; j++)
                ck[j] = RQ_KEY_MIN;
#pragma unroll
            for (int k = 0; k < 8; k++)
#pragma unroll
                for (int j = 0; j < 8; j++)
                    ck[j] = rq_max(ck[j], rq_lut(lut, rq_lut_off<TI>(cw[k], j, lane4)) + pk[k]);
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const int m = rq_max(ck[j], __shfl_xor_sync(0xFFFFFFFFu, ck[j], 16));
                if (hr == 0)
                    red[w][j * 16 + cv] = m;
            }
            __syncthreads();

            /* Output blocks (tile column c, row group g): slot pc = (c & 7) * 16 + (c >> 3). */
            {
                const int ngr = RQT >> p.bo_shift, wpg = p.bo >> 4;
                for (int idx = tid; idx < ngr * RQT; idx += RQTHREADS) {
                    const int pc = idx & (RQT - 1), g = idx >> 7, c = (pc & 15) * 8 + (pc >> 4);
                    int key = red[g * wpg][pc];
                    for (int i = 1; i < wpg; i++)
                        key = rq_max(key, red[g * wpg + i][pc]);
                    const int pv = rq_block_exp(key);
                    pout_s[g][pc] = pv;
                    const int64_t ro = c0 + c, co = r0 + ((int64_t)g << p.bo_shift);
                    if (ro < p.Ro && co < tile.Co)
                        rq_put_scale(p, tile, ro, co, pv == RQ_BADP, pv);
                }
            }
            __syncthreads();

            /* 2. codes */
            int pj[8];
            {
                const int g = rl >> p.bo_shift;
#pragma unroll
                for (int j = 0; j < 8; j++)
                    pj[j] = pout_s[g][j * 16 + cv];
            }
            int kmin = 1000, kmax = -1000, jmin = 1000, jmax = -1000;
#pragma unroll
            for (int k = 0; k < 8; k++)
                if (rq_pin_valid(pk[k])) {
                    kmin = rq_min(kmin, pk[k]);
                    kmax = rq_max(kmax, pk[k]);
                }
#pragma unroll
            for (int j = 0; j < 8; j++)
                if (pj[j] != RQ_BADP) {
                    jmin = rq_min(jmin, pj[j]);
                    jmax = rq_max(jmax, pj[j]);
                }
            if (kmin - jmax >= -126 && kmax - jmin <= 127)
                rq_encode_cols<TI, TO, true>(cw, pk, pj, tsm, u, cv);
            else
                rq_encode_cols<TI, TO, false>(cw, pk, pj, tsm, u, cv);
            if (more)
                rq_store_scales(p, pin_s[buf ^ 1], raw, ok);
            __syncthreads();

            /* 3. coalesced stores of the transposed tile (coordinates
             * recomputed: fewer registers live across the encoding) */
            rq_tsm_store<TO>(p, tsm, rq_tile<G>(p, t));
        } else {
            /* 1. row keys: the thread's 8 columns, then the lanes of the block */
            int rk[8];
#pragma unroll
            for (int k = 0; k < 8; k++) {
                int m = RQ_KEY_MIN;
#pragma unroll
                for (int j = 0; j < 8; j++)
                    m = rq_max(m, rq_lut(lut, rq_lut_off<TI>(cw[k], j, lane4)));
                rk[k] = m + pk[k];
            }
            /* (the maximum commutes with adding the row's p_in) */
#pragma unroll
            for (int k = 0; k < 8; k++) {
                rk[k] = rq_max(rk[k], __shfl_xor_sync(0xFFFFFFFFu, rk[k], 1));
                rk[k] = rq_max(rk[k], __shfl_xor_sync(0xFFFFFFFFu, rk[k], 2));
                if (p.bo == 128) {
                    rk[k] = rq_max(rk[k], __shfl_xor_sync(0xFFFFFFFFu, rk[k], 4));
                    rk[k] = rq_max(rk[k], __shfl_xor_sync(0xFFFFFFFFu, rk[k], 8));
                }
            }
            const int lanes = p.bo >> 3; /* lanes per output block: 4 or 16 */
            const int64_t bs = c0 + ((int64_t)(cl >> p.bo_shift) << p.bo_shift), cb = c0 + cl;
            const int64_t rb = r0 + rl;
            uint8_t *dst = tile.out;
#pragma unroll
            for (int k = 0; k < 8; k++) {
                const int pv = rq_block_exp(rk[k]);
                const int64_t r = rb + k;
                if ((cv & (lanes - 1)) == (k & (lanes - 1)) && r < p.Ro && bs < p.Co)
                    rq_put_scale(p, tile, r, bs, pv == RQ_BADP, pv);
                uint2 code = rq_encode_row<TI, TO>(cw[k], rq_mult(pk[k], pv));
                if (pv == RQ_BADP)
                    code.x = code.y = fm_nan_word<TO>();
                if (r < p.Ro && cb < p.Co) {
                    if (TO == FM_DTYPE_E2M1) {
                        if (p.vec_out) {
                            __stcs((unsigned int *)(dst + (r * p.Co + cb) / 2), code.x);
                        } else {
#pragma unroll
                            for (int b = 0; b < 4; b++)
                                if (cb + 2 * b < p.Co)
                                    dst[(r * p.Co + cb) / 2 + b] = (uint8_t)(code.x >> (8 * b));
                        }
                    } else {
                        if (p.vec_out) {
                            __stcs((uint2 *)(dst + r * p.Co + cb), code);
                        } else {
#pragma unroll
                            for (int b = 0; b < 8; b++)
                                if (cb + b < p.Co)
                                    dst[r * p.Co + cb + b] = (uint8_t)((b < 4 ? code.x : code.y) >> (8 * (b & 3)));
                        }
                    }
                }
            }
            if (more)
                rq_store_scales(p, pin_s[buf ^ 1], raw, ok);
            __syncthreads();
        }

        if (!more)
            break;
        t = tn;
#pragma unroll
        for (int k = 0; k < 8; k++)
#pragma unroll
            for (int q = 0; q < NW; q++)
                cw[k][q] = nw[k][q];
    }
}

/* ---- row-wise conversions: a thread per 32-element row segment ------------
 * fm_convert_scaled between the row-block modes (1 x 128, MX32) when rows
 * split into whole segments (C a multiple of 32, of 128 for a 1 x 128
 * output) and the buffers allow 16-byte accesses. One input scale and one
 * output block cover a segment (or 4 adjacent lanes' segments, for a 1 x 128
 * output), so a segment's work is one input exponent, one key and one
 * multiplier 2^d:
 *  - the key: the block key of the largest magnitude code (format.h's
 *    fm_code_scale_exp is monotonic in the magnitude, and the non-finite
 *    codes are the largest FP8 magnitudes), so one LUT lookup replaces the
 *    tile kernel's lookup per element; the magnitudes' maximum is taken on
 *    16-bit lanes (VIMNMX.U16x2), two codes an instruction.
 *  - the codes: rq_encode_row, the tile kernel's arithmetic; for FP8 ->
 *    E2M1 with 2^(d - 6) a half-precision number, rq_fp8_e2m1x8 below. */

#define RQS_THREADS 256

/* Largest magnitude code among 4 FP8 codes per word (n words), or 8 E2M1
 * nibbles per word, via unsigned 16-bit maxima: a lane's maximum orders by
 * its masked high field first, so each field position keeps its own lane. */
template <int TI, int NW>
FM_DI int rq_max_mag(const uint32_t (&w)[NW])
{
    if (TI == FM_DTYPE_E2M1) {
        uint32_t a = 0, b = 0, c = 0, d = 0;
#pragma unroll
        for (int i = 0; i < NW; i++) {
            a = __vmaxu2(a, w[i] & 0x70007000u);
            b = __vmaxu2(b, w[i] & 0x07000700u);
            c = __vmaxu2(c, w[i] & 0x00700070u);
            d = __vmaxu2(d, w[i] & 0x00070007u);
        }
        a = __vmaxu2(a >> 12, b >> 8);
        c = __vmaxu2(c >> 4, d);
        a = __vmaxu2(a, c);
        return (int)max(a & 0xFFFFu, a >> 16);
    } else {
        uint32_t hi = 0, lo = 0;
#pragma unroll
        for (int i = 0; i < NW; i += 2) {
            hi = __vimax3_u16x2(hi, w[i] & 0x7F007F00u, w[i + 1] & 0x7F007F00u);
            lo = __vimax3_u16x2(lo, w[i] & 0x007F007Fu, w[i + 1] & 0x007F007Fu);
        }
        hi = __vmaxu2(hi >> 8, lo);
        return (int)max(hi & 0xFFFFu, hi >> 16);
    }
}

/* 2^k as a half-precision number, k in [-24, 15] (subnormal below -14). */
FM_DI uint32_t rq_h2_pow2(int k)
{
    const uint32_t h = k >= -14 ? (uint32_t)(k + 15) << 10 : 1u << (k + 24);
    return h | (h << 16);
}

/* Eight FP8 codes (two words) -> eight E2M1 codes, times 2^d given as
 * hm = 2^(d - 6) in both halves, in half precision: the same grid rounding
 * as fm_e2m1_grid_e4m3 (which fm_fast_e2m1x8 runs in F32), on pairs. The
 * product |v| 2^(d - 6) is exact wherever it can reach the E2M1 grid (an
 * FP8 value has at most 4 significant bits, and half precision is exact
 * down to 2^-14 while the grid starts at 2^-8); a smaller product may be
 * rounded but still ends at 0, as in F32; an overflow to Inf is clamped to
 * 6 2^-6 like any large value. Then |y| rounded to the grid's step in its
 * binade by adding and subtracting M = 2^(e + 9) (floor 2^3): M's ulp is
 * the step, the add rounds to nearest even, and the sum's mantissa field
 * counts steps above M, so the E2M1 code is that count plus 2 (e_M - 3). */
template <int TI>
FM_DI uint32_t rq_fp8_e2m1x8(uint32_t w0, uint32_t w1, uint32_t hm)
{
    uint32_t c[4];
#pragma unroll
    for (int q = 0; q < 4; q++) {
        const uint32_t two = ((q < 2 ? w0 : w1) >> (16 * (q & 1))) & 0xFFFFu;
        uint32_t h;
        if (TI == FM_DTYPE_E4M3)
            asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"((unsigned short)two));
        else
            h = __byte_perm(two, 0u, 0x1404); /* an E5M2 code is the high byte of its F16 */
        __half2 a = __hmul2(__habs2(*(__half2 *)&h), *(__half2 *)&hm);
        a = __hmin2(a, __half2half2(__ushort_as_half((unsigned short)0x2E00u))); /* 6 * 2^-6 */
        const uint32_t ab = *(uint32_t *)&a;
        const uint32_t mb = __vmaxu2((ab & 0x7C007C00u) + 0x24002400u, 0x48004800u);
        const __half2 sm = __hadd2(a, *(const __half2 *)&mb);
        const uint32_t sb = *(const uint32_t *)&sm;
        c[q] = (sb - mb + ((mb - 0x48004800u) >> 9)) | ((h >> 12) & 0x00080008u);
    }
    /* c[q]: element 2q in bits 0-3, 2q + 1 in bits 16-19 */
    uint32_t x = c[0] | (c[1] << 8), y = c[2] | (c[3] << 8);
    x |= x >> 12;
    y |= y >> 12;
    return __byte_perm(x, y, 0x5410);
}

/* BI, BO: the input and output block widths when compiled in (both scale
 * arrays compact, the E8M0 / F32 choice following from the mode), 0 when
 * read from p. */
#define RQS_BI_SHIFT (BI ? (BI == 128 ? 7 : 5) : p.bi_shift)
#define RQS_IN_E8 (BI ? BI == 32 : p.in_e8)
#define RQS_IN_LAYOUT (BI ? (int)FM_SCALE_LAYOUT_COMPACT : p.in_layout)
#define RQS_BO (BO ? BO : p.bo)
#define RQS_BO_SHIFT (BO ? (BO == 128 ? 7 : 5) : p.bo_shift)
#define RQS_OUT_E8 (BO ? BO == 32 : p.out_e8)
#define RQS_OUT_LAYOUT (BO ? (int)FM_SCALE_LAYOUT_COMPACT : p.out_layout)

template <int BI, int BO>
FM_DI void rq_put_scale_rows(const rqparams &p, int64_t te, int64_t r, int64_t c, int pv)
{
    const int64_t off = rq_scale_off(p.out_mode, RQS_OUT_LAYOUT, p.R, p.C, p.nbo, RQS_BO_SHIFT, te * p.sout, r, c);
    const int bad = pv == RQ_BADP;
    if (RQS_OUT_E8)
        ((uint8_t *)p.out_scale)[off] = bad ? (uint8_t)FM_E8M0_NAN : (uint8_t)(pv + 127);
    else
        ((float *)p.out_scale)[off] = bad ? fm_bits_f32(FM_F32_CANON_NAN) : fm_exp2i(pv);
    if (bad && p.nonfinite)
        atomicAdd(p.nonfinite, 1ull);
}

/* A segment's place, input scale bits and codes (zeros past the end),
 * loaded one iteration ahead. */
template <int NW>
struct rqseg {
    uint32_t w[NW];
    uint32_t raw; /* input scale bits */
    uint32_t te;  /* expert */
    uint32_t r;   /* stored row in the expert */
    uint32_t c;   /* first column */
};

template <int TI, int NW, int BI, int BO>
FM_DI void rq_rows_load(const rqparams &p, uint32_t sg, rqseg<NW> &g)
{
    if (sg >= p.ntiles) {
#pragma unroll
        for (int i = 0; i < NW; i++)
            g.w[i] = 0;
        g.raw = 0, g.te = 0, g.r = 0, g.c = 0;
        return;
    }
    const uint32_t row = fm_fastdiv_div(p.ntc, sg); /* stored row over all experts */
    g.te = fm_fastdiv_div(p.ntr, row);
    g.r = row - g.te * p.ntr.d;
    g.c = (sg - row * p.ntc.d) << 5;
    const int64_t el = (int64_t)sg << 5; /* segments tile the rows: element index = 32 sg */
    const int64_t so =
        rq_scale_off(p.in_mode, RQS_IN_LAYOUT, p.R, p.C, p.nbi, RQS_BI_SHIFT, (int64_t)g.te * p.sin, g.r, g.c);
    g.raw = RQS_IN_E8 ? (uint32_t)__ldg((const uint8_t *)p.in_scale + so) : __ldg((const uint32_t *)p.in_scale + so);
    if (TI == FM_DTYPE_E2M1) {
        const uint4 v = __ldcs((const uint4 *)(p.in + el / 2));
        g.w[0] = v.x, g.w[1] = v.y, g.w[2] = v.z, g.w[3] = v.w;
    } else {
        const uint4 v0 = __ldcs((const uint4 *)(p.in + el)), v1 = __ldcs((const uint4 *)(p.in + el + 16));
        g.w[0] = v0.x, g.w[1] = v0.y, g.w[2] = v0.z, g.w[3] = v0.w;
        g.w[4] = v1.x, g.w[5] = v1.y, g.w[6] = v1.z, g.w[7] = v1.w;
    }
}

/* Eight E2M1 codes (one word) as the E4M3 codes of the same values times
 * 2^-6 (two words, byte i = element i): E2M1's sign, exponent and mantissa
 * bits placed in E4M3's sign, low exponent and high mantissa bits, so that
 * E2M1's subnormal 0.5 lands on E4M3's subnormal 2^-7. */
FM_DI void rq_e2m1_as_e4m3(uint32_t w, uint32_t *lo, uint32_t *hi)
{
#pragma unroll
    for (int h = 0; h < 2; h++) {
        uint32_t y = __byte_perm(w, 0u, h ? 0x4342u : 0x4140u); /* two nibble pairs, a byte apart */
        y = (y | (y << 4)) & 0x0F0F0F0Fu;                       /* a nibble a byte */
        const uint32_t e = ((y & 0x08080808u) << 4) | ((y & 0x07070707u) << 2);
        if (h)
            *hi = e;
        else
            *lo = e;
    }
}

/* Every lane of the warp calls (the shuffles of a 1 x 128 output block).
 * TI: the words' code dtype; X: the words are rq_e2m1_as_e4m3's of an E2M1
 * input (TI = E4M3, the LUT indexed by those bytes, 2^6 more in the
 * multiplier: the same products, as rq_mult's clamps are far outside the
 * shifts an E2M1 value can take and keep a code). */
template <int TI, int TO, int NW, bool X, int NWS, int BI, int BO>
FM_DI void rq_rows_segment(const rqparams &p, const int *lut, uint32_t sg, const rqseg<NWS> &g,
                           const uint32_t (&w)[NW])
{
    const int lane = threadIdx.x & 31;
    const bool valid = sg < p.ntiles;
    const uint32_t te = g.te, r = g.r, c = g.c;
    const int64_t el = (int64_t)sg << 5;
    int pin = 0, key = RQ_KEY_MIN;
    if (valid) {
        pin = rq_pin(g.raw, RQS_IN_E8);
        key = lut[rq_max_mag<TI, NW>(w)] + pin;
    }
    if (RQS_BO == 128) {
        key = rq_max(key, __shfl_xor_sync(0xFFFFFFFFu, key, 1));
        key = rq_max(key, __shfl_xor_sync(0xFFFFFFFFu, key, 2));
    }
    if (!valid)
        return;
    const int pv = rq_block_exp(key);
    if (RQS_BO == 32 || (lane & 3) == 0)
        rq_put_scale_rows<BI, BO>(p, te, r, c, pv);

    uint32_t o[TO == FM_DTYPE_E2M1 ? 4 : 8];
    if (pv == RQ_BADP) {
#pragma unroll
        for (int i = 0; i < (TO == FM_DTYPE_E2M1 ? 4 : 8); i++)
            o[i] = fm_nan_word<TO>();
    } else {
        const int d = pin - pv;
        if (TO == FM_DTYPE_E2M1 && TI != FM_DTYPE_E2M1 && d >= -18 && d <= 21) {
            const uint32_t hm = rq_h2_pow2(d - 6);
#pragma unroll
            for (int q = 0; q < 4; q++)
                o[q] = rq_fp8_e2m1x8<TI>(w[2 * q], w[2 * q + 1], hm);
        } else {
            const float m = rq_mult(X ? pin + 6 : pin, pv);
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const uint2 v = rq_encode_row<TI, TO>(&w[TI == FM_DTYPE_E2M1 ? q : 2 * q], m);
                if (TO == FM_DTYPE_E2M1) {
                    o[q] = v.x;
                } else {
                    o[2 * q] = v.x;
                    o[2 * q + 1] = v.y;
                }
            }
        }
    }
    if (TO == FM_DTYPE_E2M1) {
        __stcs((uint4 *)(p.out + el / 2), make_uint4(o[0], o[1], o[2], o[3]));
    } else {
        __stcs((uint4 *)(p.out + el), make_uint4(o[0], o[1], o[2], o[3]));
        __stcs((uint4 *)(p.out + el + 16), make_uint4(o[4], o[5], o[6], o[7]));
    }
}

/* A grid-stride loop over warps of 32 segments whose next codes are loaded
 * before the current ones are converted (two segments' loads in flight a
 * thread). */
template <int TI, int TO, int BI, int BO>
__global__ void __launch_bounds__(RQS_THREADS) rq_rows_kernel(const rqparams p)
{
    constexpr bool X = TI == FM_DTYPE_E2M1 && TO != FM_DTYPE_E2M1; /* decoded as E4M3 (rq_e2m1_as_e4m3) */
    constexpr int TC = X ? FM_DTYPE_E4M3 : TI;                      /* the codes rq_rows_segment sees */
    constexpr int NMAG = TC == FM_DTYPE_E2M1 ? 8 : 128;
    constexpr int NW = TI == FM_DTYPE_E2M1 ? 4 : 8; /* input words a segment */
    __shared__ int lut[NMAG];
    for (int i = threadIdx.x; i < NMAG; i += RQS_THREADS)
        lut[i] = X ? rq_code_key<TI, TO>((i >> 2) & 7, p.rule) : rq_code_key<TI, TO>(i, p.rule);
    __syncthreads();

    const uint32_t lane = threadIdx.x & 31;
    const uint32_t wstride = gridDim.x * RQS_THREADS;
    uint32_t base = blockIdx.x * RQS_THREADS + (threadIdx.x & ~31u);
    if (base >= p.ntiles)
        return;
    rqseg<NW> g, gn;
    rq_rows_load<TI, NW, BI, BO>(p, base + lane, g);
    /* Warp-uniform trip count: the lanes of a 1 x 128 output block reduce by shuffles. */
    for (;;) {
        const uint32_t nb = base + wstride;
        const bool more = nb < p.ntiles && nb > base;
        if (more)
            rq_rows_load<TI, NW, BI, BO>(p, nb + lane, gn);
        if (X) {
            uint32_t e[8];
#pragma unroll
            for (int i = 0; i < 4; i++)
                rq_e2m1_as_e4m3(g.w[i], &e[2 * i], &e[2 * i + 1]);
            rq_rows_segment<TC, TO, 8, X, NW, BI, BO>(p, lut, base + lane, g, e);
        } else {
            rq_rows_segment<TC, TO, NW, X, NW, BI, BO>(p, lut, base + lane, g, g.w);
        }
        if (!more)
            break;
        base = nb;
        g = gn;
    }
}

/* ---- BLOCK_128x128: exact transpose of codes and scale grid ---------------- */

__global__ void __launch_bounds__(RQTHREADS) rq_transpose_bytes_kernel(const rqparams p)
{
    __shared__ __align__(16) uint8_t tsm[RQT * RQT];
    const int tid = threadIdx.x, w = tid >> 5, l = tid & 31, hr = l >> 4, cv = l & 15, u = w * 2 + hr;
    for (uint32_t t = blockIdx.x; t < p.ntiles; t += gridDim.x) {
        uint32_t cw[8][2];
        rq_load_codes<FM_DTYPE_E4M3, false>(p, t, cw);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            /* byte j of rows 0..7 */
            const uint32_t sel = (uint32_t)(j & 3) | ((uint32_t)(4 + (j & 3)) << 4);
            const int q = j >> 2;
            const uint32_t p01 = __byte_perm(cw[0][q], cw[1][q], sel), p23 = __byte_perm(cw[2][q], cw[3][q], sel);
            const uint32_t p45 = __byte_perm(cw[4][q], cw[5][q], sel), p67 = __byte_perm(cw[6][q], cw[7][q], sel);
            rq_tsm_put<FM_DTYPE_E4M3>(tsm, cv * 8 + j, u, make_uint2(__byte_perm(p01, p23, 0x5410), __byte_perm(p45, p67, 0x5410)));
        }
        __syncthreads();
        rq_tsm_store<FM_DTYPE_E4M3>(p, tsm, rq_tile<false>(p, t));
        __syncthreads();
    }
}

/* Every output entry: the transposed block's scale bits, or 1.0 (padding). */
__global__ void __launch_bounds__(256) rq_grid128_kernel(const uint32_t *in, uint32_t *out, int in_layout,
                                                         int out_layout, int64_t R, int64_t C, int64_t sin,
                                                         int64_t sout, int64_t n)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t e = i / sout, k = i % sout;
        int64_t r, c;
        uint32_t v = 0x3F800000u;
        if (fm_scale_entry(FM_SCALE_BLOCK_128x128, (fm_scale_layout)out_layout, C, R, k, &r, &c))
            v = in[e * sin + fm_scale_offset(FM_SCALE_BLOCK_128x128, (fm_scale_layout)in_layout, R, C, c, r)];
        out[i] = v;
    }
}

/* ---- GEMM-layout padding of the output scales ------------------------------ */

/* Every matrix's scale array has `per` entries of an R x C matrix, or (grp)
 * group g's has those of an R x M_g one from entry grp[g].s0 on. */
__global__ void __launch_bounds__(256) rq_pad_kernel(void *scale, int mode, int e8, int64_t R, int64_t C,
                                                     int64_t per, int64_t n, const rqgrp *grp, int64_t groups)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t r, c, k = i % (per > 0 ? per : 1), cols = C;
        if (grp) {
            int64_t lo = 0, hi = groups - 1; /* the last group starting at or before i, as in rq_tile */
            while (lo < hi) {
                const int64_t mid = (lo + hi + 1) >> 1;
                if (grp[mid].s0 <= i)
                    lo = mid;
                else
                    hi = mid - 1;
            }
            k = i - grp[lo].s0;
            cols = grp[lo + 1].row0 - grp[lo].row0;
        }
        if (!fm_scale_entry((fm_scale_mode)mode, FM_SCALE_LAYOUT_GEMM, R, cols, k, &r, &c)) {
            if (e8)
                ((uint8_t *)scale)[i] = 127;
            else
                ((float *)scale)[i] = 1.0f;
        }
    }
}

/* ---- the power-of-two check of F32 input scales ---------------------------- */

typedef struct rqcheck {
    unsigned long long first_inv; /* ~index of the first bad block, (e * R + r) * nbi + cb; 0: none */
    uint32_t bits;                /* its scale */
    uint32_t done;                /* CTAs finished */
} rqcheck;
static_assert(sizeof(rqcheck) <= FM_CUDA_HOST_SMALL, "the check's verdict is read back into host_small");

FM_DI int64_t rq_check_off(const rqparams &p, int64_t i)
{
    if (p.in_layout == FM_SCALE_LAYOUT_COMPACT)
        return i; /* e * (R * nbi) + r * nbi + cb */
    const int64_t per = p.R * p.nbi, e = i / per, rem = i - e * per, r = rem / p.nbi, cb = rem - r * p.nbi;
    return e * p.sin + fm_scale_offset((fm_scale_mode)p.in_mode, (fm_scale_layout)p.in_layout, p.R, p.C, r,
                                       cb << p.bi_shift);
}

/* The minimum index of a bad block (as the maximum of its complement, so a
 * zeroed result means none: one memset), then the last CTA to finish reads
 * that block's scale for the message. */
__global__ void __launch_bounds__(256) rq_check_kernel(const rqparams p, int64_t n, rqcheck *res)
{
    __shared__ int last;
    const uint32_t *s = (const uint32_t *)p.in_scale;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        int pp = 0;
        if (!fm_f32_pow2_exp(__uint_as_float(s[rq_check_off(p, i)]), &pp))
            atomicMax(&res->first_inv, ~(unsigned long long)i);
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0)
        last = atomicAdd(&res->done, 1u) == gridDim.x - 1;
    __syncthreads();
    if (last && threadIdx.x == 0) {
        const unsigned long long f = atomicMax(&res->first_inv, 0ull);
        if (f)
            res->bits = s[rq_check_off(p, (int64_t)~f)];
    }
}

/* ---- host side -------------------------------------------------------------- */

static int rq_log2(int b) { return b == 128 ? 7 : 5; }

/* The group table reaches the device through kernel parameters (3 KiB a
 * launch), so that building it never waits for the device as a copy from
 * pageable host memory may. */
#define RQG_CHUNK 128
typedef struct rqgrp_chunk {
    rqgrp e[RQG_CHUNK];
} rqgrp_chunk;

__global__ void __launch_bounds__(RQG_CHUNK) rq_group_table_kernel(rqgrp *dst, const rqgrp_chunk c, int n)
{
    if ((int)threadIdx.x < n)
        dst[threadIdx.x] = c.e[threadIdx.x];
}

template <int TI, int TO, int TR, bool G>
static cudaError_t rq_launch3(const rqparams &p, int sms, cudaStream_t s)
{
    int per = 0;
    cudaError_t err =
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, requant_tile_kernel<TI, TO, TR, G>, RQTHREADS, 0);
    if (err != cudaSuccess)
        return err;
    int64_t g = (int64_t)(per > 0 ? per : 1) * (sms > 0 ? sms : 1);
    if (g > (int64_t)p.ntiles)
        g = p.ntiles;
    requant_tile_kernel<TI, TO, TR, G><<<(unsigned)g, RQTHREADS, 0, s>>>(p);
    return cudaGetLastError();
}

/* Grouped ops are transposes only. */
template <int TI, int TO>
static cudaError_t rq_launch2(const rqparams &p, int tr, int sms, cudaStream_t s)
{
    if (p.grp)
        return rq_launch3<TI, TO, 1, true>(p, sms, s);
    return tr ? rq_launch3<TI, TO, 1, false>(p, sms, s) : rq_launch3<TI, TO, 0, false>(p, sms, s);
}

static unsigned rq_grid(int64_t items, int64_t cap)
{
    int64_t g = items < cap ? items : cap;
    return (unsigned)(g > 0 ? g : 1);
}

/* Fills the group table (groups + 1 entries) at dst from the host sizes. */
static cudaError_t rq_group_table(const fm_splits *sp, const fm_tensor *out, int64_t N, rqgrp *dst, cudaStream_t s)
{
    rqgrp_chunk c;
    rqgrp run = {0, 0, 0};
    int n = 0;
    int64_t base = 0;
    for (int64_t g = 0; g <= sp->groups; g++) {
        c.e[n++] = run;
        if (g < sp->groups) {
            const int64_t M = sp->host[g];
            run.row0 += M;
            run.trow0 += fm_cdiv(M, RQT);
            run.s0 += fm_scale_count_2d(out->scale_mode, out->scale_layout, N, M);
        }
        if (n == RQG_CHUNK || g == sp->groups) {
            rq_group_table_kernel<<<1, RQG_CHUNK, 0, s>>>(dst + base, c, n);
            cudaError_t err = cudaGetLastError();
            if (err != cudaSuccess)
                return err;
            base += n;
            n = 0;
        }
    }
    return cudaSuccess;
}

/* rq_rows_kernel's conditions: a conversion between row-block modes over
 * whole 32-element segments (whole 1 x 128 blocks for a 1 x 128 output),
 * 16-byte aligned buffers, 31-bit segment, column and row counts. */
static int rq_rows_fit(const rqparams &p, int tr, int64_t E)
{
    if (tr || p.grp || (p.bi != 32 && p.bi != 128) || (p.bo != 32 && p.bo != 128))
        return 0;
    if (p.C % 32 || (p.bo == 128 && p.C % 128) || (uintptr_t)p.in % 16 || (uintptr_t)p.out % 16)
        return 0;
    const int64_t nseg = E * p.R * (p.C / 32);
    return nseg < ((int64_t)1 << 31) && p.C < ((int64_t)1 << 31) && E * p.R < ((int64_t)1 << 31);
}

/* As many CTAs as fit at once: a CTA started late would end late. */
template <int TI, int TO, int BI, int BO>
static cudaError_t rq_rows_launch3(const rqparams &q, int64_t nseg, int sms, cudaStream_t s)
{
    static int cached = 0; /* CTAs an SM: the same on every sm_90 part, asked once (a relaxed race is benign) */
    int per = __atomic_load_n(&cached, __ATOMIC_RELAXED);
    if (!per) {
        cudaError_t err =
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, rq_rows_kernel<TI, TO, BI, BO>, RQS_THREADS, 0);
        if (err != cudaSuccess)
            return err;
        __atomic_store_n(&cached, per, __ATOMIC_RELAXED);
    }
    const unsigned g = rq_grid(fm_cdiv(nseg, RQS_THREADS), (int64_t)(per > 0 ? per : 1) * (sms > 0 ? sms : 1));
    rq_rows_kernel<TI, TO, BI, BO><<<g, RQS_THREADS, 0, s>>>(q);
    return cudaGetLastError();
}

/* Compact scale arrays on both sides (what the recipes use) get the block
 * widths compiled in; E2M1 blocks are MX32 on either side. */
template <int TI, int TO>
static cudaError_t rq_rows_launch2(const rqparams &q, int64_t nseg, int sms, cudaStream_t s)
{
    if (q.in_layout != FM_SCALE_LAYOUT_COMPACT || q.out_layout != FM_SCALE_LAYOUT_COMPACT)
        return rq_rows_launch3<TI, TO, 0, 0>(q, nseg, sms, s);
    constexpr int BI2 = TI == FM_DTYPE_E2M1 ? 32 : 128, BO2 = TO == FM_DTYPE_E2M1 ? 32 : 128;
    if (q.bi == 32)
        return q.bo == 32 ? rq_rows_launch3<TI, TO, 32, 32>(q, nseg, sms, s)
                          : rq_rows_launch3<TI, TO, 32, BO2>(q, nseg, sms, s);
    return q.bo == 32 ? rq_rows_launch3<TI, TO, BI2, 32>(q, nseg, sms, s)
                      : rq_rows_launch3<TI, TO, BI2, BO2>(q, nseg, sms, s);
}

/* The launch for the run-time element dtypes: the row-segment kernel (rows,
 * with the segment count) or the tile kernel. */
template <int TI, int TO>
static cudaError_t rq_launch_pair(const rqparams &p, int rows, int64_t nseg, int tr, int sms, cudaStream_t s)
{
    return rows ? rq_rows_launch2<TI, TO>(p, nseg, sms, s) : rq_launch2<TI, TO>(p, tr, sms, s);
}

template <int TI>
static cudaError_t rq_launch1(const rqparams &p, int to, int rows, int64_t nseg, int tr, int sms, cudaStream_t s)
{
    if (to == FM_DTYPE_E4M3)
        return rq_launch_pair<TI, FM_DTYPE_E4M3>(p, rows, nseg, tr, sms, s);
    if (to == FM_DTYPE_E5M2)
        return rq_launch_pair<TI, FM_DTYPE_E5M2>(p, rows, nseg, tr, sms, s);
    return rq_launch_pair<TI, FM_DTYPE_E2M1>(p, rows, nseg, tr, sms, s);
}

static cudaError_t rq_launch(const rqparams &p, int ti, int to, int rows, int64_t nseg, int tr, int sms,
                             cudaStream_t s)
{
    if (ti == FM_DTYPE_E4M3)
        return rq_launch1<FM_DTYPE_E4M3>(p, to, rows, nseg, tr, sms, s);
    if (ti == FM_DTYPE_E5M2)
        return rq_launch1<FM_DTYPE_E5M2>(p, to, rows, nseg, tr, sms, s);
    return rq_launch1<FM_DTYPE_E2M1>(p, to, rows, nseg, tr, sms, s);
}

/* The row-segment kernel: the segment count goes in ntiles, the divisions
 * by segments a row and by rows an expert in ntc and ntr. */
static cudaError_t rq_rows_launch(const rqparams &p, int64_t E, int ti, int to, int sms, cudaStream_t s)
{
    rqparams q = p;
    const int64_t nseg = E * p.R * (p.C / 32);
    q.ntiles = (uint32_t)nseg;
    q.ntc = fm_fastdiv_make((uint32_t)(p.C / 32));
    q.ntr = fm_fastdiv_make((uint32_t)p.R);
    return rq_launch(q, ti, to, 1, nseg, 0, sms, s);
}

/* fm_transpose_scaled and fm_convert_scaled (sp NULL), and
 * fm_transpose_scaled_grouped: one kernel, per-matrix geometry from rq_tile. */
static fm_status rq_run(fm_context *ctx, const fm_requant_config *cfg, const fm_splits *sp, const fm_tensor *in,
                        fm_tensor *out)
{
    const int tr = in->layout != out->layout;
    const char *op = sp ? "fm_transpose_scaled_grouped" : tr ? "fm_transpose_scaled" : "fm_convert_scaled";
    fm_cuda_device_guard guard;
    fm_status st = fm_cuda_enter(ctx, &guard, op);
    if (st)
        return st;
    cudaStream_t s = fm_cuda_stream(ctx);
    const int sms = fm_cuda(ctx)->prop.multiProcessorCount;
    /* Grouped: the whole [sum(M_i), N] input is one matrix for the input
     * scale array and the power-of-two check. */
    const int64_t E = sp ? 1 : fm_tensor_experts(in), R = fm_tensor_stored_rows(in), C = fm_tensor_stored_cols(in);
    const int exact128 = in->scale_mode == FM_SCALE_BLOCK_128x128;

    rqparams p;
    memset(&p, 0, sizeof p);
    p.in = (const uint8_t *)in->data;
    p.in_scale = in->scale;
    p.out = (uint8_t *)out->data;
    p.out_scale = out->scale;
    p.nonfinite = (unsigned long long *)cfg->nonfinite_blocks;
    p.in_mode = in->scale_mode;
    p.in_layout = in->scale_layout;
    p.in_e8 = in->scale_dtype == FM_DTYPE_E8M0;
    p.out_mode = out->scale_mode;
    p.out_layout = out->scale_layout;
    p.out_e8 = out->scale_dtype == FM_DTYPE_E8M0;
    p.bi = fm_mode_block_cols(in->scale_mode);
    p.bo = fm_mode_block_cols(out->scale_mode);
    p.bi_shift = rq_log2(p.bi);
    p.bo_shift = rq_log2(p.bo);
    p.rule = cfg->rule;
    p.R = R;
    p.C = C;
    p.Ro = tr ? C : R;
    p.Co = tr ? R : C;
    p.nbi = fm_cdiv(C, p.bi);
    p.nbo = fm_cdiv(p.Co, p.bo);
    p.sin = fm_scale_count_2d(in->scale_mode, in->scale_layout, R, C);
    p.sout = fm_scale_count_2d(out->scale_mode, out->scale_layout, p.Ro, p.Co);
    p.ib = in->dtype == FM_DTYPE_E2M1 ? R * C / 2 : R * C;
    p.ob = out->dtype == FM_DTYPE_E2M1 ? R * C / 2 : R * C;
    p.in_half = in->dtype == FM_DTYPE_E2M1;
    p.out_half = out->dtype == FM_DTYPE_E2M1;
    p.groups = sp ? sp->groups : 0;
    int64_t ntr = fm_cdiv(R, RQT), ntiles_rows = E * ntr, nscales_out = E * p.sout;
    if (sp) { /* the same totals as the table's sentinel, from the host sizes */
        ntiles_rows = nscales_out = 0;
        for (int64_t g = 0; g < sp->groups; g++) {
            ntiles_rows += fm_cdiv(sp->host[g], RQT);
            nscales_out += fm_scale_count_2d(out->scale_mode, out->scale_layout, C, sp->host[g]);
        }
    }
    const int64_t ntc = fm_cdiv(C, RQT);
    const int64_t ntiles = R * C > 0 ? ntiles_rows * ntc : 0;
    if (ntiles >= ((int64_t)1 << 31)) {
        fm_cuda_leave(ctx, &guard, cudaSuccess, NULL);
        return fm_error(ctx, FM_ERR_UNSUPPORTED, "%s: %lld tiles of 128 x 128 exceed the kernel's 31-bit tile index",
                        op, (long long)ntiles);
    }
    p.ntiles = (uint32_t)ntiles;
    if (ntiles) {
        p.ntc = fm_fastdiv_make((uint32_t)ntc);
        p.ntr = fm_fastdiv_make((uint32_t)ntr);
    }
    const uintptr_t ia = (uintptr_t)in->data, oa = (uintptr_t)out->data;
    if (in->dtype == FM_DTYPE_E2M1)
        p.vec_in = C % 8 == 0 && ia % 4 == 0;
    else
        p.vec_in = C % 8 == 0 && ia % 8 == 0;
    /* Grouped: what the whole buffer allows; each group's tiles also need
     * their own row length and start aligned (rq_tile). */
    p.vo_align = out->dtype == FM_DTYPE_E2M1 ? 4 : 16;
    p.vo_cols = out->dtype == FM_DTYPE_E2M1 ? 8 : 16;
    if (sp)
        p.vec_out = oa % (uintptr_t)p.vo_align == 0;
    else if (out->dtype == FM_DTYPE_E2M1)
        p.vec_out = p.Co % 8 == 0 && oa % 4 == 0;
    else if (tr || exact128)
        p.vec_out = p.Co % 16 == 0 && oa % 16 == 0;
    else
        p.vec_out = p.Co % 8 == 0 && oa % 8 == 0;

    cudaError_t err = cudaSuccess;
    const char *what = op;
    void *buf = NULL;
    int owned = 0;
    /* Scratch: the check's result, then the group table. */
    const size_t check_bytes = 64, table_bytes = sp ? (size_t)(sp->groups + 1) * sizeof(rqgrp) : 0;
    const int64_t nblocks = E * R * p.nbi;
    const int check = !exact128 && !p.in_e8 && nblocks > 0;
    if (check || sp) {
        st = fm_cuda_scratch(ctx, check_bytes + table_bytes, &buf, &owned, op);
        if (st) {
            fm_cuda_leave(ctx, &guard, cudaSuccess, NULL);
            return st;
        }
    }

    /* Every input F32 scale is checked before anything is written. */
    if (check) {
        rqcheck &h = *(rqcheck *)fm_cuda(ctx)->host_small; /* pinned: the copy goes straight there */
        what = "cudaMemsetAsync(check)";
        if ((err = cudaMemsetAsync(buf, 0, sizeof(rqcheck), s)) != cudaSuccess)
            goto out;
        what = "power-of-two scale check: kernel launch";
        rq_check_kernel<<<rq_grid(fm_cdiv(nblocks, 256), (int64_t)sms * 8), 256, 0, s>>>(p, nblocks, (rqcheck *)buf);
        if ((err = cudaGetLastError()) != cudaSuccess)
            goto out;
        what = "power-of-two scale check: cudaMemcpyAsync";
        if ((err = cudaMemcpyAsync(&h, buf, sizeof h, cudaMemcpyDeviceToHost, s)) != cudaSuccess)
            goto out;
        what = "power-of-two scale check: cudaStreamSynchronize";
        if ((err = cudaStreamSynchronize(s)) != cudaSuccess)
            goto out;
        if (h.first_inv) {
            if (owned && (err = cudaFreeAsync(buf, s)) != cudaSuccess) {
                owned = 0;
                goto out;
            }
            fm_cuda_leave(ctx, &guard, cudaSuccess, NULL);
            const long long i = (long long)~h.first_inv, per = (long long)(R * p.nbi);
            long long e = i / per, r = (i % per) / (long long)p.nbi;
            /* Grouped: name the group and its row, as the CPU does. */
            for (int64_t g = 0; sp && g < sp->groups; g++) {
                if (r < sp->host[g]) {
                    e = g;
                    break;
                }
                r -= sp->host[g];
            }
            return fm_error(ctx, FM_ERR_INVALID_ARG,
                            "in->scale: the scale of block (expert %lld, stored row %lld, block %lld) is %g, "
                            "not a positive power of two; scaling-aware ops need POW2 scales",
                            e, r, i % (long long)p.nbi, (double)fm_bits_f32(h.bits));
        }
    }

    what = "cudaMemsetAsync(cfg->nonfinite_blocks)";
    if (cfg->nonfinite_blocks && (err = cudaMemsetAsync(cfg->nonfinite_blocks, 0, sizeof(int64_t), s)) != cudaSuccess)
        goto out;

    if (exact128) {
        const int64_t n = E * p.sout;
        if (n > 0) {
            what = "BLOCK_128x128 scale grid: kernel launch";
            rq_grid128_kernel<<<rq_grid(fm_cdiv(n, 256), 4096), 256, 0, s>>>(
                (const uint32_t *)in->scale, (uint32_t *)out->scale, in->scale_layout, out->scale_layout, R, C,
                p.sin, p.sout, n);
            if ((err = cudaGetLastError()) != cudaSuccess)
                goto out;
        }
        if (p.ntiles) {
            what = "BLOCK_128x128 transpose: kernel launch";
            rq_transpose_bytes_kernel<<<rq_grid(p.ntiles, (int64_t)sms * 8), RQTHREADS, 0, s>>>(p);
            err = cudaGetLastError();
        }
        goto out;
    }

    if (sp) {
        rqgrp *table = (rqgrp *)((char *)buf + check_bytes);
        what = "group table: kernel launch";
        if ((err = rq_group_table(sp, out, C, table, s)) != cudaSuccess)
            goto out;
        p.grp = table;
    }

    if (out->scale_layout == FM_SCALE_LAYOUT_GEMM && nscales_out > 0) {
        what = "GEMM-layout scale padding: kernel launch";
        rq_pad_kernel<<<rq_grid(fm_cdiv(nscales_out, 256), 4096), 256, 0, s>>>(
            out->scale, out->scale_mode, p.out_e8, p.Ro, p.Co, p.sout, nscales_out, p.grp, p.groups);
        if ((err = cudaGetLastError()) != cudaSuccess)
            goto out;
    }

    if (p.ntiles && rq_rows_fit(p, tr, E)) {
        what = "row-wise conversion: kernel launch";
        err = rq_rows_launch(p, E, in->dtype, out->dtype, sms, s);
    } else if (p.ntiles) {
        what = "kernel launch";
        err = rq_launch(p, in->dtype, out->dtype, 0, 0, tr, sms, s);
    }
out:
    if (owned) {
        cudaError_t e2 = cudaFreeAsync(buf, s);
        if (err == cudaSuccess)
            err = e2;
    }
    if (err == cudaSuccess)
        return fm_cuda_leave(ctx, &guard, err, NULL);
    char msg[128];
    snprintf(msg, sizeof msg, "%s: %s", op, what);
    return fm_cuda_leave(ctx, &guard, err, msg);
}

extern "C" fm_status fm_cuda_requantize(fm_context *ctx, const fm_requant_config *cfg, const fm_tensor *in,
                                        fm_tensor *out)
{
    return rq_run(ctx, cfg, NULL, in, out);
}

extern "C" fm_status fm_cuda_requantize_grouped(fm_context *ctx, const fm_requant_config *cfg, const fm_splits *splits,
                                                const fm_tensor *in, fm_tensor *out)
{
    return rq_run(ctx, cfg, splits, in, out);
}
