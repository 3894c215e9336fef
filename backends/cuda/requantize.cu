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
 * block (in the CPU's order) whose scale is not, before anything is
 * written. The host does not wait for it: on a bad scale every later kernel
 * of the call returns at once (outputs untouched) and the finding waits in
 * the context until fm_context_synchronize reports it (cuda.h,
 * fm_cuda_pending). The kernel after the check is a programmatic dependent
 * launch: it may start, and load, while the check runs, and waits for it in
 * rq_refused before its first write. E8M0 scales need no check, nor do
 * scales the caller vouches for (cfg->trusted_pow2_scales). No call waits
 * for the device.
 *
 * The tile kernel below serves conversions and the transposes with an E2M1
 * side; FP8 -> FP8 transposes take rq_fp8t_kernel (further down) or, where
 * it fits, rq_fp8t_tma_kernel, which also takes the MXFP4 -> MXFP4
 * transposes that fit it, and conversions between row-block modes the
 * row-segment kernel.
 * GEMM-layout padding entries get 1.0 (E8M0 127) from a separate kernel.
 * BLOCK_128x128 -> BLOCK_128x128 is an exact transpose of codes and scale
 * grid (no check, no re-rounding, nonfinite count 0), as on the CPU. */
#include <stdint.h>
#include <string.h>

#include <cuda_fp16.h>

#include "cuda.h"
#include "kernels.cuh"
#include "sm90.cuh"

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
    int rows_first;  /* grouped tiles: tile rows fastest (rq_tile<true>) */
    fm_fastdiv ntrg; /* ... over this many tile rows (all groups') */
    int tile; /* a BLOCK_128x128 output of a 1x128 input (ROWMAX): one exponent per 128 x 128 tile */
    int vec_in, vec_out;
    int vec_in16; /* rows of whole 16-byte chunks from a 16-byte aligned base (FP8) */
    int tma;      /* the call may take rq_fp8t_tma_kernel (rq_tma_fits) */
    int tma_rag;  /* ... as rq_fp8t_tma_kernel<.., RAG>: groups of any size, rows of any alignment */
    int cols_first; /* plain tiles: tile columns fastest (rq_place), for the TMA kernel */
    int pdl;        /* host: the call's kernel directly follows the check, and may start during it (fm_launch) */
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
    /* fm_transpose_scaled_grouped_rows: row r of the grouped input is row
     * rmap[r] / k of `in` when rmap[r] is in [0, nslots), else padding
     * (zero codes, scale 1); NULL for every other op. */
    const int32_t *rmap;
    uint32_t nslots;
    fm_fastdiv kdiv;
    /* The power-of-two check's verdict (rqcheck.verdict), or NULL: nonzero
     * when it found a bad scale (rq_refused). */
    const unsigned long long *verdict;
} rqparams;

/* A call whose check found a bad scale writes nothing: each kernel of the
 * call returns at once. The kernel right after the check may have started
 * during it (p.pdl), so this first waits for the check to finish; every
 * kernel calls it before its first write. */
FM_DI bool rq_refused(const unsigned long long *verdict)
{
    fm_pdl_wait();
    return verdict && *verdict != 0ull;
}

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

/* Plain tile t's expert, tile row and tile column. */
FM_DI void rq_place(const rqparams &p, uint32_t t, uint32_t *te, uint32_t *tr, uint32_t *tc)
{
    if (p.cols_first)
        fm_tile_place(p.ntc, p.ntr, t, te, tr, tc);
    else
        fm_tile_place(p.ntr, p.ntc, t, te, tc, tr);
}

template <bool G>
FM_DI rqtile rq_tile(const rqparams &p, uint32_t t)
{
    rqtile k;
    if (!G) {
        /* Tile rows fastest unless p.cols_first (the TMA kernel): the CTAs at
         * work at once then share tile columns, so a compact column-wise
         * scale array's 32-byte sectors (8 tile rows of one output row) fill
         * within a short window, and the output rows are written in long
         * runs. rq_fp8t_kernel's trusted 1 x 128 transpose 74.6% -> 76.1-76.3%
         * of copy, untrusted 65.7% -> 67.3-67.8%; GEMM-layout scales and
         * MX32 unchanged (S17-9, against tile columns fastest). */
        uint32_t te, tr, tc;
        rq_place(p, t, &te, &tr, &tc);
        k.c0 = (int64_t)tc * RQT;
        k.r0 = (int64_t)tr * RQT;
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
        uint32_t tq; /* tile row over all groups */
        if (p.rows_first) {
            const uint32_t tc = fm_fastdiv_div(p.ntrg, t);
            tq = t - tc * p.ntrg.d;
            k.c0 = (int64_t)tc * RQT;
        } else {
            tq = fm_fastdiv_div(p.ntc, t);
            k.c0 = (int64_t)(t - tq * p.ntc.d) * RQT;
        }
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
        /* vo_cols and vo_align are powers of two: masks, where a 64-bit `%`
         * by a run-time value was a subroutine call for every thread and
         * tile (about 110 of the grouped kernel's extra instructions a warp
         * and tile over the plain one, SourceCounters S16-5) */
        k.vec_out = p.vec_out && (k.Co & (p.vo_cols - 1)) == 0 &&
                    ((uintptr_t)k.out & (uintptr_t)(p.vo_align - 1)) == 0;
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
        return base + (mode == FM_SCALE_BLOCK_128x128 ? r >> 7 : r) * nb + (c >> shift);
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
    /* a positive normal power of two, the common case, without
     * fm_f32_pow2_exp's four branches (the row conversion runs this once
     * a segment) */
    if ((raw & 0x807FFFFFu) == 0 && raw - 0x00800000u < 0x7F000000u)
        return (int)(raw >> 23) - 127;
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
 * so the loads of the next tile overlap the current one. rm: the tile's
 * token rows (rqf_rows_put) for the rows' transpose, else NULL. */
FM_DI void rq_load_scales_at(const rqparams &p, const rqtile &tile, uint32_t (&raw)[2], int *ok,
                             const int32_t *rm = nullptr)
{
    const int nbt = RQT >> p.bi_shift;
    *ok = 0;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int idx = threadIdx.x + h * RQTHREADS, row = idx & (RQT - 1), b = idx >> 7;
        const int64_t r = tile.r0 + row, c = tile.c0 + ((int64_t)b << p.bi_shift);
        raw[h] = 0;
        if (b < nbt && r < tile.R && c < p.C) {
            if (rm) { /* the rows' transpose: compact scales of the token rows; padding has scale 1 */
                const int64_t t = rm[row], off = t * p.nbi + (c >> p.bi_shift);
                raw[h] = t < 0    ? (p.in_e8 ? 127u : 0x3F800000u)
                         : p.in_e8 ? (uint32_t)((const uint8_t *)p.in_scale)[off]
                                   : ((const uint32_t *)p.in_scale)[off];
            } else {
                const int64_t off =
                    rq_scale_off(p.in_mode, p.in_layout, p.R, p.C, p.nbi, p.bi_shift, tile.sin0, tile.srow + r, c);
                raw[h] = p.in_e8 ? (uint32_t)((const uint8_t *)p.in_scale)[off] : ((const uint32_t *)p.in_scale)[off];
            }
            *ok |= 1 << h;
        }
    }
}

template <bool G>
FM_DI void rq_load_scales(const rqparams &p, uint32_t t, uint32_t (&raw)[2], int *ok)
{
    rq_load_scales_at(p, rq_tile<G>(p, t), raw, ok);
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

/* Output scale entry `off`: 2^pv, or NaN (and counted) for a non-finite
 * block. KEEP (F32 scales): stored with an L2 evict_last policy. For the
 * column-wise scales of rq_fp8t_tma_kernel, 4 bytes a whole output row
 * apart: the other 7 entries of each 32-byte sector come from 7 other tiles
 * a few microseconds later, and the sector, kept in L2 until they do,
 * leaves as one whole write instead of a DRAM read-modify-write of a partial
 * one (S33-6, H100, [32768, 7168]: the 1 x 128 transpose 213.8 -> 201.3
 * us, 207.0 -> 198.9 with trusted scales; the per-expert one 208.0 ->
 * 204.0). rq_fp8t_kernel's transposes gained 2 us where its tiles walk
 * rows fastest (ragged groups) and lost 3-4 where they gather token rows
 * (S33-4), so they keep plain stores. */
template <bool KEEP = false>
FM_DI void rq_store_scale(const rqparams &p, int e8, int64_t off, int bad, int pv)
{
    if (e8)
        ((uint8_t *)p.out_scale)[off] = bad ? (uint8_t)FM_E8M0_NAN : (uint8_t)(pv + 127);
    else if (KEEP)
        fm_st_keep<true, 4>((float *)p.out_scale + off, bad ? FM_F32_CANON_NAN : __float_as_uint(fm_exp2i(pv)));
    else
        ((float *)p.out_scale)[off] = bad ? fm_bits_f32(FM_F32_CANON_NAN) : fm_exp2i(pv);
    if (bad && p.nonfinite)
        atomicAdd(p.nonfinite, 1ull);
}

template <bool KEEP = false>
FM_DI void rq_put_scale(const rqparams &p, const rqtile &tile, int64_t ro, int64_t co, int bad, int pv)
{
    const int64_t off =
        rq_scale_off(p.out_mode, p.out_layout, p.Ro, tile.Co, tile.nbo, p.bo_shift, tile.sout0, ro, co);
    rq_store_scale<KEEP>(p, p.out_e8, off, bad, pv);
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
    if (t >= p.ntiles || rq_refused(p.verdict))
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

/* ---- FP8 -> FP8 transposes: keys and codes in half precision --------------
 * The tile kernel's 128 x 128 tiles and rules, for E4M3 / E5M2 in and out,
 * with the work per element cut to a few instructions a pair of codes and
 * the tile's trips through memory reorganised:
 *  - input tiles come into shared stages by cp.async (zero-filled outside
 *    the matrix), several tiles ahead; a warp owns 16 tile columns and its
 *    lane 8 rows x 8 of them, so each output block's rows sit in one warp
 *    (keys reduce by shuffles) and a tile needs two barriers;
 *  - the lane's 8 x 8 codes are transposed in registers (PRMT), so that a
 *    16-bit half holds two rows of one column: the unit both cvt
 *    directions take; codes go out through a shared [column][row] tile in
 *    16-byte stores.
 *  - keys: |value| x 2^(p_in - Q) in half precision (HMUL2), Q the largest
 *    valid input exponent of the tile, and maxima on the bits (VIMNMX.U16x2:
 *    magnitudes order as integers). A zero stays 0, NaN / Inf stay above
 *    every finite value, and the column maximum K is exactly the block's
 *    amax times 2^-Q whenever K >= rqf_thr: products of 2^-21 and more are
 *    exact (an FP8 value has at most 4 significant bits), a smaller product
 *    rounds to at most 2^-21, and a row more than 24 octaves below Q (no
 *    half-precision factor: 0) holds values below rqf_thr. The block
 *    exponent is the rule applied to K, plus Q (the rules commute with
 *    power-of-two shifts, format.h). If a block of the tile has K below
 *    rqf_thr (a zero column, or only tiny values), those blocks take the
 *    CPU's keys element by element (rq_code_key): rare and exact.
 *  - codes: code x 2^(p_in - p_out) in half precision, rounded by
 *    cvt.rn.satfinite.{e4m3,e5m2}x2.f16x2. Exact wherever the product is at
 *    least 2^-14; a smaller one may round in half precision, but below half
 *    the output's smallest subnormal it ends as a signed zero either way,
 *    as the F32 product does. The multipliers of two rows are one integer
 *    add when every d of the lane's rows and the column lies in [-14, 15];
 *    otherwise the column takes F32 and rq_mult, as the tile kernel does. */

#define RQF_FAIL 2000 /* block exponent slot of a block whose K is below rqf_thr */
#define RQF_NQ 17     /* per tile: its largest valid input exponent, then per (row group, input block) */

template <int TI>
struct rqf_thr {
    /* 2^-16 for E4M3 (448 x 2^-25 < 2^-16), 2^-9 for E5M2 (57344 x 2^-25 < 2^-9), as half bits */
    static const uint32_t v = TI == FM_DTYPE_E4M3 ? 0x0100u : 0x1800u;
};

/* Two FP8 codes (bits 0-15) as a half2, exactly. */
template <int TI>
FM_DI uint32_t rqf_h2(uint32_t two)
{
    uint32_t h;
    if (TI == FM_DTYPE_E4M3)
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"((unsigned short)two));
    else
        h = __byte_perm(two, 0u, 0x1404); /* an E5M2 code is the high byte of its F16 */
    return h;
}

/* A half2 to two FP8 codes (bits 0-15), RNE and satfinite. */
template <int TO>
FM_DI uint32_t rqf_enc2(uint32_t h)
{
    unsigned short d;
    if (TO == FM_DTYPE_E4M3)
        asm("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;" : "=h"(d) : "r"(h));
    else
        asm("cvt.rn.satfinite.e5m2x2.f16x2 %0, %1;" : "=h"(d) : "r"(h));
    return d;
}

/* The byte selectors of rqf_t4's two levels (pairs of rows, then pairs of
 * pairs); rqf_tsel_of(x) reads rows held in the order k ^ x (x < 4). */
typedef struct rqf_tsel {
    uint32_t lo1, hi1, lo2, hi2;
} rqf_tsel;

FM_DI rqf_tsel rqf_tsel_of(uint32_t x)
{
    rqf_tsel t;
    t.lo1 = x & 1u ? 0x1504u : 0x5140u;
    t.hi1 = x & 1u ? 0x3726u : 0x7362u;
    t.lo2 = x & 2u ? 0x1054u : 0x5410u;
    t.hi2 = x & 2u ? 0x3276u : 0x7632u;
    return t;
}

/* 4 x 4 bytes: rows r0..r3 (byte i = column i) -> c[i] = column i (byte k = row k). */
FM_DI void rqf_t4(uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3, uint32_t *c0, uint32_t *c1, uint32_t *c2,
                  uint32_t *c3, const rqf_tsel &ts)
{
    const uint32_t t0 = __byte_perm(r0, r1, ts.lo1), t1 = __byte_perm(r0, r1, ts.hi1);
    const uint32_t t2 = __byte_perm(r2, r3, ts.lo1), t3 = __byte_perm(r2, r3, ts.hi1);
    *c0 = __byte_perm(t0, t2, ts.lo2);
    *c1 = __byte_perm(t0, t2, ts.hi2);
    *c2 = __byte_perm(t1, t3, ts.lo2);
    *c3 = __byte_perm(t1, t3, ts.hi2);
}

/* 8 rows of 8 bytes (cw[k][q]: row k, columns 4 q .. 4 q + 3) -> col[j][h]:
 * column j, rows 4 h .. 4 h + 3; with ts = rqf_tsel_of(x), cw[k] holding
 * row k ^ x. */
FM_DI void rqf_t8(const uint32_t (&cw)[8][2], uint32_t (&col)[8][2], const rqf_tsel &ts = rqf_tsel_of(0))
{
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
        for (int q = 0; q < 2; q++)
            rqf_t4(cw[4 * h][q], cw[4 * h + 1][q], cw[4 * h + 2][q], cw[4 * h + 3][q], &col[4 * q][h],
                   &col[4 * q + 1][h], &col[4 * q + 2][h], &col[4 * q + 3][h], ts);
}

/* Factors 2^(p - Q) as half bits, by e = clamp(p - Q, -26, 1) + 26: 0 for
 * rows more than 24 octaves below Q and outside the matrix (RQ_EMPTY), NaN
 * for a NaN scale (RQ_NAN_ROW); p <= Q otherwise. */
#define RQF_NLUT 28
FM_DI uint32_t rqf_factor_bits(int i)
{
    const int e = i - 26;
    return i == 27 ? 0x7E00u : e < -24 ? 0u : e >= -14 ? (uint32_t)(e + 15) << 10 : 1u << (e + 24);
}

FM_DI uint32_t rqf_factor(const uint32_t *lut, int p, int Q)
{
    return lut[min(max(p - Q, -26), 1) + 26];
}

/* The next tile's input exponents (as rq_store_scales), and its largest
 * valid one overall (q[0]) and per (output row group, input block)
 * (q[1 + 4 g + b]), by warp maxima: a warp's 32 entries share b and g. */
FM_DI void rqf_store_scales(const rqparams &p, int (*pin_s)[RQT], int *q, const uint32_t (&raw)[2], int ok)
{
    const int nbt = RQT >> p.bi_shift;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int idx = threadIdx.x + h * RQTHREADS, row = idx & (RQT - 1), b = idx >> 7;
        if (b < nbt) {
            const int pin = (ok >> h) & 1 ? rq_pin(raw[h], p.in_e8) : RQ_EMPTY;
            pin_s[b][row] = pin;
            const int m = __reduce_max_sync(0xFFFFFFFFu, rq_pin_valid(pin) ? pin : RQ_EMPTY);
            if ((threadIdx.x & 31) == 0 && m != RQ_EMPTY) {
                atomicMax(&q[0], m);
                atomicMax(&q[1 + 4 * (row >> p.bo_shift) + b], m);
            }
        }
    }
}

/* A tile wholly inside its output matrix with 16-byte stores: one pointer
 * a thread, advanced by 32 output rows a pass (no per-row bounds). */
FM_DI bool rqf_full_out(const rqparams &p, const rqtile &tl)
{
    return tl.vec_out && tl.c0 + RQT <= p.Ro && tl.r0 + RQT <= tl.Co;
}

/* Tile t's codes into a shared stage (128 rows of 128 bytes, zeros outside
 * the matrix; 16-byte chunk ch of row r at chunk ch ^ (r / 8 mod 8), so
 * that the lanes of a warp, 16 row groups of 8 rows reading the same chunk
 * column, spread over the banks): cp.async of 16-byte chunks when the rows allow them
 * (p.vec_in16: row length a multiple of 16, aligned base), loads
 * through registers otherwise (rare: odd row lengths). */
FM_DI void rqf_cp16(uint8_t *dst, const uint8_t *src, bool in)
{
    const uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(in ? 16 : 0) : "memory");
}

/* The rows' transpose: the token rows of tile tf's 128 rows (-1: padding,
 * or past the matrix) go into shared memory, by one thread of each 8 that
 * fill a row, an iteration before the fill (slots: rq_fp8t_kernel), so that
 * the fill's addresses do not wait on them; the next tile's input scales
 * take them from there too. In two halves around the store pass: the map
 * entries into registers (tl: tile tf's place), then the token rows. */
FM_DI void rqf_rows_fetch(const rqparams &p, uint64_t tf, const rqtile &tl, uint32_t (&m)[4])
{
#pragma unroll
    for (int i = 0; i < 4; i++)
        m[i] = 0xFFFFFFFFu;
    if ((threadIdx.x & 7) || tf >= p.ntiles)
        return;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int64_t r = tl.r0 + (threadIdx.x >> 3) + 32 * i;
        if (r < tl.R)
            m[i] = (uint32_t)__ldg(p.rmap + tl.srow + r);
    }
}

FM_DI void rqf_rows_put(const rqparams &p, const uint32_t (&m)[4], int32_t *rm)
{
    if (threadIdx.x & 7)
        return;
#pragma unroll
    for (int i = 0; i < 4; i++)
        rm[(threadIdx.x >> 3) + 32 * i] = m[i] < p.nslots ? (int32_t)fm_fastdiv_div(p.kdiv, m[i]) : -1;
}

/* Both halves at once, the place found here (the prologue). */
FM_DI void rqf_rows_map(const rqparams &p, uint64_t tf, int32_t *rm)
{
    uint32_t m[4];
    rqf_rows_fetch(p, tf, tf < p.ntiles ? rq_tile<true>(p, (uint32_t)tf) : rqtile{}, m);
    rqf_rows_put(p, m, rm);
}

template <int TI, bool G>
FM_DI void rqf_fill_stage(const rqparams &p, uint32_t t, const rqtile &tl, uint8_t *stage, const int32_t *rm)
{
    const int tid = threadIdx.x;
    if (G && p.rmap) {
        /* the token rows (rq_run made sure of p.vec_in16); padding rows zero-filled */
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int id = tid + i * RQTHREADS, row = id >> 3, ch = id & 7;
            const int64_t c = tl.c0 + 16 * ch;
            const int64_t t = rm[row];
            const bool in = t >= 0 && c < p.C;
            rqf_cp16(stage + row * RQT + 16 * (ch ^ ((row >> 3) & 7)), in ? p.in + t * p.C + c : p.in, in);
        }
    } else if (p.vec_in16 && tl.r0 + RQT <= tl.R && tl.c0 + RQT <= p.C) {
        /* a whole tile: chunk ch of rows row + 32 i (swizzle bit 2 flips with i) */
        const int row = tid >> 3, ch = tid & 7;
        const uint8_t *src = tl.in + (tl.r0 + row) * p.C + tl.c0 + 16 * ch;
        uint8_t *dst = stage + row * RQT;
        const int x0 = 16 * (ch ^ ((row >> 3) & 7)), x1 = 16 * (ch ^ (((row >> 3) + 4) & 7));
        const int64_t step = 32 * p.C;
#pragma unroll
        for (int i = 0; i < 4; i++)
            rqf_cp16(dst + i * 32 * RQT + ((i & 1) ? x1 : x0), src + i * step, true);
    } else if (p.vec_in16) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int id = tid + i * RQTHREADS, row = id >> 3, ch = id & 7;
            const int64_t r = tl.r0 + row, c = tl.c0 + 16 * ch;
            const bool in = r < tl.R && c < p.C;
            rqf_cp16(stage + row * RQT + 16 * (ch ^ ((row >> 3) & 7)), in ? tl.in + r * p.C + c : tl.in, in);
        }
    } else {
        uint32_t cw[8][2];
        rq_load_codes<TI, G>(p, t, cw);
        const int w = tid >> 5, l = tid & 31, r = w * 16 + (l >> 4) * 8, cb = (l & 15) * 8;
        uint8_t *d = stage + r * RQT + 16 * ((cb >> 4) ^ ((r >> 3) & 7)) + (cb & 8);
#pragma unroll
        for (int k = 0; k < 8; k++)
            *(uint2 *)(d + k * RQT) = make_uint2(cw[k][0], cw[k][1]);
    }
}

/* The transposed tile out of shared memory ([tile column][tile row], 128
 * bytes a column, no swizzle): output row c0 + c, 16 bytes a thread. WARP:
 * each warp stores the 16 columns it wrote (rq_fp8t_kernel's lanes), 4 a
 * pass, so no barrier stands between the codes and their stores; else the
 * CTA stores all 128, 32 a pass. */
template <int TO, bool WARP>
FM_DI void rqf_store_tile(const rqparams &p, const uint8_t *tsm, const rqtile &tl)
{
    const int tid = threadIdx.x, qq = tid & 7;
    const int c = WARP ? ((tid >> 5) << 4) + ((tid & 31) >> 3) : tid >> 3, cstep = WARP ? 4 : 32;
    if (rqf_full_out(p, tl)) {
        uint8_t *dst = tl.out + (tl.c0 + c) * tl.Co + tl.r0 + 16 * qq;
        const int64_t step = cstep * tl.Co;
#pragma unroll
        for (int pass = 0; pass < 4; pass++)
            __stcs((uint4 *)(dst + pass * step), *(const uint4 *)(tsm + (c + cstep * pass) * 128 + 16 * qq));
        return;
    }
#pragma unroll
    for (int pass = 0; pass < 4; pass++) {
        const int64_t sr = tl.c0 + c + cstep * pass, sc = tl.r0 + 16 * qq;
        if (sr >= p.Ro || sc >= tl.Co)
            continue;
        const uint4 val = *(const uint4 *)(tsm + (c + cstep * pass) * 128 + 16 * qq);
        uint8_t *dst = tl.out + sr * tl.Co + sc;
        if (tl.vec_out) {
            __stcs((uint4 *)dst, val);
            continue;
        }
        /* A group whose row length is not a multiple of 16 (its rows start
         * anywhere): the widest stores the address allows, bytes at the end. */
        const int n = tl.Co - sc < 16 ? (int)(tl.Co - sc) : 16;
        const uintptr_t a = (uintptr_t)dst;
        const uint32_t wd[4] = {val.x, val.y, val.z, val.w};
        if (n == 16 && a % 8 == 0) {
            __stcs((uint2 *)dst, make_uint2(val.x, val.y));
            __stcs((uint2 *)(dst + 8), make_uint2(val.z, val.w));
            continue;
        }
        const int nw = a % 4 == 0 ? n >> 2 : 0; /* whole words stored as words */
#pragma unroll
        for (int k = 0; k < 4; k++)
            if (k < nw)
                __stcs((unsigned int *)(dst + 4 * k), wd[k]);
#pragma unroll
        for (int b = 0; b < 16; b++)
            if (b >= 4 * nw && b < n)
                dst[b] = (uint8_t)(wd[b >> 2] >> (8 * (b & 3)));
    }
}

/* The maximum over the lanes holding one output block's rows (the row
 * group is lane bits 1-2 for a 32-row block, 1-4 for a 128-row one): of
 * 16-bit pairs (PAIRS), or of signed keys. */
template <bool PAIRS>
FM_DI uint32_t rqf_block_max(uint32_t v, bool b128)
{
#pragma unroll
    for (int s = 2; s <= 16; s <<= 1) {
        if (s >= 8 && !b128)
            break;
        const uint32_t o = __shfl_xor_sync(0xFFFFFFFFu, v, s);
        v = PAIRS ? __vmaxu2(v, o) : (uint32_t)rq_max((int)v, (int)o);
    }
    return v;
}

/* ROWMAX's only question to the codes: which of the lane's 8 columns hold,
 * in any row of their output block, a non-finite code or a row whose input
 * scale is NaN (bit j). The block's lanes are combined as in rqf_block_max;
 * rows outside the matrix (invalid p_in) hold nothing. */
template <int TI>
FM_DI uint32_t rqf_nonfinite_cols(const uint32_t (&col)[8][2], const int (&pk)[8], bool b128)
{
    const uint32_t mag = TI == FM_DTYPE_E4M3 ? 0x7F7F7F7Fu : 0x7C7C7C7Cu; /* NaN (E4M3), Inf/NaN (E5M2) */
    uint32_t vm[2] = {0u, 0u};
    bool nan_row = false;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        if (rq_pin_valid(pk[k]))
            vm[k >> 2] |= 0xFFu << (8 * (k & 3));
        nan_row = nan_row || pk[k] == RQ_NAN_ROW;
    }
    uint32_t bits = nan_row ? 0xFFu : 0u;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const uint32_t e = (__vcmpeq4(col[j][0] & mag, mag) & vm[0]) | (__vcmpeq4(col[j][1] & mag, mag) & vm[1]);
        bits |= (e != 0u ? 1u : 0u) << j;
    }
#pragma unroll
    for (int s = 2; s <= 16; s <<= 1) {
        if (s >= 8 && !b128)
            break;
        bits |= __shfl_xor_sync(0xFFFFFFFFu, bits, s);
    }
    return bits;
}

/* A column's 8 codes in the common case (every row's d = p_in - p_out in
 * [-14, 15]): the packed half-precision multiplier 2^d of rows 2q, 2q + 1
 * is Rp[q] (their p_in - rlo) plus the column's (rlo - p_out + 15), one
 * integer add, then one HMUL2 and one saturating cvt a pair. */
template <int TI, int TO>
FM_DI uint2 rqf_fast_col(uint32_t c0, uint32_t c1, const uint32_t (&Rp)[4], int rlo, int pout)
{
    const uint32_t Cc = (uint32_t)(rlo - pout + 15) << 10, C2 = Cc | (Cc << 16);
    uint32_t e[4];
#pragma unroll
    for (int q = 0; q < 4; q++) {
        const uint32_t h = rqf_h2<TI>((q < 2 ? c0 : c1) >> (16 * (q & 1))), mh = Rp[q] + C2;
        const __half2 y = __hmul2(*(const __half2 *)&h, *(const __half2 *)&mh);
        e[q] = rqf_enc2<TO>(*(const uint32_t *)&y);
    }
    return make_uint2(e[0] | (e[1] << 16), e[2] | (e[3] << 16));
}

/* The rare paths, out of line (the kernel's loop stays small in the
 * instruction cache). A column's 8 codes (rows 0-3, 4-7) and the rows'
 * input exponents (shared memory): the CPU's key of its block maximum, ... */
template <int TI, int TO>
static __device__ __noinline__ int rqf_exact_key(uint32_t c0, uint32_t c1, const int *pin, int rule)
{
    int key = RQ_KEY_MIN;
#pragma unroll 1
    for (int k = 0; k < 8; k++) {
        const uint32_t code = ((k < 4 ? c0 : c1) >> (8 * (k & 3))) & 0x7Fu;
        key = rq_max(key, rq_code_key<TI, TO>((int)code, rule) + pin[k]);
    }
    return key;
}

/* ... and its output codes through F32, for any d (rq_mult's clamps); an
 * E2M1 output's 8 codes in .x (row k in bits 4k..4k+3). */
template <int TI, int TO>
static __device__ __noinline__ uint2 rqf_slow_col(uint32_t c0, uint32_t c1, const int *pin, int pout)
{
    uint32_t e[4];
#pragma unroll
    for (int q = 0; q < 4; q++) {
        const uint32_t h = rqf_h2<TI>((q < 2 ? c0 : c1) >> (16 * (q & 1)));
        const float lo = fm_hw_f16_to_f32((uint16_t)(h & 0xFFFFu)), hi = fm_hw_f16_to_f32((uint16_t)(h >> 16));
        const float ylo = __fmul_rn(lo, rq_mult(pin[2 * q], pout)), yhi = __fmul_rn(hi, rq_mult(pin[2 * q + 1], pout));
        e[q] = TO == FM_DTYPE_E4M3   ? fm_hw_e4m3x2(ylo, yhi)
             : TO == FM_DTYPE_E5M2 ? fm_hw_e5m2x2(ylo, yhi)
                                   : (uint32_t)fm_e2m1_from_f32(ylo) | ((uint32_t)fm_e2m1_from_f32(yhi) << 4);
    }
    if (TO == FM_DTYPE_E2M1)
        return make_uint2(e[0] | (e[1] << 8) | (e[2] << 16) | (e[3] << 24), 0u);
    return make_uint2(e[0] | (e[1] << 16), e[2] | (e[3] << 16));
}

/* Input stages in flight: the plain form keeps 4 (2 CTAs an SM), the
 * grouped form 3 (3 CTAs an SM): measured best each (S9, after S9-11:
 * 4 stages gave the plain transpose 70 -> 74% of copy, the grouped one
 * 66 -> 60%). Dynamic shared memory: the stages, then the transposed tile. */
#define RQF_STAGES(G) ((G) ? 3 : 4)
#define RQF_DYN_SMEM(G) ((RQF_STAGES(G) + 1) * RQT * RQT)

/* Lane l of warp w: rows 8 rg .. 8 rg + 7 (rg = l / 2) of tile columns
 * 16 w + 8 cg .. + 7 (cg = l % 2), so a warp holds whole output blocks
 * (128 or 32 rows of its 16 columns): the column keys reduce by shuffles,
 * the warp stores its own transposed columns, and a tile needs one barrier
 * (its stage in; the rows' transpose keeps a second for its row map). */
template <int TI, int TO, bool G>
__global__ void __launch_bounds__(RQTHREADS, G ? 3 : 2) rq_fp8t_kernel(const rqparams p)
{
    constexpr int S = RQF_STAGES(G);
    extern __shared__ __align__(16) uint8_t rqf_dyn[];
    __shared__ __align__(16) int pin_s[2][4][RQT];
    __shared__ int qs[2][RQF_NQ];
    __shared__ uint32_t flut[RQF_NLUT];
    __shared__ rqtile tl_s[S]; /* tile places, by stage */
    uint8_t *const tsm = rqf_dyn + S * RQT * RQT;

    const int tid = threadIdx.x, w = tid >> 5, l = tid & 31, rg = l >> 1, cg = l & 1;
    const int rl = rg * 8, cl = w * 16 + cg * 8;

    uint32_t t = blockIdx.x;
    if (t >= p.ntiles || rq_refused(p.verdict))
        return;
    uint32_t raw[2];
    int ok;
    if (tid < RQF_NQ)
        qs[0][tid] = RQ_EMPTY;
    if (tid < RQF_NLUT)
        flut[tid] = rqf_factor_bits(tid);
    /* Tiles t .. t + (S - 2) grid into stages 0 .. S - 2 (a cp.async group each, empty past the end). */
    /* The rows' transpose: row-map entries by tile, three slots. Iteration j
     * fills from slot j % 3, loads the next tile's scales through slot
     * (j + 2) % 3 (that tile was the last iteration's fill) and writes the
     * next fill's map into slot (j + 1) % 3, which nothing reads before the
     * next iteration's first barrier. The prologue's stage i uses slot i + 1. */
    __shared__ int32_t rm_s[3][RQT];
    /* and the place of the next fill's tile, by parity, worked out once (by thread 0, with the map) */
    __shared__ rqtile tln_s[G ? 2 : 1];
#pragma unroll
    for (int i = 0; i < S - 1; i++) {
        const uint32_t ti = t + i * gridDim.x;
        if (ti < p.ntiles && ti >= t) {
            const rqtile tl = rq_tile<G>(p, ti);
            if (tid == 0)
                tl_s[i] = tl;
            if (G && p.rmap) { /* block-uniform */
                rqf_rows_map(p, ti, rm_s[(i + 1) % 3]);
                __syncthreads();
            }
            rqf_fill_stage<TI, G>(p, ti, tl, rqf_dyn + i * RQT * RQT, rm_s[(i + 1) % 3]);
            if (i == 0)
                rq_load_scales_at(p, tl, raw, &ok, G && p.rmap ? rm_s[1] : nullptr);
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    }
    __syncthreads();
    rqf_store_scales(p, pin_s[0], qs[0], raw, ok);
    if (G && p.rmap) { /* the first loop fill's, slot 0 (the loop's first barrier orders it) */
        const uint64_t tf0 = (uint64_t)t + (uint64_t)(S - 1) * gridDim.x;
        rqf_rows_map(p, tf0, rm_s[0]);
        if (tid == 0 && tf0 < p.ntiles)
            tln_s[G ? 1 : 0] = rq_tile<G>(p, (uint32_t)tf0);
    }

    static_assert(!G || RQF_STAGES(G) == 3, "the rows' map slots assume 3 stages in the grouped kernel");
    for (int buf = 0, slot = 0, ms = 0; t < p.ntiles; buf ^= 1, ms = ms == 2 ? 0 : ms + 1) {
        const int nslot = slot == S - 1 ? 0 : slot + 1, fslot = slot == 0 ? S - 1 : slot - 1;
        const uint32_t tn = t + gridDim.x;
        const uint64_t tf = (uint64_t)t + (uint64_t)(S - 1) * gridDim.x; /* the tile whose stage is filled now */
        const bool more = tn < p.ntiles && tn > t;
        /* Tile t's stage complete and visible; every thread is past the last tile. */
        asm volatile("cp.async.wait_group %0;" ::"n"(S - 2) : "memory");
        __syncthreads();
        if (tf < p.ntiles && G && p.rmap) { /* the place worked out last iteration, read where used */
            const rqtile &tl = tln_s[G ? (buf ^ 1) : 0];
            if (tid == 0)
                tl_s[fslot] = tl;
            rqf_fill_stage<TI, G>(p, (uint32_t)tf, tl, rqf_dyn + fslot * RQT * RQT, rm_s[ms]);
        } else if (tf < p.ntiles) {
            const rqtile tl = rq_tile<G>(p, (uint32_t)tf);
            if (tid == 0)
                tl_s[fslot] = tl;
            rqf_fill_stage<TI, G>(p, (uint32_t)tf, tl, rqf_dyn + fslot * RQT * RQT, rm_s[ms]);
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
        if (tid < RQF_NQ)
            qs[buf ^ 1][tid] = RQ_EMPTY;
        if (more)
            rq_load_scales_at(p, tl_s[nslot], raw, &ok, G && p.rmap ? rm_s[ms == 0 ? 2 : ms - 1] : nullptr);

        /* the lane's 8 x 8 codes by columns: col[j][0] rows 0-3, col[j][1] rows 4-7 */
        uint32_t col[8][2];
        {
            const uint8_t *sb = rqf_dyn + slot * RQT * RQT + rl * RQT + 16 * (w ^ (rg & 7)) + 8 * cg;
            uint32_t cw[8][2];
#pragma unroll
            for (int k = 0; k < 8; k++) {
                const uint2 v = *(const uint2 *)(sb + k * RQT);
                cw[k][0] = v.x;
                cw[k][1] = v.y;
            }
            rqf_t8(cw, col);
        }

        int pk[8];
        const int b = cl >> p.bi_shift;
        {
            const int4 a = *(const int4 *)&pin_s[buf][b][rl], c = *(const int4 *)&pin_s[buf][b][rl + 4];
            pk[0] = a.x, pk[1] = a.y, pk[2] = a.z, pk[3] = a.w, pk[4] = c.x, pk[5] = c.y, pk[6] = c.z, pk[7] = c.w;
        }
        const int Qr = qs[buf][0], Q = Qr == RQ_EMPTY ? 0 : Qr;
        const bool b128 = p.bo == 128;

        /* 1. block maxima of |value| 2^(p_in - Q), two columns a word: the
         * lane's 8 rows, then the lanes of the block (rg bits: lane bits 1-4).
         * ROWMAX takes its exponents from the input scales (qs) and only
         * needs to know which columns hold a non-finite value: bit j of nfb. */
        uint32_t kp[4] = {0u, 0u, 0u, 0u}, nfb = 0u;
        if (p.rule == FM_REQUANT_ROWMAX)
            nfb = rqf_nonfinite_cols<TI>(col, pk, b128);
        else {
            uint32_t F[4];
#pragma unroll
            for (int q = 0; q < 4; q++)
                F[q] = rqf_factor(flut, pk[2 * q], Q) | (rqf_factor(flut, pk[2 * q + 1], Q) << 16);
            uint32_t m[8];
#pragma unroll
            for (int j = 0; j < 8; j++) {
                uint32_t x[4];
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    const uint32_t h = rqf_h2<TI>(col[j][q >> 1] >> (16 * (q & 1)));
                    const __half2 a = __hmul2(__habs2(*(const __half2 *)&h), *(const __half2 *)&F[q]);
                    x[q] = *(const uint32_t *)&a;
                }
                m[j] = __vmaxu2(__vimax3_u16x2(x[0], x[1], x[2]), x[3]);
            }
#pragma unroll
            for (int i = 0; i < 4; i++) {
                kp[i] = rqf_block_max<true>(__vmaxu2(__byte_perm(m[2 * i], m[2 * i + 1], 0x5410),
                                                     __byte_perm(m[2 * i], m[2 * i + 1], 0x7632)),
                                            b128);
            }
        }

        /* Each block's exponent by one lane: a 1 x 128 block's column rg (lanes
         * rg < 8 write its scale), a 32-row block's columns rg % 4 and + 4. */
        const rqtile &tile = tl_s[slot]; /* read where used: fewer registers live */
        const int g = b128 ? 0 : rg >> 2, jj = b128 ? rg & 7 : rg & 3;
        int pv[2], fail[2] = {0, 0};
#pragma unroll
        for (int e = 0; e < 2; e++) {
            pv[e] = 0;
            if (e == 1 && b128)
                break;
            const int j = jj + 4 * e, c = cl + j;
            const uint32_t kw = j < 2 ? kp[0] : j < 4 ? kp[1] : j < 6 ? kp[2] : kp[3];
            const uint32_t K = (kw >> (16 * (j & 1))) & 0xFFFFu;
            int key;
            if (p.rule == FM_REQUANT_ROWMAX ? ((nfb >> j) & 1u) != 0u : K >= 0x7C00u)
                key = RQ_BIG;
            else if (p.rule == FM_REQUANT_ROWMAX)
                key = qs[buf][1 + 4 * g + (c >> p.bi_shift)];
            else if (K >= rqf_thr<TI>::v) {
                const float a = __half2float(__ushort_as_half((unsigned short)K));
                key = (p.rule == FM_REQUANT_MX_FLOOR ? fm_mx_floor_scale_exp(a, (fm_dtype)TO)
                                                     : fm_pow2_scale_exp(a, (fm_dtype)TO)) + Q;
            } else
                key = RQ_KEY_MIN;
            const int64_t ro = tile.c0 + c, co = tile.r0 + ((int64_t)g << p.bo_shift);
            const bool mine = (!b128 || rg < 8) && ro < p.Ro && co < tile.Co;
            if (key == RQ_KEY_MIN) {
                pv[e] = RQF_FAIL;
                fail[e] = mine;
            } else {
                pv[e] = rq_block_exp(key);
                if (mine && !p.tile)
                    rq_put_scale(p, tile, ro, co, pv[e] == RQ_BADP, pv[e]);
            }
        }
        if (p.tile) {
            /* One block a tile (ROWMAX: the columns' exponents agree): non-finite
             * as a whole when any stored column is, its scale stored once. The
             * columns' keys come from qs, never RQ_KEY_MIN, so none failed. */
            const bool bad = __syncthreads_or(pv[0] == RQ_BADP && tile.c0 + cl + jj < p.Ro);
            if (bad)
                pv[0] = RQ_BADP;
            if (tid == 0)
                rq_put_scale(p, tile, tile.c0, tile.r0, bad, pv[0]);
        }
        if (__any_sync(0xFFFFFFFFu, fail[0] | fail[1])) {
            /* The CPU's keys, element by element, for the blocks K could not settle. */
            int ck[8];
#pragma unroll
            for (int j = 0; j < 8; j++) {
                ck[j] = (int)rqf_block_max<false>(
                    (uint32_t)rqf_exact_key<TI, TO>(col[j][0], col[j][1], &pin_s[buf][b][rl], p.rule), b128);
            }
#pragma unroll
            for (int e = 0; e < 2; e++) {
                if (!fail[e])
                    continue;
                const int j = jj + 4 * e, c = cl + j;
                int key = ck[0];
#pragma unroll
                for (int i = 1; i < 8; i++)
                    if (i == j)
                        key = ck[i];
                pv[e] = rq_block_exp(key);
                rq_put_scale(p, tile, tile.c0 + c, tile.r0 + ((int64_t)g << p.bo_shift), pv[e] == RQ_BADP, pv[e]);
            }
        }

        /* 2. codes, a column at a time into the shared transposed tile */
        {
            int rlo = 1000, rhi = -1000;
#pragma unroll
            for (int k = 0; k < 8; k++)
                if (rq_pin_valid(pk[k])) {
                    rlo = rq_min(rlo, pk[k]);
                    rhi = rq_max(rhi, pk[k]);
                }
            if (rlo > rhi)
                rlo = rhi = 0;
            uint32_t Rp[4]; /* (p_in - rlo) << 10 of rows 2q, 2q + 1 (rlo for rows that hold nothing stored) */
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int a = rq_pin_valid(pk[2 * q]) ? pk[2 * q] - rlo : 0;
                const int c = rq_pin_valid(pk[2 * q + 1]) ? pk[2 * q + 1] - rlo : 0;
                Rp[q] = ((uint32_t)a << 10) | ((uint32_t)c << 26);
            }
            const int lo = rhi - 15, hi = rlo + 14;
            uint8_t *const tput = tsm + cl * RQT + rl;
            /* the exponents of the lane's 8 columns' blocks, from the lanes that settled them */
            int pjs[8];
            bool fast = true;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const int src = b128 ? (j << 1) | cg : ((4 * g + (j & 3)) << 1) | cg;
                pjs[j] = __shfl_sync(0xFFFFFFFFu, (b128 || j < 4) ? pv[0] : pv[1], src);
                fast = fast && pjs[j] >= lo && pjs[j] <= hi;
            }
            if (fast) {
#pragma unroll
                for (int j = 0; j < 8; j++)
                    *(uint2 *)(tput + j * RQT) = rqf_fast_col<TI, TO>(col[j][0], col[j][1], Rp, rlo, pjs[j]);
            } else
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const int pj = pjs[j];
                uint2 v;
                if (pj >= lo && pj <= hi)
                    v = rqf_fast_col<TI, TO>(col[j][0], col[j][1], Rp, rlo, pj);
                else if (pj == RQ_BADP)
                    v = make_uint2(fm_nan_word<TO>(), fm_nan_word<TO>());
                else
                    v = rqf_slow_col<TI, TO>(col[j][0], col[j][1], &pin_s[buf][b][rl], pj);
                *(uint2 *)(tput + j * RQT) = v;
            }
        }
        if (more)
            rqf_store_scales(p, pin_s[buf ^ 1], qs[buf ^ 1], raw, ok);
        /* The rows' transpose: the next fill's tile place now (read after the
         * barrier below and at the next iteration's top), its map entries in
         * flight during the store pass, into shared memory after it. */
        const uint64_t tfn = tf + gridDim.x;
        if (G && p.rmap) { /* block-uniform */
            if (tid == 0 && tfn < p.ntiles)
                tln_s[G ? buf : 0] = rq_tile<G>(p, (uint32_t)tfn);
            __syncthreads();
            uint32_t mv[4];
            rqf_rows_fetch(p, tfn, tln_s[G ? buf : 0], mv);
            /* 3. coalesced stores of the transposed tile */
            rqf_store_tile<TO, false>(p, tsm, tile);
            rqf_rows_put(p, mv, rm_s[ms == 2 ? 0 : ms + 1]);
        } else {
            /* 3. each warp's own 16 columns: the next iteration's barrier
             * keeps the next tile's codes out of tsm until they are stored
             * (a barrier here held 10% of the stall samples, S17-3) */
            __syncwarp();
            rqf_store_tile<TO, true>(p, tsm, tile);
        }

        if (!more)
            break;
        t = tn;
        slot = nslot;
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
}

/* ---- the plain FP8 -> FP8 1x128 and MX32 (and MXFP4) transposes, fed by TMA
 * rq_fp8t_kernel's arithmetic for the commonest calls (E4M3 -> E4M3 or E5M2
 * -> E5M2, 1 x 128 F32 scales -> 128 x 1, TIGHT or ROWMAX, or -> 128 x 128
 * under ROWMAX, where the consumer warps agree on the tile's one non-finite
 * verdict at a named barrier; (MX) MX32 -> MX32 under any rule, each lane's
 * 8 rows in one 32 x 32 block of the tile, whose Q its 4 lanes find among
 * themselves from the rows' E8M0 words: 226.4-227.4 -> 158.4-159.3 us
 * against rq_fp8t_kernel, H200, [32768, 7168]; (X) MXFP4 -> MXFP4 the same
 * way, its codes read as the E4M3 codes of 2^-6 their values and encoded
 * by fm_fp8x8_e2m1's half-precision FMAs, for plain calls and groups of
 * whole tiles (rq_tma_fits): 436 -> 177 us against the tile kernel, H200,
 * S40-6, and bound by the ALU pipe (ncu S40-3, S40-5: its PRMTs, LOP3s and
 * half minima wait for it); one matrix, a stack of experts, (G)
 * fm_transpose_scaled_grouped's groups of any size (a ragged group's last
 * tile masked, rqt_mask_rows), or fm_transpose_scaled_grouped_rows's token
 * rows, gathered: rqt_gather_rows),
 * with the tile's instructions cut where that kernel spends them
 * (notes/transpose_scaled.md has the counts: on an H200 the old
 * kernel ran on instructions and latency, and this one is 1.14x faster; on an
 * H100 both run on DRAM, S23, and the grouped call gains from the barrier and
 * group search per tile that this kernel does not have):
 *  - one or two producer warps (alternate tiles; rq_tma_producers) stream
 *    each tile's codes into a ring of RQT_STAGES stages with one TMA copy
 *    (128-byte swizzle, zeros past the matrix) and its 128 row exponents
 *    and their maximum Q and minimum, completing on a "full" mbarrier;
 *    the 8 consumer warps hand a stage back on an "empty" one as soon as
 *    they hold it in registers. No CTA-wide barrier per tile:
 *    each warp owns 16 whole output blocks (columns) and runs on its own.
 *  - each code is decoded once: s = h x 2^(p_in - Q) in half precision, the
 *    column maxima of |s| give the block exponents (the maximum is exact when
 *    it is at least rqf_thr, as in rq_fp8t_kernel), and the output code is
 *    enc(s x 2^(Q - p_out)), one multiply by the column's power of two. That
 *    equals RNE(code x 2^(p_in - p_out)) whenever every product s is exact
 *    (no row more than L octaves below Q) or, for E4M3, when Q - p_out <= 6:
 *    an inexact s is below 2^-20, and a row dropped by the factor table (more
 *    than 24 octaves below Q) below 1.75 x 2^-17, so either times 2^6 still
 *    rounds to zero as its exact value does. Other columns take the exact
 *    per-element path (rqf_slow_col), blocks whose maximum is below rqf_thr
 *    the exact key (rqf_exact_key).
 *  - each lane stores its 8 columns' 8 rows as 8-byte pieces: a warp's store
 *    covers two whole 128-byte output rows, no shared staging.
 * Lane l of consumer warp w holds rows 8 rg .. 8 rg + 7 (rg = l / 2) of
 * columns 16 w + 8 cg .. + 7 (cg = l % 2). With the 128-byte swizzle, row r's
 * 16-byte chunk w sits at chunk w ^ (r % 8); reading its rows in the order
 * k ^ (rg % 8) spreads a warp's 32 loads over all banks, and two byte
 * permutes a column put the rows back in order. */

#define RQT_STAGES 4
#define RQT_CONSUMERS 8
/* P producer warps take alternate tiles (each stage has one producer), a
 * choice per call (rq_tma_producers): one left the consumers waiting at the
 * full barrier for a quarter of their stall samples even with its scale
 * loads a tile ahead, itself waiting on them (H200, S34-8). */
#define RQT_THREADS(P) (32 * (RQT_CONSUMERS + (P)))
/* Codes (1024-byte aligned stages, 1 KiB of slack to align the base), then
 * per stage the 128 row exponents (MX: the rows' E8M0 words) and the tile's
 * (Q, smallest exponent; not used by MX). */
#define RQT_DYN_SMEM (1024 + RQT_STAGES * (RQT * RQT + RQT * 4 + 8))

/* T: the element dtype; E2M1 codes go through the kernel as the E4M3 codes
 * of 2^-6 their values (fm_e2m1x8_as_e4m3), whose rules these are. */
template <int T>
struct rqt_fmt {
    static const bool x = T == FM_DTYPE_E2M1;
    static const int tc = x ? FM_DTYPE_E4M3 : T; /* the codes' dtype in the kernel */
    static const int oct = x ? 6 : 0;            /* octaves the codes' reading lowers the values by */
    /* f16 K -> p_out - Q: 15 + the element's emax (E2M1: less the 6 octaves of its E4M3 codes) */
    static const int kbias = T == FM_DTYPE_E4M3 ? 23 : T == FM_DTYPE_E5M2 ? 30 : 11;
    /* the power-of-two rule rounds K's exponent up past a mantissa of 1.75 (E4M3 448, E5M2 57344) or 1.5 (E2M1 6) */
    static const int kround = x ? 0x1FF : 0xFF;
    static const int exact_rows = T == FM_DTYPE_E4M3 ? 15 : 8; /* octaves below Q that keep every s exact (FP8) */
    /* exact and normal; E2M1: also p_out >= Q - 8, so that the encoder's
     * shift Q - p_out + 6 stays inside fm_h2_shift3_of's range (rqt_enc8x) */
    static const uint32_t kfast = x ? 0xC00u : rqf_thr<T>::v > 0x400u ? rqf_thr<T>::v : 0x400u;
};

/* Whether the call was refused (rq_refused); if so, after the copies a
 * producer started into stages first, first + P, ... below n
 * (its first tiles) have landed (a CTA must not exit with copies into its
 * shared memory in flight). */
template <int P>
FM_DI bool rqt_refused_drain(const rqparams &p, uint64_t *full, int first, int n)
{
    if (!rq_refused(p.verdict))
        return false;
    for (int k = first; k < n && k < RQT_STAGES; k += P)
        sm90_bar_wait(&full[k], 0);
    return true;
}

/* Column j's 8 codes from its scaled halves sv (see the kernel): enc(s x
 * 2^d), d = Q - p_out in [0, 15], as one 8-byte store. */
template <int T>
FM_DI uint2 rqt_enc8(const uint32_t sv[4], int d)
{
    const uint32_t M = ((uint32_t)(15 + d) << 10) * 0x10001u;
    uint32_t e[4];
#pragma unroll
    for (int q = 0; q < 4; q++) {
        const __half2 y = __hmul2(*(const __half2 *)&sv[q], *(const __half2 *)&M);
        e[q] = rqf_enc2<T>(*(const uint32_t *)&y);
    }
    return make_uint2(e[0] | (e[1] << 16), e[2] | (e[3] << 16));
}

/* X: column j's 8 E2M1 codes (row k in bits 4k..4k+3) from its scaled
 * halves sv, which hold 2^-6 the values (rqt_fmt), and its E4M3-read codes
 * c (the signs): enc(s x 2^(d + 6)), d = Q - p_out in [0, 8]: 6 to 14
 * octaves, which keep the encoder's three multipliers normal. CLAMP for MX_FLOOR, whose products may pass 6;
 * under the other rules none does (p_out is at least each element's own
 * exponent), and the minimum would change nothing.
 * Every s is exact but in rows more than 17 octaves below Q, where it is
 * under 1.5 x 2^-21: times at most 2^14 such a value, exact or rounded,
 * encodes as a zero of its sign, as fm_requant_code makes it. */
template <bool CLAMP>
FM_DI uint32_t rqt_enc8x(const uint32_t (&sv)[4], const uint32_t (&c)[2], int d)
{
    const fm_h2_shift3 m = fm_h2_shift3_normal(d + rqt_fmt<FM_DTYPE_E2M1>::oct);
    uint32_t e[4];
#pragma unroll
    for (int q = 0; q < 4; q++)
        e[q] = fm_h2_e2m1_mag<CLAMP>(sv[q], m);
    return fm_e2m1_signed_row(e, c[0], c[1]);
}

/* X, every column's d in [0, 8]: the lane's 8 columns' codes, one 4-byte
 * store each at o + column x step. */
template <bool CLAMP>
FM_DI void rqt_store8x(uint8_t *o, int64_t step, const uint32_t (&sv)[8][4], const uint32_t (&col)[8][2], int Q,
                       const int (&po)[8], int ncol)
{
    /* o stepped a column at a time: o + j x step took 59 instructions a
     * warp and tile for the 8 stores (ncu, S40-5) */
#pragma unroll
    for (int j = 0; j < 8; j++, o += step) {
        const uint32_t v = rqt_enc8x<CLAMP>(sv[j], col[j], Q - po[j]);
        if (j < ncol)
            __stcs((unsigned int *)o, v);
    }
}

/* Whether v holds in any of the 8 consumer warps' threads (a named barrier
 * of theirs; the producer warp is not in it). Only the predicate crosses
 * it, so memory accesses may move across. */
FM_DI bool rqt_consumers_any(bool v)
{
    uint32_t r;
    asm volatile("{\n.reg .pred p, q;\nsetp.ne.u32 q, %1, 0;\nbar.red.or.pred p, 1, %2, q;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(r)
                 : "r"((uint32_t)v), "n"(32 * RQT_CONSUMERS));
    return r != 0u;
}

/* MX: the lane's rows' E8M0 bytes (pk) as exponents (RQ_NAN_ROW for a NaN
 * scale), where a path needs them: the common one works on the bytes. */
template <bool MX>
FM_DI void rqt_pins(const int (&pk)[8], int (&pn)[8])
{
#pragma unroll
    for (int k = 0; k < 8; k++)
        pn[k] = MX ? rq_pin((uint32_t)pk[k], 1) : pk[k];
}

/* The lane's 8 row exponents into its own slot, for the exact paths; X:
 * 6 octaves up, as the E4M3 codes of 2^-6 an E2M1 value read them. */
template <bool MX, bool X>
FM_DI void rqt_put_pins(int *pins, const int (&pk)[8])
{
    int pn[8];
    rqt_pins<MX>(pk, pn);
#pragma unroll
    for (int k = 0; k < 8; k++)
        pn[k] += X && rq_pin_valid(pn[k]) ? rqt_fmt<FM_DTYPE_E2M1>::oct : 0;
    *(int4 *)pins = make_int4(pn[0], pn[1], pn[2], pn[3]);
    *(int4 *)(pins + 4) = make_int4(pn[4], pn[5], pn[6], pn[7]);
}

/* A ragged group's last tile (rq_tile's R - r0 < 128): the TMA box holds
 * the next group's rows past it, which must weigh as the zeros past the
 * matrix do. n: the lane's rows 8 rg .. 8 rg + 7 still in the group. */
FM_DI void rqt_mask_rows(uint32_t (&col)[8][2], int64_t n)
{
    const int k = n < 0 ? 0 : n > 8 ? 8 : (int)n;
    const uint32_t lo = k >= 4 ? 0xFFFFFFFFu : (1u << (8 * k)) - 1u;
    const uint32_t hi = k >= 8 ? 0xFFFFFFFFu : k <= 4 ? 0u : (1u << (8 * (k - 4))) - 1u;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        col[j][0] &= lo;
        col[j][1] &= hi;
    }
}

/* Column j's 8 output codes at o: one 8-byte store when every output row
 * is 8-byte aligned (whole8), else the widest stores o allows, and only the
 * n bytes left in a ragged group's row. */
FM_DI void rqt_put8(uint8_t *o, uint2 v, int n, bool whole8)
{
    if (whole8) {
        __stcs((uint2 *)o, v);
        return;
    }
    const uint64_t x = ((uint64_t)v.y << 32) | v.x;
    const uintptr_t a = (uintptr_t)o;
    for (int k = 0; k < n;) {
        const uint64_t y = x >> (8 * k);
        if (n - k == 8 && (a & 7) == 0) {
            __stcs((uint2 *)o, v);
            k = 8;
        } else if (n - k >= 4 && ((a + k) & 3) == 0) {
            __stcs((unsigned int *)(o + k), (unsigned int)y);
            k += 4;
        } else if (n - k >= 2 && ((a + k) & 1) == 0) {
            __stcs((unsigned short *)(o + k), (unsigned short)y);
            k += 2;
        } else {
            __stcs(o + k, (unsigned char)y);
            k += 1;
        }
    }
}

/* MX: the output scales of the lane's 8 columns' 32-row blocks (po, the
 * lane's row group rg / 4), stored by lane rg < 8 for column rg (output
 * row ro) as the 4 bytes of the tile's 4 row groups: one word at
 * consecutive entries in either layout (fm_mx32_gemm_entry), kept in L2
 * as the F32 scales are (rq_store_scale); single bytes where the tile's
 * blocks are not a whole aligned word (a ragged group). Called by the
 * whole warp. */
FM_DI void rqt_put_mx_scales(const rqparams &p, const rqtile &tl, const int (&po)[8], int rg, int cg, int64_t ro)
{
    const int x = rg & 3;
    int a = po[0], b = po[4];
#pragma unroll
    for (int j = 1; j < 4; j++) {
        a = x == j ? po[j] : a;
        b = x == j ? po[j + 4] : b;
    }
    /* the E8M0 codes of columns x and x + 4 of this lane's group */
    const uint32_t ea = a == RQ_BADP ? 0xFFu : (uint32_t)(a + 127), eb = b == RQ_BADP ? 0xFFu : (uint32_t)(b + 127);
    const uint32_t v = ea | (eb << 8);
    uint32_t word = 0;
#pragma unroll
    for (int g = 0; g < 4; g++) {
        const uint32_t o = __shfl_sync(0xFFFFFFFFu, v, ((4 * g + x) << 1) | cg);
        word |= ((o >> (8 * ((rg >> 2) & 1))) & 0xFFu) << (8 * g);
    }
    if (rg >= 8 || ro >= p.Ro)
        return;
    const int64_t off = rq_scale_off(p.out_mode, p.out_layout, p.Ro, tl.Co, tl.nbo, p.bo_shift, tl.sout0, ro, tl.r0);
    uint8_t *const dst = (uint8_t *)p.out_scale + off;
    if (tl.r0 + RQT <= tl.Co && ((uintptr_t)dst & 3u) == 0) {
        fm_st_keep<true, 4>(dst, word);
        if (p.nonfinite) {
            const int bad = __popc(__vcmpeq4(word, 0xFFFFFFFFu)) >> 3;
            if (bad)
                atomicAdd(p.nonfinite, (unsigned long long)bad);
        }
        return;
    }
#pragma unroll
    for (int g = 0; g < 4; g++) {
        const int e = (int)((word >> (8 * g)) & 0xFFu);
        if (tl.r0 + 32 * g < tl.Co)
            rq_put_scale(p, tl, ro, tl.r0 + 32 * g, e == 0xFF, e - 127);
    }
}

/* Input scale entry `off`: an F32 scale, or (MX) the row's 4 E8M0
 * exponents of the tile from that byte on, one word in either layout
 * (rq_tma_fits). */
template <bool MX>
FM_DI uint32_t rqt_scale_word(const rqparams &p, int64_t off)
{
    return MX ? __ldg((const uint32_t *)((const uint8_t *)p.in_scale + off))
              : __ldg((const uint32_t *)p.in_scale + off);
}

/* The producer's scale loads for tile t (0 past the matrix), issued an
 * iteration before the tile's stage is filled, so that their latency runs
 * while the producer waits for the stage: loaded in the iteration that used
 * them, they left the consumers waiting at the stage's barrier for a third
 * of their time (H200, S34-3: ncu's stall samples), and a tile ahead the
 * plain transpose ran 164.3-166.3 -> 156.9-158.5 us, the layer's grouped
 * call 178.6-179.4 -> 168.5-169.4 (S34-4, S34-5). */
template <bool G, bool MX>
FM_DI void rqt_scales(const rqparams &p, uint32_t t, uint32_t (&raw)[4])
{
    const int lane = threadIdx.x & 31;
    const rqtile tl = rq_tile<G>(p, t);
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const int64_t r = tl.r0 + lane + 32 * k;
        raw[k] = r < tl.R ? rqt_scale_word<MX>(p, rq_scale_off(p.in_mode, p.in_layout, p.R, p.C, p.nbi, p.bi_shift,
                                                                  tl.sin0, tl.srow + r, tl.c0))
                          : 0u;
    }
}

/* The rows' transpose (fm_transpose_scaled_grouped_rows), whose tile rows
 * are token rows through the row map, which no TMA box describes: the
 * producer warp gathers them by cp.async into the layout TMA's 128-byte
 * swizzle gives (16-byte chunk ch of row r at chunk ch ^ (r % 8)), zeros for
 * padding and for rows past the group, and loads the rows' scales (padding:
 * scale 1, as rq_load_scales_at). Lane l owns rows l + 32 k's map entries;
 * copy i of a lane moves chunk l % 8 of row 4 i + l / 8, so a warp's copy
 * covers four whole 128-byte rows. Against rq_fp8t_kernel (same binary,
 * FLOWMOE_RQ_TMA=1, H200, S34-1): the flow recipes' dy 242.8 -> 211.8 us,
 * fp8-flow's x (ROWMAX -> 128 x 128) 238.7 -> 208.9. One producer warp
 * bounds it (the consumers wait at the full barrier for 42% of their stall
 * samples, S34-8), so it runs with two (rq_tma_producers): dy 212-214 ->
 * 160-161 us, x 208-210 -> 166 (S35-1). Its loads a tile ahead (as
 * rqt_scales) measured 228-230 us against 213-214 (S34-4, S34-5); this
 * code itself measured 208-218 us over S34-6, S34-8 and S34-9, so a few us
 * between binaries are not a finding. */
template <bool MX>
FM_DI void rqt_gather_rows(const rqparams &p, const rqtile &tl, uint8_t *stage, uint32_t (&raw)[4])
{
    const int lane = threadIdx.x & 31;
    int tok[4]; /* token row, -1 padding, -2 past the group */
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const int64_t r = tl.r0 + lane + 32 * k;
        tok[k] = -2;
        raw[k] = 0u;
        if (r < tl.R) {
            const uint32_t m = (uint32_t)__ldg(p.rmap + tl.srow + r);
            tok[k] = m < p.nslots ? (int)fm_fastdiv_div(p.kdiv, m) : -1;
            /* padding: scale 1 (E8M0 127 in each of MX's 4 bytes) */
            raw[k] = tok[k] < 0 ? (MX ? 0x7F7F7F7Fu : 0x3F800000u)
                                : rqt_scale_word<MX>(p, (int64_t)tok[k] * p.nbi + (tl.c0 >> (MX ? 5 : 7)));
        }
    }
    const int ch = lane & 7;
    const int64_t c = tl.c0 + 16 * ch;
    const uint32_t base = sm90_sa(stage) + 16u * ch;
#pragma unroll
    for (int i = 0; i < 32; i++) {
        const int row = 4 * i + (lane >> 3);
        const int t = __shfl_sync(0xFFFFFFFFu, tok[i >> 3], row & 31);
        const bool in = t >= 0 && c < p.C;
        const uint8_t *src = in ? p.in + (int64_t)t * p.C + c : p.in;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"((base + RQT * row) ^ (16u * (row & 7))),
                     "l"(src), "r"(in ? 16 : 0)
                     : "memory");
    }
}

template <int T, bool G, int P, bool RAG, bool MX>
__global__ void __launch_bounds__(RQT_THREADS(P), 2) rq_fp8t_tma_kernel(const __grid_constant__ CUtensorMap map,
                                                                     const rqparams p)
{
    extern __shared__ uint8_t rqt_dyn[];
    __shared__ uint64_t full[RQT_STAGES], empty[RQT_STAGES];
    __shared__ uint32_t flut[RQF_NLUT];
    /* The exact paths read the row exponents through a pointer: each lane its
     * own copy, since the slow codes' path is not warp-uniform (a lane and
     * its partner of the same rows wrote the same copy with no barrier
     * between: racecheck, S33-13). */
    __shared__ __align__(16) int slow_pin[RQT_CONSUMERS][32][8];

    static_assert(RQT_STAGES % P == 0, "each stage has one producer");
    static_assert(G || !RAG, "ragged tiles are groups'");
    /* X: MXFP4, a tile's rows of 64 bytes, read as E4M3 codes (rqt_fmt) */
    constexpr bool X = rqt_fmt<T>::x;
    constexpr int TC = rqt_fmt<T>::tc;
    static_assert(!X || (MX && !RAG), "MXFP4 -> MXFP4 only, in whole-byte output rows");
    if (blockIdx.x >= p.ntiles)
        return;
    /* offsets from rqt_dyn keep the accesses in the shared window (LDS, not generic loads) */
    uint8_t *const codes = rqt_dyn + ((1024u - (sm90_sa(rqt_dyn) & 1023u)) & 1023u);
    int *const exps = (int *)(codes + RQT_STAGES * RQT * RQT);
    int2 *const qmin = (int2 *)(exps + RQT_STAGES * RQT);
    const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31;
    if (tid == 0) {
        for (int s = 0; s < RQT_STAGES; s++) {
            /* the producer's 32 lanes, and lane 0's byte count (TMA) or the
             * lanes' copies (the rows' gather) */
            sm90_bar_init(&full[s], G && p.rmap ? 64 : 33);
            sm90_bar_init(&empty[s], RQT_CONSUMERS);
        }
        sm90_bar_init_fence();
    }
    if (tid < RQF_NLUT)
        flut[tid] = rqf_factor_bits(tid);
    __syncthreads();

    if (w >= RQT_CONSUMERS) {
        /* Producer pw: the CTA's tiles i = pw, pw + P, ... (stages pw, pw +
         * P, ...: each stage has one producer), tile t's codes by TMA (or
         * gathered), its row exponents by loads. It fills its stages before
         * it waits for the power-of-two check (the loads read only the
         * input, which the check does not write), so the first tiles arrive
         * while the check runs; on a refusal it leaves once the copies it
         * started have landed. */
        const int pw = w - RQT_CONSUMERS;
        const uint64_t step = (uint64_t)P * gridDim.x;
        const bool rows = G && p.rmap;
        int i = pw;
        bool drained = false;
        uint32_t raw[4];
        uint64_t t = blockIdx.x + (uint64_t)pw * gridDim.x;
        if (!rows && t < p.ntiles)
            rqt_scales<G, MX>(p, (uint32_t)t, raw);
        for (; t < p.ntiles; t += step, i += P) {
            const int s = i % RQT_STAGES, ph = (i / RQT_STAGES) & 1;
            if (i >= RQT_STAGES && !drained) {
                drained = true;
                if (rqt_refused_drain<P>(p, full, pw, i))
                    return;
            }
            if (i >= RQT_STAGES)
                sm90_bar_wait(&empty[s], ph ^ 1);
            uint32_t te = 0;
            if (!G) {
                uint32_t tr, tc;
                rq_place(p, (uint32_t)t, &te, &tr, &tc);
            }
            const rqtile tl = rq_tile<G>(p, (uint32_t)t);
            if (rows) {
                rqt_gather_rows<MX>(p, tl, codes + s * RQT * RQT, raw);
                sm90_cp_async_arrive(&full[s]);
            } else if (lane == 0) {
                sm90_bar_expect(&full[s], (RQT * RQT) >> X);
                sm90_tma_load_3d(codes + s * RQT * RQT, &map, &full[s], (int)(tl.c0 >> X), (int)(tl.srow + tl.r0),
                                 (int)te);
            }
            if constexpr (MX) {
                /* the rows' words as loaded: each consumer lane takes its
                 * 8 rows' bytes of its input block, and the 4 lanes of an
                 * output block (32 rows) find their Q among themselves */
#pragma unroll
                for (int k = 0; k < 4; k++)
                    exps[s * RQT + lane + 32 * k] = (int)raw[k];
            } else {
                int hi = RQ_EMPTY, lo = -RQ_EMPTY;
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    const int pin = tl.r0 + lane + 32 * k < tl.R ? rq_pin(raw[k], 0) : RQ_EMPTY;
                    exps[s * RQT + lane + 32 * k] = pin;
                    if (rq_pin_valid(pin)) {
                        hi = rq_max(hi, pin);
                        lo = rq_min(lo, pin);
                    }
                }
                hi = __reduce_max_sync(0xFFFFFFFFu, hi);
                lo = __reduce_min_sync(0xFFFFFFFFu, lo);
                if (lane == 0)
                    qmin[s] = make_int2(hi, lo);
            }
            sm90_bar_arrive(&full[s]);
            if (!rows && t + step < p.ntiles)
                rqt_scales<G, MX>(p, (uint32_t)(t + step), raw);
        }
        if (!drained)
            rqt_refused_drain<P>(p, full, pw, i);
        return;
    }
    if (rq_refused(p.verdict))
        return;

    /* X reads its rows in the order k ^ (rg % 4) (see below) */
    const int rg = lane >> 1, cg = lane & 1, m = rg & (X ? 3 : 7), cl = 16 * w + 8 * cg;
    /* Byte selectors that put the lane's rows back in order (see above). */
    uint32_t sel[2];
    if constexpr (!X)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            sel[h] = 0;
#pragma unroll
            for (int b = 0; b < 4; b++)
                sel[h] |= (uint32_t)(4 * (h ^ (m >> 2)) + (b ^ (m & 3))) << (4 * b);
        }
    /* X: the lane's 8 rows of 4 bytes (8 codes), rows of 64 bytes under the
     * 64-byte swizzle (16-byte chunk c of row r at c ^ ((r / 2) % 4)). Rows
     * k ^ m, m = rg % 4, spread a warp's loads over 8 banks (a 4-way
     * conflict on loads of 4 bytes: 8 of them a tile), and the transposes'
     * own byte selectors put them back in order (rqf_tsel_of), where the
     * FP8 tile's order k ^ (rg % 8) takes two more PRMTs a column. */
    const rqf_tsel xts = rqf_tsel_of((uint32_t)m);
    const uint32_t lane_off = X ? 512u * rg + 64u * m + 16u * ((uint32_t)(w >> 1) ^ ((uint32_t)m >> 1)) +
                                      4u * (2u * (w & 1) + cg)
                                : 1024u * rg + 8u * cg + 128u * m + 16u * (w ^ m);
    const bool rowmax = p.rule == FM_REQUANT_ROWMAX;
    int i = 0;
    for (uint32_t t = blockIdx.x; t < p.ntiles; t += gridDim.x, i++) {
        const int s = i % RQT_STAGES, ph = (i / RQT_STAGES) & 1;
        sm90_bar_wait(&full[s], ph);
        uint32_t cw[8][2];
        {
            /* row 8 rg + (k ^ m), physical chunk w ^ k ^ m: the stage base and
             * 8 cg + 1024 rg leave bits 4-9 clear, so each load's address is
             * this lane's first one XOR 144 k */
            const uint32_t a0 = sm90_sa(codes + s * RQT * RQT) + lane_off;
#pragma unroll
            for (int k = 0; k < 8; k++) {
                uint32_t x, y;
                if constexpr (X) {
                    /* row k ^ m: 64 (k ^ m) and its chunk's swizzle (k ^ m) / 2 XOR onto the lane's offset */
                    asm volatile("ld.shared.u32 %0, [%1];"
                                 : "=r"(x)
                                 : "r"(a0 ^ (64u * k + 16u * ((k >> 1) & 3)))
                                 : "memory");
                    y = 0u; /* the row's 8 codes are its 4 bytes */
                } else
                    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(x), "=r"(y) : "r"(a0 ^ (144u * k)) : "memory");
                cw[k][0] = x;
                cw[k][1] = y;
            }
        }
        int pk[8];
        {
            const int4 a = *(const int4 *)&exps[s * RQT + 8 * rg], b = *(const int4 *)&exps[s * RQT + 8 * rg + 4];
            pk[0] = a.x, pk[1] = a.y, pk[2] = a.z, pk[3] = a.w, pk[4] = b.x, pk[5] = b.y, pk[6] = b.z, pk[7] = b.w;
        }
        const int2 qm = MX ? make_int2(0, 0) : qmin[s];
        const bool floor_rule = MX && p.rule == FM_REQUANT_MX_FLOOR;
        __syncwarp();
        if (lane == 0)
            sm90_bar_arrive(&empty[s]);

        /* col[j][h]: column j, rows 4 h .. 4 h + 3 */
        uint32_t col[8][2];
        if constexpr (X) {
            /* the rows' bytes transposed (byte column b: columns 2b, 2b + 1),
             * then each byte column's codes read as E4M3 ones: 16 PRMTs a
             * tile and 5 instructions a word, where spreading each row into 8
             * bytes first (fm_e2m1x8_as_e4m3) and transposing those took 32
             * PRMTs and 10 a row (ncu S40-3 -> S40-5, with the factors and
             * |s| below: 126.1M -> 113.1M warp instructions, 202 -> 181 us) */
#pragma unroll
            for (int h = 0; h < 2; h++) {
                uint32_t bc[4];
                rqf_t4(cw[4 * h][0], cw[4 * h + 1][0], cw[4 * h + 2][0], cw[4 * h + 3][0], &bc[0], &bc[1], &bc[2],
                       &bc[3], xts);
#pragma unroll
                for (int b = 0; b < 4; b++)
                    fm_e2m1x8_as_e4m3_split(bc[b], &col[2 * b][h], &col[2 * b + 1][h]);
            }
        } else {
            rqf_t8(cw, col);
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const uint32_t a = col[j][0], b = col[j][1];
                col[j][0] = __byte_perm(a, b, sel[0]);
                col[j][1] = __byte_perm(a, b, sel[1]);
            }
        }
        /* RAG: the tile now, for the mask; else after the keys (held from
         * here, the plain call spilled registers and the grouped ones ran
         * 12-18 us slower, S35-2) */
        rqtile tl;
        if (RAG) {
            tl = rq_tile<G>(p, t);
            if (tl.r0 + RQT > tl.R)
                rqt_mask_rows(col, tl.R - tl.r0 - 8 * rg);
        }

        /* Q: the largest valid input exponent of the tile, or (MX) of the
         * lane's output block (its input block w / 2, its 32 rows: lane bits
         * 1-2); qlo the smallest. MX keeps the rows' E8M0 bytes in pk (rqt_pins
         * makes exponents of them where a rare path needs them) and finds
         * both four bytes at a time: the decode took 12M of 97M warp
         * instructions element by element (H200, ncu). A NaN byte weighs as
         * nothing (as -127 for the maximum: a block of NaN rows is NaN
         * whatever Q is), rows past the matrix as -127 (their word is 0):
         * not above any row's, and their codes are zeros. Qf: Q as the
         * factor table's reference (the bytes' bias kept). */
        int Q, Qf, qlo;
        bool table = true;   /* the rows' factors from flut (below) */
        uint32_t ew[2] = {}; /* MX: the rows' bytes */
        if constexpr (MX) {
            const uint32_t b = (uint32_t)(w >> 1), s2 = b | ((b + 4u) << 4);
            const uint32_t e03 = __byte_perm(__byte_perm((uint32_t)pk[0], (uint32_t)pk[1], s2),
                                             __byte_perm((uint32_t)pk[2], (uint32_t)pk[3], s2), 0x5410);
            const uint32_t e47 = __byte_perm(__byte_perm((uint32_t)pk[4], (uint32_t)pk[5], s2),
                                             __byte_perm((uint32_t)pk[6], (uint32_t)pk[7], s2), 0x5410);
            const uint32_t nan = __vcmpeq4(e03, 0xFFFFFFFFu) | __vcmpeq4(e47, 0xFFFFFFFFu);
            uint32_t hi = __vmaxu4(e03 & ~__vcmpeq4(e03, 0xFFFFFFFFu), e47 & ~__vcmpeq4(e47, 0xFFFFFFFFu));
            uint32_t lo = __vminu4(e03, e47);
            hi = __vmaxu4(hi, hi >> 16);
            lo = __vminu4(lo, lo >> 16);
            hi = __vmaxu4(hi, hi >> 8);
            lo = __vminu4(lo, lo >> 8);
            /* both maxima as one pair, over the block's 4 lanes */
            const uint32_t v = rqf_block_max<true>((hi & 0xFFu) | ((~lo & 0xFFu) << 16), false);
            Qf = (int)(v & 0xFFu);
            Q = Qf - 127;
            qlo = (int)(~(v >> 16) & 0xFFu) - 127;
            table = !X || nan != 0u || (int)(lo & 0xFFu) < Qf - 14;
            ew[0] = e03;
            ew[1] = e47;
#pragma unroll
            for (int k = 0; k < 8; k++)
                pk[k] = (int)(((k < 4 ? e03 : e47) >> (8 * (k & 3))) & 0xFFu);
        } else {
            Q = Qf = qm.x == RQ_EMPTY ? 0 : qm.x;
            qlo = qm.y;
        }

        /* s = h x 2^(p_in - Q), two rows a word: sv[j][q] holds rows 2 q, 2 q + 1 of column j */
        uint32_t sv[8][4];
        {
            /* X: the factors as normal halves from the bytes, two rows at a
             * time (PRMT, IMAD), when no row of the lane is NaN or more than
             * 14 octaves below Q: the table's lookups took 56 of a warp's
             * 1100 instructions a tile (ncu, S40-3). (The FP8 MX32 kernel
             * keeps the table: this spilled more of its registers.) */
            uint32_t F[4];
            const uint32_t c = (uint32_t)(15 - Qf) * 0x04000400u;
#pragma unroll
            for (int q = 0; q < 4; q++)
                F[q] = table ? rqf_factor(flut, pk[2 * q], Qf) | (rqf_factor(flut, pk[2 * q + 1], Qf) << 16)
                             : __byte_perm(ew[q >> 1], 0u, q & 1 ? 0x4342 : 0x4140) * 1024u + c;
#pragma unroll
            for (int j = 0; j < 8; j++)
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    const uint32_t h = rqf_h2<TC>(col[j][q >> 1] >> (16 * (q & 1)));
                    /* X: |s| (the signs come from col), an operand modifier of the multiply */
                    const __half2 y = __hmul2(X ? __habs2(*(const __half2 *)&h) : *(const __half2 *)&h,
                                              *(const __half2 *)&F[q]);
                    sv[j][q] = *(const uint32_t *)&y;
                }
        }

        /* 1. block exponents of the lane's 8 columns (every lane of a column's 16 gets them) */
        int po[8];
        bool fail = false;
        if (rowmax) {
            uint32_t nfb;
            if constexpr (MX) {
                int pn[8];
                rqt_pins<MX>(pk, pn);
                nfb = rqf_nonfinite_cols<TC>(col, pn, false);
            } else
                nfb = rqf_nonfinite_cols<TC>(col, pk, true);
            const int pq = Q < -127 ? -127 : Q > 127 ? 127 : Q; /* a tile of no finite row is all NaN */
            /* one 128 x 128 block a tile: non-finite as a whole when any
             * stored column is. The columns past the matrix need no mask:
             * their codes are TMA's zeros, and a NaN row, which marks every
             * column, marks the tile's first column too, which is stored. */
            if (p.tile)
                nfb = rqt_consumers_any(nfb != 0u) ? 0xFFu : 0u;
#pragma unroll
            for (int j = 0; j < 8; j++)
                po[j] = (nfb >> j) & 1u ? RQ_BADP : pq;
        } else {
            uint32_t kp[4];
#pragma unroll
            for (int i2 = 0; i2 < 4; i2++) {
                uint32_t mx[2];
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const uint32_t *v = sv[2 * i2 + e];
                    const uint32_t a = X ? 0xFFFFFFFFu : 0x7FFF7FFFu; /* X: sv holds |s| */
                    mx[e] = __vmaxu2(__vimax3_u16x2(v[0] & a, v[1] & a, v[2] & a), v[3] & a);
                }
                kp[i2] = rqf_block_max<true>(__vmaxu2(__byte_perm(mx[0], mx[1], 0x5410), __byte_perm(mx[0], mx[1], 0x7632)),
                                             !MX);
            }
            /* Common case, without branches: every K exact and normal, none non-finite. */
            const uint32_t kmin = __vminu2(__vminu2(kp[0], kp[1]), __vminu2(kp[2], kp[3]));
            const uint32_t kmax = __vmaxu2(__vmaxu2(kp[0], kp[1]), __vmaxu2(kp[2], kp[3]));
            const bool plain = rq_min((int)(kmin & 0xFFFFu), (int)(kmin >> 16)) >= (int)rqt_fmt<T>::kfast &&
                               rq_max((int)(kmax & 0xFFFFu), (int)(kmax >> 16)) < 0x7C00;
            /* K's exponent field less kbias is floor(log2 K) - emax: the MX
             * floor rule; rounded up (rqt_fmt::kround) the power-of-two rule */
            const int kadd = floor_rule ? 0 : rqt_fmt<T>::kround;
            if (plain) {
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    const int K = (int)((kp[j >> 1] >> (16 * (j & 1))) & 0xFFFFu);
                    po[j] = min(max(Q - rqt_fmt<T>::kbias + ((K + kadd) >> 10), -127), 127);
                }
            } else
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const uint32_t K = (kp[j >> 1] >> (16 * (j & 1))) & 0xFFFFu;
                int key;
                if (K >= 0x7C00u)
                    key = RQ_BADP;
                else if (K >= rqt_fmt<T>::kfast)
                    key = Q + (((int)K + kadd) >> 10) - rqt_fmt<T>::kbias;
                else if (K >= rqf_thr<TC>::v) {
                    const float a = __half2float(__ushort_as_half((unsigned short)K));
                    key = (floor_rule ? fm_mx_floor_scale_exp(a, (fm_dtype)T) : fm_pow2_scale_exp(a, (fm_dtype)T)) + Q +
                          rqt_fmt<T>::oct;
                }
                else {
                    key = RQF_FAIL;
                    fail = true;
                }
                po[j] = key == RQ_BADP || key == RQF_FAIL ? key : key < -127 ? -127 : key > 127 ? 127 : key;
            }
        }
        const bool slow_keys = __any_sync(0xFFFFFFFFu, fail);
        if (slow_keys) {
            /* The CPU's keys, element by element, for the blocks K could not settle (warp-wide reductions). */
            rqt_put_pins<MX, X>(slow_pin[w][lane], pk);
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const int ck = (int)rqf_block_max<false>(
                    (uint32_t)rqf_exact_key<TC, T>(col[j][0], col[j][1], slow_pin[w][lane], p.rule), !MX);
                if (po[j] == RQF_FAIL)
                    po[j] = rq_block_exp(ck);
            }
        }

        if (!RAG)
            tl = rq_tile<G>(p, t);
        /* one lane a column stores its scale: lane rg < 8 has column rg (a
         * 128 x 128 block's one scale: the first lane, column 0; MX: the
         * column's 4 blocks of the tile) */
        if constexpr (MX)
            rqt_put_mx_scales(p, tl, po, rg, cg, tl.c0 + cl + rg);
        else {
            int pv = po[0];
#pragma unroll
            for (int j = 1; j < 8; j++)
                pv = rg == j ? po[j] : pv;
            const int64_t ro = tl.c0 + cl + rg;
            if ((p.tile ? w == 0 && lane == 0 : rg < 8) && ro < p.Ro)
                rq_put_scale<true>(p, tl, ro, tl.r0, pv == RQ_BADP, pv);
        }

        /* 2. codes: enc(s x 2^(Q - p_out)), or the exact path (see the top comment) */
        const int dmax = X ? 8 : qlo >= Q - rqt_fmt<T>::exact_rows ? 15 : T == FM_DTYPE_E4M3 ? 6 : -1;
        bool fast = true;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int d = Q - po[j];
            fast = fast && d >= 0 && d <= dmax; /* never for RQ_BADP */
        }
        const int64_t oc = tl.r0 + 8 * rg;
        const int ncol = oc < tl.Co ? (int)min((int64_t)8, p.Ro - (tl.c0 + cl)) : 0; /* columns to store */
        if constexpr (X) {
            /* whole 8-row pieces (rq_tma_fits): one 4-byte store a column */
            uint8_t *o = tl.out + (((tl.c0 + cl) * tl.Co + oc) >> 1);
            const int64_t step = tl.Co >> 1;
            if (fast) {
                /* only MX_FLOOR's products may pass 6 (rqt_enc8x) */
                if (floor_rule)
                    rqt_store8x<true>(o, step, sv, col, Q, po, ncol);
                else
                    rqt_store8x<false>(o, step, sv, col, Q, po, ncol);
                continue;
            }
            if (!slow_keys)
                rqt_put_pins<MX, X>(slow_pin[w][lane], pk);
#pragma unroll
            for (int j = 0; j < 8; j++, o += step) {
                const int d = Q - po[j];
                uint32_t v;
                if (d >= 0 && d <= dmax)
                    v = rqt_enc8x<true>(sv[j], col[j], d);
                else if (po[j] == RQ_BADP)
                    v = 0u; /* E2M1 has no NaN: format.h's fm_elem_nan */
                else
                    v = rqf_slow_col<TC, T>(col[j][0], col[j][1], slow_pin[w][lane], po[j]).x;
                if (j < ncol)
                    __stcs((unsigned int *)o, v);
            }
            continue;
        }
        /* bytes a column: 8, but for a ragged group's last lanes */
        const int nb = (int)min((int64_t)8, tl.Co - oc);
        /* every output row 8-byte aligned (a ragged group's need not be) */
        const bool whole8 = !RAG || ((tl.Co & 7) == 0 && ((uintptr_t)tl.out & 7) == 0);
        uint8_t *o = tl.out + (tl.c0 + cl) * tl.Co + oc;
        if (fast) {
#pragma unroll
            for (int j = 0; j < 8; j++, o += tl.Co) {
                const uint2 v = rqt_enc8<T>(sv[j], Q - po[j]);
                if (j < ncol)
                    rqt_put8(o, v, nb, whole8);
            }
            continue;
        }
        if (!slow_keys)
            rqt_put_pins<MX, X>(slow_pin[w][lane], pk);
#pragma unroll
        for (int j = 0; j < 8; j++, o += tl.Co) {
            const int d = Q - po[j];
            uint2 v;
            if (d >= 0 && d <= dmax)
                v = rqt_enc8<T>(sv[j], d);
            else if (po[j] == RQ_BADP)
                v = make_uint2(fm_nan_word<T>(), fm_nan_word<T>());
            else
                v = rqf_slow_col<T, T>(col[j][0], col[j][1], slow_pin[w][lane], po[j]);
            if (j < ncol)
                rqt_put8(o, v, nb, whole8);
        }
    }
}

/* Whether rq_fp8t_tma_kernel may take the call (host; the dtypes are the
 * caller's): a plain FP8 1x128 -> 128x1 transpose with F32 scales (or ->
 * 128x128 under ROWMAX) or MX32 -> MX32 (whole 128-column tiles), rows of
 * whole 16-byte pieces for TMA, compute
 * capability 9.0 and the driver's tensor-map encoder; plain, rows of 8-byte
 * output pieces; grouped, any groups (a ragged group's last tile masks the
 * rows past it, rqt_mask_rows, and stores what its rows' alignment allows,
 * rqt_put8), and the rows' transpose (gathered, rqt_gather_rows). For
 * comparisons: FLOWMOE_RQ_TMA=0 keeps rq_fp8t_kernel for every call,
 * FLOWMOE_RQ_TMA=1 for the rows' transpose and ragged groups. */
static int rq_tma_fits(const rqparams &p, const cudaDeviceProp &prop, int same_dtype, int tr, int grouped)
{
    static int knob = -1;
    if (knob < 0) {
        const char *v = getenv("FLOWMOE_RQ_TMA");
        knob = v && v[0] == '0' ? 0 : v && v[0] == '1' ? 1 : 2;
    }
    const int newer = grouped && (p.rmap != NULL || p.rows_first); /* the rows' transpose, ragged groups */
    const int f32 = p.in_mode == FM_SCALE_BLOCK_1x128 &&
                    (p.out_mode == FM_SCALE_BLOCK_1x128 || (p.tile && p.rule == FM_REQUANT_ROWMAX)) && !p.in_e8 &&
                    !p.out_e8 && (p.rule == FM_REQUANT_TIGHT || p.rule == FM_REQUANT_ROWMAX);
    /* MX32 -> MX32 under any rule: a row's 4 exponents of a tile are one
     * aligned word (whole 128-column tiles; the scale arrays word aligned).
     * MXFP4 only where each lane's 8 rows are whole bytes of an output row
     * that a 4-byte store may write: plain calls (p.R % 8), groups of whole
     * tiles (the rest, ragged ones included, keep the tile kernel, in its
     * own tile order: p.cols_first cost it 435 -> 444 us, H200, S39-6). */
    const int mx = p.in_mode == FM_SCALE_MX32 && p.out_mode == FM_SCALE_MX32 && p.in_e8 && p.out_e8 &&
                   (!p.in_half || (!newer && (uintptr_t)p.out % 8 == 0)) && p.C % RQT == 0 &&
                   (uintptr_t)p.in_scale % 4 == 0 && (uintptr_t)p.out_scale % 4 == 0;
    return knob && same_dtype && tr && (!newer || knob == 2) && (f32 || mx) && p.C % 16 == 0 &&
           (uintptr_t)p.in % 16 == 0 && (grouped || (p.R % 8 == 0 && (uintptr_t)p.out % 8 == 0)) &&
           prop.major == 9 && prop.minor == 0 && sm90_tensor_map_encoder() != NULL;
}

/* 0 when FLOWMOE_RQ_PDL=0: the kernel after the scale check is launched
 * only once the check has finished, as before programmatic launch. */
static int rq_pdl_knob(void)
{
    static int knob = -1;
    if (knob < 0) {
        const char *v = getenv("FLOWMOE_RQ_PDL");
        knob = !(v && v[0] == '0');
    }
    return knob;
}

/* The TMA transpose's producer warps for a grouped call: two (plain calls
 * and ragged groups have one). Two against one (H200, S34-9, S35-1, S35-9):
 * the rows' dy 212-214 -> 160-161 us, x 208-210 -> 166, the layer's
 * grouped call 165 -> 153-155, ROWMAX h 167.6 -> 158.6, the untrusted
 * grouped call 169.9-170.6 -> 166.1-168.5 (after the check; beside it
 * 172.3-173.2); but the plain call untrusted 158 -> 177 and trusted 156 ->
 * 163, and ragged groups 251 -> 263. FLOWMOE_RQT_PRODUCERS=1 or 2 sets the
 * count of every grouped call but ragged ones (for comparisons). */
static int rq_tma_producers(void)
{
    static int knob = -1;
    if (knob < 0) {
        const char *v = getenv("FLOWMOE_RQT_PRODUCERS");
        knob = v && (v[0] == '1' || v[0] == '2') ? v[0] - '0' : 0;
    }
    return knob ? knob : 2;
}

/* The TMA kernel on a grid of the CTAs that fit at once. */
template <int T, bool G, int P, bool RAG, bool MX>
static cudaError_t rq_tma_launch_p(const CUtensorMap &map, const rqparams &p, int sms, cudaStream_t s)
{
    static int attr = 0, cache = 0;
    cudaError_t err;
    if (!__atomic_load_n(&attr, __ATOMIC_RELAXED)) {
        err = cudaFuncSetAttribute(rq_fp8t_tma_kernel<T, G, P, RAG, MX>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   RQT_DYN_SMEM);
        if (err != cudaSuccess)
            return err;
        __atomic_store_n(&attr, 1, __ATOMIC_RELAXED);
    }
    int per = 0;
    if ((err = rq_ctas_per_sm(rq_fp8t_tma_kernel<T, G, P, RAG, MX>, RQT_THREADS(P), RQT_DYN_SMEM, &cache, &per)) !=
        cudaSuccess)
        return err;
    int64_t g = (int64_t)(per > 0 ? per : 1) * (sms > 0 ? sms : 1);
    if (g > (int64_t)p.ntiles)
        g = p.ntiles;
    /* RAG and two producers start after the check, not beside it: ragged
     * groups 251 against 286 us (H200, S35-2, FLOWMOE_RQ_PDL=0;
     * rq_fp8t_kernel took them in 274, S35-3), the untrusted grouped call
     * 166.1-168.5 against 172.3-173.2 (S35-9); one producer, the plain
     * call, is 5 us faster beside it. */
    return fm_launch(rq_fp8t_tma_kernel<T, G, P, RAG, MX>, (unsigned)g, RQT_THREADS(P), RQT_DYN_SMEM, s,
                     RAG || P == 2 ? 0 : p.pdl, map, p);
}

/* The TMA kernel; cudaErrorNotSupported when the tensor map cannot be made
 * (the caller then runs rq_fp8t_kernel). */
template <int T, bool G, bool MX>
static cudaError_t rq_tma_launch(const rqparams &p, int sms, cudaStream_t s)
{
    const int64_t E = G ? 1 : (int64_t)p.ntiles / ((int64_t)p.ntr.d * p.ntc.d);
    constexpr int X = T == FM_DTYPE_E2M1; /* rows of C / 2 bytes, a tile's of 64 */
    CUtensorMap map;
    const cuuint64_t dims[3] = {(cuuint64_t)(p.C >> X), (cuuint64_t)p.R, (cuuint64_t)E};
    const cuuint64_t strides[2] = {(cuuint64_t)(p.C >> X), (cuuint64_t)((p.R * p.C) >> X)};
    const cuuint32_t box[3] = {RQT >> X, RQT, 1}, es[3] = {1, 1, 1};
    if (p.rmap) /* gathered: no map */
        memset(&map, 0, sizeof map);
    else if (sm90_tensor_map_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, (void *)p.in, dims, strides, box, es,
                                       CU_TENSOR_MAP_INTERLEAVE_NONE,
                                       X ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_128B,
                                       CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                       CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
        return cudaErrorNotSupported;
    if constexpr (G) {
        if constexpr (!X) /* never set for MXFP4 */
            if (p.tma_rag)
                return rq_tma_launch_p<T, G, 1, true, MX>(map, p, sms, s);
        if (rq_tma_producers() == 2)
            return rq_tma_launch_p<T, G, 2, false, MX>(map, p, sms, s);
    }
    return rq_tma_launch_p<T, G, 1, false, MX>(map, p, sms, s);
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
 *  - the codes: rq_encode_row, the tile kernel's arithmetic; for an E2M1
 *    output with 2^d inside fm_fp8x8_e2m1's range, that encoder (kernels.cuh:
 *    half-precision FMAs and minima, no per-code integer arithmetic).
 *  - an E2M1 input is first spread into the E4M3 codes of its values times
 *    2^-6 (fm_e2m1x8_as_e4m3, exact), so that every input takes the FP8 path
 *    (tests/test_scale_exp_rules checks the monotonicity); into an FP8
 *    output whose codes need no rounding (every product normal), the codes
 *    are picked from a table by PRMTs (fm_e2m1x8_to_fp8). */

#define RQS_THREADS 256

/* Largest magnitude code among 4 FP8 codes per word (NW words), via
 * unsigned 16-bit maxima: a lane's maximum orders by its high byte first,
 * so the odd bytes are read from the magnitudes as they are and the even
 * ones from the magnitudes times 256 (an IMAD, off the integer ALU pipe):
 * one mask a word instead of two. With fm_fp8x8_e2m1 reading its odd pairs
 * from the cvt's upper half (no shift), MX32 -> E2M1 106.8-107.6 ->
 * 102.2-102.4 us, 1x128 -> E2M1 untrusted 111.4-111.6 -> 110.0-110.2 (H200,
 * S37-9). The multiply is in asm because the compiler rewrote a * 256 as
 * (w * 256) & 0x7F7F7F00, a second mask a word after all; with it, and
 * fm_fp8x8_e2m1's signs in two LOP3s, 12 fewer ALU instructions a segment:
 * 1x128 -> E2M1 untrusted 108.4-108.5 -> 106.8-107.4 us, MX32 level (S38-3). */
template <int NW>
FM_DI int rq_max_mag(const uint32_t (&w)[NW])
{
    uint32_t hi = 0, lo = 0;
#pragma unroll
    for (int i = 0; i < NW; i += 2) {
        const uint32_t a = w[i] & 0x7F7F7F7Fu, b = w[i + 1] & 0x7F7F7F7Fu;
        hi = __vimax3_u16x2(hi, a, b);
        uint32_t a8, b8; /* in asm: as a * 256, the compiler masks the product again */
        asm("mul.lo.u32 %0, %1, 256;" : "=r"(a8) : "r"(a));
        asm("mul.lo.u32 %0, %1, 256;" : "=r"(b8) : "r"(b));
        lo = __vimax3_u16x2(lo, a8, b8);
    }
    hi = __vmaxu2(hi, lo) >> 8;
    return (int)max(hi & 0xFFu, hi >> 16);
}

/* BI, BO: the input and output block widths when compiled in (both scale
 * arrays compact, the E8M0 / F32 choice following from the mode, and every
 * input block whole: C a multiple of BI), 0 when read from p. Compiled in,
 * a segment's scale entries are its index over 1 (32-element blocks) or 4
 * (1 x 128): with whole blocks, compact scales number the blocks as the
 * segments do, experts and rows included, so the segment's place is not
 * needed (fm_tile_place and two 64-bit offsets were 33 of the 426 warp
 * instructions a segment of MX32 -> E2M1, SourceCounters S17-1). */
#define RQS_IN_E8 (BI ? BI == 32 : p.in_e8)
#define RQS_BO (BO ? BO : p.bo)
#define RQS_OUT_E8 (BO ? BO == 32 : p.out_e8)

/* A segment's input scale bits and codes (zeros past the end), its place
 * where the scale offsets need it, loaded one iteration ahead. */
template <int NW>
struct rqseg {
    uint32_t w[NW];
    uint32_t raw; /* input scale bits */
    uint32_t te;  /* expert (BI == 0 only) */
    uint32_t r;   /* stored row in the expert (BI == 0 only) */
    uint32_t c;   /* first column (BI == 0 only) */
};

/* The codes of an FP8 input: lane l loads 16-byte chunks l and 32 + l of
 * its warp's 32 segments (1 KB, two contiguous 512-byte requests), and
 * rq_rows_kernel exchanges them through shared memory so that each lane
 * gets its own segment's two chunks. Each lane loading its own 32 bytes
 * uses half of every 32-byte sector a request: MX32 -> E2M1 83.5% -> 84.4%
 * of copy, 1 x 128 -> E2M1 (trusted) 80.0% -> 82.3% with the exchange
 * (S17-1, H100). S37 took it from the F32 scales' input, level then (the
 * loop was held by the integer ALU); with S37's encoder it counts again:
 * 1x128 -> E2M1 trusted 107.8-108.7 -> 102.9-103.5 us, untrusted
 * 109.6-110.5 -> 108.5-109.7 (H200, S38-1, S38-2). The untrusted call's
 * 5 us over the trusted one is the check's latency: the check's and this
 * kernel's shared-memory split set equal (carveout 43, 44 or 100 on both)
 * changed nothing, fewer CTAs an SM beside the check (5 or 4 of 6) or fewer
 * check CTAs (1 or 2 an SM of 4) were slower, 114 to 141 us (S38-2, S38-4).
 * Also slower: the exchange by shuffles (chunk l ^ 1 swapped with lane
 * l ^ 1, two SELs a word, no shared memory), 1x128 trusted 114 us (S38-1),
 * and 32 registers for 8 CTAs an SM (__launch_bounds__ 8), 102.6-103.2 ->
 * 105.9-106.7 us (S38-5). */
template <int TI, int NW, int BI, int BO>
FM_DI void rq_rows_load(const rqparams &p, uint32_t sg, rqseg<NW> &g)
{
    constexpr bool X = TI == FM_DTYPE_E2M1;
    if (!X) { /* every lane: its chunks may belong to other lanes' segments */
        const uint32_t wb = sg & ~31u, lane = sg & 31u;
        const uint8_t *src = p.in + ((int64_t)wb << 5) + 16 * lane;
        uint4 v0 = make_uint4(0u, 0u, 0u, 0u), v1 = v0;
        if (wb + (lane >> 1) < p.ntiles)
            v0 = __ldcs((const uint4 *)src);
        if (wb + 16 + (lane >> 1) < p.ntiles)
            v1 = __ldcs((const uint4 *)(src + 512));
        g.w[0] = v0.x, g.w[1] = v0.y, g.w[2] = v0.z, g.w[3] = v0.w;
        g.w[4] = v1.x, g.w[5] = v1.y, g.w[6] = v1.z, g.w[7] = v1.w;
    }
    g.raw = 0, g.te = 0, g.r = 0, g.c = 0;
    if (sg >= p.ntiles) {
        if (X)
#pragma unroll
            for (int i = 0; i < NW; i++)
                g.w[i] = 0;
        return;
    }
    int64_t so;
    if (BI) {
        so = sg >> (BI == 128 ? 2 : 0);
    } else {
        uint32_t cs; /* the segment's place: expert, stored row, segment in the row */
        fm_tile_place(p.ntc, p.ntr, sg, &g.te, &g.r, &cs);
        g.c = cs << 5;
        so = rq_scale_off(p.in_mode, p.in_layout, p.R, p.C, p.nbi, p.bi_shift, (int64_t)g.te * p.sin, g.r, g.c);
    }
    g.raw = RQS_IN_E8 ? (uint32_t)__ldg((const uint8_t *)p.in_scale + so) : __ldg((const uint32_t *)p.in_scale + so);
    if (X) {
        const uint4 v = __ldcs((const uint4 *)(p.in + ((int64_t)sg << 4)));
        g.w[0] = v.x, g.w[1] = v.y, g.w[2] = v.z, g.w[3] = v.w;
    }
}

/* Every lane of the warp calls (the shuffles of a 1 x 128 output block).
 * TI: the words' FP8 code dtype; X: the words are fm_e2m1x8_as_e4m3's of an
 * E2M1 input (TI = E4M3, the LUT indexed by those bytes, 2^6 more in the
 * multiplier: the same products, as rq_mult's clamps are far outside the
 * shifts an E2M1 value can take and keep a code). */
template <int TI, int TO, bool X, int NWS, int BI, int BO>
FM_DI void rq_rows_segment(const rqparams &p, const int *lut, uint32_t sg, const rqseg<NWS> &g,
                           const uint32_t (&w)[8])
{
    const int lane = threadIdx.x & 31;
    const bool valid = sg < p.ntiles;
    const int64_t el = (int64_t)sg << 5;
    int pin = 0, key = RQ_KEY_MIN;
    if (valid) {
        pin = rq_pin(g.raw, RQS_IN_E8);
        key = lut[rq_max_mag<8>(w)] + pin;
    }
    if (RQS_BO == 128) {
        key = rq_max(key, __shfl_xor_sync(0xFFFFFFFFu, key, 1));
        key = rq_max(key, __shfl_xor_sync(0xFFFFFFFFu, key, 2));
    }
    if (!valid)
        return;
    const int pv = rq_block_exp(key);
    if (RQS_BO == 32 || (lane & 3) == 0) {
        const int64_t off = BO ? (int64_t)(sg >> (BO == 128 ? 2 : 0))
                               : rq_scale_off(p.out_mode, p.out_layout, p.R, p.C, p.nbo, p.bo_shift,
                                              (int64_t)g.te * p.sout, g.r, g.c);
        rq_store_scale(p, RQS_OUT_E8, off, pv == RQ_BADP, pv);
    }

    uint32_t o[TO == FM_DTYPE_E2M1 ? 4 : 8];
    if (pv == RQ_BADP) {
#pragma unroll
        for (int i = 0; i < (TO == FM_DTYPE_E2M1 ? 4 : 8); i++)
            o[i] = fm_nan_word<TO>();
    } else {
        const int pw = X ? pin + 6 : pin; /* the exponent of the words' values */
        const int d = pw - pv;
        if (TO == FM_DTYPE_E2M1 && d >= -23 && d <= 14) {
            const fm_h2_shift3 m3 = fm_h2_shift3_of(d);
            /* The POW2 rule's exponent keeps every |v| 2^d <= 6 unless it was
             * clamped at 127 (a block past 6 2^127); MX_FLOOR's lets values
             * saturate. */
            if (p.rule != FM_REQUANT_MX_FLOOR && pv < 127) {
#pragma unroll
                for (int q = 0; q < 4; q++)
                    o[q] = fm_fp8x8_e2m1<TI, false>(w[2 * q], w[2 * q + 1], m3);
            } else {
#pragma unroll
                for (int q = 0; q < 4; q++)
                    o[q] = fm_fp8x8_e2m1<TI, true>(w[2 * q], w[2 * q + 1], m3);
            }
        } else if (X && TO != FM_DTYPE_E2M1 && p.rule != FM_REQUANT_MX_FLOOR && pv < 127 &&
                   d - 6 >= (TO == FM_DTYPE_E4M3 ? -5 : -13)) {
            /* The rule's exponent keeps every product within the format
             * (unless clamped at 127, or under MX_FLOOR); d - 6 no lower
             * than this keeps 0.5 2^(d - 6) normal. */
            if constexpr (X && TO != FM_DTYPE_E2M1)
                fm_e2m1x8_to_fp8<TO>(g.w, w, d - 6, o);
        } else {
            const float m = rq_mult(pw, pv);
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const uint2 v = rq_encode_row<TI, TO>(&w[2 * q], m);
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
    static_assert((BI == 0) == (BO == 0), "the segment's place is loaded only when no block width is compiled in");
    constexpr bool X = TI == FM_DTYPE_E2M1;      /* read as E4M3 codes (fm_e2m1x8_as_e4m3) */
    constexpr int TC = X ? FM_DTYPE_E4M3 : TI;   /* the codes rq_rows_segment sees */
    constexpr int NW = X ? 4 : 8;                /* input words a segment */
    __shared__ uint4 xs[X ? 1 : RQS_THREADS / 32][64]; /* FP8 input: rq_rows_load's chunks, by warp */
    __shared__ int lut[128];
    for (int i = threadIdx.x; i < 128; i += RQS_THREADS)
        lut[i] = X ? rq_code_key<TI, TO>((i >> 2) & 7, p.rule) : rq_code_key<TI, TO>(i, p.rule);
    __syncthreads();

    const uint32_t lane = threadIdx.x & 31;
    const uint32_t wstride = gridDim.x * RQS_THREADS;
    uint32_t base = blockIdx.x * RQS_THREADS + (threadIdx.x & ~31u);
    if (base >= p.ntiles)
        return;
    rqseg<NW> g, gn;
    /* The first segments' codes and scales are read while the check may
     * still run (nothing the check writes): only the writes wait for it. */
    rq_rows_load<TI, NW, BI, BO>(p, base + lane, g);
    if (rq_refused(p.verdict))
        return;
    /* Warp-uniform trip count: the lanes of a 1 x 128 output block reduce by shuffles. */
    for (;;) {
        const uint32_t nb = base + wstride;
        const bool more = nb < p.ntiles && nb > base;
        if (more)
            rq_rows_load<TI, NW, BI, BO>(p, nb + lane, gn);
        if constexpr (!X) {
            /* chunk j at slot j ^ (j / 8 % 2): no bank conflicts either way */
            uint4 *x = xs[threadIdx.x >> 5];
            x[lane ^ ((lane >> 3) & 1)] = make_uint4(g.w[0], g.w[1], g.w[2], g.w[3]);
            x[(32 + lane) ^ ((lane >> 3) & 1)] = make_uint4(g.w[4], g.w[5], g.w[6], g.w[7]);
            __syncwarp();
            const uint32_t j = 2 * lane, f = (j >> 3) & 1;
            const uint4 a = x[j ^ f], b = x[(j + 1) ^ f];
            __syncwarp();
            uint32_t w8[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
            rq_rows_segment<TC, TO, X, NW, BI, BO>(p, lut, base + lane, g, w8);
        } else {
            uint32_t e[8];
#pragma unroll
            for (int i = 0; i < 4; i++)
                fm_e2m1x8_as_e4m3(g.w[i], &e[2 * i], &e[2 * i + 1]);
            rq_rows_segment<TC, TO, X, NW, BI, BO>(p, lut, base + lane, g, e);
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
                                                     int64_t per, int64_t n, const rqgrp *grp, int64_t groups,
                                                     const unsigned long long *verdict)
{
    if (rq_refused(verdict))
        return;
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

/* The check's device state, one per queue in the context's op words: the
 * kernel's last CTA hands first_inv on to verdict (what the call's later
 * kernels read) and leaves first_inv and done zero for the next call, so no
 * call clears it first. */
typedef struct rqcheck {
    /* ~index of the first bad block, (e * R + r) * nbi + cb (the token rows: t * nbi + cb); 0: none */
    unsigned long long first_inv;
    unsigned long long verdict;   /* this call's first_inv */
    uint32_t done;                /* CTAs finished */
} rqcheck;
static_assert(sizeof(rqcheck) <= FM_CUDA_OP_WORDS, "the check's state lives in a queue's op words");

FM_DI int64_t rq_check_off(const rqparams &p, int64_t i)
{
    if (p.in_layout == FM_SCALE_LAYOUT_COMPACT)
        return i; /* e * (R * nbi) + r * nbi + cb */
    const int64_t per = p.R * p.nbi, e = i / per, rem = i - e * per, r = rem / p.nbi, cb = rem - r * p.nbi;
    return e * p.sin + fm_scale_offset((fm_scale_mode)p.in_mode, (fm_scale_layout)p.in_layout, p.R, p.C, r,
                                       cb << p.bi_shift);
}

/* true where the scale is bad (and marked) */
FM_DI bool rq_check_one(uint32_t bits, int64_t i, rqcheck *res)
{
    int pp = 0;
    if (fm_f32_pow2_exp(__uint_as_float(bits), &pp))
        return false;
    atomicMax(&res->first_inv, ~(unsigned long long)i);
    return true;
}

/* Scales 4q .. 4q + 3 (one 16-byte load): true where one is bad. */
FM_DI bool rq_check_four(uint4 v, int64_t q, rqcheck *res)
{
    bool bad = rq_check_one(v.x, 4 * q, res);
    bad |= rq_check_one(v.y, 4 * q + 1, res);
    bad |= rq_check_one(v.z, 4 * q + 2, res);
    bad |= rq_check_one(v.w, 4 * q + 3, res);
    return bad;
}

/* 16 bytes of scales kept in L2 ahead of the lines streamed past them
 * (evict_last), for a kernel that reads the same scales right after the
 * check: the row conversion (rq_rows_kernel) into E2M1, untrusted, 152.5 ->
 * 149.0 us (S24-9, H100, against the tree before, twice each). With it for
 * every call the plain TMA transpose measured 211.7 -> 216.2 us (the grouped
 * one 209.6 -> 208.1, S24-8), so transposes keep the streaming loads. */
FM_DI uint4 rq_check_load(const uint4 *a)
{
    const uint64_t pol = fm_l2_keep_policy();
    uint4 v;
    asm volatile("ld.global.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(a), "l"(pol));
    return v;
}

/* 16-byte loads a thread issues at once in the check before the row
 * conversion: a CTA reads RQC_U x 4 KB of scales in one DRAM round trip
 * instead of one round trip a load, and only a thread that marked a bad
 * block fences. Untrusted 1x128 -> E2M1 146.5-146.8 -> 145.3-145.8 us
 * (S26-7, H100), 144.2-144.9 -> 143.7-144.5 after the S27 encoder (S27-2);
 * 8 loads were slower, 2 the same (S27-5). The same for the transposes
 * moved the ragged per-expert one 369.7-370.3 -> 374.2-375.1 us (S26-7),
 * so their check stays as it was. */
#define RQC_U 4

/* The minimum index of a bad block, as the maximum of its complement (0:
 * none). The last CTA to finish settles the call: a bad block goes to the
 * context's pending finding (named as the CPU names it: row and block of
 * the token rows, or expert / group, stored row and block) and every later
 * kernel of the call sees the verdict and writes nothing; otherwise it
 * zeroes nonfinite_blocks, the call's first write. Compact scales are read
 * 16 bytes a thread (keep_l2: kept in L2 for the row conversion after it,
 * RQC_U loads at once). */
__global__ void __launch_bounds__(256) rq_check_kernel(const rqparams p, int64_t n, int token_rows, int keep_l2,
                                                       rqcheck *res, fm_cuda_pending *pend)
{
    __shared__ int last;
    /* the call's next kernel may start now (p.pdl): it waits for this one
     * before its first write (rq_refused) */
    fm_pdl_release();
    const uint32_t *s = (const uint32_t *)p.in_scale;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x, i0 = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    int64_t tail = 0;
    bool found = false;
    if (keep_l2 && p.in_layout == FM_SCALE_LAYOUT_COMPACT && (uintptr_t)s % 16 == 0) {
        const int64_t nq = n / 4;
        for (int64_t c0 = (int64_t)blockIdx.x * RQC_U * 256; c0 < nq; c0 += (int64_t)gridDim.x * RQC_U * 256) {
            uint4 v[RQC_U];
#pragma unroll
            for (int u = 0; u < RQC_U; u++) {
                const int64_t q = c0 + u * 256 + threadIdx.x;
                v[u] = make_uint4(0x3F800000u, 0x3F800000u, 0x3F800000u, 0x3F800000u); /* 1.0 passes */
                if (q < nq)
                    v[u] = rq_check_load((const uint4 *)s + q);
            }
#pragma unroll
            for (int u = 0; u < RQC_U; u++)
                found |= rq_check_four(v[u], c0 + u * 256 + threadIdx.x, res);
        }
        tail = nq * 4;
    } else if (p.in_layout == FM_SCALE_LAYOUT_COMPACT && (uintptr_t)s % 16 == 0) {
        for (int64_t q = i0; q < n / 4; q += stride)
            rq_check_four(__ldcs((const uint4 *)s + q), q, res);
        tail = n / 4 * 4;
    }
    for (int64_t i = tail + i0; i < n; i += stride)
        found |= rq_check_one(s[rq_check_off(p, i)], i, res);
    /* The last CTA reads only the marks, so only a marking thread needs
     * the fence (about a DRAM round trip at the kernel's end); the checks
     * before the transposes keep it in every thread, as before S26-7. */
    if (found || !keep_l2)
        __threadfence();
    __syncthreads();
    if (threadIdx.x == 0)
        last = atomicAdd(&res->done, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last || threadIdx.x != 0)
        return;
    const unsigned long long f = atomicExch(&res->first_inv, 0ull);
    res->verdict = f;
    res->done = 0;
    if (!f) {
        if (p.nonfinite)
            *p.nonfinite = 0;
        return;
    }
    if (!fm_pending_claim(pend))
        return;
    const int64_t i = (int64_t)~f, per = p.R * p.nbi;
    pend->bits = s[rq_check_off(p, i)];
    if (token_rows) {
        pend->kind = FM_CUDA_PENDING_SCALE_ROW;
        pend->a = i / p.nbi;
        pend->b = i % p.nbi;
    } else {
        int64_t e = i / per, r = (i % per) / p.nbi;
        /* Grouped: the group holding stored row r, and the row within it. */
        for (int64_t g = 0; p.grp && g < p.groups; g++)
            if (r < p.grp[g + 1].row0) {
                e = g;
                r -= p.grp[g].row0;
                break;
            }
        pend->kind = FM_CUDA_PENDING_SCALE_BLOCK;
        pend->a = e;
        pend->b = r;
        pend->c = i % p.nbi;
    }
    fm_pending_post(pend);
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

/* CTAs of `threads` a kernel keeps on one SM at once, asked once per kernel
 * (*cache: the same on every sm_90 part; a relaxed race is benign). */
template <typename K>
static cudaError_t rq_ctas_per_sm(K kernel, int threads, size_t dyn_smem, int *cache, int *per)
{
    *per = __atomic_load_n(cache, __ATOMIC_RELAXED);
    if (*per)
        return cudaSuccess;
    cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(per, kernel, threads, dyn_smem);
    if (err == cudaSuccess)
        __atomic_store_n(cache, *per, __ATOMIC_RELAXED);
    return err;
}

/* Transposes between FP8 formats take rq_fp8t_kernel, everything else the
 * tile kernel; a grid of the CTAs that fit at once. */
template <int TI, int TO, int TR, bool G>
static cudaError_t rq_launch3(const rqparams &p, int sms, cudaStream_t s)
{
    constexpr bool F = TR && TI != FM_DTYPE_E2M1 && TO != FM_DTYPE_E2M1;
    static int cache = 0;
    int per = 0;
    cudaError_t err;
    if constexpr (F && TI == TO) {
        if (p.tma) {
            err = p.in_e8 ? rq_tma_launch<TI, G, true>(p, sms, s) : rq_tma_launch<TI, G, false>(p, sms, s);
            if (err != cudaErrorNotSupported)
                return err;
        }
    }
    if constexpr (TR && TI == FM_DTYPE_E2M1 && TO == FM_DTYPE_E2M1) {
        if (p.tma) { /* MXFP4 -> MXFP4 (rq_tma_fits) */
            err = rq_tma_launch<TI, G, true>(p, sms, s);
            if (err != cudaErrorNotSupported)
                return err;
        }
    }
    if constexpr (F) {
        static int attr = 0; /* the dynamic shared memory above 48 KiB, allowed once */
        if (!__atomic_load_n(&attr, __ATOMIC_RELAXED)) {
            err = cudaFuncSetAttribute(rq_fp8t_kernel<TI, TO, G>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       RQF_DYN_SMEM(G));
            if (err != cudaSuccess)
                return err;
            __atomic_store_n(&attr, 1, __ATOMIC_RELAXED);
        }
        err = rq_ctas_per_sm(rq_fp8t_kernel<TI, TO, G>, RQTHREADS, RQF_DYN_SMEM(G), &cache, &per);
    } else
        err = rq_ctas_per_sm(requant_tile_kernel<TI, TO, TR, G>, RQTHREADS, 0, &cache, &per);
    if (err != cudaSuccess)
        return err;
    int64_t g = (int64_t)(per > 0 ? per : 1) * (sms > 0 ? sms : 1);
    if (g > (int64_t)p.ntiles)
        g = p.ntiles;
    /* Grouped, rq_fp8t_kernel starts after the check, not beside it: the
     * ragged transpose ran 312 us beside it against 275 after it (H200,
     * S35-1, FLOWMOE_RQ_PDL=0, before the TMA kernel took ragged groups),
     * while its plain calls measured the same either way and the TMA
     * transpose 5 us faster beside it. */
    if constexpr (F)
        return fm_launch(rq_fp8t_kernel<TI, TO, G>, (unsigned)g, RQTHREADS, RQF_DYN_SMEM(G), s, G ? 0 : p.pdl, p);
    else
        return fm_launch(requant_tile_kernel<TI, TO, TR, G>, (unsigned)g, RQTHREADS, 0, s, p.pdl, p);
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

/* As many CTAs as fit at once (a CTA started late would end late), but at
 * most 4 an SM for E2M1 input (16 bytes read, 32 written a lane): with the
 * 6 (1 x 128 out) or 8 (MX32 out) that fit, E2M1 -> E4M3 ran at 83.9% and
 * 78.3% of copy, with 4 at 87.6% and 86.9% (S16-3 set the count from
 * outside one binary, S16-4 and S16-6 compared binaries); FP8 input keeps
 * all that fit (6 at 40 registers: 4 gave 83.4% -> 80.7%; 8 since the
 * compiled-in scale offsets took FP8 -> E2M1 to 31 registers). */
template <int TI, int TO, int BI, int BO>
static cudaError_t rq_rows_launch3(const rqparams &q, int64_t nseg, int sms, cudaStream_t s)
{
    static int cache = 0;
    int per = 0;
    cudaError_t err = rq_ctas_per_sm(rq_rows_kernel<TI, TO, BI, BO>, RQS_THREADS, 0, &cache, &per);
    if (err != cudaSuccess)
        return err;
    /* E2M1 input: 4 CTAs an SM (5 into MX32), of the 6-8 that fit. H100
     * (S16-2, S16-3) 1x128 out 3 / 4 / 5 / 6: 86.1 / 86.8 / 82.8 / 82.7% of
     * copy, MX32 out 4 / 5 / 8: 85.2 / 85.4 / 79.8%; H200 (S34-5) 1x128 out
     * 2 / 3 / 4 / 5 / 6 / 8: 116.8 / 106.8 / 102.0 / 105.7 / 108.1 / 117.3
     * us, MX32 out 139.1 / 118.4 / 110.2 / 104.3 / 109.2 / 121.2 us; with
     * the table encoder (S37-6) 1x128 out 3 / 4 / 5 / 6 / 8: 105.5 / 100.5 /
     * 104.8 / 107.6 / 107.4, MX32 out 112.7 / 104.8 / 101.4 / 110.5 / 110.7. */
    const int cap = q.bo == 32 ? 5 : 4;
    if (TI == FM_DTYPE_E2M1 && per > cap)
        per = cap;
    const unsigned g = rq_grid(fm_cdiv(nseg, RQS_THREADS), (int64_t)(per > 0 ? per : 1) * (sms > 0 ? sms : 1));
    return fm_launch(rq_rows_kernel<TI, TO, BI, BO>, g, RQS_THREADS, 0, s, q.pdl, q);
}

/* Compact scale arrays on both sides (what the recipes use) over whole
 * input blocks get the block widths compiled in (rq_rows_load); E2M1 blocks
 * are MX32 on either side. */
template <int TI, int TO>
static cudaError_t rq_rows_launch2(const rqparams &q, int64_t nseg, int sms, cudaStream_t s)
{
    if (q.in_layout != FM_SCALE_LAYOUT_COMPACT || q.out_layout != FM_SCALE_LAYOUT_COMPACT || q.C % q.bi)
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
/* rows: fm_transpose_scaled_grouped_rows's token rows (in is then their
 * [R, N] view, the geometry of the grouped input), with row_map and topk. */
static fm_status rq_run(fm_context *ctx, const fm_requant_config *cfg, const fm_splits *sp, const fm_tensor *in,
                        fm_tensor *out, const fm_tensor *rows = NULL, const fm_tensor *row_map = NULL, int topk = 0)
{
    const int tr = in->layout != out->layout;
    const char *op = rows ? "fm_transpose_scaled_grouped_rows"
                     : sp ? "fm_transpose_scaled_grouped"
                     : tr ? "fm_transpose_scaled"
                          : "fm_convert_scaled";
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
    p.tile = in->scale_mode == FM_SCALE_BLOCK_1x128 && out->scale_mode == FM_SCALE_BLOCK_128x128;
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
    /* npad: GEMM-layout padding entries (entries less blocks), which only
     * rq_pad_kernel writes; it visits every entry, so it runs only when
     * there are some (none in the layer's transposes: S14-3 had the grouped
     * one 17 us slower into GEMM-layout scales than into compact ones). */
    int64_t ntr = fm_cdiv(R, RQT), ntiles_rows = E * ntr, nscales_out = E * p.sout;
    int64_t npad = E * fm_scale_padding_2d(out->scale_mode, out->scale_layout, p.Ro, p.Co);
    int ragged = 0, groups8 = 1; /* a group that is not a multiple of 128 rows; every group of 8-row multiples */
    if (sp) { /* the same totals as the table's sentinel, from the host sizes */
        ntiles_rows = nscales_out = npad = 0;
        for (int64_t g = 0; g < sp->groups; g++) {
            ragged |= sp->host[g] % RQT != 0;
            groups8 &= sp->host[g] % 8 == 0;
            ntiles_rows += fm_cdiv(sp->host[g], RQT);
            nscales_out += fm_scale_count_2d(out->scale_mode, out->scale_layout, C, sp->host[g]);
            npad += fm_scale_padding_2d(out->scale_mode, out->scale_layout, C, sp->host[g]);
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
        p.ntrg = fm_fastdiv_make((uint32_t)ntiles_rows);
    }
    if (sp) {
        /* Grouped tiles run tile rows fastest (as the plain ones, rq_tile<false>)
         * for the rows' transpose and for groups that are not all multiples of
         * 128 rows; groups of 128-row multiples keep tile columns fastest.
         * S17-11, one binary with the order switched: token rows 35.6% ->
         * 37.3% of copy (254.6 -> 242.8 us, the flow recipes' dy and x), ragged
         * groups 39.6% -> 47.6%, but 128-row groups 64.0% -> 63.0% and the layer's
         * GEMM-layout call 65.1% -> 63.7%. The rows' transpose on the TMA
         * kernel keeps tile rows fastest too: 211-212 us against 255-256 with
         * tile columns fastest (H200, S34-1), the token rows of a column strip
         * then read by every expert's tiles while they sit in L2; ragged
         * groups there too: 243 us against 274 (H200, S35-3). */
        p.rows_first = row_map != NULL || ragged;
    }
    const uintptr_t ia = (uintptr_t)in->data, oa = (uintptr_t)out->data;
    if (in->dtype == FM_DTYPE_E2M1)
        p.vec_in = C % 8 == 0 && ia % 4 == 0;
    else
        p.vec_in = C % 8 == 0 && ia % 8 == 0;
    p.vec_in16 = in->dtype != FM_DTYPE_E2M1 && C % 16 == 0 && ia % 16 == 0;
    int64_t nblocks = E * R * p.nbi; /* input scales the check reads */
    if (rows) {
        if (!p.vec_in16 || out->dtype == FM_DTYPE_E2M1) {
            fm_cuda_leave(ctx, &guard, cudaSuccess, NULL);
            return fm_error(ctx, FM_ERR_UNSUPPORTED,
                            "%s: the CUDA kernel reads the token rows in 16-byte pieces into an FP8 output: N (%lld) "
                            "must be a multiple of 16, in->data 16-byte aligned and out E4M3 or E5M2 (out is %s)",
                            op, (long long)C, fm_dtype_name(out->dtype));
        }
        const int64_t T = rows->shape[0];
        p.rmap = (const int32_t *)row_map->data;
        p.nslots = (uint32_t)(T * topk);
        p.kdiv = fm_fastdiv_make((uint32_t)topk);
        nblocks = T * p.nbi; /* every scale of the token rows (compact) */
    }
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

    p.tma = rq_tma_fits(p, fm_cuda(ctx)->prop, in->dtype == out->dtype, tr, sp != NULL);
    /* a group's last tile partial with the next group's rows in its TMA box
     * (the rows' gather fills zeros instead), or an output row that may
     * start anywhere */
    p.tma_rag = p.tma && sp && ((row_map ? !groups8 : ragged) || (uintptr_t)out->data % 8 != 0);
    /* The TMA kernel walks plain tiles tile columns fastest, as the grouped
     * ones: 212.8-214.0 -> 207.4 us trusted (S23-10, one binary; the old
     * kernel prefers tile rows fastest, S17-9, and keeps them) */
    p.cols_first = p.tma;

    cudaError_t err = cudaSuccess;
    const char *what = op;
    void *buf = NULL;
    int owned = 0;
    /* Scratch: the group table. */
    const size_t table_bytes = sp ? (size_t)(sp->groups + 1) * sizeof(rqgrp) : 0;
    const int check = !exact128 && !p.in_e8 && nblocks > 0 && !cfg->trusted_pow2_scales;
    const int rows_path = !exact128 && p.ntiles && rq_rows_fit(p, tr, E); /* rq_rows_kernel takes the call */
    if (sp) {
        st = fm_cuda_scratch(ctx, table_bytes, &buf, &owned, op);
        if (st) {
            fm_cuda_leave(ctx, &guard, cudaSuccess, NULL);
            return st;
        }
    }

    /* Grouped: the table first (scratch only), which the check's message and
     * every later kernel read. */
    if (sp) {
        rqgrp *table = (rqgrp *)buf;
        what = "group table: kernel launch";
        if ((err = rq_group_table(sp, out, C, table, s)) != cudaSuccess)
            goto out;
        p.grp = table;
    }

    /* Every input F32 scale is checked on the device before anything is
     * written, without waiting for it: a bad one makes the call's kernels
     * write nothing and waits in the context's pending finding, which the
     * next fm_context_synchronize reports (the op stays asynchronous, as the
     * trusted call: a host synchronisation here cost 25 us of a 235 us
     * transpose, S17-10). The check also zeroes nonfinite_blocks when it
     * passes. */
    if (check) {
        rqcheck *chk = (rqcheck *)fm_cuda_op_words(ctx);
        what = "power-of-two scale check: kernel launch";
        const int64_t per_cta =
            rows_path && p.in_layout == FM_SCALE_LAYOUT_COMPACT && (uintptr_t)in->scale % 16 == 0 ? 1024 * RQC_U : 1024;
        rq_check_kernel<<<rq_grid(fm_cdiv(nblocks, per_cta), (int64_t)sms * 4), 256, 0, s>>>(
            p, nblocks, rows != NULL, rows_path, chk, fm_cuda(ctx)->pending);
        if ((err = cudaGetLastError()) != cudaSuccess)
            goto out;
        p.verdict = &chk->verdict;
        /* the kernel after it overlaps its launch and first loads with the
         * check (S23: untrusted - trusted was 7-8 us of a 216 us transpose);
         * FLOWMOE_RQ_PDL=0 launches it after the check (for comparisons) */
        p.pdl = rq_pdl_knob();
    } else {
        what = "cudaMemsetAsync(cfg->nonfinite_blocks)";
        if (cfg->nonfinite_blocks &&
            (err = cudaMemsetAsync(cfg->nonfinite_blocks, 0, sizeof(int64_t), s)) != cudaSuccess)
            goto out;
    }

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

    if (out->scale_layout == FM_SCALE_LAYOUT_GEMM && npad > 0) {
        what = "GEMM-layout scale padding: kernel launch";
        rq_pad_kernel<<<rq_grid(fm_cdiv(nscales_out, 256), 4096), 256, 0, s>>>(
            out->scale, out->scale_mode, p.out_e8, p.Ro, p.Co, p.sout, nscales_out, p.grp, p.groups, p.verdict);
        if ((err = cudaGetLastError()) != cudaSuccess)
            goto out;
        p.pdl = 0; /* the next kernel follows this one, not the check */
    }

    if (rows_path) {
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

extern "C" fm_status fm_cuda_requantize_grouped_rows(fm_context *ctx, const fm_requant_config *cfg,
                                                     const fm_splits *splits, const fm_tensor *in,
                                                     const fm_tensor *row_map, int topk, fm_tensor *out)
{
    fm_tensor view = *in; /* the grouped input's geometry: R rows */
    view.shape[0] = out->shape[0];
    return rq_run(ctx, cfg, splits, &view, out, in, row_map, topk);
}
